//! Issue 17: the `better-compute` binary as an operator runs it, against a real control plane on a real
//! PostgreSQL (api and scheduler roles, a seeded fleet): every list and show parsed as JSON and YAML and printed as
//! a table with its header; `nodes list` filtered and paged by the API; the deletions with the rules an operator
//! expects (a referenced artifact, a secret a BMC uses, a machine in the metal flow and a node that is not revoked
//! or holds a booking are refused naming why); `audit list` by actor, action, subject and time; `--watch`;
//! transport errors named by their cause.

use bc_control::config::{Roles, ServeConfig};
use bc_store::Store;
use bc_store::testing::test_db;
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

/// A running control plane and its admin key.
struct Plane {
    url: String,
    key: String,
    state: std::path::PathBuf,
    _running: bc_control::Running,
    _dir: tempfile::TempDir,
    _db: bc_store::testing::TestDb,
}

/// What one CLI run did.
struct Ran {
    code: Option<i32>,
    out: String,
    err: String,
}

impl Ran {
    fn ok(&self) -> &str {
        assert_eq!(
            self.code,
            Some(0),
            "stdout: {}\nstderr: {}",
            self.out,
            self.err
        );
        &self.out
    }

    fn failed(&self) -> &str {
        assert_eq!(
            self.code,
            Some(1),
            "stdout: {}\nstderr: {}",
            self.out,
            self.err
        );
        assert_eq!(self.err.lines().count(), 1, "one line: {}", self.err);
        &self.err
    }

    fn json(&self) -> Value {
        serde_json::from_str(self.ok()).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.out))
    }
}

