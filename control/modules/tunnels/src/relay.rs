//! Relays one tunnel connection between the operator's upgraded HTTP connection (length-prefixed
//! `TunnelFrame`s, [`bc_proto::tunnel`]) and the node's tunnel stream at the gateway. The same frames go both
//! ways: `data`, `half_close` (TCP FIN: the other side keeps sending) and `close{code, reason}` (an abort of both
//! directions, passed on to the other side). A tunnel that moves no frame either way for the idle limit is closed
//! `IDLE` on both sides. Memory is bounded: one frame in flight each way here, the gateway's queue and HTTP/2's
//! window beyond.

use bc_gateway::tunnel::{TunnelRx, TunnelTx};
use bc_proto::tunnel as wire;
use bc_proto::v1;
use bc_proto::v1::TunnelCloseCode as C;
use bc_proto::v1::tunnel_frame::Frame;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

/// How long a close at the idle limit may wait for a side that stopped reading.
const CLOSE_DEADLINE: Duration = Duration::from_secs(5);
/// Once the relay ended, how long the node's side may take to end its stream.
pub const FINISH: Duration = Duration::from_secs(10);

/// How a relayed tunnel ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// `OK` after a half-close each way, else the close code (`DIAL_REFUSED`, `IDLE`, `ABORTED`, ...).
    pub outcome: String,
    pub reason: String,
}

impl Ended {
    fn ok() -> Ended {
        Ended {
            outcome: "OK".into(),
            reason: String::new(),
        }
    }

    fn closed(code: C, reason: impl Into<String>) -> Ended {
        Ended {
            outcome: code_name(code),
            reason: reason.into(),
        }
    }
}

/// `DIAL_REFUSED` for `TUNNEL_CLOSE_CODE_DIAL_REFUSED`.
pub fn code_name(code: C) -> String {
    let name = code.as_str_name();
    name.strip_prefix("TUNNEL_CLOSE_CODE_")
        .unwrap_or(name)
        .to_string()
}

/// When a byte last moved either way, on the monotonic clock (a wall clock set back would keep an idle tunnel open).
struct Activity {
    start: tokio::time::Instant,
    /// Milliseconds from `start`.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: tokio::time::Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn since_start(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.last_ms.store(self.since_start(), Relaxed);
    }

    fn quiet_for(&self) -> Duration {
        Duration::from_millis(
            self.since_start()
                .saturating_sub(self.last_ms.load(Relaxed)),
        )
    }
}

/// Once nothing moved for `idle`: closes both sides `IDLE`, each for a bounded time (either may be the one that
/// stopped reading).
async fn idle_close<F, Fut>(last: &Activity, idle: Duration, tx: &TunnelTx, to_client: &F) -> Ended
where
    F: Fn(v1::TunnelFrame) -> Fut,
    Fut: Future<Output = Result<(), wire::FrameError>>,
{
    quiet_for(last, idle).await;
    let reason = format!(
        "no byte moved either way for {} s (the idle limit); open a new tunnel",
        idle.as_secs()
    );
    let _ = tokio::time::timeout(
        CLOSE_DEADLINE,
        tx.send(wire::close(C::Idle, reason.clone())),
    )
    .await;
    let _ = tokio::time::timeout(
        CLOSE_DEADLINE,
        to_client(wire::close(C::Idle, reason.clone())),
    )
    .await;
    Ended::closed(C::Idle, reason)
}

/// Returns once nothing was recorded in `last` for `idle`.
async fn quiet_for(last: &Activity, idle: Duration) {
    let tick = (idle / 10).clamp(Duration::from_millis(10), Duration::from_secs(30));
    loop {
        tokio::time::sleep(tick).await;
        if last.quiet_for() >= idle {
            return;
        }
    }
}

/// Runs both directions until each ended normally (`OK`), one of them ended the tunnel, or `stop` did.
async fn both(
    up: impl Future<Output = Result<(), Ended>>,
    down: impl Future<Output = Result<(), Ended>>,
    stop: impl Future<Output = Ended>,
) -> Ended {
    tokio::pin!(up, down, stop);
    let (mut up_done, mut down_done) = (false, false);
    loop {
        tokio::select! {
            r = &mut up, if !up_done => match r {
                Ok(()) => up_done = true,
                Err(e) => return e,
            },
            r = &mut down, if !down_done => match r {
                Ok(()) => down_done = true,
                Err(e) => return e,
            },
            e = &mut stop => return e,
        }
        if up_done && down_done {
            return Ended::ok();
        }
    }
}

