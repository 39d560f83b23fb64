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
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).expect("log file"))
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

/// A signal to a child (SIGKILL, SIGSTOP, SIGCONT).
async fn signal(child: &Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let ok = Command::new("kill")
        .args([sig, &pid])
        .status()
        .await
        .expect("kill");
    assert!(ok.success(), "kill {sig} {pid}");
}

/// The worker id (lease owner) of the process with `pid` in `role`, from its leases.
async fn owner_of(store: &Store, role: &str, pid: u32) -> String {
    let rows = store.shard_leases(role).await.expect("leases");
    rows.into_iter()
        .map(|(_, owner, _, _)| owner)
        .find(|o| o.split('-').rev().nth(1) == Some(pid.to_string().as_str()))
        .unwrap_or_else(|| panic!("no {role} lease owned by pid {pid}"))
}

/// Admissions from `w`, each retried under its key on the other API process until answered; the answered keys
/// (and reservation ids) go to `answered`.
async fn admit_load(
    clients: Vec<ApiClient>,
    w: usize,
    answered: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut i = 0usize;
    while !*stop.borrow() {
        let key = format!("load-{w}-{i}");
        let body = json!({"tenant": "root", "gpus": 1, "duration_s": 3, "idempotency_key": key});
        for attempt in 0usize.. {
            let c = &clients[(i + attempt) % clients.len()];
            match tokio::time::timeout(
                Duration::from_secs(15),
                c.call("reservations", "create", body.clone()),
            )
            .await
            {
                Ok(Ok(r)) => {
                    let id = r["reservation"]["id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    answered.lock().expect("lock").push((key.clone(), id));
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

/// Issue 18 item 2: under load, kill -9 one API process, one of two schedulers and one of three controllers in
/// turn: the API's calls are answered by the other, and each killed process's shards are taken within the lease
/// expiry. Then a controller is paused (SIGSTOP) until the others took its shards, and resumed: its fenced write
/// (expiry and the outbox sink lock their leases `FOR SHARE` with the fence they hold them by) is refused, as the
/// store shows directly with its stale fences and as the resumed process logs; every reservation expires once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_killed_process_is_replaced_within_the_lease_and_a_paused_owner_is_fenced_out() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    bc_control::migrate(&store)
        .await
        .expect("module migrations");
    seed_gpu_nodes(&db.pool, "gpu", "n", 40, 8, "NVIDIA H100 80GB HBM3")
        .await
        .expect("seed");
    let admin_key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let dir = tempfile::tempdir().expect("dir");
    let url = db.url();
    let mut api1 = serve(dir.path(), "api1", &url, "api").await;
    let api2 = serve(dir.path(), "api2", &url, "api").await;
    let sched1 = serve(dir.path(), "sched1", &url, "scheduler").await;
    let sched2 = serve(dir.path(), "sched2", &url, "scheduler").await;
    let mut ctl = Vec::new();
    for i in 0..3 {
        ctl.push(serve(dir.path(), &format!("ctl{i}"), &url, "controllers").await);
    }
    let clients: Vec<ApiClient> = [&api1, &api2]
        .iter()
        .map(|p| ApiClient::new(p.api.as_deref().expect("api addr"), &admin_key))
        .collect();
    let pid = |p: &Proc| p.child.id().unwrap_or_default().to_string();
    let (s2, c1, c2) = (pid(&sched2), pid(&ctl[1]), pid(&ctl[2]));
    until(
        30,
        "two schedulers and three controllers share all shards",
        || async {
            let (sv, so) = leases(&store, "scheduler").await;
            let (cv, co) = leases(&store, "controllers").await;
            if sv == 256 && so.len() == 2 && cv == 256 && co.len() == 3 {
                Ok(())
            } else {
                Err(format!("scheduler {sv} {so:?}, controllers {cv} {co:?}"))
            }
        },
    )
    .await;
    let answered = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut load = tokio::task::JoinSet::new();
    for w in 0..2 {
        load.spawn(admit_load(
            clients.clone(),
            w,
            answered.clone(),
            stop.clone(),
        ));
    }
    let count =
        |a: &std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>| a.lock().expect("lock").len();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lease = Duration::from_millis(LEASE_MS);
    let bound = lease * 2 + Duration::from_millis(1500);

    // kill -9 an API process: the calls go on through the other.
    signal(&api1.child, "-KILL").await;
    let _ = api1.child.wait().await;
    let n = count(&answered);
    until(
        15,
        "admissions answered by the other API process",
        || async {
            if count(&answered) >= n + 5 {
                Ok(())
            } else {
                Err(format!("{} answered", count(&answered)))
            }
        },
    )
    .await;

    // kill -9 a scheduler: the other holds every scheduler shard within the lease.
    signal(&sched1.child, "-KILL").await;
    let t0 = tokio::time::Instant::now();
    until(
        15,
        "the other scheduler takes every scheduler shard",
        || async {
            let (v, o) = leases(&store, "scheduler").await;
            if v == 256 && o.len() == 1 && o.contains_key(&s2) {
                Ok(())
            } else {
                Err(format!("{v} valid, {o:?}"))
            }
        },
    )
    .await;
    let sched_moved = t0.elapsed();
    assert!(
        sched_moved < bound,
        "scheduler shards took {sched_moved:?} with a {lease:?} lease"
    );

    // kill -9 a controller: the two others hold every shard within the lease.
    signal(&ctl[0].child, "-KILL").await;
    let t0 = tokio::time::Instant::now();
    until(
        15,
        "the other controllers take the killed one's shards",
        || async {
            let (v, o) = leases(&store, "controllers").await;
            if v == 256 && o.len() == 2 && o.contains_key(&c1) && o.contains_key(&c2) {
                Ok(())
            } else {
                Err(format!("{v} valid, {o:?}"))
            }
        },
    )
    .await;
    let ctl_moved = t0.elapsed();
    assert!(
        ctl_moved < bound,
        "controller shards took {ctl_moved:?} with a {lease:?} lease"
    );
    println!(
        "shards moved: scheduler {sched_moved:?}, controllers {ctl_moved:?} (lease {lease:?})"
    );

    // Pause a controller past its lease: the last one takes its shards with higher fences.
    let paused = owner_of(&store, "controllers", ctl[1].child.id().unwrap_or_default()).await;
    let stale: Vec<bc_store::work::ShardLease> = store
        .shard_leases("controllers")
        .await
        .expect("leases")
        .into_iter()
        .filter(|(_, o, _, ok)| *o == paused && *ok)
        .map(|(shard, _, fence, _)| bc_store::work::ShardLease { shard, fence })
        .collect();
    assert!(!stale.is_empty(), "the controller to pause holds no shard");
    signal(&ctl[1].child, "-STOP").await;
    until(
        15,
        "the running controller takes the paused one's shards",
        || async {
            let (v, o) = leases(&store, "controllers").await;
            if v == 256 && o.len() == 1 && o.contains_key(&c2) {
                Ok(())
            } else {
                Err(format!("{v} valid, {o:?}"))
            }
        },
    )
    .await;
    let now: HashMap<i16, i64> = store
        .shard_leases("controllers")
        .await
        .expect("leases")
        .into_iter()
        .map(|(s, _, f, _)| (s, f))
        .collect();
    assert!(
        stale.iter().all(|l| now[&l.shard] > l.fence),
        "a takeover raises every fence"
    );
    // The paused owner's stale fences write nothing: a due expiry on its old shard stays for the new owner.
    let written = store
        .run_due_expiries("controllers", &paused, &stale, 500)
        .await
        .expect("stale expiry round");
    assert!(written.is_empty(), "a stale owner expired {written:?}");
    let drained = store
        .drain_outbox("controllers", &paused, &stale, 1000)
        .await
        .expect("stale outbox round");
    assert_eq!(drained, 0, "a stale owner drained the outbox");
    // Resumed, the process acts on its old leases no more: either a reconciler tries them once and their fences
    // refuse it ("fenced out"), or its membership loop, whose renewal did not answer within the lease, gives them up
    // first ("shards given up"); which comes first is a race of the timers that fire at the resume.
    signal(&ctl[1].child, "-CONT").await;
    let log = dir.path().join("ctl1.log");
    let status = format!("/proc/{}/status", ctl[1].child.id().unwrap_or_default());
    let stopped_acting = |l: &str| l.contains("fenced out") || l.contains("shards given up");
    until(
        20,
        "the resumed controller is fenced out or gives its shards up",
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.lines().any(stopped_acting) {
                Ok(())
            } else {
                // Once seen failing in CI with nothing logged after the resume: say whether it runs at all.
                let state = std::fs::read_to_string(&status)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.starts_with("State:") || l.starts_with("Threads:"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let (valid, owners) = leases(&store, "controllers").await;
                Err(format!(
                    "process {state}; {valid} valid controller leases by owner pid {owners:?}; its log:\n{text}"
                ))
            }
        },
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    if let Some(line) = text.lines().find(|l| stopped_acting(l)) {
        println!("the resumed controller: {line}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop_tx.send(true);
    while load.join_next().await.is_some() {}

    // Every answered admission is stored once, and every reservation expires exactly once.
    let answered = answered.lock().expect("lock").clone();
    assert!(
        answered.len() > 20,
        "only {} admissions answered",
        answered.len()
    );
    until(30, "every answered reservation expires", || async {
        let ids: Vec<String> = answered.iter().map(|(_, id)| id.clone()).collect();
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM reservations WHERE id = ANY($1) AND state = 'expired'",
        )
        .bind(&ids)
        .fetch_one(store.pool())
        .await
        .map_err(|e| e.to_string())?;
        if n as usize == ids.len() {
            Ok(())
        } else {
            Err(format!("{n} of {} expired", ids.len()))
        }
    })
    .await;
    let twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT subject FROM audit_events WHERE action = 'reservation.expired' \
         GROUP BY subject HAVING count(*) > 1) x",
    )
    .fetch_one(store.pool())
    .await
    .expect("audits");
    assert_eq!(twice, 0, "reservations expired twice");
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL")
            .fetch_one(store.pool())
            .await
            .expect("left");
    assert_eq!(left, 0, "GPUs still booked after every reservation expired");
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
