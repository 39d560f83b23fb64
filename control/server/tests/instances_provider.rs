//! Provider pools against moto's EC2 server (`moto[server]` from PyPI, in `.venv-moto`: scripts/setup) as the
//! real emulator, and a real PostgreSQL: the control plane's provider workflow (controllers role, shard-owned)
//! launches, stops, starts and terminates instances through EC2's Query API signed with SigV4, with the
//! credentials read from a control-plane secret at each call. Between the workflow and moto sits a TCP relay of
//! this test that can lose the answer of a launch (the launch happened, the caller never heard) or stop moto
//! (SIGSTOP) the moment a launch arrives, so the two ways a naive client duplicates instances are exercised: moto,
//! unlike EC2, ignores client tokens (shown below), so only the workflow's own describe-before-launch keeps one
//! instance per create.

use bc_control::client::ApiClient;
use bc_control::config::{Roles, ServeConfig};
use bc_core::provider::ec2::{self as codec, Ec2Answer, Ec2State};
use bc_mod_instances::provider::ec2::{Credentials, Ec2Client};
use bc_store::Store;
use bc_store::testing::test_db;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SHA: &str = "abababababababababababababababababababababababababababababababab";
const CREDS: &str = r#"{"access_key_id": "AKIDBCTEST", "secret_access_key": "bc-test-secret"}"#;

/// moto's server on a free loopback port, stopped by its PID when dropped.
struct Moto {
    child: std::process::Child,
    port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        signal(self.child.id(), "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `SIG<sig>` to `pid` (a process this test started) with kill(1).
fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status();
}

fn moto_binary() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = root.join(".venv-moto/bin/moto_server");
    bin.exists().then_some(bin)
}

async fn start_moto(bin: &PathBuf) -> Moto {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        l.local_addr().expect("addr").port()
    };
    let child = std::process::Command::new(bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start moto_server");
    let moto = Moto { child, port };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "moto_server did not listen on {port} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    moto
}

/// The relay's faults and what it saw.
#[derive(Default)]
struct Faults {
    /// Lose the answers of this many RunInstances calls (moto still gets them).
    lose_run_answers: AtomicU32,
    /// Stop moto (SIGSTOP) when the next RunInstances arrives, before passing it on.
    stop_on_run: AtomicBool,
    stopped: AtomicBool,
    runs: AtomicU32,
}

/// A TCP relay in front of moto (one connection to moto per client connection; moto closes after each answer).
async fn relay(moto_port: u16, moto_pid: u32, faults: Arc<Faults>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let faults = faults.clone();
            tokio::spawn(relay_one(client, moto_port, moto_pid, faults));
        }
    });
    port
}

async fn relay_one(mut client: TcpStream, moto_port: u16, moto_pid: u32, faults: Arc<Faults>) {
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", moto_port)).await else {
        return;
    };
    // The request: read until its body is complete (Content-Length), deciding before anything reaches moto.
    let mut req = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let Ok(n) = client.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            return;
        }
        req.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&req).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if req.len() >= end + 4 + len {
                break;
            }
        }
    }
    let is_run = String::from_utf8_lossy(&req).contains("Action=RunInstances");
    let mut lose = false;
    if is_run {
        faults.runs.fetch_add(1, Ordering::SeqCst);
        if faults.stop_on_run.swap(false, Ordering::SeqCst) {
            signal(moto_pid, "STOP");
            faults.stopped.store(true, Ordering::SeqCst);
        }
        lose = faults
            .lose_run_answers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
    }
    if server.write_all(&req).await.is_err() {
        return;
    }
    let mut answer = Vec::new();
    let _ = server.read_to_end(&mut answer).await;
    if !lose {
        let _ = client.write_all(&answer).await;
    }
}

struct Lab {
    db: bc_store::testing::TestDb,
    _dir: tempfile::TempDir,
    running: bc_control::Running,
    admin: ApiClient,
    moto: Moto,
    faults: Arc<Faults>,
}

/// A control plane (api + controllers) with pool `ec2` a provider pool whose endpoint is the relay in front of
/// moto, its credentials in the secret `aws/ec2/lab`.
async fn lab(bin: &PathBuf) -> Lab {
    bc_proto::install_crypto_provider();
    let moto = start_moto(bin).await;
    let faults = Arc::new(Faults::default());
    let relay_port = relay(moto.port, moto.child.id(), faults.clone()).await;
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root");
    sqlx_exec(
        &store,
        "INSERT INTO pools (id, tenant_id, name) VALUES ('ec2', 'root', 'ec2')",
    )
    .await;
    let dir = tempfile::tempdir().expect("dir");
    let config = ServeConfig {
        shard_lease: Some(Duration::from_secs(2)),
        ..ServeConfig::loopback(
            dir.path().to_path_buf(),
            "test.bc",
            Roles {
                api: true,
                controllers: true,
                ..Roles::default()
            },
        )
    };
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start");
    let url = format!("http://{}", running.api_addr.expect("api"));
    let admin = ApiClient::new(
        &url,
        &bc_control::bootstrap_admin(&store).await.expect("admin"),
    );
    admin
        .call("site-tokens", "create", json!({"site": "aws"}))
        .await
        .expect("site");
    admin
        .call(
            "secrets",
            "put",
            json!({"site": "aws", "name": "ec2/lab", "value": CREDS}),
        )
        .await
        .expect("secret");
    let provider = json!({
        "kind": "ec2", "endpoint": format!("http://127.0.0.1:{relay_port}"), "region": "us-east-1",
        "credentials": {"site": "aws", "name": "ec2/lab"},
        "instance_types": [{"name": "t3.micro", "vcpus": 2, "memory_mib": 1024},
                           {"name": "t3.large", "vcpus": 2, "memory_mib": 8192}],
        "images": [{"sha256": SHA, "image_id": "ami-12c6146b"}]
    });
    admin
        .call(
            "instances",
            "set-pool",
            json!({"pool": "ec2", "class": "provider", "provider": provider}),
        )
        .await
        .expect("set-pool");
    Lab {
        db,
        _dir: dir,
        running,
        admin,
        moto,
        faults,
    }
}

