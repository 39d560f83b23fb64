//! A pool on a libpq multi-host URL ([`bc_store::multihost`]) through a real failover: a primary and its
//! synchronous streaming standby ([`bc_store::replica::Replicated`], Debian's PostgreSQL), writers committing
//! throughout, the primary killed (SIGKILL) and the standby promoted. The pool moves to the new primary by itself,
//! calls begun during the outage finish soon after the promotion, and every acknowledged commit is on the new
//! primary.

use bc_store::embedded::Durability;
use bc_store::multihost;
use bc_store::replica::Replicated;
use bc_store::sqlx;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_follows_the_promoted_standby_and_no_acknowledged_commit_is_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pg = Replicated::start(dir.path(), Durability::Throwaway, "bc")
        .await
        .expect("primary and standby");
    let url = pg.url("bc");
    let pool = multihost::connect(&url, 8, Duration::from_secs(10))
        .await
        .expect("pool");
    sqlx::query("CREATE TABLE acked (k bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
        .execute(&pool)
        .await
        .expect("table");

    // Writers: each commit's key is acknowledged only once its INSERT returned; a failed one is retried (the same
    // key: ON CONFLICT makes a commit whose answer was lost harmless).
    let acked: Arc<Mutex<Vec<(i64, Instant)>>> = Arc::default();
    let errors: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..4i64 {
        let (pool, acked, errors, stop) =
            (pool.clone(), acked.clone(), errors.clone(), stop.clone());
        writers.spawn(async move {
            let mut k = w;
            while !*stop.borrow() {
                let t = Instant::now();
                match sqlx::query("INSERT INTO acked (k) VALUES ($1) ON CONFLICT DO NOTHING")
                    .bind(k)
                    .execute(&pool)
                    .await
                {
                    Ok(_) => {
                        acked.lock().expect("lock").push((k, Instant::now()));
                        k += 4;
                    }
                    Err(e) => {
                        errors.lock().expect("lock").push((t, e.to_string()));
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = acked.lock().expect("lock").len();
    assert!(before > 0, "no commits before the kill");

    let kill = Instant::now();
    pg.kill_primary();
    let promote = pg.promote_standby().await.expect("promote");
    let promoted = kill.elapsed();
    // The first commit acknowledged after the promotion, and every writer going again.
    let deadline = Instant::now() + Duration::from_secs(60);
    let recovered = loop {
        let first = acked
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, at)| *at > kill + promoted)
            .map(|(_, at)| *at - kill)
            .min();
        if let Some(r) = first {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no commit within 60 s of the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop_tx.send(true);
    while writers.join_next().await.is_some() {}
    let errs = errors.lock().expect("lock").clone();
    let last_error = errs.iter().map(|(t, _)| *t - kill).max();
    println!(
        "promoted (pg_promote) {:.2} s, in all {:.2} s after the kill; first commit after it at {:.2} s; {} failed \
         statements, the last begun at {:?}",
        promote.as_secs_f64(),
        promoted.as_secs_f64(),
        recovered.as_secs_f64(),
        errs.len(),
        last_error
    );
    for (t, e) in errs.iter().take(5) {
        println!("  {:.2} s: {e}", (*t - kill).as_secs_f64());
    }
    assert!(
        recovered < promoted + Duration::from_secs(5),
        "the pool took {recovered:?} to commit again; the standby was promoted at {promoted:?}"
    );

    // Every acknowledged commit is on the promoted standby, which is now read-write.
    let keys: Vec<i64> = acked
        .lock()
        .expect("lock")
        .iter()
        .map(|(k, _)| *k)
        .collect();
    let (found, in_recovery): (i64, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM acked WHERE k = ANY($1)), pg_is_in_recovery()",
    )
    .bind(&keys)
    .fetch_one(&pool)
    .await
    .expect("count");
    assert!(!in_recovery, "the pool is not on the promoted standby");
    assert_eq!(found as usize, keys.len(), "acknowledged commits lost");
    println!(
        "{} acknowledged commits, all on the new primary",
        keys.len()
    );
}
