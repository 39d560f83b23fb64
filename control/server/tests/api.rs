//! The HTTP API against a real PostgreSQL: authentication, the lean IAM (a grant on one pool does not reach
//! another), stable error codes, and the CA / JoinService keys kept private on disk.

use bc_control::client::{ApiClient, ClientError};
use bc_control::config::{Roles, ServeConfig};
use bc_core::iam::Grant;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::testing::test_db;
use serde_json::json;
use std::os::unix::fs::PermissionsExt as _;

fn code(r: Result<serde_json::Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, .. }) => code,
        Err(e) => format!("transport: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_are_scoped_to_pools_and_errors_have_stable_codes() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("tenant");
    for pool in ["a", "b"] {
        store
            .ensure_pool(pool, "root", pool, true)
            .await
            .expect("pool");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServeConfig {
        state_dir: dir.path().join("state"),
        database_url: None,
        trust_domain: "test.bc".into(),
        roles: Roles {
            api: true,
            ..Roles::default()
        },
        api_listen: "127.0.0.1:0".parse().expect("addr"),
        gateway_listen: "127.0.0.1:0".parse().expect("addr"),
        gateway_hosts: vec!["localhost".into()],
        gateway_url: None,
        session_timing: None,
        lifecycle_timing: None,
        leaf_lifetime: None,
        shard_lease: None,
        capacity_reload: None,
    };
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start");
    let url = format!("http://{}", running.api_addr.expect("api"));

    let key = Token::generate(TokenKind::ApiKey).expect("key");
    store
        .upsert_principal(
            "ops-a",
            "root",
            "pool a operator",
            key.id(),
            &key.secret().hash(),
            &[Grant {
                permission: "compute:join-tokens:*".into(),
                scope: "pool/a".into(),
            }],
        )
        .await
        .expect("principal");
    let ops = ApiClient::new(&url, &key.reveal());
    let create = |pool: &str| json!({"pool": pool, "uses": 1});

    assert!(code(ops.call("join-tokens", "create", create("a")).await).starts_with("OK"));
    assert_eq!(
        code(ops.call("join-tokens", "create", create("b")).await),
        "ACCESS_DENIED"
    );
    assert_eq!(
        code(ops.call("join-tokens", "create", create("nope")).await),
        "ACCESS_DENIED"
    );
    assert!(code(ops.call("nodes", "list", json!({})).await).starts_with("OK"));
    assert_eq!(
        code(
            ops.call("join-tokens", "create", json!({"pool": "a", "uses": 0}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            ops.call(
                "join-tokens",
                "create",
                json!({"pool": "a", "expect": {"gpu.colour": "red"}})
            )
            .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            ops.call("join-tokens", "create", json!({"pool": "a", "bogus": 1}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(ops.call("join-tokens", "frobnicate", json!({})).await),
        "NOT_FOUND"
    );
    let wrong = ApiClient::new(&url, &format!("{}.{}", &key.reveal()[..21], "A".repeat(43)));
    assert_eq!(
        code(wrong.call("nodes", "list", json!({})).await),
        "UNAUTHENTICATED"
    );
    let garbage = ApiClient::new(&url, "not-a-key");
    assert_eq!(
        code(garbage.call("nodes", "list", json!({})).await),
        "UNAUTHENTICATED"
    );
    // Listing shows only what the grant covers.
    let admin = ApiClient::new(
        &url,
        &bc_control::bootstrap_admin(&store).await.expect("admin"),
    );
    admin
        .call("join-tokens", "create", create("b"))
        .await
        .expect("admin creates in b");
    let listed = ops
        .call("join-tokens", "list", json!({}))
        .await
        .expect("list");
    let pools: Vec<_> = listed["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t["pool_id"].clone())
        .collect();
    assert_eq!(pools, vec![json!("a")]);

    for f in ["ca.key", "join.key"] {
        let mode = std::fs::metadata(config.state_dir.join(f))
            .expect(f)
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f} must be private");
    }
    running.shutdown().await;
}
