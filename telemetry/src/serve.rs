//! The optional loopback `/metrics` endpoint: the latest admitted snapshot in the Prometheus text format, so a
//! local scraper (or an operator with curl) sees exactly what the exporters send. Served over HTTP/1 by hyper with
//! its timer, so each connection has [`HEADER_DEADLINE`] to send a request's head (or to stay idle between
//! requests): `axum::serve` gives hyper no timer, and a client that sent part of a head, or nothing, held its
//! connection for as long as it liked.

use crate::Latest;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::time::Duration;

/// Longest a connection may take to send a request's head, or stay idle between requests (a scraper's keep-alive
/// connection idle longer is closed; it opens another).
pub const HEADER_DEADLINE: Duration = Duration::from_secs(30);

async fn metrics(latest: Latest) -> impl IntoResponse {
    let snap = latest.get();
    let mut body = String::with_capacity(snap.series_count() * 96);
    crate::exposition::render(&snap.families, &mut body);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::exposition::CONTENT_TYPE)],
        body,
    )
}

/// Serves until `shutdown` resolves.
pub async fn run(
    listener: tokio::net::TcpListener,
    latest: Latest,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    run_within(listener, latest, shutdown, HEADER_DEADLINE).await;
}

/// [`run`] with `header_deadline` for [`HEADER_DEADLINE`] (tests shorten it). A response is one render of the
/// snapshot, so at the stop the connections are dropped, not drained.
pub async fn run_within(
    listener: tokio::net::TcpListener,
    latest: Latest,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_deadline: Duration,
) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || metrics(latest.clone())),
    );
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted: the listener still works.
                    tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "/metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let service = TowerToHyperService::new(app.clone());
        conns.spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_deadline)
                .serve_connection(TokioIo::new(tcp), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "/metrics connection ended");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A client that sends part of a request's head is closed at the deadline, and one idle after its response is
    /// closed the same way; a whole request is answered. Before, both connections stayed open for as long as the
    /// client kept them.
    #[tokio::test]
    async fn a_connection_without_a_whole_head_is_closed_at_the_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(run_within(
            listener,
            Latest::default(),
            async {
                let _ = stopped.await;
            },
            Duration::from_millis(500),
        ));
        let closed_within = |mut c: tokio::net::TcpStream| async move {
            let started = std::time::Instant::now();
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest)).await;
            (read.is_ok(), started.elapsed(), rest)
        };

        let mut partial = tokio::net::TcpStream::connect(addr).await.expect("connect");
        partial
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let (closed, after, _) = closed_within(partial).await;
        assert!(closed, "a partial head held its connection for 5 s");
        assert!(after < Duration::from_secs(3), "{after:?}");

        let mut whole = tokio::net::TcpStream::connect(addr).await.expect("connect");
        whole
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let (closed, _, answer) = closed_within(whole).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(closed, "an idle kept-alive connection held for 5 s");

        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("stops")
            .expect("task");
    }
}
