//! A pool on a libpq multi-host URL ([`bc_store::multihost`]) through a real failover: a primary and its
//! synchronous streaming standby ([`bc_store::replica::Replicated`], Debian's PostgreSQL), writers committing
//! throughout, the primary killed (SIGKILL) or hung (SIGSTOP: its sockets stay open and nothing ever fails on the
//! client's side) and the standby promoted. The pool moves to the new primary by itself, calls begun during the
//! outage finish (or are given up at their deadline) and the next ones commit soon after the promotion, and every
//! acknowledged commit is on the new primary.

use bc_store::embedded::Durability;
use bc_store::multihost;
use bc_store::replica::Replicated;
use bc_store::sqlx;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Acked = Arc<Mutex<Vec<(i64, Instant)>>>;
type Errors = Arc<Mutex<Vec<(Instant, String)>>>;

/// An INSERT of key `$1`.
const INSERT: &str = "INSERT INTO acked (k) VALUES ($1) ON CONFLICT DO NOTHING";
/// The same, taking 200 ms on the server: a pool whose writers use it has every connection in a query nearly all
/// the time.
const SLOW_INSERT: &str =
    "INSERT INTO acked (k) SELECT $1 FROM pg_sleep(0.2) ON CONFLICT DO NOTHING";

/// Writers committing keys on `pool` until stopped; each commit's key is acknowledged only once its INSERT
/// returned, and a failed one is retried with the same key (ON CONFLICT makes a commit whose answer was lost
/// harmless). `deadline`: each INSERT is given up past it, as every caller of the store bounds its calls.
struct Writers {
    acked: Acked,
    errors: Errors,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: tokio::task::JoinSet<()>,
}

