//! The metal group against a real PostgreSQL through the composed control plane: grants scoped to `site/<id>`
//! (enroll checked on the request's site, the verbs on the machine's), stable codes (a verb the machine's state
//! refuses is FAILED_PRECONDITION with the planner's reason, an unknown machine NOT_FOUND, bad input
//! INVALID_ARGUMENT naming the field), and the `better-compute metal` CLI: enroll, inspect, show, list with
//! filters, abort, retry; `--wait` gives up at its own deadline with what the machine waits for.

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
        Err(ClientError::Api { code, message }) => format!("{code}: {message}"),
        Err(e) => format!("transport: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metal_grants_codes_and_cli() {
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
    for site in ["r1", "r2"] {
        admin
            .call("site-tokens", "create", json!({"site": site, "uses": 1}))
            .await
            .expect("site");
    }
    let key = Token::generate(TokenKind::ApiKey).expect("key");
    store
        .upsert_principal(
            "ops-r1",
            "root",
            "rack 1 operator",
            key.id(),
            &key.secret().hash(),
            &[Grant {
                permission: "compute:metal:*".into(),
                scope: "site/r1".into(),
            }],
        )
        .await
        .expect("principal");
    let ops = ApiClient::new(&url, &key.reveal());
    let bmc = json!({"address": "http://127.0.0.1:1", "credentials": "bmc/a"});

    let enroll = |site: &str, mac: &str| json!({"site": site, "mac": mac, "bmc": bmc});
    assert!(
        code(
            ops.call("metal", "enroll", enroll("r2", "52:54:00:00:00:02"))
                .await
        )
        .starts_with("ACCESS_DENIED")
    );
    let e = code(
        ops.call(
            "metal",
            "enroll",
            json!({"site": "r1", "mac": "nope", "bmc": bmc}),
        )
        .await,
    );
    assert!(
        e.starts_with("INVALID_ARGUMENT") && e.contains("mac"),
        "{e}"
    );
    let e = code(
        ops.call(
            "metal",
            "enroll",
            json!({"site": "r1", "mac": "52:54:00:00:00:01", "bmc": {"address": "10.0.0.5", "credentials": "x"}}),
        )
        .await,
    );
    assert!(
        e.starts_with("INVALID_ARGUMENT") && e.contains("bmc.address"),
        "{e}"
    );
    let v = ops
        .call("metal", "enroll", enroll("r1", "52-54-00-00-00-01"))
        .await
        .expect("enroll");
    assert_eq!(v["mac"], "52:54:00:00:00:01");
    assert_eq!(v["state"], json!({"state": "active", "phase": "enrolled"}));
    admin
        .call("metal", "enroll", enroll("r2", "52:54:00:00:00:02"))
        .await
        .expect("enroll r2");
    let e = code(
        ops.call("metal", "enroll", enroll("r1", "52:54:00:00:00:01"))
            .await,
    );
    assert!(e.starts_with("CONFLICT"), "{e}");
    // The machine of r2 is not the r1 operator's.
    let e = code(
        ops.call("metal", "show", json!({"mac": "52:54:00:00:00:02"}))
            .await,
    );
    assert!(e.starts_with("ACCESS_DENIED"), "{e}");
    let e = code(
        ops.call("metal", "show", json!({"mac": "52:54:00:00:00:09"}))
            .await,
    );
    assert!(e.starts_with("NOT_FOUND"), "{e}");
    let e = code(
        ops.call("metal", "release", json!({"mac": "52:54:00:00:00:01"}))
            .await,
    );
    assert!(
        e.starts_with("FAILED_PRECONDITION") && e.contains("inspect, provide or deploy it"),
        "{e}"
    );
    let e = code(
        ops.call(
            "metal",
            "deploy",
            json!({"mac": "52:54:00:00:00:01", "image": "ubuntu.img"}),
        )
        .await,
    );
    assert!(
        e.starts_with("INVALID_ARGUMENT") && e.contains("sha256"),
        "{e}"
    );

    let cli = |args: &[&str]| {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_better-compute"));
        c.arg("metal")
            .args(args)
            .env("BC_API_URL", &url)
            .env("BC_API_KEY", key.reveal());
        c
    };
    let run = async |args: &[&str]| {
        let out = cli(args).output().await.expect("run cli");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, out, err) = run(&[
        "enroll",
        "--site",
        "r1",
        "--mac",
        "52:54:00:00:00:03",
        "--bmc",
        "http://127.0.0.1:1",
        "--credentials",
        "bmc/c",
        "--expect-gpus",
        "8",
    ])
    .await;
    assert!(ok, "{err}");
    assert!(out.contains("52:54:00:00:00:03 enrolled"), "{out}");
    // No controllers run in this plane: the inspection waits, and --wait gives up at its deadline saying so.
    let (ok, out, err) = run(&[
        "inspect",
        "52:54:00:00:00:03",
        "--wait",
        "--wait-timeout",
        "1s",
    ])
    .await;
    assert!(!ok, "{out}");
    assert!(out.contains("inspecting"), "{out}");
    assert!(
        err.contains("still inspecting") && err.contains("the BMC's inventory"),
        "{err}"
    );
    let (ok, out, err) = run(&["show", "52:54:00:00:00:03"]).await;
    assert!(ok, "{err}");
    assert!(
        out.contains("state     inspecting") && out.contains("deadline"),
        "{out}"
    );
    assert!(
        out.contains("Inspect") && out.contains("pending"),
        "the BMC step is shown: {out}"
    );
    let (ok, _, err) = run(&["abort", "52:54:00:00:00:03"]).await;
    assert!(ok, "{err}");
    let (_, out, _) = run(&["list", "--failed"]).await;
    assert!(
        out.contains("52:54:00:00:00:03") && out.contains("aborted by the operator"),
        "{out}"
    );
    assert!(!out.contains("52:54:00:00:00:01"), "{out}");
    let (_, out, _) = run(&["list", "--phase", "enrolled"]).await;
    assert!(
        out.contains("52:54:00:00:00:01") && !out.contains("52:54:00:00:00:02"),
        "only r1's: {out}"
    );
    let (ok, _, err) = run(&["list", "--phase", "cooking"]).await;
    assert!(!ok && err.contains("booting-ramdisk"), "{err}");
    let (ok, out, err) = run(&["retry", "52:54:00:00:00:03"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("inspecting"), "{out}");
    let (ok, out, err) = run(&["show", "52:54:00:00:00:03", "-o", "json"]).await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["timeline"].as_array().map(Vec::len), Some(3), "{v}");
    assert_eq!(v["bmc"]["credentials"], "bmc/c");
}
