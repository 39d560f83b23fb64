//! The API document: what a running control plane serves at `/api/openapi.json` is docs/openapi.json (drift test;
//! `BC_UPDATE_GOLDEN=1` rewrites it and docs/api-reference.md), a real validator accepts it (PyPI's
//! openapi-spec-validator, in `.venv-openapi` from scripts/setup), every method is in it with its permission, every
//! epoch-millisecond instant says so, and real answers validate against its schemas; `/readyz` follows the database.

use bc_control::config::{Roles, ServeConfig};
use bc_store::Store;
use bc_store::testing::test_db;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

async fn get(url: &str) -> (u16, Value) {
    let r = reqwest::get(url).await.expect("GET");
    let status = r.status().as_u16();
    (status, r.json().await.expect("JSON"))
}

/// Every property named `*_ms` in the components, with its schema.
fn ms_properties(doc: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    fn walk(path: &str, v: &Value, out: &mut Vec<(String, Value)>) {
        match v {
            Value::Object(o) => {
                if let Some(Value::Object(props)) = o.get("properties") {
                    for (name, s) in props {
                        if name.ends_with("_ms") {
                            out.push((format!("{path}.{name}"), s.clone()));
                        }
                    }
                }
                for (k, child) in o {
                    walk(&format!("{path}/{k}"), child, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|c| walk(path, c, out)),
            _ => {}
        }
    }
    walk("", &doc["components"]["schemas"], &mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_document_is_the_checked_in_one_and_a_validator_accepts_it() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
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

    // Served without a key, and the same as the checked-in file.
    let (status, doc) = get(&format!("{url}/api/openapi.json")).await;
    assert_eq!(status, 200);
    let pretty = serde_json::to_string_pretty(&doc).expect("pretty") + "\n";
    bc_testkit::assert_golden(repo().join("docs/openapi.json"), &pretty);
    bc_testkit::assert_golden(
        repo().join("docs/api-reference.md"),
        &bc_kernel::openapi::markdown(&doc),
    );

    // Every method the control plane lists is documented, with its permission and scope.
    let admin = bc_control::bootstrap_admin(&store).await.expect("admin");
    let client = bc_control::client::ApiClient::new(&url, &admin);
    let methods = client
        .call("system", "methods", json!({}))
        .await
        .expect("system.methods");
    let methods = methods["methods"].as_array().expect("methods");
    assert!(methods.len() >= 45, "{} methods", methods.len());
    for m in methods {
        let path = format!(
            "/api/compute/{}/{}",
            m["group"].as_str().unwrap_or(""),
            m["method"].as_str().unwrap_or("")
        );
        let op = &doc["paths"][&path]["post"];
        assert!(op.is_object(), "{path} is not in the document");
        assert_eq!(op["x-permission"], m["permission"], "{path}");
        if m["scope"] != "-" {
            assert_eq!(op["x-scope"], m["scope"], "{path}");
        }
        for part in ["requestBody", "responses"] {
            assert!(op[part].is_object(), "{path} has no {part}");
        }
    }
    for path in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/api/openapi.json",
        "/fleet",
        "/api/artifacts",
        "/api/tunnels/{node}/{port}",
    ] {
        assert!(
            doc["paths"][path].is_object(),
            "{path} is not in the document"
        );
    }

    // Instants say they are epoch milliseconds; nothing named *_ms is left as a bare integer.
    let ms = ms_properties(&doc);
    assert!(ms.len() >= 25, "{ms:?}");
    for (at, s) in &ms {
        let text = s.to_string();
        assert!(text.contains("unix-epoch-ms"), "{at} has no format: {text}");
    }

    // A real validator (openapi-spec-validator, OpenAPI 3.1 and its JSON Schema dialect).
    let validator = repo().join(".venv-openapi/bin/openapi-spec-validator");
    if !validator.exists() {
        bc_testkit::skip!(
            "openapi-spec-validator is not installed in .venv-openapi (scripts/setup installs it)"
        );
    }
    let out = std::process::Command::new(&validator)
        .arg(repo().join("docs/openapi.json"))
        .output()
        .expect("run openapi-spec-validator");
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openapi-spec-validator refused docs/openapi.json:\n{said}"
    );
    assert!(said.contains("OK"), "{said}");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_database_and_healthz_does_not() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
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
    assert_eq!(
        get(&format!("{url}/readyz")).await,
        (200, json!({"ready": true}))
    );
    // The database goes away: the pool's connections are closed and no new one can be made.
    db.pool.close().await;
    let (status, body) = get(&format!("{url}/readyz")).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "UNAVAILABLE", "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("not ready"),
        "{body}"
    );
    let health = reqwest::get(format!("{url}/healthz"))
        .await
        .expect("healthz");
    assert_eq!(health.status().as_u16(), 200);
    assert_eq!(health.text().await.expect("text"), "ok");
    running.shutdown().await;
}