impl Plane {
    async fn start() -> Plane {
        bc_proto::install_crypto_provider();
        let db = test_db().await;
        let store = Store::new(db.pool.clone());
        store.ensure_root_tenant().await.expect("tenant");
        // Before the scheduler starts (it reads the fleet then). Three adopted nodes of one GPU in pool gpu: gn-1 (gpu-a1), gn-2 (gpu-b1), gn-3 (cpu-1, draining).
        bc_store::testing::seed_gpu_nodes(&db.pool, "gpu", "gn", 3, 1, "H100")
            .await
            .expect("seed");
        for (id, host) in [("gn-1", "gpu-a1"), ("gn-2", "gpu-b1"), ("gn-3", "cpu-1")] {
            bc_store::sqlx::query(
                "UPDATE nodes SET claims = jsonb_build_object('hostname', $2::text) WHERE id = $1",
            )
            .bind(id)
            .bind(host)
            .execute(&db.pool)
            .await
            .expect("claims");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let roles = Roles {
            api: true,
            scheduler: true,
            ..Roles::default()
        };
        let config = ServeConfig::loopback(state.clone(), "test.bc", roles);
        let running = bc_control::start(&config, store.clone())
            .await
            .expect("start");
        let url = format!("http://{}", running.api_addr.expect("api"));
        let key = bc_control::bootstrap_admin(&store).await.expect("admin");
        Plane {
            url,
            key,
            state,
            _running: running,
            _dir: dir,
            _db: db,
        }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("BC_API_URL", &self.url)
            .env("BC_API_KEY", &self.key)
            .env("BC_CONFIG", "/nonexistent")
            .env_remove("BC_CONTEXT")
            .stdin(Stdio::null());
        c
    }

    /// Runs the CLI on a blocking thread (the plane runs on this runtime).
    async fn run(&self, args: &[&str]) -> Ran {
        let mut c = self.cmd(args);
        let out = tokio::task::spawn_blocking(move || c.output())
            .await
            .expect("join")
            .expect("run better-compute");
        Ran {
            code: out.status.code(),
            out: String::from_utf8_lossy(&out.stdout).into_owned(),
            err: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// `args` with `-o json`, parsed; `-o yaml` parses to the same; the table starts with its header `first`.
    async fn read(&self, args: &[&str], first: &str) -> Value {
        let json = self.run(&[args, &["-o", "json"]].concat()).await.json();
        let yaml = self.run(&[args, &["-o", "yaml"]].concat()).await;
        let from_yaml: Value = serde_norway::from_str(yaml.ok()).expect("yaml");
        assert_eq!(from_yaml, json, "{args:?}: YAML and JSON differ");
        let table = self.run(args).await;
        let header = table.ok().lines().next().unwrap_or_default().to_string();
        assert!(header.starts_with(first), "{args:?}: header {header:?}");
        json
    }
}

fn ids(v: &Value, list: &str, field: &str) -> Vec<String> {
    v[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list} in {v}"))
        .iter()
        .map(|x| x[field].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_list_and_show_prints_json_yaml_and_a_table() {
    let p = Plane::start().await;
    // State to read: a join token, a site (by its token), a machine, a secret, an artifact, a reservation, a
    // command, a principal, a metal machine.
    p.run(&["join-tokens", "create", "--pool", "gpu"])
        .await
        .ok();
    p.run(&["site-tokens", "create", "--site", "r1"]).await.ok();
    p.run(&["machines", "create", "52:54:00:00:17:01", "--site", "r1"])
        .await
        .ok();
    let mut c = p.cmd(&["secrets", "put", "bmc", "--site", "r1"]);
    c.env(
        "BC_SECRET_VALUE",
        "{\"username\":\"u\",\"password\":\"hunter2\"}",
    );
    assert!(c.status().expect("run").success());
    let file = p.state.join("../kernel.img");
    std::fs::write(&file, vec![7u8; 300_000]).expect("write");
    let put = p
        .run(&["artifacts", "put", file.to_str().expect("path")])
        .await;
    let reference = put.ok().trim().to_string();
    assert!(reference.starts_with("sha256:"), "{reference}");
    // Not a terminal: the progress is plain lines (a start and an end), no carriage returns or escapes.
    assert!(
        put.err
            .contains("uploading kernel.img: 293.0 KiB / 293.0 KiB (100%)")
            && !put.err.contains('\r')
            && !put.err.contains('\x1b'),
        "{}",
        put.err
    );
    let r = p
        .run(&[
            "reservations",
            "create",
            "--gpus",
            "1",
            "--pool",
            "gpu",
            "-o",
            "json",
        ])
        .await
        .json();
    let reservation = r["reservation"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no reservation id in {r}"))
        .to_string();
    let queued = p.run(&["nodes", "command", "gn-1", "diag.nvml"]).await;
    let command = queued.ok().trim().to_string();
    p.run(&[
        "principals",
        "create",
        "ops",
        "--tenant",
        "root",
        "--grant",
        "compute:nodes:list@pool/gpu",
    ])
    .await
    .ok();
    p.run(&[
        "metal",
        "enroll",
        "--site",
        "r1",
        "--mac",
        "52:54:00:00:17:02",
        "--bmc",
        "http://127.0.0.1:1",
        "--credentials",
        "bmc",
    ])
    .await
    .ok();

    let v = p.read(&["nodes", "list"], "NODE").await;
    assert_eq!(ids(&v, "nodes", "id"), ["gn-1", "gn-2", "gn-3"]);
    assert!(v["nodes"][0]["joined_at"].is_string(), "RFC 3339: {v}");
    let v = p.read(&["nodes", "show", "gn-1"], "node gn-1").await;
    assert_eq!(v["node"]["claims"]["hostname"], "gpu-a1");
    let v = p.read(&["join-tokens", "list"], "ID").await;
    assert_eq!(v["tokens"].as_array().map(Vec::len), Some(1));
    let v = p.read(&["site-tokens", "list"], "ID").await;
    assert_eq!(ids(&v, "tokens", "site_id"), ["r1"]);
    let v = p.read(&["sites", "list"], "SITE").await;
    assert_eq!(ids(&v, "sites", "id"), ["r1"]);
    assert_eq!(
        (
            v["sites"][0]["machines"].as_i64(),
            v["sites"][0]["secrets"].as_i64()
        ),
        (Some(2), Some(1))
    );
    let v = p.read(&["machines", "list"], "MAC").await;
    assert_eq!(
        ids(&v, "machines", "mac"),
        ["52:54:00:00:17:01", "52:54:00:00:17:02"]
    );
    let v = p.read(&["secrets", "list"], "SITE").await;
    assert_eq!(ids(&v, "secrets", "name"), ["bmc"]);
    let v = p.read(&["artifacts", "list"], "SHA256").await;
    assert_eq!(ids(&v, "artifacts", "name"), ["kernel.img"]);
    let v = p.read(&["reservations", "list"], "ID").await;
    assert_eq!(v["reservations"][0]["id"], reservation.as_str());
    let v = p.read(&["reservations", "show", &reservation], "ID").await;
    assert_eq!(v["reservation"]["id"], reservation.as_str());
    let v = p.read(&["commands", "list", "--node", "gn-1"], "ID").await;
    assert_eq!(ids(&v, "commands", "id"), [command.as_str()]);
    let v = p.read(&["commands", "show", &command], "command").await;
    assert_eq!(v["kind"], "diag.nvml");
    let v = p.read(&["tenants", "list"], "TENANT").await;
    assert_eq!(ids(&v, "tenants", "id"), ["root"]);
    let v = p.read(&["principals", "list"], "PRINCIPAL").await;
    assert!(
        ids(&v, "principals", "id").contains(&"ops".to_string()),
        "{v}"
    );
    let v = p.read(&["audit", "list"], "AGE").await;
    assert!(v["events"].as_array().is_some_and(|e| e.len() >= 6), "{v}");
    let v = p.read(&["metal", "list"], "MAC").await;
    assert_eq!(ids(&v, "machines", "mac"), ["52:54:00:00:17:02"]);
    let v = p
        .read(&["metal", "show", "52:54:00:00:17:02"], "machine")
        .await;
    assert_eq!(v["bmc"]["credentials"], "bmc");
    let v = p.read(&["tunnels", "list"], "NODE").await;
    assert_eq!(v["tunnels"].as_array().map(Vec::len), Some(0));
    let v = p.read(&["instances", "list"], "ID").await;
    assert_eq!(v["instances"].as_array().map(Vec::len), Some(0));
    let v = p.read(&["info"], "FIELD").await;
    assert_eq!(v["trust_domain"], "test.bc");
    // Never a secret: not the secret's value, not a key's hash.
    for args in [
        &["secrets", "list", "-o", "json"][..],
        &["principals", "list", "-o", "yaml"],
    ] {
        let out = p.run(args).await.out;
        assert!(!out.contains("hunter2") && !out.contains("hash"), "{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_list_is_filtered_and_paged_by_the_api() {
    let p = Plane::start().await;
    p.run(&["nodes", "drain", "gn-3"]).await.ok();
    let listed = async |args: &[&str]| {
        let v = p
            .run(&[&["nodes", "list", "-o", "json"], args].concat())
            .await
            .json();
        ids(&v, "nodes", "id")
    };
    assert_eq!(listed(&["--hostname", "gpu-*"]).await, ["gn-1", "gn-2"]);
    assert_eq!(listed(&["--hostname", "*-b*"]).await, ["gn-2"]);
    assert_eq!(listed(&["--state", "draining"]).await, ["gn-3"]);
    assert_eq!(
        listed(&["--pool", "gpu", "--state", "adopted"]).await,
        ["gn-1", "gn-2"]
    );
    assert!(listed(&["--pool", "other"]).await.is_empty());
    let page = p
        .run(&["nodes", "list", "-o", "json", "--limit", "2"])
        .await;
    assert_eq!(ids(&page.json(), "nodes", "id"), ["gn-1", "gn-2"]);
    assert!(
        page.err.contains("more nodes: --after gn-2"),
        "{}",
        page.err
    );
    assert_eq!(listed(&["--limit", "2", "--after", "gn-2"]).await, ["gn-3"]);
    let bad = p.run(&["nodes", "list", "--state", "sleeping"]).await;
    assert!(bad.failed().contains("adopting, adopted, draining"));
    // The API itself answers the page and the cursor (no client-side slicing).
    let client = bc_control::client::ApiClient::new(&p.url, &p.key);
    let v = client
        .call(
            "nodes",
            "list",
            serde_json::json!({"limit": 1, "after": "gn-1"}),
        )
        .await
        .expect("list");
    assert_eq!(
        (ids(&v, "nodes", "id"), v["next"].as_str()),
        (vec!["gn-2".to_string()], Some("gn-2"))
    );
    let e = client
        .call("nodes", "list", serde_json::json!({"limt": 1}))
        .await
        .expect_err("unknown field");
    assert!(e.to_string().contains("limt"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletions_refuse_what_is_still_used_naming_it() {
    let p = Plane::start().await;
    p.run(&["site-tokens", "create", "--site", "r1"]).await.ok();
    let file = p.state.join("../vmlinuz");
    std::fs::write(&file, b"kernel").expect("write");
    let reference = p
        .run(&["artifacts", "put", file.to_str().expect("path")])
        .await
        .ok()
        .trim()
        .to_string();
    let hex = reference.trim_start_matches("sha256:").to_string();
    let stored = p.state.join("artifacts/sha256").join(&hex);
    assert!(stored.exists(), "{}", stored.display());
    p.run(&[
        "machines",
        "create",
        "52:54:00:00:17:11",
        "--site",
        "r1",
        "--kernel",
        &reference,
    ])
    .await
    .ok();
    // An artifact a machine boots: refused naming the machine, kept.
    let e = p.run(&["artifacts", "delete", &reference]).await;
    assert!(
        e.failed().contains("FAILED_PRECONDITION") && e.err.contains("machine/52:54:00:00:17:11"),
        "{}",
        e.err
    );
    assert!(stored.exists());
    // A secret a metal machine's BMC uses, and a machine the metal flow holds: refused naming them.
    let mut c = p.cmd(&["secrets", "put", "bmc", "--site", "r1"]);
    c.env("BC_SECRET_VALUE", "{}");
    assert!(c.status().expect("run").success());
    p.run(&[
        "metal",
        "enroll",
        "--site",
        "r1",
        "--mac",
        "52:54:00:00:17:12",
        "--bmc",
        "http://127.0.0.1:1",
        "--credentials",
        "bmc",
    ])
    .await
    .ok();
    let e = p.run(&["secrets", "delete", "bmc", "--site", "r1"]).await;
    assert!(e.failed().contains("metal/52:54:00:00:17:12"), "{}", e.err);
    let e = p.run(&["machines", "delete", "52:54:00:00:17:12"]).await;
    assert!(e.failed().contains("metal release"), "{}", e.err);
    // Once unreferenced they go, the artifact's file with its row.
    p.run(&["machines", "delete", "52-54-00-00-17-11"])
        .await
        .ok();
    p.run(&["artifacts", "delete", &hex]).await.ok();
    assert!(!stored.exists(), "the file is removed with the row");
    let e = p.run(&["artifacts", "delete", &hex]).await;
    assert!(e.failed().contains("NOT_FOUND"), "{}", e.err);
    let e = p.run(&["artifacts", "delete", "sha256:xyz"]).await;
    assert!(e.failed().contains("not an artifact hash"), "{}", e.err);
    let mut c = p.cmd(&["secrets", "put", "other", "--site", "r1"]);
    c.env("BC_SECRET_VALUE", "x");
    assert!(c.status().expect("run").success());
    p.run(&["secrets", "delete", "other", "--site", "r1"])
        .await
        .ok();
    let v = p.run(&["secrets", "list", "-o", "json"]).await.json();
    assert_eq!(ids(&v, "secrets", "name"), ["bmc"]);

    // Nodes: one that is not revoked is refused (revoke first); one holding a booking is refused naming it.
    let r = p
        .run(&[
            "reservations",
            "create",
            "--gpus",
            "1",
            "--pool",
            "gpu",
            "-o",
            "json",
        ])
        .await
        .json();
    let booked = r["reservation"]["nodes"][0]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no node in {r}"));
    let id = r["reservation"]["id"].as_str().unwrap_or_default();
    let e = p.run(&["nodes", "delete", &booked]).await;
    assert!(
        e.failed().contains("revoke it first") && e.err.contains(id),
        "refused naming the booking: {}",
        e.err
    );
    let free = ["gn-1", "gn-2", "gn-3"]
        .into_iter()
        .find(|n| *n != booked)
        .expect("a free node");
    p.run(&["nodes", "revoke", free]).await.ok();
    p.run(&["nodes", "delete", free]).await.ok();
    let e = p.run(&["nodes", "show", free]).await;
    assert!(e.failed().contains("NOT_FOUND"), "{}", e.err);

    // The audit log, by action, subject, actor and time.
    let listed = async |args: &[&str]| {
        let v = p
            .run(&[&["audit", "list", "-o", "json"], args].concat())
            .await
            .json();
        v["events"].as_array().cloned().unwrap_or_default()
    };
    let deleted = listed(&["--action", "node.delete"]).await;
    assert_eq!(deleted.len(), 1, "{deleted:?}");
    assert_eq!(deleted[0]["subject"], format!("node/{free}"));
    let actor = deleted[0]["actor"].as_str().expect("actor").to_string();
    assert!(actor.starts_with("principal/"), "{actor}");
    let machine = listed(&["--subject", "machine/52:54:00:00:17:11"]).await;
    let actions: Vec<&str> = machine
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    assert_eq!(
        actions,
        ["machine.delete", "machine.create"],
        "newest first"
    );
    let machines = listed(&["--action", "machine.*"]).await;
    assert!(
        machines.len() >= 2
            && machines.iter().all(|e| e["action"]
                .as_str()
                .is_some_and(|a| a.starts_with("machine."))),
        "{machines:?}"
    );
    assert!(listed(&["--actor", "principal/nobody"]).await.is_empty());
    assert!(listed(&["--actor", &actor, "--since", "1h"]).await.len() >= 5);
    assert!(
        listed(&["--until", "2001-01-01T00:00:00Z"])
            .await
            .is_empty()
    );
    let page = p
        .run(&["audit", "list", "-o", "json", "--limit", "2"])
        .await;
    let first = page.json()["events"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let next = page
        .err
        .trim()
        .strip_prefix("older events: --before ")
        .expect("a cursor");
    let second = listed(&["--limit", "2", "--before", next]).await;
    assert!(
        first.len() == 2 && second.len() == 2 && first[1]["id"].as_i64() > second[0]["id"].as_i64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_each_change_of_a_read() {
    let p = Plane::start().await;
    let e = p.run(&["nodes", "drain", "gn-1", "--watch"]).await;
    assert_eq!(e.code, Some(2), "--watch repeats reads only: {}", e.err);
    let mut c = p.cmd(&["nodes", "list", "-o", "json", "--watch", "--interval", "1s"]);
    c.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = c.spawn().expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    std::thread::spawn(move || {
        for v in serde_json::Deserializer::from_reader(stdout).into_iter::<Value>() {
            let Ok(v) = v else { return };
            if tx.send(v).is_err() {
                return;
            }
        }
    });
    let states = |v: &Value| -> Vec<String> {
        v["nodes"]
            .as_array()
            .map(|n| {
                n.iter()
                    .map(|n| n["state"].as_str().unwrap_or_default().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let first = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("a first read");
    assert_eq!(states(&first), ["adopted", "adopted", "adopted"]);
    // Unchanged reads print nothing; the drain prints the next document.
    p.run(&["nodes", "drain", "gn-2"]).await.ok();
    let t0 = Instant::now();
    let second = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the change");
    assert_eq!(
        states(&second),
        ["adopted", "draining", "adopted"],
        "after {:?}",
        t0.elapsed()
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn transport_errors_name_their_cause_and_what_to_check() {
    let run = |url: &str, extra: &[&str]| {
        let out = Command::new(BIN)
            .args(
                [
                    &["nodes", "list", "--api-key", "k", "--api-url", url],
                    extra,
                ]
                .concat(),
            )
            .env("BC_CONFIG", "/nonexistent")
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let (code, err) = run(&format!("http://127.0.0.1:{port}"), &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("nothing listens at") && err.contains("connection refused"),
        "{err}"
    );
    // Accepted but never answered: the call's own deadline, named.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr");
    let held = std::thread::spawn(move || {
        let conn = silent.accept();
        std::thread::sleep(Duration::from_secs(5));
        drop(conn);
    });
    let t0 = Instant::now();
    let (code, err) = run(&format!("http://{addr}"), &["--timeout", "1s"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert!(err.contains("did not answer within 1s (timeout)"), "{err}");
    let _ = held.join();
    // https:// against the plain API.
    let rt = tokio::runtime::Runtime::new().expect("rt");
    let p = rt.block_on(Plane::start());
    let plain = p.url.replace("http://", "https://");
    let (code, err) = run(&plain, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("plain text") && err.contains("use http://"),
        "{err}"
    );
    drop(p);
}