async fn sqlx_exec(store: &Store, sql: &str) {
    bc_store::sqlx::query(bc_store::sqlx::AssertSqlSafe(sql.to_string()))
        .execute(store.pool())
        .await
        .expect(sql);
}

fn create_body(key: &str) -> Value {
    json!({"tenant": "root", "pool": "ec2", "vcpus": 1, "memory_mib": 512, "disk_gib": 8,
           "image": {"url": "http://127.0.0.1:9/debian.qcow2", "sha256": SHA},
           "user_data": "#cloud-config\n{}", "idempotency_key": key})
}

impl Lab {
    /// Every instance moto holds tagged with `instance` (asked directly, not through the relay).
    async fn at_moto(&self, instance: &str) -> Vec<(String, Ec2State)> {
        let creds = Credentials::parse(CREDS.as_bytes()).expect("creds");
        let endpoint = format!("http://127.0.0.1:{}", self.moto.port);
        let client = Ec2Client::with_timeout(Duration::from_secs(60)).expect("client");
        match client
            .call(
                &endpoint,
                "us-east-1",
                &creds,
                &codec::describe_by_tag(instance),
            )
            .await
        {
            Ok(Ec2Answer::Instances(list)) => {
                list.into_iter().map(|i| (i.instance_id, i.state)).collect()
            }
            other => panic!("describe at moto: {other:?}"),
        }
    }

