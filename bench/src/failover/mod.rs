//! The PostgreSQL failover scenario (issue 18), shared by `scripts/bench failover` and the control plane's failover
//! test: a primary and a synchronous streaming standby ([`bc_store::replica::Replicated`]), a control plane of six
//! `better-compute serve` processes (two `api`, one `gateway`, two `controllers`, one `scheduler`) given the
//! multi-host URL (`target_session_attrs=read-write`), real `bcd run` daemons in session, and load throughout:
//! admissions (retried under their idempotency key until answered), joins (bcd's own Join client, HPKE-sealed
//! tokens) and commands (`nodes.command diag.nvml` on the daemons). Then the primary is killed (SIGKILL), the
//! standby promoted, and the scenario measures when each role works again and checks that nothing acknowledged was
//! lost, nothing booked twice and no command ran twice.

use anyhow::{Context as _, bail};
use bc_control::client::ApiClient;
use bc_proto::v1;
use bc_store::Store;
use bc_store::embedded::Durability;
use bc_store::replica::Replicated;
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

mod verify;
use verify::verify;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub durability: Durability,
    /// How the primary fails.
    pub failure: Failure,
    /// Real `bcd run` daemons in session.
    pub daemons: usize,
    pub shard_lease_ms: u64,
    /// Load before the kill, and after every role recovered.
    pub before: Duration,
    pub after: Duration,
    /// How long the roles may take to recover before the scenario fails.
    pub deadline: Duration,
}

/// How the primary fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// SIGKILL, as a crash: its connections are reset, so every client learns at once.
    Kill,
    /// SIGSTOP of the postmaster and its processes, as a stalled disk or a paused VM: the connections stay open and
    /// the kernel acknowledges what is sent, so no client learns but by its own deadlines.
    Hang,
}

/// One role's first success after the kill.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub role: &'static str,
    pub what: String,
    pub after: Option<Duration>,
}

/// What the scenario measured and checked.
#[derive(Debug, Clone)]
pub struct Report {
    pub promote: Duration,
    pub roles: Vec<Recovery>,
    /// Each process: when its pool moved to the new primary (from its log), after the kill.
    pub switches: Vec<(String, Option<Duration>)>,
    /// The latest of the roles' first successes: the time to recover.
    pub recovered: Duration,
    pub admissions: usize,
    pub joins: usize,
    pub commands: usize,
    /// Calls that failed during the outage (retried: admissions under the same key).
    pub failed_calls: usize,
    /// Every invariant checked, with what was seen.
    pub checks: Vec<String>,
}

/// A `better-compute serve` child and the lines it logged (with when they arrived).
struct Serve {
    name: String,
    child: Child,
    api: Option<String>,
    gateway: Option<String>,
    ca_pin: String,
    join_key: String,
    log: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Daemon {
    id: String,
    child: Child,
    log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(
    bin: &Path,
    dir: &Path,
    name: &str,
    url: &str,
    roles: &str,
    lease_ms: u64,
) -> anyhow::Result<Serve> {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "state_dir = {:?}\ndatabase_url = {url:?}\nroles = {roles:?}\napi_listen = \"127.0.0.1:0\"\n\
             gateway_listen = \"127.0.0.1:0\"\ngateway_hosts = [\"127.0.0.1\"]\ntrust_domain = \"failover.bc\"\n\
             shard_lease_ms = {lease_ms}\n",
            dir.join(name)
        ),
    )?;
    let mut child = Command::new(bin.join("better-compute"))
        .args(["serve", "--no-migrate", "--config"])
        .arg(&cfg)
        .env(
            "BC_LOG",
            std::env::var("BC_FAILOVER_LOG").unwrap_or_else(|_| "warn,sqlx=error".into()),
        )
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawning better-compute serve")?;
    let log = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().context("stderr")?;
    let (sink, file) = (
        log.clone(),
        std::fs::File::create(dir.join(format!("{name}.log")))?,
    );
    std::thread::spawn(move || {
        let mut file = file;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{line}");
            if let Ok(mut l) = sink.lock() {
                l.push((Instant::now(), line));
            }
        }
    });
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut s = Serve {
        name: name.to_string(),
        child,
        api: None,
        gateway: None,
        ca_pin: String::new(),
        join_key: String::new(),
        log,
    };
    for line in lines.by_ref() {
        let line = line?;
        let Some(rest) = line.strip_prefix("serving: ") else {
            continue;
        };
        for field in rest.split_whitespace() {
            match field.split_once('=') {
                Some(("api", a)) if a != "-" => s.api = Some(format!("http://{a}")),
                Some(("gateway", a)) if a != "-" => s.gateway = Some(format!("https://{a}")),
                Some(("ca_pin", p)) => s.ca_pin = p.to_string(),
                Some(("join_key", k)) => s.join_key = k.to_string(),
                _ => {}
            }
        }
        std::thread::spawn(move || for _ in lines {});
        return Ok(s);
    }
    bail!(
        "{name} exited before serving; see {}",
        dir.join(format!("{name}.log")).display()
    )
}

