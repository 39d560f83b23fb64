//! Shard leases and fencing against a real PostgreSQL: a takeover raises the fence; a process holding a stale
//! fence (or an expired lease) commits no work; outbox rows and due work are processed once.

use bc_store::Store;
use bc_store::sqlx;
use bc_store::testing::{seed_gpu_nodes, test_db};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_raises_the_fence_and_stale_holders_commit_nothing() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "p", "n", 4, 2, "m")
        .await
        .expect("seed");
    let all: Vec<i16> = (0..256).collect();

    // A takes every shard with a lease that runs out at once.
    let a = store
        .sync_leases("controllers", "a", &all, 600)
        .await
        .expect("a");
    assert_eq!(a.len(), 256);
    assert!(a.iter().all(|l| l.fence == 1));
    // While A's lease is valid, B gets nothing.
    let b = store
        .sync_leases("controllers", "b", &all, 600)
        .await
        .expect("b");
    assert!(b.is_empty(), "B took {} shards from a live lease", b.len());

    // Outbox rows for every node; work due now.
    sqlx::query(
        "INSERT INTO outbox (node_id, shard, kind, generation) SELECT id, shard, 'desired', 1 FROM nodes",
    )
    .execute(&db.pool)
    .await
    .expect("outbox");

    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    // A's lease expired: A commits nothing with it.
    assert_eq!(
        store
            .drain_outbox("controllers", "a", &a, 100)
            .await
            .expect("drain"),
        0,
        "an expired lease drained the outbox"
    );
    // B takes over: the fence rises.
    let b = store
        .sync_leases("controllers", "b", &all, 10_000)
        .await
        .expect("b");
    assert_eq!(b.len(), 256);
    assert!(b.iter().all(|l| l.fence == 2), "{:?}", &b[..3]);
    // A renews with its old view: it no longer owns anything, and its old fence drains nothing.
    let a2 = store
        .sync_leases("controllers", "a", &all, 10_000)
        .await
        .expect("a2");
    assert!(a2.is_empty());
    assert_eq!(
        store
            .drain_outbox("controllers", "a", &a, 100)
            .await
            .expect("drain"),
        0
    );
    // B delivers each row once.
    assert_eq!(
        store
            .drain_outbox("controllers", "b", &b, 100)
            .await
            .expect("drain"),
        4
    );
    assert_eq!(
        store
            .drain_outbox("controllers", "b", &b, 100)
            .await
            .expect("drain"),
        0
    );

    // Letting go keeps the fence: the next owner gets fence + 1.
    let some: Vec<i16> = (0..128).collect();
    let b2 = store
        .sync_leases("controllers", "b", &some, 10_000)
        .await
        .expect("b2");
    assert_eq!(b2.len(), 128);
    let c = store
        .sync_leases(
            "controllers",
            "c",
            &(128..256).collect::<Vec<i16>>(),
            10_000,
        )
        .await
        .expect("c");
    assert_eq!(c.len(), 128);
    assert!(c.iter().all(|l| l.fence == 3));
    // Roles are independent.
    let s = store
        .sync_leases("scheduler", "b", &all, 10_000)
        .await
        .expect("s");
    assert_eq!(s.len(), 256);
    assert!(s.iter().all(|l| l.fence == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_lists_live_workers_and_leaving_frees_shards() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    let w = store
        .heartbeat_worker("controllers", "x", 10_000)
        .await
        .expect("x");
    assert_eq!(w, vec!["x".to_string()]);
    let w = store
        .heartbeat_worker("controllers", "y", 10_000)
        .await
        .expect("y");
    assert_eq!(w, vec!["x".to_string(), "y".to_string()]);
    let w = store
        .heartbeat_worker("scheduler", "z", 10_000)
        .await
        .expect("z");
    assert_eq!(w, vec!["z".to_string()], "roles have separate memberships");
    store
        .sync_leases("controllers", "x", &[1, 2], 10_000)
        .await
        .expect("x leases");
    store.leave_role("controllers", "x").await.expect("leave");
    let w = store
        .heartbeat_worker("controllers", "y", 10_000)
        .await
        .expect("y");
    assert_eq!(w, vec!["y".to_string()]);
    let taken = store
        .sync_leases("controllers", "y", &[1, 2], 10_000)
        .await
        .expect("y takes");
    assert_eq!(taken.len(), 2, "a clean leave frees the shards at once");
}

/// A lease row still locked by another process's open transaction (a fenced holder that was paused, or cut off,
/// mid-transaction) is skipped by a takeover instead of waited for: the taker renews its own leases and takes the
/// other free shards at once, and takes the locked one once that transaction ended. Before, the one statement that
/// syncs every lease waited behind the lock, so every lease of the taker expired too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_skips_a_lease_row_locked_by_a_stalled_holder() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    let a = store
        .sync_leases("controllers", "a", &[0, 1, 2, 3], 600)
        .await
        .expect("a");
    assert_eq!(a.len(), 4);
    let b = store
        .sync_leases("controllers", "b", &[10, 11], 60_000)
        .await
        .expect("b");
    assert_eq!(b.len(), 2);
    // A's fenced transaction locks shard 0's lease and stalls (never commits while B works).
    let mut stalled = db.pool.begin().await.expect("begin");
    sqlx::query(
        "SELECT shard FROM shard_leases WHERE role = 'controllers' AND shard = 0 FOR SHARE",
    )
    .fetch_all(&mut *stalled)
    .await
    .expect("lock");
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    // A's leases expired: B renews its own and takes 1..3 now, without waiting for the stalled transaction.
    let held = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        store.sync_leases("controllers", "b", &[0, 1, 2, 3, 10, 11], 60_000),
    )
    .await
    .expect("the sync waited behind the stalled transaction's lock")
    .expect("b syncs");
    let shards: Vec<i16> = held.iter().map(|l| l.shard).collect();
    assert_eq!(shards, [1, 2, 3, 10, 11]);
    assert!(held.iter().filter(|l| l.shard < 4).all(|l| l.fence == 2));
    // Once the holder's transaction ended, shard 0 is taken with a higher fence.
    stalled.rollback().await.expect("rollback");
    let held = store
        .sync_leases("controllers", "b", &[0, 1, 2, 3, 10, 11], 60_000)
        .await
        .expect("b again");
    assert_eq!(held.len(), 6);
    assert_eq!(held[0].shard, 0);
    assert_eq!(held[0].fence, 2);
}