    /// Waits (deadline `secs`) until `instances.show` of `id` satisfies `ok`; returns the instance.
    async fn until(&self, id: &str, secs: u64, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let shown = self
                .admin
                .call("instances", "show", json!({"id": id}))
                .await
                .expect("show");
            if ok(&shown["instance"]) {
                return shown["instance"].clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "instance {id} not {what} within {secs} s: {shown}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Seconds a stop, start or delete may take to be seen done: well under the workflow's steady poll (30 s), which
/// is what each waited for when a poke did not make the pass due.
const ACTED_ON: u64 = 20;

fn observed_state(i: &Value) -> &str {
    i["observed"]["state"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_instance_lives_its_whole_life_against_moto() {
    let Some(bin) = moto_binary() else {
        bc_testkit::skip!("no .venv-moto/bin/moto_server: run scripts/setup");
    };
    let lab = lab(&bin).await;
    let created = lab
        .admin
        .call("instances", "create", create_body("life"))
        .await
        .expect("create");
    let id = created["instance"]["id"].as_str().expect("id").to_string();
    assert_eq!(created["instance"]["state"], "placed", "{created}");
    assert_eq!(created["instance"]["node"], Value::Null);
    let running = lab
        .until(&id, 60, "running", |i| observed_state(i) == "running")
        .await;
    let provider_id = running["observed"]["provider_id"]
        .as_str()
        .expect("provider id")
        .to_string();
    // Migration 1303: the placement wrote the workflow row's shard, as the generated column did; the composed schema
    // generates no column through a SQL function.
    let pool = &lab.db.pool;
    let rows: i64 = bc_store::sqlx::query_scalar("SELECT count(*) FROM instance_provider")
        .fetch_one(pool)
        .await
        .expect("rows");
    assert_eq!(rows, 1);
    let misplaced =
        bc_store::testing::misplaced_shards(pool, &[("instance_provider", "instance_id")])
            .await
            .expect("shards");
    assert!(misplaced.is_empty(), "{misplaced:?}");
    assert_eq!(
        bc_store::testing::generated_columns_calling_sql_functions(pool)
            .await
            .expect("catalog"),
        Vec::<String>::new()
    );
    let at = lab.at_moto(&id).await;
    assert_eq!(
        at,
        vec![(provider_id.clone(), Ec2State::Running)],
        "one instance at moto"
    );
    // The smallest type that fits, from the pool's image map.
    lab.admin
        .call("instances", "stop", json!({"id": id}))
        .await
        .expect("stop");
    // A change of the desired state is acted on at once (the poke), not at the steady poll (30 s): the stop, the
    // start and the delete each take a few seconds against moto; before the fix each took 30 s.
    lab.until(&id, ACTED_ON, "stopped", |i| observed_state(i) == "stopped")
        .await;
    assert_eq!(
        lab.at_moto(&id).await,
        vec![(provider_id.clone(), Ec2State::Stopped)]
    );
    lab.admin
        .call("instances", "start", json!({"id": id}))
        .await
        .expect("start");
    lab.until(&id, ACTED_ON, "running again", |i| {
        observed_state(i) == "running"
    })
    .await;
    let deleted = lab
        .admin
        .call("instances", "delete", json!({"id": id}))
        .await
        .expect("delete");
    assert_eq!(deleted["instance"]["state"], "deleting", "{deleted}");
    lab.until(&id, ACTED_ON, "deleted", |i| i["state"] == "deleted")
        .await;
    assert_eq!(
        lab.at_moto(&id).await,
        vec![(provider_id, Ec2State::Terminated)]
    );
    assert_eq!(
        lab.faults.runs.load(Ordering::SeqCst),
        1,
        "one launch in all"
    );
    // A request the pool cannot launch is refused at admission, naming what the pool offers.
    let mut big = create_body("big");
    big["vcpus"] = json!(64);
    let r = lab.admin.call("instances", "create", big).await;
    assert!(format!("{r:?}").contains("it offers t3.micro"), "{r:?}");
    lab.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_creates_make_exactly_one_instance_though_moto_ignores_client_tokens() {
    let Some(bin) = moto_binary() else {
        bc_testkit::skip!("no .venv-moto/bin/moto_server: run scripts/setup");
    };
    let lab = lab(&bin).await;
    // moto does not deduplicate: the same client token twice launches two instances. A workflow that trusted the
    // token would duplicate here.
    let creds = Credentials::parse(CREDS.as_bytes()).expect("creds");
    let endpoint = format!("http://127.0.0.1:{}", lab.moto.port);
    // Patient: moto's first launch loads its catalogues (seconds on a loaded machine).
    let client = Ec2Client::with_timeout(Duration::from_secs(120)).expect("client");
    let launch = codec::run_instances(&codec::Launch {
        instance: "probe",
        image_id: "ami-12c6146b",
        instance_type: "t3.micro",
        user_data_b64: None,
    });
    for _ in 0..2 {
        client
            .call(&endpoint, "us-east-1", &creds, &launch)
            .await
            .expect("probe launch");
    }
    assert_eq!(
        lab.at_moto("probe").await.len(),
        2,
        "moto ignored the client token"
    );
    // Three creates with one key, concurrently, while the first launch's answer is lost (moto made the instance,
    // the workflow never heard): one instance, one launch.
    lab.faults.lose_run_answers.store(3, Ordering::SeqCst);
    let calls = (0..3).map(|_| {
        let admin = lab.admin.clone();
        async move {
            admin
                .call("instances", "create", create_body("thrice"))
                .await
        }
    });
    let answers = futures_join(calls).await;
    let ids: Vec<String> = answers
        .iter()
        .map(|a| {
            a.as_ref().expect("create")["instance"]["id"]
                .as_str()
                .expect("id")
                .to_string()
        })
        .collect();
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    let id = &ids[0];
    let running = lab
        .until(id, 90, "running", |i| observed_state(i) == "running")
        .await;
    let at = lab.at_moto(id).await;
    assert_eq!(at.len(), 1, "exactly one instance at moto: {at:?}");
    assert_eq!(
        running["observed"]["provider_id"].as_str(),
        Some(at[0].0.as_str())
    );
    assert_eq!(
        lab.faults.runs.load(Ordering::SeqCst),
        1,
        "the lost launch was found, not repeated"
    );
    lab.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_stopped_during_a_create_converges_when_it_returns() {
    let Some(bin) = moto_binary() else {
        bc_testkit::skip!("no .venv-moto/bin/moto_server: run scripts/setup");
    };
    let lab = lab(&bin).await;
    lab.faults.stop_on_run.store(true, Ordering::SeqCst);
    let created = lab
        .admin
        .call("instances", "create", create_body("paused"))
        .await
        .expect("create");
    let id = created["instance"]["id"].as_str().expect("id").to_string();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !lab.faults.stopped.load(Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no launch reached the relay"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // moto is stopped with the launch in its socket: the call times out, describes time out, the workflow backs
    // off and says why.
    let waiting = lab
        .until(&id, 30, "reporting the timeout", |i| {
            i["observed"]["reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty())
        })
        .await;
    assert_eq!(waiting["state"], "placed", "{waiting}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    signal(lab.moto.child.id(), "CONT");
    // moto now makes the instance it was asked for; the workflow finds it by its tag and adopts it.
    let running = lab
        .until(&id, 120, "running", |i| observed_state(i) == "running")
        .await;
    let at = lab.at_moto(&id).await;
    assert_eq!(at.len(), 1, "no duplicate: {at:?}");
    assert_eq!(
        running["observed"]["provider_id"].as_str(),
        Some(at[0].0.as_str())
    );
    assert_eq!(running["observed"]["reason"], Value::Null, "{running}");
    lab.running.shutdown().await;
}

/// Awaits every future (no extra dependency for a join of three).
async fn futures_join<F, T>(futures: impl Iterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("join"));
    }
    out
}
