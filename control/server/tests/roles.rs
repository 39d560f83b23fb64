//! Several real `better-compute serve` processes against one PostgreSQL: two API processes with a client
//! alternating between them per call, one scheduler, three controllers. Every shard is owned by exactly one live
//! controller; killing one moves its shards within the lease expiry; reservations expire exactly once.

use bc_control::client::ApiClient;
use bc_store::Store;
use bc_store::sqlx;
use bc_store::testing::{seed_gpu_nodes, test_db};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");
const LEASE_MS: u64 = 2000;

struct Proc {
    child: Child,
    api: Option<String>,
}

async fn serve(dir: &std::path::Path, name: &str, url: &str, roles: &str) -> Proc {
    let state = dir.join(name);
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "state_dir = {state:?}\ndatabase_url = {url:?}\nroles = {roles:?}\napi_listen = \"127.0.0.1:0\"\n\
             gateway_listen = \"127.0.0.1:0\"\ntrust_domain = \"test.bc\"\nshard_lease_ms = {LEASE_MS}\n"
        ),
    )
    .expect("config");
    let mut child = Command::new(BIN)
        .args(["serve", "--no-migrate", "--config"])
        .arg(&cfg)
        .env("BC_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut api = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(deadline, lines.next_line()).await {
        if let Some(rest) = line.strip_prefix("serving: api=") {
            let addr = rest.split_whitespace().next().unwrap_or_default();
            if addr != "-" && !addr.is_empty() {
                api = Some(format!("http://{addr}"));
            }
            break;
        }
    }
    // Keep draining stdout so the process never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Proc { child, api }
}

/// (valid shards, owner pid → count) of a role's leases.
async fn leases(store: &Store, role: &str) -> (usize, HashMap<String, usize>) {
    let rows = store.shard_leases(role).await.expect("leases");
    let mut owners: HashMap<String, usize> = HashMap::new();
    let mut valid = 0;
    for (_, owner, _, ok) in rows {
        if ok {
            valid += 1;
            let pid = owner
                .split('-')
                .rev()
                .nth(1)
                .unwrap_or_default()
                .to_string();
            *owners.entry(pid).or_default() += 1;
        }
    }
    (valid, owners)
}