impl Writers {
    fn start(pool: &sqlx::PgPool, n: i64, insert: &'static str, deadline: Duration) -> Writers {
        let acked: Acked = Arc::default();
        let errors: Errors = Arc::default();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..n {
            let (pool, acked, errors, stopped) =
                (pool.clone(), acked.clone(), errors.clone(), stopped.clone());
            tasks.spawn(async move {
                let mut k = w;
                while !*stopped.borrow() {
                    let t = Instant::now();
                    let statement = sqlx::query(insert).bind(k).execute(&pool);
                    match tokio::time::timeout(deadline, statement).await {
                        Ok(Ok(_)) => {
                            acked.lock().expect("lock").push((k, Instant::now()));
                            k += n;
                        }
                        Ok(Err(e)) => {
                            errors.lock().expect("lock").push((t, e.to_string()));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(_) => errors
                            .lock()
                            .expect("lock")
                            .push((t, format!("given up after {deadline:?}"))),
                    }
                }
            });
        }
        Writers {
            acked,
            errors,
            stop,
            tasks,
        }
    }

    /// The first commit acknowledged after `after`, measured from `from`, waiting up to 60 s for it.
    async fn first_commit_after(&self, from: Instant, after: Instant) -> Duration {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let first = self
                .acked
                .lock()
                .expect("lock")
                .iter()
                .filter(|(_, at)| *at > after)
                .map(|(_, at)| *at - from)
                .min();
            if let Some(r) = first {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "no commit within 60 s of the failure"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the writers and prints the failed statements (relative to `from`).
    async fn stop(mut self, from: Instant) -> Vec<i64> {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
        let errs = self.errors.lock().expect("lock").clone();
        let last_error = errs.iter().map(|(t, _)| *t - from).max();
        println!(
            "{} failed statements, the last begun at {last_error:?}",
            errs.len()
        );
        for (t, e) in errs.iter().take(5) {
            println!("  {:.2} s: {e}", (*t - from).as_secs_f64());
        }
        self.acked
            .lock()
            .expect("lock")
            .iter()
            .map(|(k, _)| *k)
            .collect()
    }
}

async fn replicated_with_table(
    dir: &std::path::Path,
    max_connections: u32,
) -> (Replicated, bc_store::Store, sqlx::PgPool) {
    let pg = Replicated::start(dir, Durability::Throwaway, "bc")
        .await
        .expect("primary and standby");
    let store = multihost::connect(&pg.url("bc"), max_connections, Duration::from_secs(10))
        .await
        .expect("pool");
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE acked (k bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
        .execute(&pool)
        .await
        .expect("table");
    (pg, store, pool)
}

/// Every acknowledged commit is on the promoted standby, which the pool is on and which now writes.
async fn all_acknowledged_on_the_new_primary(pool: &sqlx::PgPool, keys: &[i64]) {
    let (found, in_recovery): (i64, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM acked WHERE k = ANY($1)), pg_is_in_recovery()",
    )
    .bind(keys)
    .fetch_one(pool)
    .await
    .expect("count");
    assert!(!in_recovery, "the pool is not on the promoted standby");
    assert_eq!(found as usize, keys.len(), "acknowledged commits lost");
    println!(
        "{} acknowledged commits, all on the new primary",
        keys.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_follows_the_promoted_standby_and_no_acknowledged_commit_is_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut pg, _store, pool) = replicated_with_table(dir.path(), 8).await;
    let writers = Writers::start(&pool, 4, INSERT, Duration::from_secs(60));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !writers.acked.lock().expect("lock").is_empty(),
        "no commits before the kill"
    );

    let kill = Instant::now();
    pg.kill_primary();
    let promote = pg.promote_standby().await.expect("promote");
    let promoted = kill.elapsed();
    let recovered = writers.first_commit_after(kill, kill + promoted).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!(
        "promoted (pg_promote) {:.2} s, in all {:.2} s after the kill; first commit after it at {:.2} s",
        promote.as_secs_f64(),
        promoted.as_secs_f64(),
        recovered.as_secs_f64(),
    );
    let keys = writers.stop(kill).await;
    assert!(
        recovered < promoted + Duration::from_secs(5),
        "the pool took {recovered:?} to commit again; the standby was promoted at {promoted:?}"
    );
    all_acknowledged_on_the_new_primary(&pool, &keys).await;
}

/// The primary hangs with every pool connection in a query (4 writers of 200 ms statements, a pool of 4): its
/// sockets stay open and the kernel acknowledges what the writers send, so no statement fails; each is given up at
/// its 3 s deadline, dropping its connection mid-query. The pool must give those places back and connect to the promoted standby. Before the
/// patched sqlx-core (third_party/sqlx-core/PATCHED.md) the four places stayed held for as long as the primary
/// hung, and nothing committed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_follows_the_promoted_standby_when_the_primary_hangs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut pg, store, pool) = replicated_with_table(dir.path(), 4).await;
    let mut moves = store
        .primary_moves()
        .expect("a store on two hosts counts its moves");
    let writers = Writers::start(&pool, 4, SLOW_INSERT, Duration::from_secs(3));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !writers.acked.lock().expect("lock").is_empty(),
        "no commits before the primary hung"
    );

    let hung = Instant::now();
    let moved = tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(60), moves.changed()).await;
        hung.elapsed()
    });
    let stopped = pg.freeze_primary();
    assert!(stopped > 1, "the postmaster and its processes: {stopped}");
    let promote = pg.promote_standby().await.expect("promote");
    let promoted = hung.elapsed();
    let recovered = writers.first_commit_after(hung, hung + promoted).await;
    let moved = moved.await.expect("the move's watch");
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!(
        "{stopped} processes of the primary stopped; standby promoted (pg_promote) {:.2} s, in all {:.2} s after; \
         the pool moved at {:.2} s; first commit after it at {:.2} s",
        promote.as_secs_f64(),
        promoted.as_secs_f64(),
        moved.as_secs_f64(),
        recovered.as_secs_f64(),
    );
    let keys = writers.stop(hung).await;
    assert!(
        recovered < promoted + Duration::from_secs(15),
        "the pool took {recovered:?} to commit again; the standby was promoted at {promoted:?}"
    );
    // The watcher's check of the hung primary gives no answer within HOST_TIMEOUT; the walk that follows tries the
    // hung host last, so the promoted standby is found at once. Tried first again, the hung host would cost a second
    // HOST_TIMEOUT: the move could not come before 2 × HOST_TIMEOUT.
    assert!(
        promoted < multihost::HOST_TIMEOUT && moved < 2 * multihost::HOST_TIMEOUT,
        "the pool moved {moved:?} after the primary hung (promoted at {promoted:?}); the walk after the silent \
         check should try the hung host last"
    );
    all_acknowledged_on_the_new_primary(&pool, &keys).await;
    pg.kill_primary();
}