/// Distinct hardware for join `i` of the load.
fn claims(i: usize) -> v1::HardwareClaims {
    v1::HardwareClaims {
        dmi: Some(v1::DmiClaims {
            system_uuid: format!("failover-{i:08}"),
            system_serial: format!("FO{i:08}"),
            ..Default::default()
        }),
        nics: vec![v1::NicClaim {
            name: "eth0".into(),
            mac: format!(
                "02:fa:00:{:02x}:{:02x}:{:02x}",
                (i >> 16) & 0xff,
                (i >> 8) & 0xff,
                i & 0xff
            ),
            ..Default::default()
        }],
        hostname: format!("failover-{i}"),
        arch: "x86_64".into(),
        gpu_backend: "none".into(),
        ..Default::default()
    }
}

/// Everything the load was told, with when.
#[derive(Default)]
struct Ledger {
    /// Idempotency key → (reservation id, when the answered attempt was sent, when it was answered).
    admitted: HashMap<String, (String, Instant, Instant)>,
    /// Node ids of joins answered, with when each was sent and answered.
    joined: Vec<(String, Instant, Instant)>,
    /// Command ids queued (answered), with the daemon and when.
    commands: Vec<(String, String, Instant)>,
    failed: usize,
}

type Shared = Arc<Mutex<Ledger>>;

fn lock(l: &Shared) -> std::sync::MutexGuard<'_, Ledger> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

const CALL_TIMEOUT: Duration = Duration::from_secs(20);

async fn call(c: &ApiClient, group: &str, method: &str, body: Value) -> anyhow::Result<Value> {
    Ok(
        tokio::time::timeout(CALL_TIMEOUT, c.call(group, method, body))
            .await
            .map_err(|_| {
                anyhow::anyhow!("{group}.{method}: no answer within {CALL_TIMEOUT:?}")
            })??,
    )
}

