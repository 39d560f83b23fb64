//! A database that goes silent without a reset (a primary cut off, power lost, a flow dropped by a firewall) while
//! queries are in flight on the pool's connections. Every caller here bounds its calls (the API's method deadline,
//! a reconciler's step deadline, the gateway's store deadline), and a call given up drops its connection mid-query.
//! The pool must get those connections' places back and open new connections (to the host a failover moved to).

use bc_store::sqlx;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_given_up_on_a_silent_database_are_replaced() {
    let db = bc_store::testing::test_db().await;
    let direct = db.connect_options();
    let (at, freeze) =
        bc_store::testing::freezing_proxy(SocketAddr::from(([127, 0, 0, 1], direct.get_port())))
            .await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(direct.clone().port(at.port()))
        .await
        .expect("pool through the proxy");

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
    let db = bc_store::testing::test_db().await;
    let direct = db.connect_options();
    let (at, freeze) =
        bc_store::testing::freezing_proxy(SocketAddr::from(([127, 0, 0, 1], direct.get_port())))
            .await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(direct.clone().port(at.port()))
        .await
        .expect("pool through the proxy");
    // Two connections, both idle in the pool.
    drop((
        pool.acquire().await.expect("first"),
        pool.acquire().await.expect("second"),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pool.num_idle(), 2);
    freeze.send_modify(|g| *g += 1);

    let t = Instant::now();
    let r = sqlx::query_scalar::<_, i32>("SELECT 3")
        .fetch_one(&pool)
        .await;
    let waited = t.elapsed();
    assert!(matches!(r, Ok(3)), "after {waited:?}: {r:?}");
    println!("served {waited:?} after its idle connections went silent");
    assert!(waited < Duration::from_secs(9), "{waited:?}");
}
