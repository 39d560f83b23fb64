//! Store tests against a real PostgreSQL (the harness starts a private cluster).

use bc_core::join::Expectations;
use bc_store::Store;
use bc_store::join_tokens::NewJoinToken;
use bc_store::nodes::{JoinCandidate, JoinCommit};
use bc_store::testing::test_db;

async fn seeded(uses: i32) -> Store {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root tenant");
    store
        .ensure_pool("p1", "root", "pool one", true)
        .await
        .expect("pool");
    store
        .create_join_token(NewJoinToken {
            id: "0123456789abcdef",
            pool_id: "p1",
            secret_hash: "00",
            uses,
            expires_at_ms: i64::MAX / 2_000_000,
            expect: &Expectations::default(),
            reclaim: false,
            created_by: "test",
        })
        .await
        .expect("token");
    store
}

fn candidate(n: u32, hk: &str) -> JoinCandidate {
    JoinCandidate {
        node_id: format!("node-{n}"),
        reclaim: false,
        hardware_key: Some(hk.to_string()),
        claims: serde_json::json!({"n": n}),
        join_key_hash: format!("key-{n}"),
        cert_serial: format!("{n:02x}"),
        not_after_ms: 1_900_000_000_000,
        public_key_hex: "04ab".into(),
    }
}

#[tokio::test]
async fn batch_grants_at_most_uses_left_and_refuses_duplicate_hardware() {
    let store = seeded(3).await;
    let batch = vec![
        candidate(1, "hk-a"),
        candidate(2, "hk-a"),
        candidate(3, "hk-c"),
        candidate(4, "hk-d"),
    ];
    let out = store
        .commit_joins("0123456789abcdef", "p1", &batch)
        .await
        .expect("commit");
    assert_eq!(
        out[0],
        JoinCommit::Joined {
            node_id: "node-1".into(),
            reclaimed: false
        }
    );
    assert_eq!(
        out[1],
        JoinCommit::HardwareTaken {
            node_id: "node-1".into(),
            same_key: false
        }
    );
    assert_eq!(
        out[2],
        JoinCommit::Joined {
            node_id: "node-3".into(),
            reclaimed: false
        }
    );
    assert_eq!(out[3], JoinCommit::Exhausted);
    let token = store
        .join_token("0123456789abcdef")
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(
        token.uses_left, 1,
        "only the two nodes actually created spend a use"
    );
    assert_eq!(store.list_nodes().await.expect("list").len(), 2);
}

#[tokio::test]
async fn migrations_are_idempotent() {
    let db = test_db().await;
    assert_eq!(
        bc_store::migrate::migrate(&db.pool).await.expect("migrate"),
        0
    );
}

async fn xmin(store: &Store, id: &str) -> String {
    bc_store::sqlx::query_scalar("SELECT xmin::text FROM nodes WHERE id = $1")
        .bind(id)
        .fetch_one(store.pool())
        .await
        .expect("xmin")
}

#[tokio::test]
async fn liveness_rewrites_a_row_only_when_last_seen_moved_and_names_sessions_to_close() {
    let store = seeded(3).await;
    let batch = vec![candidate(1, "hk-1"), candidate(2, "hk-2")];
    store
        .commit_joins("0123456789abcdef", "p1", &batch)
        .await
        .expect("commit");
    let t = 1_800_000_000_000i64;
    let seen = |ms: i64| {
        vec![
            ("node-1".to_string(), 0i64, ms),
            ("node-2".to_string(), 0, ms),
        ]
    };
    assert!(
        store
            .record_liveness(&seen(t))
            .await
            .expect("liveness")
            .is_empty()
    );
    let v1 = xmin(&store, "node-1").await;
    // Nothing new from the node: the row is not rewritten.
    assert!(
        store
            .record_liveness(&seen(t))
            .await
            .expect("liveness")
            .is_empty()
    );
    assert_eq!(
        xmin(&store, "node-1").await,
        v1,
        "an unchanged last-seen rewrote the row"
    );
    // A message arrived: last-seen moves.
    assert!(
        store
            .record_liveness(&seen(t + 15_000))
            .await
            .expect("liveness")
            .is_empty()
    );
    assert_ne!(xmin(&store, "node-1").await, v1);
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!(row.last_seen_ms, Some(t + 15_000));
    assert!(row.online);
    // A stale epoch and a revoked node must close, even when their last-seen did not move.
    assert!(
        store
            .set_node_state("node-2", "revoked", "test")
            .await
            .expect("revoke")
    );
    let close = store
        .record_liveness(&[
            ("node-1".into(), 7, t + 15_000),
            ("node-2".into(), 0, t + 15_000),
        ])
        .await
        .expect("liveness");
    assert_eq!(close.len(), 2, "{close:?}");
    // The revocation reaches a reader once, by watermark.
    let (all, mark) = store.revoked_nodes_since(None).await.expect("revoked");
    assert_eq!(all, vec!["node-2".to_string()]);
    assert!(mark > 0);
}