/// Admissions from worker `w`, each retried under its key (alternating API processes) until answered.
async fn admit_loop(
    apis: Vec<ApiClient>,
    w: usize,
    ledger: Shared,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut i = 0usize;
    while !*stop.borrow() {
        let key = format!("fo-{w}-{i}");
        let body = json!({"tenant": "root", "gpus": 1, "duration_s": 4, "idempotency_key": key});
        let mut attempt = 0usize;
        loop {
            let sent = Instant::now();
            match call(
                &apis[(i + attempt) % apis.len()],
                "reservations",
                "create",
                body.clone(),
            )
            .await
            {
                Ok(v) => {
                    let id = v["reservation"]["id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    lock(&ledger)
                        .admitted
                        .insert(key.clone(), (id, sent, Instant::now()));
                    break;
                }
                Err(_) => {
                    lock(&ledger).failed += 1;
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Joins through the gateway, each with a fresh key and distinct hardware (a failed one is not retried).
async fn join_loop(
    config: bcd::config::Config,
    token: String,
    ledger: Shared,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut i = 0usize;
    while !*stop.borrow() {
        i += 1;
        let sent = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| e.to_string())
            .and_then(|key| {
                bcd::join::request_for_key(&config, &key, &token, claims(i))
                    .map_err(|e| e.to_string())
            });
        let Ok(req) = sent else { continue };
        let sent = Instant::now();
        match tokio::time::timeout(CALL_TIMEOUT, bcd::join::send(&config, req)).await {
            Ok(Ok(resp)) => lock(&ledger)
                .joined
                .push((resp.node_id, sent, Instant::now())),
            _ => {
                lock(&ledger).failed += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `diag.nvml` commands to the daemons in turn (a call that failed is not repeated).
async fn command_loop(
    api: ApiClient,
    nodes: Vec<String>,
    ledger: Shared,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut i = 0usize;
    while !*stop.borrow() {
        let node = &nodes[i % nodes.len()];
        i += 1;
        let body = json!({"node_id": node, "kind": "diag.nvml", "args": {"expected_gpu_count": 2}, "timeout_s": 300});
        match call(&api, "nodes", "command", body).await {
            Ok(v) => {
                let id = v["id"].as_str().unwrap_or_default().to_string();
                lock(&ledger)
                    .commands
                    .push((id, node.clone(), Instant::now()));
            }
            Err(_) => lock(&ledger).failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Joins and starts `n` real `bcd run` daemons (two fixture GPUs each); returns them once all are online.
async fn daemons(
    bin: &Path,
    dir: &Path,
    gw: &Serve,
    admin: &ApiClient,
    n: usize,
) -> anyhow::Result<Vec<Daemon>> {
    let mut out = Vec::new();
    for d in 0..n {
        let state = dir.join(format!("bcd{d}"));
        std::fs::create_dir_all(&state)?;
        let fixture = state.join("gpus.json");
        std::fs::write(
            &fixture,
            bcd::gpu::fixture::synthetic(2, &format!("failover{d}")),
        )?;
        let cfg = state.join("bcd.toml");
        std::fs::write(
            &cfg,
            format!(
                "gateway_url = {:?}\nca_pin = {:?}\njoin_public_key = {:?}\nstate_dir = {:?}\ngpu_backend = \"fixture:{}\"\ncdi_dir = {:?}\n",
                gw.gateway.as_deref().unwrap_or_default(),
                gw.ca_pin,
                gw.join_key,
                state,
                fixture.display(),
                state.join("cdi"),
            ),
        )?;
        let token = call(
            admin,
            "join-tokens",
            "create",
            json!({"pool": "default", "uses": 1, "ttl_seconds": 3600}),
        )
        .await?;
        let join = Command::new(bin.join("bcd"))
            .arg("--config")
            .arg(&cfg)
            .arg("join")
            .env(
                "BCD_JOIN_TOKEN",
                token["token"].as_str().unwrap_or_default(),
            )
            .output()?;
        if !join.status.success() {
            bail!("bcd join failed: {}", String::from_utf8_lossy(&join.stderr));
        }
        let node: Value = serde_json::from_str(&std::fs::read_to_string(state.join("node.json"))?)?;
        let node = node["node_id"].as_str().unwrap_or_default().to_string();
        let log = state.join("bcd.log");
        let child = Command::new(bin.join("bcd"))
            .arg("--config")
            .arg(&cfg)
            .arg("run")
            .env("BCD_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        out.push(Daemon {
            id: node.trim().to_string(),
            child,
            log,
        });
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let nodes = call(admin, "nodes", "list", json!({})).await?;
        let online: HashMap<String, bool> = nodes["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| {
                (
                    n["id"].as_str().unwrap_or_default().to_string(),
                    n["online"].as_bool().unwrap_or(false),
                )
            })
            .collect();
        if out
            .iter()
            .all(|d| online.get(&d.id).copied().unwrap_or(false))
        {
            return Ok(out);
        }
        if Instant::now() > deadline {
            bail!("daemons not online within 60 s: {online:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Milliseconds since the epoch of a wall-clock instant (the database's timestamps are compared with it).
fn epoch_ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The first time after `kill_ms` (epoch ms) that a query's `min(epoch ms)` reports, as a duration after the kill.
/// Within 2 s and cut short when the bench's own pool moves ([`Store::within`]): the observer's queries waited on a
/// hung primary as long as any role's, and the recovery it observed by the clock (every daemon online) was late by
/// its own wait (10.4 s reported where the API answered at 4.6 s).
async fn first_after(
    store: &Store,
    q: &'static str,
    kill_ms: i64,
) -> anyhow::Result<Option<Duration>> {
    let read = bc_store::sqlx::query_scalar(q)
        .bind(kill_ms as f64)
        .fetch_one(store.pool());
    let ms: Option<f64> = store
        .within("observing the recovery", Duration::from_secs(2), async {
            Ok(read.await?)
        })
        .await?;
    Ok(ms.map(|m| Duration::from_millis((m as i64 - kill_ms).max(0) as u64)))
}

/// Runs the scenario under `dir` with the release or debug binaries in `bin` (better-compute, bcd).
pub async fn run(bin: &Path, dir: &Path, opts: &Options) -> anyhow::Result<Report> {
    let mut pg = Replicated::start(&dir.join("pg"), opts.durability, "bc").await?;
    let url = pg.url("bc");
    let store = bc_store::multihost::connect(&url, 8, Duration::from_secs(10)).await?;
    bc_control::migrate(&store).await?;
    store.ensure_root_tenant().await?;
    store
        .ensure_pool("default", "root", "default", true)
        .await?;
    bc_store::testing::seed_gpu_nodes(store.pool(), "gpu", "seed", 40, 8, "NVIDIA H100 80GB HBM3")
        .await?;
    let key = bc_control::bootstrap_admin(&store).await?;
    let lease = opts.shard_lease_ms;
    let mut procs = Vec::new();
    for (name, roles) in [
        ("api1", "api"),
        ("api2", "api"),
        ("gateway", "gateway"),
        ("ctl1", "controllers"),
        ("ctl2", "controllers"),
        ("sched", "scheduler"),
    ] {
        procs.push(serve(bin, dir, name, &url, roles, lease)?);
    }
    let apis: Vec<ApiClient> = procs
        .iter()
        .filter_map(|p| p.api.as_deref())
        .map(|a| ApiClient::new(a, &key))
        .collect();
    let gw = procs
        .iter()
        .find(|p| p.gateway.is_some())
        .context("a gateway")?;
    let daemons = daemons(bin, dir, gw, &apis[0], opts.daemons).await?;
    let config = bcd::config::ConfigWire {
        gateway_url: gw.gateway.clone(),
        ca_pin: Some(gw.ca_pin.clone()),
        join_public_key: Some(gw.join_key.clone()),
        state_dir: None,
        gpu_backend: Some("none".into()),
        hardware_root: None,
        cdi_dir: None,
        tunnels: None,
    }
    .validate("failover")?;
    let token = call(
        &apis[0],
        "join-tokens",
        "create",
        json!({"pool": "default", "uses": 100000, "ttl_seconds": 3600}),
    )
    .await?;
    let token = token["token"].as_str().context("token")?.to_string();

    let ledger: Shared = Arc::default();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut load = tokio::task::JoinSet::new();
    for w in 0..2 {
        load.spawn(admit_loop(apis.clone(), w, ledger.clone(), stop.clone()));
    }
    load.spawn(join_loop(config, token, ledger.clone(), stop.clone()));
    let node_ids: Vec<String> = daemons.iter().map(|d| d.id.clone()).collect();
    load.spawn(command_loop(
        apis[1].clone(),
        node_ids,
        ledger.clone(),
        stop.clone(),
    ));
    tokio::time::sleep(opts.before).await;

    match opts.failure {
        Failure::Kill => pg.kill_primary(),
        Failure::Hang => {
            pg.freeze_primary();
        }
    }
    // From here on the old primary is gone (reaped) or stopped: whatever commits after this, commits on the standby.
    let kill_at = Instant::now();
    let kill_wall = SystemTime::now();
    let promote = pg.promote_standby().await?;
    let roles = wait_recovery(
        &store,
        &ledger,
        &daemons,
        &apis[0],
        kill_at,
        epoch_ms(kill_wall),
        opts.deadline,
    )
    .await?;
    let recovered = roles
        .iter()
        .filter_map(|r| r.after)
        .max()
        .unwrap_or_default();
    tokio::time::sleep(opts.after).await;
    let _ = stop_tx.send(true);
    while load.join_next().await.is_some() {}
    let switches = procs
        .iter()
        .map(|p| {
            let log = p.log.lock().map(|l| l.clone()).unwrap_or_default();
            let at = log
                .iter()
                .find(|(at, l)| *at > kill_at && l.contains("database primary moved"))
                .map(|(at, _)| *at - kill_at);
            (p.name.clone(), at)
        })
        .collect();
    let checks = verify(&store, &ledger, &daemons).await?;
    let l = lock(&ledger);
    let report = Report {
        promote,
        roles,
        switches,
        recovered,
        admissions: l.admitted.len(),
        joins: l.joined.len(),
        commands: l.commands.len(),
        failed_calls: l.failed,
        checks,
    };
    drop(l);
    drop(daemons);
    drop(procs);
    Ok(report)
}

/// Waits until every role has done its work once after the kill (or `deadline` passes: then the scenario fails
/// naming the roles that did not).
async fn wait_recovery(
    store: &Store,
    ledger: &Shared,
    daemons: &[Daemon],
    admin: &ApiClient,
    kill_at: Instant,
    kill_ms: i64,
    deadline: Duration,
) -> anyhow::Result<Vec<Recovery>> {
    let mut roles = vec![
        Recovery {
            role: "api",
            what: "first admission sent after the kill answered".into(),
            after: None,
        },
        Recovery {
            role: "scheduler",
            what: "first reservation placed (placed_at)".into(),
            after: None,
        },
        Recovery {
            role: "controllers",
            what: "first reservation expired (ended_at)".into(),
            after: None,
        },
        Recovery {
            role: "gateway",
            what: "first join sent after the kill answered".into(),
            after: None,
        },
        Recovery {
            role: "gateway",
            what: "first command queued after the kill finished by its daemon".into(),
            after: None,
        },
        Recovery {
            role: "gateway",
            what: "every daemon online in a session again".into(),
            after: None,
        },
    ];
    loop {
        {
            let l = lock(ledger);
            roles[0].after = l
                .admitted
                .values()
                .filter(|(_, sent, _)| *sent > kill_at)
                .map(|(_, _, at)| *at - kill_at)
                .min();
            roles[3].after = l
                .joined
                .iter()
                .filter(|(_, sent, _)| *sent > kill_at)
                .map(|(_, _, at)| *at - kill_at)
                .min();
        }
        roles[1].after = first_after(
            store,
            "SELECT min(extract(epoch FROM placed_at) * 1000)::float8 FROM reservations WHERE placed_at > to_timestamp($1 / 1000.0)",
            kill_ms,
        )
        .await
        .unwrap_or(None);
        roles[2].after = first_after(
            store,
            "SELECT min(extract(epoch FROM ended_at) * 1000)::float8 FROM reservations WHERE state = 'expired' AND ended_at > to_timestamp($1 / 1000.0)",
            kill_ms,
        )
        .await
        .unwrap_or(None);
        roles[4].after = first_after(
            store,
            "SELECT min(extract(epoch FROM finished_at) * 1000)::float8 FROM commands WHERE state = 'done' AND created_at > to_timestamp($1 / 1000.0)",
            kill_ms,
        )
        .await
        .unwrap_or(None);
        if roles[5].after.is_none() {
            let nodes = call(admin, "nodes", "list", json!({}))
                .await
                .unwrap_or_default();
            let online: HashSet<&str> = nodes["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|n| n["online"].as_bool() == Some(true))
                .filter_map(|n| n["id"].as_str())
                .collect();
            if daemons.iter().all(|d| online.contains(d.id.as_str())) && roles[0].after.is_some() {
                roles[5].after = Some(kill_at.elapsed());
            }
        }
        if roles.iter().all(|r| r.after.is_some()) {
            return Ok(roles);
        }
        if kill_at.elapsed() > deadline {
            let missing: Vec<String> = roles
                .iter()
                .filter(|r| r.after.is_none())
                .map(|r| format!("{}: {}", r.role, r.what))
                .collect();
            bail!("not recovered within {deadline:?}: {}", missing.join("; "));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
