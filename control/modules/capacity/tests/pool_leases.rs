//! The pool-lease placer's fencing, on a real PostgreSQL: a booking transaction holds its pool lease rows
//! `FOR SHARE` with the fence it read, so a placer whose lease moved on claims nothing, and a takeover waits for
//! the holder's transaction to end.

use bc_mod_capacity::queries::{self, PoolLease};
use bc_store::Store;
use bc_store::reservations::{Admission, NewReservation};
use bc_store::testing::{insert_reservations, seed_gpu_nodes, test_db};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

async fn pending_in(store: &Store, id: &str, pool: &str) {
    let request = serde_json::json!({
        "tenant": "root", "gpus": 1, "topology": "node", "duration_s": 60, "pool": pool,
    });
    let admitted = store
        .admit_reservation(NewReservation {
            id,
            principal_id: "admin",
            key: id,
            body_hash: "h",
            tenant: "root",
            request: &request,
            duration_s: 60,
        })
        .await
        .expect("admit");
    assert!(matches!(admitted, Admission::Recorded));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placer_whose_pool_lease_moved_on_claims_nothing() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "pa", "a", 1, 2, "H100")
        .await
        .expect("seed");
    pending_in(&store, "rsv-1", "pa").await;

    let a = queries::sync_pool_leases(&store, "A", &["pa".into()], 10_000)
        .await
        .expect("A takes pa");
    assert_eq!(a.len(), 1);
    let (tx, valid, pending) = queries::claim_pending_in_pools(&store, "A", &a, None, 10)
        .await
        .expect("claim");
    assert_eq!(
        (valid.len(), pending.len()),
        (1, 1),
        "the holder claims its pool's reservation"
    );
    tx.rollback().await.expect("rollback");

    // A's lease ends (it stopped); B takes pa with a higher fence.
    queries::leave_pools(&store, "A").await.expect("leave");
    let b = queries::sync_pool_leases(&store, "B", &["pa".into()], 10_000)
        .await
        .expect("B takes pa");
    assert_eq!(b.len(), 1);
    assert!(b[0].fence > a[0].fence, "{b:?} after {a:?}");

    // A, still believing it holds pa with its old fence, claims nothing; B claims it.
    let (tx, valid, pending) = queries::claim_pending_in_pools(&store, "A", &a, None, 10)
        .await
        .expect("stale claim");
    assert!(
        valid.is_empty() && pending.is_empty(),
        "a stale holder claimed {pending:?}"
    );
    tx.rollback().await.expect("rollback");
    // Even A's own renewal cannot take pa back while B holds it.
    let again = queries::sync_pool_leases(&store, "A", &["pa".into()], 10_000)
        .await
        .expect("sync");
    assert!(again.is_empty(), "{again:?}");
    let (tx, _, pending) = queries::claim_pending_in_pools(&store, "B", &b, None, 10)
        .await
        .expect("claim");
    assert_eq!(pending.len(), 1);
    tx.rollback().await.expect("rollback");

    // B stops and A takes pa again, with a new fence: a claim still carrying A's first fence (work begun before
    // it lost the lease) claims nothing, though the owner matches.
    queries::leave_pools(&store, "B").await.expect("leave");
    let a2 = queries::sync_pool_leases(&store, "A", &["pa".into()], 10_000)
        .await
        .expect("A takes pa again");
    assert!(a2[0].fence > b[0].fence, "{a2:?} after {b:?}");
    let (tx, valid, pending) = queries::claim_pending_in_pools(&store, "A", &a, None, 10)
        .await
        .expect("old-fence claim");
    assert!(
        valid.is_empty() && pending.is_empty(),
        "a claim with a fence from an earlier tenure claimed {pending:?}"
    );
    tx.rollback().await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_the_holders_booking_transaction() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "pa", "a", 1, 2, "H100")
        .await
        .expect("seed");
    pending_in(&store, "rsv-1", "pa").await;
    // B holds pa for 300 ms and opens its booking transaction at once.
    let b: Vec<PoolLease> = queries::sync_pool_leases(&store, "B", &["pa".into()], 300)
        .await
        .expect("B takes pa");
    let (tx, valid, _) = queries::claim_pending_in_pools(&store, "B", &b, None, 10)
        .await
        .expect("claim");
    assert_eq!(valid.len(), 1);
    let committed = Arc::new(AtomicBool::new(false));
    let done = committed.clone();
    let holder = tokio::spawn(async move {
        // The booking takes longer than the lease: the lease runs out while the transaction is open.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        done.store(true, Ordering::SeqCst);
        tx.commit().await.expect("commit");
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let a = queries::sync_pool_leases(&store, "A", &["pa".into()], 10_000)
        .await
        .expect("A takes pa");
    assert!(
        committed.load(Ordering::SeqCst),
        "A took pa while B's booking transaction, fenced on it, was still open"
    );
    assert_eq!(
        a.len(),
        1,
        "A takes the expired lease once B's transaction ended"
    );
    assert!(a[0].fence > b[0].fence);
    holder.await.expect("holder");
}

/// A claim of the reservations a notification named takes only those still pending in a pool the placer holds:
/// not one already decided, not one of another pool, not an unknown id. (The named claim has its own statement, so
/// that its generic plan looks the ids up by key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_claim_takes_only_pending_reservations_of_held_pools() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "pa", "a", 1, 2, "H100")
        .await
        .expect("seed pa");
    seed_gpu_nodes(&db.pool, "pb", "b", 1, 2, "H100")
        .await
        .expect("seed pb");
    pending_in(&store, "rsv-1", "pa").await;
    pending_in(&store, "rsv-2", "pa").await;
    pending_in(&store, "rsv-3", "pb").await;
    bc_store::sqlx::query(
        "UPDATE reservations SET state = 'failed', ended_at = now() WHERE id = 'rsv-2'",
    )
    .execute(&db.pool)
    .await
    .expect("decide rsv-2");
    let a = queries::sync_pool_leases(&store, "A", &["pa".into()], 10_000)
        .await
        .expect("A takes pa");
    let named: Vec<String> = ["rsv-1", "rsv-2", "rsv-3", "rsv-none"]
        .map(String::from)
        .to_vec();
    let (tx, valid, pending) = queries::claim_pending_in_pools(&store, "A", &a, Some(&named), 10)
        .await
        .expect("named claim");
    let ids: Vec<&str> = pending.iter().map(|p| p.id.as_str()).collect();
    assert_eq!((valid.len(), ids), (1, vec!["rsv-1"]));
    tx.rollback().await.expect("rollback");
}

