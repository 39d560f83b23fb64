//! Serves the API router over HTTP/1 with the deadlines `axum::serve` leaves off: it gives hyper no timer, so
//! hyper's 30 s deadline for a request's head never runs, and a client that opens connections and sends a few bytes
//! of a head (or nothing, or nothing more after a response) holds each for as long as it likes. Here every
//! connection has [`HEADER_DEADLINE`] to send each request's head, counted from when the server waits for it (so
//! it also ends a kept-alive connection idle that long); a method's body has the router's own deadline; an upgraded
//! connection (a tunnel) leaves this server's hands. A stop ends accepting, lets requests in flight finish for
//! [`DRAIN`] and closes idle connections at once.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Longest a connection may take to send a request's head, or stay idle between requests.
pub const HEADER_DEADLINE: Duration = Duration::from_secs(30);

/// Longest a stop waits for requests in flight before their connections are dropped.
pub const DRAIN: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` completes, then drains (see the module's doc).
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) {
    serve_within(listener, router, shutdown, HEADER_DEADLINE).await;
}

/// [`serve`] with `header_deadline` for [`HEADER_DEADLINE`] (tests shorten it).
pub async fn serve_within(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()>,
    header_deadline: Duration,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted: the listener still works.
                    tracing::warn!(error = %e, "api accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_deadline)
                .serve_connection(TokioIo::new(tcp), service)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "api connection ended");
                    }
                    return;
                }
                _ = stop.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained =
        tokio::time::timeout(DRAIN, async { while conns.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            left = conns.len(),
            "api connections still busy {} s after the stop: dropped",
            DRAIN.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Reads until the server closes; how long that took, or `None` if it had not within `limit`.
    async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<(Duration, Vec<u8>)> {
        let t = tokio::time::Instant::now();
        let mut got = Vec::new();
        tokio::time::timeout(limit, async {
            let mut buf = [0u8; 1024];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await
        .ok()
        .map(|()| (t.elapsed(), got))
    }

    /// A client that sends part of a head and stops, one that sends nothing, and one idle after its answer: each is
    /// closed at the deadline, while a whole request is answered; a stop then ends the server. With `axum::serve`
    /// (no timer for hyper) all three connections stayed open.
    #[tokio::test]
    async fn slow_or_idle_connections_are_closed_at_the_header_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new().route("/ok", get(|| async { "ok" }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_within(
            listener,
            router,
            async {
                let _ = stopped.await;
            },
            Duration::from_millis(500),
        ));
        let mut partial = TcpStream::connect(addr).await.expect("connect");
        partial
            .write_all(b"GET /ok HTTP/1.1\r\nHo")
            .await
            .expect("write");
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        idle.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        for (what, s) in [
            ("partial head", &mut partial),
            ("nothing sent", &mut silent),
            ("idle after an answer", &mut idle),
        ] {
            let (took, got) = closed_within(s, Duration::from_secs(5))
                .await
                .unwrap_or_else(|| panic!("{what}: still open after 5 s"));
            assert!(
                took < Duration::from_secs(3),
                "{what}: closed after {took:?}"
            );
            if what == "idle after an answer" {
                let text = String::from_utf8_lossy(&got);
                assert!(
                    text.starts_with("HTTP/1.1 200") && text.ends_with("ok"),
                    "{text}"
                );
            }
        }
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server ends after a stop")
            .expect("server task");
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "the listener is closed"
        );
    }
}
