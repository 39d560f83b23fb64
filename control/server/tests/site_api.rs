//! The site API groups against a real PostgreSQL: grants scoped to `site/<id>`, stable codes, MAC canonical form,
//! a MAC cannot be moved to another site by create, and the `better-compute sites`, `site-tokens` and `artifacts`
//! CLI.

use bc_control::client::{ApiClient, ClientError};
use bc_control::config::{Roles, ServeConfig};
use bc_core::iam::Grant;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::testing::test_db;
use serde_json::json;

fn code(r: Result<serde_json::Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, .. }) => code,
        Err(e) => format!("transport: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn site_grants_codes_and_cli() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("tenant");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServeConfig::loopback(
        dir.path().join("state"),
        "test.bc",
        Roles {
            api: true,
            ..Roles::default()
        },
    );
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start");
    let url = format!("http://{}", running.api_addr.expect("api"));
    let admin_key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let admin = ApiClient::new(&url, &admin_key);

    let key = Token::generate(TokenKind::ApiKey).expect("key");
    store
        .upsert_principal(
            "ops-r1",
            "root",
            "rack 1 operator",
            key.id(),
            &key.secret().hash(),
            &[Grant {
                permission: "compute:*".into(),
                scope: "site/r1".into(),
            }],
        )
        .await
        .expect("principal");
    let ops = ApiClient::new(&url, &key.reveal());

    assert!(
        code(
            ops.call("site-tokens", "create", json!({"site": "r1"}))
                .await
        )
        .starts_with("OK")
    );
    assert_eq!(
        code(
            ops.call("site-tokens", "create", json!({"site": "r2"}))
                .await
        ),
        "ACCESS_DENIED"
    );
    assert_eq!(
        code(
            ops.call("site-tokens", "create", json!({"site": "a/b"}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            ops.call("site-tokens", "create", json!({"site": "r1", "uses": 0}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert!(
        code(
            admin
                .call("site-tokens", "create", json!({"site": "r2"}))
                .await
        )
        .starts_with("OK")
    );
    // Listing shows only what the grant reaches.
    let listed = ops
        .call("site-tokens", "list", json!({}))
        .await
        .expect("list");
    let sites: Vec<&str> = listed["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|t| t["site_id"].as_str())
        .collect();
    assert_eq!(sites, vec!["r1"]);

    // Machines: canonical MAC, boot validated, no silent move between sites.
    let created = ops
        .call(
            "machines",
            "create",
            json!({"mac": "52-54-00-AA-BB-01", "site": "r1", "boot": {"kernel": "ramdisk/vmlinuz"}}),
        )
        .await
        .expect("create");
    assert_eq!(created["machine"]["mac"], "52:54:00:aa:bb:01");
    assert_eq!(
        code(
            ops.call("machines", "create", json!({"mac": "zz", "site": "r1"}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            ops.call(
                "machines",
                "create",
                json!({"mac": "52:54:00:aa:bb:02", "site": "r1", "boot": {"kernel": "a\nb"}})
            )
            .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            admin
                .call(
                    "machines",
                    "create",
                    json!({"mac": "52:54:00:aa:bb:01", "site": "r2"})
                )
                .await
        ),
        "CONFLICT"
    );
    assert_eq!(
        code(
            admin
                .call(
                    "machines",
                    "create",
                    json!({"mac": "52:54:00:aa:bb:03", "site": "nosuch"})
                )
                .await
        ),
        "NOT_FOUND"
    );
    assert!(
        code(
            admin
                .call(
                    "machines",
                    "create",
                    json!({"mac": "52:54:00:aa:bb:04", "site": "r2"})
                )
                .await
        )
        .starts_with("OK")
    );
    assert_eq!(
        code(
            ops.call(
                "machines",
                "set-boot",
                json!({"mac": "52:54:00:aa:bb:04", "boot": null})
            )
            .await
        ),
        "ACCESS_DENIED"
    );
    assert!(
        code(
            ops.call(
                "machines",
                "set-boot",
                json!({"mac": "52:54:00:aa:bb:01", "boot": null})
            )
            .await
        )
        .starts_with("OK")
    );
    assert_eq!(
        code(
            ops.call(
                "machines",
                "set-boot",
                json!({"mac": "52:54:00:aa:bb:99", "boot": null})
            )
            .await
        ),
        "NOT_FOUND"
    );
    let listed = ops.call("machines", "list", json!({})).await.expect("list");
    assert_eq!(listed["machines"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        code(
            ops.call(
                "secrets",
                "put",
                json!({"site": "r2", "name": "x", "value": "v"})
            )
            .await
        ),
        "ACCESS_DENIED"
    );

    // The CLI prints the token on stdout, once.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["site-tokens", "create", "--site", "r1", "--uses", "1"])
        .env("BC_API_URL", &url)
        .env("BC_API_KEY", key.reveal())
        .output()
        .await
        .expect("run cli");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.trim().starts_with("bcst_"), "{stdout}");
    assert!(Token::parse(TokenKind::Site, stdout.trim()).is_ok());

    // Artifacts: a site-scoped operator may not upload; the admin's CLI upload prints the reference, stores the
    // content under its hash (0644) and lists it.
    assert_eq!(
        code(ops.put_artifact(b"kernel".to_vec(), Some("k")).await),
        "ACCESS_DENIED"
    );
    let file = dir.path().join("vmlinuz");
    // Larger than any chunk on the way: the CLI streams it from disk.
    let content: Vec<u8> = (0..3_000_001u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &content).expect("write");
    let cli = |args: &[&str]| {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_better-compute"));
        c.args(args)
            .env("BC_API_URL", &url)
            .env("BC_API_KEY", &admin_key);
        c
    };
    let out = cli(&["artifacts", "put", file.to_str().expect("path")])
        .output()
        .await
        .expect("run cli");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&content));
    assert_eq!(reference, format!("sha256:{sha}"));
    let stored = dir.path().join("state/artifacts/sha256").join(&sha);
    assert_eq!(std::fs::read(&stored).expect("stored"), content);
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&stored)
            .expect("meta")
            .permissions()
            .mode()
            & 0o777,
        0o644
    );
    let out = cli(&["artifacts", "list"]).output().await.expect("run cli");
    let missing = cli(&["artifacts", "put", "/nonexistent/vmlinuz"])
        .output()
        .await
        .expect("run cli");
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("reading /nonexistent/vmlinuz"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
    // Secrets through the CLI: the value only from the environment, never echoed.
    let value = r#"{"username":"root","password":"cli-secret-pw"}"#;
    let put = cli(&["secrets", "put", "bmc/n1", "--site", "r1"])
        .env("BC_SECRET_VALUE", value)
        .output()
        .await
        .expect("run cli");
    let (o, e) = (
        String::from_utf8_lossy(&put.stdout),
        String::from_utf8_lossy(&put.stderr),
    );
    assert!(put.status.success(), "{e}");
    assert!(o.contains("stored secret bmc/n1 for site r1"), "{o}");
    assert!(!o.contains("cli-secret-pw") && !e.contains("cli-secret-pw"));
    let unset = cli(&["secrets", "put", "bmc/n1", "--site", "r1"])
        .env_remove("BC_SECRET_VALUE")
        .output()
        .await
        .expect("run cli");
    assert!(!unset.status.success());
    assert!(
        String::from_utf8_lossy(&unset.stderr).contains("BC_SECRET_VALUE"),
        "{}",
        String::from_utf8_lossy(&unset.stderr)
    );
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        listing.contains(&sha) && listing.contains("3000001") && listing.contains("vmlinuz"),
        "{listing}"
    );
    // Machines may reference it; a malformed or unknown reference is refused.
    assert!(
        code(
            admin
                .call(
                    "machines",
                    "create",
                    json!({"mac": "52:54:00:aa:bb:10", "site": "r1", "boot": {"kernel": reference}})
                )
                .await
        )
        .starts_with("OK")
    );
    assert_eq!(
        code(
            admin
                .call(
                    "machines",
                    "create",
                    json!({"mac": "52:54:00:aa:bb:11", "site": "r1", "boot": {"kernel": "sha256:ABC"}})
                )
                .await
        ),
        "INVALID_ARGUMENT"
    );

    // Revoking a site: scoped like the other site methods, NOT_FOUND for an unknown site, idempotent, audited once;
    // its unspent tokens are revoked and it takes no new token.
    assert_eq!(
        code(ops.call("sites", "revoke", json!({"site": "r2"})).await),
        "ACCESS_DENIED"
    );
    assert_eq!(
        code(
            ops.call("sites", "revoke", json!({"site": "nowhere"}))
                .await
        ),
        "ACCESS_DENIED"
    );
    assert_eq!(
        code(
            admin
                .call("sites", "revoke", json!({"site": "nowhere"}))
                .await
        ),
        "NOT_FOUND"
    );
    assert_eq!(
        code(admin.call("sites", "revoke", json!({"site": "a/b"})).await),
        "INVALID_ARGUMENT"
    );
    let unspent = |site: &'static str| {
        let store = store.clone();
        async move {
            store
                .list_site_tokens(Some(site))
                .await
                .expect("tokens")
                .iter()
                .filter(|t| !t.revoked)
                .count()
        }
    };
    assert!(unspent("r1").await > 0);
    let revoke = cli(&["sites", "revoke", "r1"])
        .env("BC_API_KEY", key.reveal())
        .output()
        .await
        .expect("run cli");
    let o = String::from_utf8_lossy(&revoke.stdout);
    assert!(
        revoke.status.success(),
        "{}",
        String::from_utf8_lossy(&revoke.stderr)
    );
    assert!(o.contains("revoked site r1"), "{o}");
    assert_eq!(unspent("r1").await, 0);
    assert!(
        unspent("r2").await > 0,
        "another site's tokens are untouched"
    );
    let again = cli(&["sites", "revoke", "r1"])
        .output()
        .await
        .expect("run cli");
    assert!(again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("already revoked"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
    let events: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'site.revoked' AND subject = 'site/r1'",
    )
    .fetch_one(store.pool())
    .await
    .expect("audit");
    assert_eq!(events, 1);
    assert_eq!(
        code(
            admin
                .call("site-tokens", "create", json!({"site": "r1"}))
                .await
        ),
        "FAILED_PRECONDITION"
    );
    let missing = cli(&["sites", "revoke", "nowhere"])
        .output()
        .await
        .expect("run cli");
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("not found"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
    running.shutdown().await;
}

/// Issue 10 item 15: `machines.create` on a MAC that exists (in any spelling) is CONFLICT and changes nothing: its
/// boot is kept until `machines.set-boot` changes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_an_existing_machine_is_a_conflict_that_keeps_its_boot() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("tenant");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServeConfig::loopback(
        dir.path().join("state"),
        "test.bc",
        Roles {
            api: true,
            ..Roles::default()
        },
    );
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start");
    let url = format!("http://{}", running.api_addr.expect("api"));
    let admin = ApiClient::new(
        &url,
        &bc_control::bootstrap_admin(&store).await.expect("admin"),
    );
    for site in ["r1", "r2"] {
        admin
            .call("site-tokens", "create", json!({"site": site}))
            .await
            .expect("site");
    }
    let boot = json!({"kernel": "ramdisk/vmlinuz", "initrd": "ramdisk/initrd", "cmdline": "console=ttyS0"});
    admin
        .call(
            "machines",
            "create",
            json!({"mac": "52:54:00:aa:bb:01", "site": "r1", "boot": boot}),
        )
        .await
        .expect("create");
    let boot_of = || async {
        let v = admin
            .call("machines", "list", json!({}))
            .await
            .expect("list");
        assert_eq!(v["machines"].as_array().map(Vec::len), Some(1), "{v}");
        v["machines"][0]["boot"].clone()
    };
    for (what, body) in [
        ("no boot", json!({"mac": "52:54:00:aa:bb:01", "site": "r1"})),
        (
            "another boot",
            json!({"mac": "52:54:00:aa:bb:01", "site": "r1", "boot": {"kernel": "other"}}),
        ),
        (
            "another spelling",
            json!({"mac": "52-54-00-AA-BB-01", "site": "r1"}),
        ),
        (
            "another site",
            json!({"mac": "52:54:00:aa:bb:01", "site": "r2"}),
        ),
    ] {
        match admin.call("machines", "create", body).await {
            Err(ClientError::Api { code, message }) => {
                assert_eq!(code, "CONFLICT", "{what}: {message}");
                assert!(message.contains("set-boot"), "{what}: {message}");
            }
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(boot_of().await, boot, "{what} changed the boot");
    }
    admin
        .call(
            "machines",
            "set-boot",
            json!({"mac": "52:54:00:aa:bb:01", "boot": null}),
        )
        .await
        .expect("set-boot");
    assert_eq!(boot_of().await, json!(null));
    running.shutdown().await;
}