async fn until<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        match f().await {
            Ok(()) => return,
            Err(e) if tokio::time::Instant::now() > deadline => panic!("{what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_scheduler_and_controllers_share_work_across_processes() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    // The modules' migrations too: `serve --no-migrate` refuses a database with any pending.
    bc_control::migrate(&store)
        .await
        .expect("module migrations");
    seed_gpu_nodes(&db.pool, "gpu", "n", 20, 8, "NVIDIA H100 80GB HBM3")
        .await
        .expect("seed");
    let admin_key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let dir = tempfile::tempdir().expect("dir");
    let url = db.url();
    let api1 = serve(dir.path(), "api1", &url, "api").await;
    let api2 = serve(dir.path(), "api2", &url, "api").await;
    let _sched = serve(dir.path(), "sched", &url, "scheduler").await;
    let mut ctl = Vec::new();
    for i in 0..3 {
        ctl.push(serve(dir.path(), &format!("ctl{i}"), &url, "controllers").await);
    }
    let clients = [
        ApiClient::new(api1.api.as_deref().expect("api1 addr"), &admin_key),
        ApiClient::new(api2.api.as_deref().expect("api2 addr"), &admin_key),
    ];
    let pids: Vec<String> = ctl
        .iter()
        .map(|p| p.child.id().unwrap_or_default().to_string())
        .collect();

    // Every shard owned by exactly one of the three live controllers (the table's key makes "at most one" hold;
    // all 256 valid and three owners make it "exactly one, spread").
    until(20, "three controllers own all 256 shards", || async {
        let (valid, owners) = leases(&store, "controllers").await;
        let live: HashSet<_> = owners.keys().cloned().collect();
        if valid == 256 && live.len() == 3 && pids.iter().all(|p| live.contains(p)) {
            Ok(())
        } else {
            Err(format!("{valid} valid, owners {owners:?}"))
        }
    })
    .await;
    let (_, sched) = leases(&store, "scheduler").await;
    assert_eq!(
        sched.values().sum::<usize>(),
        256,
        "the scheduler owns every scheduler shard"
    );

    // Creates alternate between the API processes; a replay on the other process answers the same.
    let mut ids = Vec::new();
    for i in 0..30usize {
        let body = json!({"tenant": "root", "gpus": 2, "duration_s": 4, "idempotency_key": format!("k{i}")});
        let r = clients[i % 2]
            .call("reservations", "create", body.clone())
            .await
            .expect("create");
        assert_eq!(r["reservation"]["state"], "placed", "{r}");
        let replay = clients[(i + 1) % 2]
            .call("reservations", "create", body)
            .await
            .expect("replay");
        assert_eq!(replay["reservation"]["id"], r["reservation"]["id"]);
        ids.push(
            r["reservation"]["id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    // One snapshot: the reservations last 4 s, so on a loaded machine the first ones may already have expired
    // (and given their GPUs back) before the last is created. Every placed one holds exactly its 2 GPUs, and every
    // one of the 30 is placed or expired.
    let (booked, placed, expired): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL), \
                (SELECT count(*) FROM reservations WHERE state = 'placed'), \
                (SELECT count(*) FROM reservations WHERE state = 'expired')",
    )
    .fetch_one(store.pool())
    .await
    .expect("booked");
    assert_eq!(booked, 2 * placed, "{placed} placed, {expired} expired");
    assert_eq!(placed + expired, 30, "{booked} GPUs booked");

    // Kill one controller without a goodbye: its shards move within the lease expiry.
    let killed = pids[0].clone();
    ctl[0].child.kill().await.expect("kill");
    let t0 = tokio::time::Instant::now();
    until(10, "the killed controller's shards move", || async {
        let (valid, owners) = leases(&store, "controllers").await;
        if valid == 256 && !owners.contains_key(&killed) && owners.len() == 2 {
            Ok(())
        } else {
            Err(format!("{valid} valid, owners {owners:?}"))
        }
    })
    .await;
    let moved_in = t0.elapsed();
    assert!(
        moved_in < Duration::from_millis(LEASE_MS * 2 + 1500),
        "shards took {moved_in:?} to move with a {LEASE_MS} ms lease"
    );

    // Every reservation expires exactly once, across the kill.
    until(20, "all reservations expire", || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM reservations WHERE state = 'expired'")
                .fetch_one(store.pool())
                .await
                .map_err(|e| e.to_string())?;
        if n == 30 {
            Ok(())
        } else {
            Err(format!("{n} of 30 expired"))
        }
    })
    .await;
    let per: Vec<(String, i64)> = sqlx::query_as(
        "SELECT subject, count(*) FROM audit_events WHERE action = 'reservation.expired' GROUP BY subject",
    )
    .fetch_all(store.pool())
    .await
    .expect("audits");
    assert_eq!(per.len(), 30);
    assert!(per.iter().all(|(_, n)| *n == 1), "processed twice: {per:?}");
    for id in &ids {
        assert!(per.iter().any(|(s, _)| s == &format!("reservation/{id}")));
    }
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL")
            .fetch_one(store.pool())
            .await
            .expect("left");
    assert_eq!(left, 0);
    let queue: i64 = sqlx::query_scalar("SELECT count(*) FROM work_queue")
        .fetch_one(store.pool())
        .await
        .expect("queue");
    assert_eq!(queue, 0);
    // The outbox sink delivered every booking and release (rows are deleted once the gateways are poked).
    until(10, "the outbox drains", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
            .fetch_one(store.pool())
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            Ok(())
        } else {
            Err(format!("{n} outbox rows left"))
        }
    })
    .await;
}