/// The pool placer's scan reads `reservations_pending_pool` by pool, on its generic plan (the placer's transaction
/// forces generic plans), and that index holds only reservations that name a pool (migration 17): an admission
/// without one, every admission under the default shard placer, writes no entry into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_scan_reads_its_index_which_holds_only_reservations_with_a_pool() {
    let db = test_db().await;
    let def: String = bc_store::sqlx::query_scalar(
        "SELECT pg_get_indexdef('reservations_pending_pool'::regclass)",
    )
    .fetch_one(&db.pool)
    .await
    .expect("index");
    assert!(def.contains("pool IS NOT NULL"), "{def}");
    seed_gpu_nodes(&db.pool, "pa", "a", 1, 2, "H100")
        .await
        .expect("seed");
    insert_reservations(
        &db.pool,
        "rsv-old-",
        (1, 20_000),
        "released",
        "jsonb_build_object('pool', 'pa')",
    )
    .await
    .expect("old reservations");
    // Pending elsewhere: 5,000 in another pool and 5,000 naming none.
    insert_reservations(
        &db.pool,
        "rsv-other-",
        (1, 10_000),
        "pending",
        "CASE WHEN g % 2 = 0 THEN jsonb_build_object('pool', 'pb') ELSE '{}' END",
    )
    .await
    .expect("other pending reservations");
    bc_store::sqlx::query("ANALYZE reservations")
        .execute(&db.pool)
        .await
        .expect("analyze");
    let one = db.one_connection().await;
    let store = Store::new(one.clone());
    pending_in(&store, "rsv-1", "pa").await;
    let a = queries::sync_pool_leases(&store, "A", &["pa".into()], 10_000)
        .await
        .expect("A takes pa");
    let (tx, _, pending) = queries::claim_pending_in_pools(&store, "A", &a, None, 10)
        .await
        .expect("claim");
    assert_eq!(pending.len(), 1);
    tx.rollback().await.expect("rollback");
    let (name, params): (String, i32) = bc_store::sqlx::query_as(
        "SELECT name, cardinality(parameter_types) FROM pg_prepared_statements \
         WHERE statement LIKE 'SELECT id, request%pool = ANY($1)%'",
    )
    .fetch_one(&one)
    .await
    .expect("the scan's prepared statement");
    let mut tx = store.begin_placement().await.expect("begin");
    let nulls = vec!["NULL"; usize::try_from(params).expect("count")].join(", ");
    let plan: Vec<String> = bc_store::sqlx::query_scalar(bc_store::sqlx::AssertSqlSafe(format!(
        "EXPLAIN EXECUTE {name}({nulls})"
    )))
    .fetch_all(&mut *tx)
    .await
    .expect("explain");
    let plan = plan.join("\n");
    assert!(
        plan.contains("reservations_pending_pool") && !plan.contains("Seq Scan"),
        "{plan}"
    );
    tx.rollback().await.expect("rollback");
}
