//! A database that goes silent without a reset (a primary cut off, power lost, a flow dropped by a firewall) while
//! queries are in flight on the pool's connections. Every caller here bounds its calls (the API's method deadline,
//! a reconciler's step deadline, the gateway's store deadline), and a call given up drops its connection mid-query.
//! The pool must get those connections' places back and open new connections (to the host a failover moved to).

use bc_store::sqlx;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Real PostgreSQL behind a proxy that freezes on demand (`bc_store::testing::freezing_proxy`), and a pool of 2 on
/// it made with `options` (a 10 s acquire timeout). The database is kept for as long as the pool is used.
async fn through_freezing_proxy(
    options: sqlx::postgres::PgPoolOptions,
) -> (
    bc_store::testing::TestDb,
    sqlx::PgPool,
    tokio::sync::watch::Sender<u64>,
) {
    let db = bc_store::testing::test_db().await;
    let direct = db.connect_options();
    let (at, freeze) =
        bc_store::testing::freezing_proxy(SocketAddr::from(([127, 0, 0, 1], direct.get_port())))
            .await;
    let pool = options
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(direct.clone().port(at.port()))
        .await
        .expect("pool through the proxy");
    (db, pool, freeze)
}

/// How long the next query took once both of `pool`'s connections, idle, went silent (`frozen` runs as they do).
async fn served_after_the_idle_connections_froze(
    pool: &sqlx::PgPool,
    freeze: &tokio::sync::watch::Sender<u64>,
    frozen: impl FnOnce(),
) -> Duration {
    drop((
        pool.acquire().await.expect("first"),
        pool.acquire().await.expect("second"),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pool.num_idle(), 2);
    freeze.send_modify(|g| *g += 1);
    frozen();
    let t = Instant::now();
    let r = sqlx::query_scalar::<_, i32>("SELECT 3")
        .fetch_one(pool)
        .await;
    let waited = t.elapsed();
    assert!(matches!(r, Ok(3)), "after {waited:?}: {r:?}");
    waited
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_given_up_on_a_silent_database_are_replaced() {
    let (_db, pool, freeze) = through_freezing_proxy(sqlx::postgres::PgPoolOptions::new()).await;

    // Both of the pool's connections are taken, then the database goes silent under them.
    let mut taken = vec![
        pool.acquire().await.expect("first"),
        pool.acquire().await.expect("second"),
    ];
    freeze.send_modify(|g| *g += 1);
    for conn in &mut taken {
        let r = tokio::time::timeout(
            Duration::from_millis(300),
            sqlx::query("SELECT 1").execute(&mut **conn),
        )
        .await;
        assert!(r.is_err(), "a silent database answered: {r:?}");
    }
    // Given up: dropped mid-query, as a deadline drops a handler's future.
    drop(taken);

    // New connections pass the proxy; the pool must make room for them.
    let t = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        sqlx::query_scalar::<_, i32>("SELECT 2").fetch_one(&pool),
    )
    .await;
    let waited = t.elapsed();
    match r {
        Ok(Ok(2)) => {}
        other => panic!("after {waited:?} the pool still had no connection: {other:?}"),
    }
    println!("a connection again {waited:?} after the two were given up");
    assert!(waited < Duration::from_secs(8), "{waited:?}");
}

/// The pool's idle connections go silent: the next call is not held for the acquire's whole timeout and failed,
/// each silent connection is given up after its ping's few seconds and a new connection serves the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_on_a_silent_database_do_not_fail_the_next_call() {
    let (_db, pool, freeze) = through_freezing_proxy(sqlx::postgres::PgPoolOptions::new()).await;
    let waited = served_after_the_idle_connections_froze(&pool, &freeze, || {}).await;
    println!("served {waited:?} after its idle connections went silent");
    assert!(waited < Duration::from_secs(9), "{waited:?}");
}

/// As after a failover (`bc_store::multihost` rejects, in `before_acquire`, every connection opened before the pool
/// moved): idle connections to the old primary, gone silent, are rejected by the hook without being pinged, so the
/// next call is served at once by a new connection instead of after a ping's timeout for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_pool_rejects_are_not_pinged_first() {
    let moved_at: std::sync::Arc<std::sync::Mutex<Option<Instant>>> = Default::default();
    let moved = moved_at.clone();
    let options = sqlx::postgres::PgPoolOptions::new().before_acquire(move |_, meta| {
        let stale = moved
            .lock()
            .expect("lock")
            .is_some_and(|at| meta.age > at.elapsed());
        Box::pin(async move { Ok(!stale) })
    });
    let (_db, pool, freeze) = through_freezing_proxy(options).await;
    let waited = served_after_the_idle_connections_froze(&pool, &freeze, || {
        *moved_at.lock().expect("lock") = Some(Instant::now());
    })
    .await;
    println!("served {waited:?} after the pool moved off its silent connections");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

/// `Store::within`: a call that waits for ever (a query to a primary that hangs) is given up at its deadline, and
/// at once when the pool moves to another primary; a move before the call began does not cut it.
#[tokio::test]
async fn a_call_within_is_given_up_at_its_deadline_or_when_the_primary_moves() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://bc@127.0.0.1:1/bc")
        .expect("a lazy pool");
    let (moves, moved) = tokio::sync::watch::channel(0u64);
    let store = bc_store::Store::following(pool, moved);
    let never = || std::future::pending::<Result<(), bc_store::StoreError>>();

    let t = Instant::now();
    let e = store
        .within("a stuck call", Duration::from_millis(300), never())
        .await
        .expect_err("never answers");
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(
        e.to_string(),
        "a stuck call: the database did not answer within 300ms"
    );

    moves.send_modify(|n| *n += 1);
    let t = Instant::now();
    let cut = store.within("a stuck call", Duration::from_secs(60), never());
    let mover = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        moves.send_modify(|n| *n += 1);
    };
    let (e, ()) = tokio::join!(cut, mover);
    let e = e.expect_err("cut short");
    assert!(
        (Duration::from_millis(200)..Duration::from_secs(5)).contains(&t.elapsed()),
        "cut at the move, not before (the earlier move) nor at the deadline: {:?}",
        t.elapsed()
    );
    assert_eq!(
        e.to_string(),
        "a stuck call: cut short, the database primary moved while it ran"
    );
    let ok = store
        .within("an answer", Duration::from_secs(1), async { Ok(7) })
        .await
        .expect("answers");
    assert_eq!(ok, 7);
}
