//! LISTEN/NOTIFY as a stream of pokes. Every loop that listens also converges on its own tick, so a lost
//! notification (a dropped connection, a full queue) costs latency, never correctness; [`Notice::Resync`] tells
//! the consumer that some may have been lost.

use bc_store::Store;
use bc_store::sqlx::PgPool;
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

/// How the listening connection is checked: a connection the database end of which vanished without a reset (a
/// primary cut off, a failover to a standby elsewhere) delivers nothing and reports no error, so without a probe
/// every notification after it was lost until a restart (each loop still converged on its tick, slower).
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// After this long without a notification, the connection is asked `SELECT 1`.
    pub every: Duration,
    /// The probe's answer must come within this long, or the connection is replaced (and [`Notice::Resync`]
    /// sent).
    pub within: Duration,
}

/// A new listening connection (a connect, its authentication and its LISTEN) must be ready within this long.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(10);

/// 30 s between probes, 10 s for an answer.
pub const LIVENESS: Liveness = Liveness {
    every: Duration::from_secs(30),
    within: Duration::from_secs(10),
};

/// Listens on `channels` until `stop`; notifications arrive on the returned receiver (bounded).
pub fn listen(
    store: &Store,
    channels: &[&'static str],
    stop: watch::Receiver<bool>,
) -> mpsc::Receiver<Notice> {
    listen_with(
        store.pool().clone(),
        store.primary_moves(),
        channels,
        stop,
        LIVENESS,
    )
}

/// [`listen`] on `pool`'s database with `liveness` (tests shorten it). `moves` counts the pool's moves to another
/// primary: at one the listening connection follows at once (it would wait on the old primary until its probe).
pub fn listen_with(
    pool: PgPool,
    mut moves: Option<watch::Receiver<u64>>,
    channels: &[&'static str],
    mut stop: watch::Receiver<bool>,
    liveness: Liveness,
) -> mpsc::Receiver<Notice> {
    let (tx, rx) = mpsc::channel(4096);
    let channels = channels.to_vec();
    tokio::spawn(async move {
        let mut overflowed = false;
        loop {
            // Its own pool of one, to the host the main pool uses now (a failover moves that): a listener dropped
            // after a failed probe sends `UNLISTEN *` on its connection before giving it back, which on a silent
            // connection never ends. From the main pool that connection would be lost to every other caller.
            let own = bc_store::sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .max_lifetime(None)
                .idle_timeout(None)
                .acquire_timeout(CONNECT_DEADLINE)
                .connect_lazy_with((*pool.connect_options()).clone());
            let mut listener = match open(&own, &channels, &mut moves).await {
                Some(Ok(l)) => l,
                None => {
                    tracing::warn!(
                        "the database primary moved while the LISTEN connection was opening; opening it there"
                    );
                    continue;
                }
                Some(Err(why)) => {
                    tracing::warn!(error = %why, "LISTEN connection failed; retrying");
                    // In a second, or at once when the pool moves to another primary.
                    tokio::select! {
                        stopped = sleep_or_stop(&mut stop, Duration::from_secs(1)) => if stopped {
                            return;
                        },
                        () = bc_store::next_move(&mut moves) => {}
                    }
                    continue;
                }
            };
            // Anything sent while we were not listening is lost: say so.
            if tx.send(Notice::Resync).await.is_err() {
                return;
            }
            let mut probe_at = tokio::time::Instant::now() + liveness.every;
            if let Some(m) = moves.as_mut() {
                m.borrow_and_update();
            }
            loop {
                tokio::select! {
                    () = bc_store::next_move(&mut moves) => {
                        tracing::warn!("the database primary moved; the LISTEN connection follows it");
                        break;
                    }
                    n = listener.try_recv() => {
                        probe_at = tokio::time::Instant::now() + liveness.every;
                        match n {
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
                        }
                    }
                    () = tokio::time::sleep_until(probe_at) => {
                        let probe = bc_store::sqlx::query("SELECT 1").execute(&mut listener);
                        match tokio::time::timeout(liveness.within, probe).await {
                            Ok(Ok(_)) => probe_at = tokio::time::Instant::now() + liveness.every,
                            failed => {
                                let why = match failed {
                                    Ok(Err(e)) => e.to_string(),
                                    _ => format!("no answer within {} s", liveness.within.as_secs_f64()),
                                };
                                tracing::warn!(error = %why, "LISTEN connection failed its probe; reconnecting");
                                break;
                            }
                        }
                    }
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

/// A listening connection from `own` (a pool of one), listening on `channels`, within [`CONNECT_DEADLINE`];
/// `None` when the pool moves to another primary first. The open was made with the old primary's address, where a
/// refused connect is retried until the deadline: a primary that died just before the pool found the promoted
/// standby kept every notification from the listener for up to 10 s after the move.
async fn open(
    own: &PgPool,
    channels: &[&'static str],
    moves: &mut Option<watch::Receiver<u64>>,
) -> Option<Result<PgListener, String>> {
    let opened = tokio::time::timeout(CONNECT_DEADLINE, async {
        let mut l = PgListener::connect_with(own).await?;
        l.listen_all(channels.iter().copied()).await?;
        Ok::<_, bc_store::sqlx::Error>(l)
    });
    tokio::select! {
        opened = opened => Some(match opened {
            Ok(Ok(l)) => Ok(l),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("not ready within {} s", CONNECT_DEADLINE.as_secs())),
        }),
        () = bc_store::next_move(moves) => None,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use bc_store::sqlx::postgres::PgConnectOptions;
    use std::net::SocketAddr;

    async fn next(rx: &mut mpsc::Receiver<Notice>, what: &str) -> Notice {
        tokio::time::timeout(Duration::from_secs(15), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: nothing within 15 s"))
            .expect("the listener runs")
    }

    /// Listening from a pool whose connects fail (`bad`: the old primary's address), the pool moves to the
    /// database: the listener says Resync there within half a second of the move.
    async fn listening_again_at_a_move(db: &bc_store::testing::TestDb, bad: PgConnectOptions) {
        let pool = bc_store::sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(bad);
        let (moves_tx, moves) = watch::channel(0u64);
        let (stop_tx, stop) = watch::channel(false);
        let mut rx = listen_with(pool.clone(), Some(moves), &["bc_test_move"], stop, LIVENESS);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            rx.try_recv().is_err(),
            "listening through connects that fail"
        );
        pool.set_connect_options(db.connect_options());
        let moved = tokio::time::Instant::now();
        moves_tx.send_modify(|n| *n += 1);
        assert_eq!(next(&mut rx, "after the move").await, Notice::Resync);
        assert!(
            moved.elapsed() < Duration::from_millis(500),
            "listening again {:?} after the move",
            moved.elapsed()
        );
        let _ = stop_tx.send(true);
    }

    /// A move of the primary reaches a listener that cannot connect: one whose connect is refused (retried inside
    /// the open until its 10 s deadline: the open is cut short) and one whose connect failed at once (waiting a
    /// second to retry: the wait is cut short). Before, the first listened again 9.9 s after the move.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listener_that_cannot_connect_follows_a_move_of_the_primary_at_once() {
        let db = bc_store::testing::test_db().await;
        let refused = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a port nothing listens on")
            .port();
        listening_again_at_a_move(&db, db.connect_options().port(refused)).await;
        let missing = db.connect_options().database("bc_no_such_database");
        listening_again_at_a_move(&db, missing).await;
    }

    /// The database end of the listening connection goes silent (no reset): the probe notices within its
    /// deadline, the listener reconnects and says Resync, and notifications arrive again. Before, nothing arrived
    /// after the silence and nothing said so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listening_connection_gone_silent_is_replaced() {
        let db = bc_store::testing::test_db().await;
        let direct = db.connect_options();
        let (at, freeze) = bc_store::testing::freezing_proxy(SocketAddr::from((
            [127, 0, 0, 1],
            direct.get_port(),
        )))
        .await;
        let pool = bc_store::sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(direct.clone().port(at.port()))
            .await
            .expect("pool through the proxy");
        let (stop_tx, stop) = watch::channel(false);
        let mut rx = listen_with(
            pool,
            None,
            &["bc_test_liveness"],
            stop,
            Liveness {
                every: Duration::from_millis(500),
                within: Duration::from_millis(500),
            },
        );
        let notify = |payload: &'static str| {
            let pool = db.pool.clone();
            async move {
                bc_store::sqlx::query("SELECT pg_notify('bc_test_liveness', $1)")
                    .bind(payload)
                    .execute(&pool)
                    .await
                    .expect("notify");
            }
        };
        assert_eq!(next(&mut rx, "listening").await, Notice::Resync);
        notify("one").await;
        assert_eq!(
            next(&mut rx, "one").await,
            Notice::Message {
                channel: "bc_test_liveness".into(),
                payload: "one".into()
            }
        );
        let frozen = tokio::time::Instant::now();
        freeze.send_modify(|g| *g += 1);
        notify("lost").await;
        assert_eq!(
            next(&mut rx, "after the silence").await,
            Notice::Resync,
            "the silent connection is replaced and the loss announced"
        );
        assert!(
            frozen.elapsed() < Duration::from_secs(5),
            "{:?}",
            frozen.elapsed()
        );
        notify("two").await;
        assert_eq!(
            next(&mut rx, "two").await,
            Notice::Message {
                channel: "bc_test_liveness".into(),
                payload: "two".into()
            }
        );
        let _ = stop_tx.send(true);
    }
}