/// Issue 17 item 2: `better-compute serve` as its systemd unit runs it (packaging/systemd/better-compute.service),
/// in the unit's sandbox reproduced here (a dynamic user without capabilities, the state directory the only
/// writable path of its tree, umask 077): it tells the service manager it is ready only once its API answers, with
/// the addresses as status; pings the watchdog at half of WATCHDOG_USEC; and on SIGTERM says it is stopping and
/// exits cleanly. The CA key it writes belongs to the dynamic user and is private.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_under_its_units_sandbox_is_ready_watched_and_stops_cleanly() {
    use bc_testkit::unit::{DYNAMIC_USER, Notifications, Sandbox, can_sandbox};
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    if let Err(why) = can_sandbox() {
        bc_testkit::skip!("{why}");
    }
    let db = test_db().await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let unit = include_str!("../../../packaging/systemd/better-compute.service");
    let sandbox = Sandbox::parse(unit);
    assert!(
        sandbox.dynamic_user && sandbox.bounding.as_deref() == Some(&[][..]),
        "{unit}"
    );
    let root = dir.path().join("stage");
    let state = root.join("var/lib/better-compute");
    let etc = root.join("etc/better-compute");
    std::fs::create_dir_all(&state).expect("state dir");
    std::fs::create_dir_all(&etc).expect("config dir");
    // systemd makes the StateDirectory= the dynamic user's.
    std::os::unix::fs::chown(&state, Some(DYNAMIC_USER), Some(DYNAMIC_USER)).expect("chown");
    let cfg = etc.join("serve.toml");
    std::fs::write(
        &cfg,
        format!(
            "database_url = {:?}\nroles = \"all\"\napi_listen = \"127.0.0.1:0\"\n\
             gateway_listen = \"127.0.0.1:0\"\ntrust_domain = \"test.bc\"\n",
            db.url()
        ),
    )
    .expect("config");
    let mut notes = Notifications::bind(dir.path()).expect("notify socket");
    let args: Vec<&std::ffi::OsStr> = vec![
        BIN.as_ref(),
        "serve".as_ref(),
        "--config".as_ref(),
        cfg.as_os_str(),
        "--state-dir".as_ref(),
        state.as_os_str(),
    ];
    let mut child = Command::from(sandbox.command(&root, &args).expect("sandbox"))
        .env("BC_LOG", "warn")
        .env("NOTIFY_SOCKET", &notes.path)
        .env("WATCHDOG_USEC", "200000")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn serve");
    let status = tokio::task::block_in_place(|| notes.until("STATUS=serving: api=", 60))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        notes.seen.iter().any(|l| l == "READY=1"),
        "{:?}",
        notes.seen
    );
    let api = status
        .trim_start_matches("STATUS=serving: api=")
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    // Ready means serving: the API answers at once.
    let mut conn = tokio::net::TcpStream::connect(&api)
        .await
        .expect("api after READY");
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    conn.write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("read");
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    tokio::task::block_in_place(|| notes.pings(3, 5)).unwrap_or_else(|e| panic!("{e}"));
    // What it wrote is the dynamic user's and private (UMask=0077).
    let written: Vec<_> = std::fs::read_dir(&state)
        .expect("state dir")
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .collect();
    assert!(
        !written.is_empty(),
        "serve wrote nothing to its state directory"
    );
    for m in &written {
        assert_eq!(m.uid(), DYNAMIC_USER);
        assert_eq!(
            m.mode() & 0o077,
            0,
            "a state file is readable by others: {:o}",
            m.mode()
        );
    }
    let pid = child.id().expect("running");
    let _ = Command::new("kill").arg(pid.to_string()).status().await;
    tokio::task::block_in_place(|| notes.until("STOPPING=1", 15)).unwrap_or_else(|e| panic!("{e}"));
    let exit = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("serve stops within 30 s of SIGTERM")
        .expect("wait");
    assert!(exit.success(), "serve did not stop cleanly: {exit}");
}