/// Relays until both sides half-closed, either side closed or went away, or the tunnel sat idle for `idle`.
pub async fn relay<IO>(io: IO, tx: &TunnelTx, rx: &mut TunnelRx, idle: Duration) -> Ended
where
    IO: AsyncRead + AsyncWrite + Send,
{
    let (client_rd, client_wr) = tokio::io::split(io);
    let mut client_rd = wire::FrameReader::new(client_rd);
    let client_wr = Mutex::new(client_wr);
    let last = Activity::new();
    let to_client = |f: v1::TunnelFrame| {
        let client_wr = &client_wr;
        async move {
            let mut w = client_wr.lock().await;
            wire::write(&mut *w, &f).await
        }
    };
    // Operator → node. Ok: the operator half-closed. Err: how the tunnel ended.
    let up = async {
        loop {
            let f = match client_rd.next().await {
                Ok(Some(f)) => f,
                Ok(None) => {
                    let e = Ended::closed(
                        C::Aborted,
                        "the operator's connection ended without a half-close",
                    );
                    let _ = tx.send(wire::close(C::Aborted, e.reason.clone())).await;
                    return Err(e);
                }
                Err(err) => {
                    let reason = format!("the operator's side: {err}");
                    let _ = tx.send(wire::close(C::Protocol, reason.clone())).await;
                    let _ = to_client(wire::close(C::Protocol, reason.clone())).await;
                    return Err(Ended::closed(C::Protocol, reason));
                }
            };
            last.touch();
            match &f.frame {
                Some(Frame::Data(d)) if d.len() <= wire::MAX_DATA => {}
                Some(Frame::HalfClose(_)) => {
                    return match tx.send(f).await {
                        Ok(()) => Ok(()),
                        Err(_) => Err(Ended::closed(C::Aborted, "the node's tunnel stream ended")),
                    };
                }
                Some(Frame::Close(c)) => {
                    let code = C::try_from(c.code).unwrap_or(C::Aborted);
                    let _ = tx.send(f.clone()).await;
                    return Err(Ended::closed(
                        code,
                        format!("closed by the operator: {}", c.reason),
                    ));
                }
                _ => {
                    let reason = "the operator sent a frame other than data (at most 64 KiB), half_close or close";
                    let _ = tx.send(wire::close(C::Protocol, reason)).await;
                    let _ = to_client(wire::close(C::Protocol, reason)).await;
                    return Err(Ended::closed(C::Protocol, reason));
                }
            }
            if let Err(s) = tx.send(f).await {
                let reason = s.message().to_string();
                let _ = to_client(wire::close(C::Aborted, reason.clone())).await;
                return Err(Ended::closed(C::Aborted, reason));
            }
        }
    };
    // Node → operator. Ok: the node half-closed.
    let down = async {
        loop {
            let f = match rx.recv().await {
                Some(Ok(f)) => f,
                end => {
                    let reason = match end {
                        Some(Err(s)) => format!("the node's tunnel stream failed: {}", s.message()),
                        _ => "the node's tunnel stream ended before a half-close".into(),
                    };
                    let _ = to_client(wire::close(C::Aborted, reason.clone())).await;
                    return Err(Ended::closed(C::Aborted, reason));
                }
            };
            last.touch();
            let ended = match &f.frame {
                Some(Frame::HalfClose(_)) => Some(Ok(())),
                Some(Frame::Close(c)) => Some(Err(Ended::closed(
                    C::try_from(c.code).unwrap_or(C::Aborted),
                    c.reason.clone(),
                ))),
                Some(Frame::Data(_)) => None,
                _ => {
                    let reason = "the node sent a frame other than data, half_close or close";
                    let _ = tx.send(wire::close(C::Protocol, reason)).await;
                    Some(Err(Ended::closed(C::Protocol, reason)))
                }
            };
            if let Err(e) = to_client(f).await {
                let reason = format!("writing to the operator: {e}");
                let _ = tx.send(wire::close(C::Aborted, reason.clone())).await;
                return Err(Ended::closed(C::Aborted, reason));
            }
            if let Some(end) = ended {
                return end;
            }
        }
    };
    let idle_watch = idle_close(&last, idle, tx, &to_client);
    let ended = both(up, down, idle_watch).await;
    let mut w = client_wr.lock().await;
    let _ = tokio::time::timeout(CLOSE_DEADLINE, w.shutdown()).await;
    ended
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The idle watch on the monotonic clock, time as input: a tunnel quiet for just under its limit lives, a byte
    /// restarts the count, and it is let go once quiet for the whole limit (the default, an hour).
    #[tokio::test(start_paused = true)]
    async fn an_idle_tunnel_lives_its_whole_limit_and_a_byte_restarts_it() {
        let idle = crate::Options::default().idle;
        assert!(idle >= Duration::from_secs(3600), "{idle:?}");
        let last = Activity::new();
        let watch = quiet_for(&last, idle);
        tokio::pin!(watch);
        let step = Duration::from_secs(1);
        // Quiet for the limit less a second: still open.
        assert!(
            tokio::time::timeout(idle - step, &mut watch).await.is_err(),
            "let go before its limit"
        );
        // A byte moves: a whole limit again from here.
        last.touch();
        assert!(
            tokio::time::timeout(idle - step, &mut watch).await.is_err(),
            "a byte did not restart the count"
        );
        let started = tokio::time::Instant::now();
        tokio::time::timeout(idle, &mut watch)
            .await
            .expect("let go once quiet for its limit");
        // The watch wakes every tenth of the limit (at most 30 s): late by at most that.
        assert!(
            started.elapsed() <= step + Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
}
