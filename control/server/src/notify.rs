//! LISTEN/NOTIFY as a stream of pokes. Every loop that listens also converges on its own tick, so a lost
//! notification (a dropped connection, a full queue) costs latency, never correctness; [`Notice::Resync`] tells
//! the consumer that some may have been lost.

use bc_store::Store;
use bc_store::sqlx::postgres::PgListener;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Message {
        channel: String,
        payload: String,
    },
    /// The listening connection was lost (and is being re-established) or the queue overflowed.
    Resync,
}

/// Listens on `channels` until `stop`; notifications arrive on the returned receiver (bounded).
pub fn listen(
    store: &Store,
    channels: &[&'static str],
    mut stop: watch::Receiver<bool>,
) -> mpsc::Receiver<Notice> {
    let (tx, rx) = mpsc::channel(4096);
    let pool = store.pool().clone();
    let channels = channels.to_vec();
    tokio::spawn(async move {
        let mut overflowed = false;
        loop {
            let mut listener = match PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection failed; retrying");
                    if sleep_or_stop(&mut stop, Duration::from_secs(1)).await {
                        return;
                    }
                    continue;
                }
            };
            if let Err(e) = listener.listen_all(channels.iter().copied()).await {
                tracing::warn!(error = %e, "LISTEN failed; retrying");
                if sleep_or_stop(&mut stop, Duration::from_secs(1)).await {
                    return;
                }
                continue;
            }
            // Anything sent while we were not listening is lost: say so.
            if tx.send(Notice::Resync).await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    n = listener.try_recv() => match n {
                        Ok(Some(n)) => {
                            let notice = Notice::Message {
                                channel: n.channel().to_string(),
                                payload: n.payload().to_string(),
                            };
                            match tx.try_send(notice) {
                                Ok(()) => {
                                    if overflowed && tx.try_send(Notice::Resync).is_ok() {
                                        overflowed = false;
                                    }
                                }
                                Err(mpsc::error::TrySendError::Full(_)) => overflowed = true,
                                Err(mpsc::error::TrySendError::Closed(_)) => return,
                            }
                        }
                        Ok(None) => {
                            // Connection lost; try_recv reconnects on the next call.
                            if tx.send(Notice::Resync).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "LISTEN connection broke; reconnecting");
                            break;
                        }
                    },
                    changed = stop.changed() => {
                        if changed.is_err() || *stop.borrow() {
                            return;
                        }
                    }
                }
            }
            if sleep_or_stop(&mut stop, Duration::from_millis(200)).await {
                return;
            }
        }
    });
    rx
}

/// Sleeps for `d`; true when `stop` fired first.
pub async fn sleep_or_stop(stop: &mut watch::Receiver<bool>, d: Duration) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        changed = stop.changed() => changed.is_err() || *stop.borrow(),
    }
}
