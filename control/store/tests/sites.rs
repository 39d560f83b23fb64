//! The boot lease and site enrollment against a real PostgreSQL: one holder per site, renewal keeps the fence, a
//! takeover only after expiry and with a higher fence, release hands over at once; enrollment spends one use per
//! key and replays a retry.

use bc_store::Store;
use bc_store::sites::{EnrollCommit, NewSiteToken};
use bc_store::testing::test_db;
use std::time::Duration;

async fn site(store: &Store, id: &str, uses: i32) {
    store
        .create_site_token(NewSiteToken {
            id: &format!("tok-{id}"),
            site_id: id,
            secret_hash: "00",
            uses,
            expires_at_ms: (time::OffsetDateTime::now_utc().unix_timestamp() + 3600) * 1000,
            created_by: "test",
        })
        .await
        .expect("site token");
}

#[tokio::test]
async fn one_holder_per_site_fenced_takeover_after_expiry() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    site(&store, "r1", 1).await;
    site(&store, "r2", 1).await;

    let a = store.acquire_boot_lease("r1", "a", 400).await.expect("a");
    assert!(a.held);
    assert_eq!(a.fence, 1);
    assert!(a.expires_in_ms > 0 && a.expires_in_ms <= 400, "{a:?}");
    // Another site's lease is independent.
    assert!(
        store
            .acquire_boot_lease("r2", "b", 400)
            .await
            .expect("r2")
            .held
    );
    // B stands by while A's lease runs.
    let b = store.acquire_boot_lease("r1", "b", 400).await.expect("b");
    assert!(!b.held);
    assert_eq!(b.holder, "a");
    // A renews: same fence.
    let a2 = store.acquire_boot_lease("r1", "a", 400).await.expect("a2");
    assert!(a2.held);
    assert_eq!(a2.fence, 1);
    // A stops renewing; after expiry B takes it with a higher fence, and A is told so.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let b2 = store.acquire_boot_lease("r1", "b", 400).await.expect("b2");
    assert!(b2.held);
    assert_eq!(b2.fence, 2);
    let a3 = store.acquire_boot_lease("r1", "a", 400).await.expect("a3");
    assert!(!a3.held);
    assert_eq!(a3.holder, "b");
    // Release hands over at once (fence bumps on the next holder).
    assert!(store.release_boot_lease("r1", "b").await.expect("release"));
    assert!(
        !store
            .release_boot_lease("r1", "b")
            .await
            .expect("release twice")
    );
    let a4 = store.acquire_boot_lease("r1", "a", 400).await.expect("a4");
    assert!(a4.held);
    assert_eq!(a4.fence, 3);
    // Concurrent askers: exactly one holds it.
    store
        .release_boot_lease("r1", "a")
        .await
        .expect("release a");
    let asks = (0..8).map(|i| {
        let s = store.clone();
        tokio::spawn(async move { s.acquire_boot_lease("r1", &format!("x{i}"), 5000).await })
    });
    let mut held = 0;
    for t in asks {
        if t.await.expect("join").expect("ask").held {
            held += 1;
        }
    }
    assert_eq!(held, 1);
}

#[tokio::test]
async fn enrollment_spends_one_use_per_key_and_replays_retries() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    site(&store, "r1", 1).await;
    let ms = (time::OffsetDateTime::now_utc().unix_timestamp() + 86_400) * 1000;
    assert_eq!(
        store
            .commit_enrollment("tok-r1", "k1", "s1", ms)
            .await
            .expect("k1"),
        EnrollCommit::Enrolled {
            site_id: "r1".into()
        }
    );
    assert_eq!(
        store
            .commit_enrollment("tok-r1", "k1", "s2", ms)
            .await
            .expect("retry"),
        EnrollCommit::Replay {
            site_id: "r1".into()
        }
    );
    assert_eq!(
        store
            .commit_enrollment("tok-r1", "k2", "s3", ms)
            .await
            .expect("k2"),
        EnrollCommit::Exhausted
    );
    assert_eq!(
        store
            .commit_enrollment("nope", "k2", "s3", ms)
            .await
            .expect("unknown"),
        EnrollCommit::Unknown
    );
    assert!(
        store
            .revoke_site_token("tok-r1", "test")
            .await
            .expect("revoke")
    );
    // A retry of a committed enrollment still replays after revocation (the crash case); a new key does not.
    assert!(matches!(
        store
            .commit_enrollment("tok-r1", "k1", "s4", ms)
            .await
            .expect("retry"),
        EnrollCommit::Replay { .. }
    ));
    assert_eq!(store.site_agent_count("r1").await.expect("count"), 1);
}
