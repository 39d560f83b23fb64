//! Planner statistics against a real PostgreSQL: a statement whose generic plan was made while `reservations` was
//! empty keeps scanning the table after it filled, until [`Store::refresh_stale_statistics`] analyzes it; then the
//! same prepared statement is replanned as an index lookup, and later checks analyze nothing, not even after the
//! table grew fivefold (that is autovacuum's work).

use bc_store::Store;
use bc_store::sqlx::{self, Connection as _};
use bc_store::statistics::{HOT_TABLES, MIN_ROWS};
use bc_store::testing::test_db;
use std::time::{Duration, Instant};

/// The plan PostgreSQL would run for the prepared statement `by_id` now, generic (as a cached statement gets it).
async fn generic_plan(conn: &mut sqlx::PgConnection) -> String {
    let rows: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE by_id('{rsv-1,rsv-2}')")
        .fetch_all(&mut *conn)
        .await
        .expect("explain");
    rows.join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_that_outgrew_its_estimate_is_analyzed_and_plans_follow() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    // Autovacuum must not analyze behind the test's back (its naptime is a minute; this keeps it out for sure).
    for t in HOT_TABLES {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {t} SET (autovacuum_enabled = false)"
        )))
        .execute(&db.pool)
        .await
        .expect("autovacuum off");
    }
    sqlx::query("INSERT INTO tenants (id, name, is_root) VALUES ('root', 'root', true)")
        .execute(&db.pool)
        .await
        .expect("tenant");
    assert!(
        store
            .planner_row_estimate("reservations")
            .await
            .expect("estimate")
            < 0.0
    );

    // A session prepares the API's read of decided reservations while the table is empty, and keeps it (generic plan).
    let mut conn = sqlx::PgConnection::connect_with(&db.connect_options())
        .await
        .expect("connect");
    for stmt in [
        "SET plan_cache_mode = force_generic_plan",
        "PREPARE by_id(text[]) AS SELECT r.id, r.state, r.request FROM reservations r WHERE r.id = ANY($1)",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(stmt))
            .execute(&mut conn)
            .await
            .expect(stmt);
    }
    let empty = generic_plan(&mut conn).await;
    assert!(
        !store
            .refresh_stale_statistics(HOT_TABLES)
            .await
            .expect("check")
            .contains(&"reservations".to_string()),
        "an empty table was analyzed"
    );

    // The table fills: 3,000 reservations.
    let n = 3 * MIN_ROWS;
    fill(&db.pool, 1, n).await;
    // The cached generic plan does not know: it still is the plan made for the empty table.
    let stale = generic_plan(&mut conn).await;
    assert_eq!(stale, empty, "the plan changed without new statistics");
    assert!(
        stale.contains("Seq Scan on reservations r"),
        "expected the empty table's generic plan to scan it; got\n{stale}"
    );

    // The check analyzes it once the writer's counts reached the cumulative statistics (within about a second).
    let t = Instant::now();
    let analyzed = loop {
        let analyzed = store
            .refresh_stale_statistics(HOT_TABLES)
            .await
            .expect("refresh");
        if !analyzed.is_empty() || t.elapsed() > Duration::from_secs(20) {
            break analyzed;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(analyzed, vec!["reservations".to_string()]);
    let estimate = store
        .planner_row_estimate("reservations")
        .await
        .expect("estimate");
    assert!(
        (estimate - n as f64).abs() < n as f64 * 0.1,
        "estimate {estimate} for {n} rows"
    );

    // The same prepared statement is replanned: an index lookup now.
    let fresh = generic_plan(&mut conn).await;
    assert!(
        fresh.contains("reservations_pkey") && !fresh.contains("Seq Scan"),
        "expected a primary-key lookup after ANALYZE; got\n{fresh}"
    );
    // Nothing is stale any more; and a table whose statistics already describe MIN_ROWS or more is left to
    // autovacuum even after growing fivefold (its plans are index lookups already).
    assert!(
        store
            .refresh_stale_statistics(HOT_TABLES)
            .await
            .expect("again")
            .is_empty()
    );
    fill(&db.pool, n + 1, 5 * n).await;
    let t = Instant::now();
    while live_rows(&db.pool).await < 5 * n {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "live rows never reached the statistics"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        store
            .refresh_stale_statistics(HOT_TABLES)
            .await
            .expect("after growth")
            .is_empty(),
        "a table with statistics was analyzed on the hot path"
    );
}

/// Inserts placed reservations `rsv-<from>` to `rsv-<to>`.
async fn fill(pool: &sqlx::PgPool, from: i64, to: i64) {
    bc_store::testing::insert_reservations(pool, "rsv-", (from, to), "placed", "'{}'")
        .await
        .expect("fill");
}

async fn live_rows(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'reservations'")
        .fetch_one(pool)
        .await
        .expect("live rows")
}
