//! `BC_SESSIONS_GATEWAYS=2 scripts/bench sessions` (issue 18, item 3): idle sessions over two gateway processes
//! behind HAProxy (the two-gateway lab of issue 14, `bc_testkit::gateways`), one API process (api, controllers,
//! scheduler) beside them, on an embedded PostgreSQL. The load tool is the one of the single-gateway run: real
//! joins, real certificates, one TLS session per node, heartbeats at the interval the gateway asks.
//!
//! Where a process may not hold a descriptor per connection (RLIMIT_NOFILE's hard limit, 20,000 in this project's
//! containers), the work is spread over processes as an operator would spread it: the load tool's daemons over
//! worker processes, HAProxy over processes sharing its ports (SO_REUSEPORT), and the sessions over more gateways
//! (`BC_SESSIONS_GATEWAYS=<g>`: the program names the fewest that fit).
//!
//! Figures: both gateways' RSS per idle session at each step (1k, 10k, N), the database's commits/s at each step
//! (flat in the number of sessions: liveness is batched per gateway), how the balancer spread the sessions, and a
//! reconnect storm: both gateways killed (SIGKILL) and started again on their addresses, the time until 99% and 100%
//! of the sessions are back, and a check that every node holds one session (online once, one reconnect each).
//! Then, where the other gateways can hold every session (`BC_SESSIONS=50000 BC_SESSIONS_GATEWAYS=4` here), a
//! rolling restart as an upgrade does it: each gateway in turn stopped with SIGTERM and started again, how long it
//! took to exit and when its sessions were all up again on the others.

use super::{Fleet, join_all, xact_commits};
use anyhow::{Context as _, bail};
use bc_bench::{BenchDb, cpu_s, machine_cpu_s, query_i64, rss_kib};
use bc_store::embedded::Durability;
use bc_testkit::gateways::{Binaries, GatewayLab, LabSpec};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// HAProxy ports the load tool spreads over: loopback allows one connection per ephemeral port (28,232 here) to a
/// destination, so 50,000 sessions need more than one.
const BALANCER_PORTS: usize = 4;

/// This process's descriptor limit (RLIMIT_NOFILE, soft: scripts/bench raises it to the hard one).
fn nofile_limit() -> anyhow::Result<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits")?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no \"Max open files\" in /proc/self/limits")?;
    let soft = line
        .split_whitespace()
        .nth(3)
        .context("/proc/self/limits: Max open files")?;
    Ok(match soft {
        "unlimited" => usize::MAX,
        n => n.parse()?,
    })
}

/// Commits/s of the whole database over `secs`.
async fn commit_rate(url: &str, secs: u64) -> anyhow::Result<f64> {
    let a = xact_commits(url)?;
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let b = xact_commits(url)?;
    // psql's own query commits once per sample.
    Ok(b.saturating_sub(a + 1) as f64 / secs as f64)
}

/// The gateways' summed RSS (KiB).
fn gateways_rss(lab: &GatewayLab) -> u64 {
    lab.gateways.iter().map(|g| rss_kib(g.pid)).sum()
}

/// CPU seconds so far of each part: the gateways, HAProxy, the API process, the load tool, and the machine (all
/// cores: busy, idle).
#[derive(Debug, Clone, Copy)]
struct Cpu {
    gateways: f64,
    balancers: f64,
    api: f64,
    load: f64,
    busy: f64,
    idle: f64,
}

/// CPU seconds so far of the processes `pids`, together.
fn cpu_of(pids: impl IntoIterator<Item = u32>) -> f64 {
    pids.into_iter().map(cpu_s).sum()
}

impl Cpu {
    fn now(lab: &GatewayLab, load_pids: &[u32]) -> Cpu {
        let (busy, idle) = machine_cpu_s();
        Cpu {
            gateways: cpu_of(lab.gateways.iter().map(|g| g.pid)),
            balancers: cpu_of(lab.haproxy_pids.iter().copied()),
            api: cpu_s(lab.api_pid),
            load: cpu_of(load_pids.iter().copied()),
            busy,
            idle,
        }
    }

    /// `gateways 12 µs, …`: each part's CPU from `self` to `to`, per `n` of something.
    fn per(&self, to: &Cpu, n: usize) -> String {
        let per = |a: f64, b: f64| (b - a) * 1e6 / n.max(1) as f64;
        let gateways = per(self.gateways, to.gateways);
        let balancers = per(self.balancers, to.balancers);
        let api = per(self.api, to.api);
        let load = per(self.load, to.load);
        let busy = per(self.busy, to.busy);
        format!(
            "gateways {gateways:.0} µs, HAProxy {balancers:.0} µs, API process {api:.0} µs, load tool {load:.0} µs, \
             the rest (PostgreSQL, the kernel's softirqs, other processes) {:.0} µs; the machine busy {busy:.0} µs, \
             idle {:.0} µs",
            busy - gateways - balancers - api - load,
            per(self.idle, to.idle),
        )
    }
}

/// Row versions written to `nodes` so far (updates and inserts).
const NODES_WRITTEN: &str =
    "SELECT n_tup_upd + n_tup_ins FROM pg_stat_user_tables WHERE relname = 'nodes'";

/// What psql printed for `args` (after the URL), or its error.
fn psql(url: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(bc_bench::pg_tool("psql")?)
        .arg(url)
        .args(args)
        .output()?;
    if !out.status.success() {
        bail!("psql: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// Zeroes pg_stat_statements (when the database loaded it: `BC_PG_STAT_STATEMENTS=1`, as `scripts/bench` runs
/// this) and returns the row versions written to `nodes` so far.
fn statements_reset(url: &str) -> anyhow::Result<i64> {
    psql(
        url,
        &[
            "-Atq",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements",
            "-c",
            "SELECT pg_stat_statements_reset()",
        ],
    )?;
    query_i64(url, NODES_WRITTEN)
}

/// Since [`statements_reset`]: one line per statement that took more than 1% of the database's execution
/// time (calls, rows, total and mean time, its text shortened), then the row versions written to `nodes`.
fn statements_since(url: &str, nodes_written_before: i64) -> anyhow::Result<Vec<String>> {
    let out = psql(
        url,
        &[
            "-At",
            "-F",
            "\x1f",
            "-c",
            "WITH s AS (SELECT calls, rows, total_exec_time AS ms, \
             left(regexp_replace(query, '\\s+', ' ', 'g'), 110) AS q FROM pg_stat_statements \
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())) \
             SELECT calls, rows, round(ms::numeric, 1), round((ms / greatest(calls, 1))::numeric, 3), \
             round((100 * ms / greatest((SELECT sum(ms) FROM s), 1))::numeric, 1), q FROM s \
             WHERE ms > 0.01 * (SELECT sum(ms) FROM s) ORDER BY ms DESC",
        ],
    )?;
    let mut lines: Vec<String> = out
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\x1f').collect();
            (f.len() == 6).then(|| {
                format!(
                    "{:>5}% {:>9} ms ({} ms each) {:>7} calls {:>7} rows: {}",
                    f[4], f[2], f[3], f[0], f[1], f[5]
                )
            })
        })
        .collect();
    lines.push(format!(
        "row versions written to nodes: {}",
        query_i64(url, NODES_WRITTEN)? - nodes_written_before
    ));
    Ok(lines)
}

/// `gw0 12500, gw1 12500`: online nodes by the gateway holding them.
fn spread(url: &str) -> anyhow::Result<String> {
    let out = std::process::Command::new(bc_bench::pg_tool("psql")?)
        .args([
            url,
            "-At",
            "-F",
            " ",
            "-c",
            "SELECT coalesce(gateway_id, '-'), count(*) FROM nodes WHERE online GROUP BY 1 ORDER BY 1",
        ])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .collect::<Vec<_>>()
        .join(", "))
}

/// What the gateways' connection policy closed, summed over their logs in `dir` (each gateway reports every 10 s
/// what it closed: `expired=… shed_at_cap=… shed_per_source=… shed_for_descriptors=… refused=…`).
fn policy_closed(dir: &Path) -> String {
    const COUNTERS: [&str; 5] = [
        "expired",
        "shed_at_cap",
        "shed_per_source",
        "shed_for_descriptors",
        "refused",
    ];
    let mut sums = [0u64; 5];
    let logs = std::fs::read_dir(dir).into_iter().flatten().flatten();
    for log in logs.filter(|e| e.file_name().to_string_lossy().starts_with("gw")) {
        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
        for line in text
            .lines()
            .filter(|l| l.contains("gateway closed stalled"))
        {
            for (k, name) in COUNTERS.iter().enumerate() {
                let n = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                    .and_then(|v| v.parse::<u64>().ok());
                sums[k] += n.unwrap_or(0);
            }
        }
    }
    COUNTERS
        .iter()
        .zip(sums)
        .map(|(name, n)| format!("{name} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How the load is spread over processes where one process may hold `limit` descriptors.
#[derive(Debug, PartialEq)]
struct Spread {
    /// HAProxy processes, and each one's `maxconn`.
    balancers: usize,
    max_connections: u32,
    /// Load-tool processes (1: the daemons run in this one).
    load_processes: usize,
}

/// Descriptors a process keeps for what is not a session (its database pool, listeners, logs, health checks).
const SPARE_DESCRIPTORS: usize = 1_000;

/// The spread of `n` sessions over `gateways` gateways: one descriptor per session in the load tool and in the
/// gateway holding it, two in HAProxy. Err says why it does not fit and what would.
fn spread_for(n: usize, gateways: usize, limit: usize) -> Result<Spread, String> {
    let room = limit.saturating_sub(SPARE_DESCRIPTORS);
    // HAProxy's least-connections choice is per HAProxy process; the kernel spreads connections over the processes
    // by a hash, so a gateway may get a few percent more than its share.
    let per_gateway = n.div_ceil(gateways.max(1)) * 21 / 20;
    if per_gateway > room {
        return Err(format!(
            "{n} sessions over {gateways} gateways need about {per_gateway} descriptors in each gateway, but a \
             process here may open {limit} (RLIMIT_NOFILE's hard limit; raising it needs CAP_SYS_RESOURCE): give \
             BC_SESSIONS_GATEWAYS={} or more",
            (n * 21 / 20).div_ceil(room.max(1))
        ));
    }
    let (balancers, max_connections) = if 2 * (n + 200) <= room {
        (1, n + 200)
    } else {
        // The kernel's hash spreads connections over the HAProxy processes unevenly: keep 15% headroom.
        let each = room / 2;
        ((n * 23 / 20).div_ceil(each.max(1)), each)
    };
    Ok(Spread {
        balancers,
        max_connections: u32::try_from(max_connections).map_err(|e| e.to_string())?,
        load_processes: if n + 200 <= room {
            1
        } else {
            n.div_ceil(room.max(1) * 9 / 10)
        },
    })
}

/// Threads for each of `processes` processes sharing this machine's cores: the knob `var`, by default the cores
/// shared out over them (at least 1); 0: the program's own default, a thread per core in every process (None).
fn cores_share(var: &str, processes: usize) -> anyhow::Result<Option<usize>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let shared = (cores / processes.max(1)).max(1);
    Ok(match bc_bench::knob(var, shared, 0)? {
        0 => None,
        n => Some(n),
    })
}

/// Worker threads of each `better-compute serve` of the lab: `BC_SESSIONS_SERVE_THREADS` ([`cores_share`] over the
/// gateways: 4 gateways on 2 cores run one each, as an operator running several gateways on one machine would set
/// them; 0: a thread per core in every process, 8 gateway threads on 2 cores with 4 gateways: about 4% more CPU per
/// reconnect in the storm, BENCHMARKS.md, stop 50).
fn serve_threads(gateways: usize) -> anyhow::Result<Option<usize>> {
    cores_share("BC_SESSIONS_SERVE_THREADS", gateways)
}

/// Threads of each HAProxy process of the lab (`nbthread`): `BC_SESSIONS_BALANCER_THREADS` ([`cores_share`] over the
/// HAProxy processes: the 7 a 50,000-session run needs on 2 cores run one each; 0: HAProxy's default, a thread per
/// core in every process, about 11% more HAProxy CPU per reconnect in the storm, BENCHMARKS.md, stop 51).
fn balancer_threads(balancers: usize) -> anyhow::Result<Option<usize>> {
    cores_share("BC_SESSIONS_BALANCER_THREADS", balancers)
}

pub async fn run(n: usize, gateways: usize, bin: &Path) -> anyhow::Result<()> {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let limit = nofile_limit()?;
    let spread_plan = spread_for(n, gateways, limit).map_err(anyhow::Error::msg)?;
    let threads = serve_threads(gateways)?;
    let balancer_threads = balancer_threads(spread_plan.balancers)?;
    let per_core = |t: Option<usize>| t.map_or("one per core".to_string(), |t| t.to_string());
    println!(
        "sessions over {gateways} gateways behind HAProxy: {n} sessions; load {}; a process may hold {limit} \
         descriptors: {} HAProxy processes (maxconn {} each, threads {}), {} load-tool processes; worker threads per \
         better-compute process: {}",
        load.trim(),
        spread_plan.balancers,
        spread_plan.max_connections,
        per_core(balancer_threads),
        spread_plan.load_processes,
        per_core(threads),
    );
    let bins = Binaries::beside(&bin.join("bcd")).map_err(anyhow::Error::msg)?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    if std::env::var_os("BC_SESSIONS_KEEP").is_some() {
        println!("BC_SESSIONS_KEEP: the lab's logs stay in {}", dir.display());
    }
    let db = BenchDb::start(dir, Durability::Durable, &["max_connections=300"], 4).await?;
    let (url, key) = (db.url.clone(), db.admin_key.clone());
    let mut spec = LabSpec::new(&url, &dir.join("lab"));
    std::fs::create_dir_all(&spec.dir)?;
    spec.gateways = gateways;
    spec.balancer_ports = BALANCER_PORTS;
    spec.balancers = spread_plan.balancers;
    spec.max_connections = spread_plan.max_connections;
    spec.worker_threads = threads;
    spec.balancer_threads = balancer_threads;
    // BC_SESSIONS_PROXY_PROTOCOL=0: HAProxy sends no header, and the gateways account every node as the balancer.
    spec.proxy_protocol = std::env::var("BC_SESSIONS_PROXY_PROTOCOL").map_or(true, |v| v != "0");
    let mut lab = tokio::task::spawn_blocking({
        let (bins, spec) = (bins.clone(), spec.clone());
        move || GatewayLab::start(&bins, &spec)
    })
    .await?
    .map_err(anyhow::Error::msg)?;
    let admin = bc_control::client::ApiClient::new(&lab.api_url, &key);
    let token = admin
        .call(
            "join-tokens",
            "create",
            serde_json::json!({"pool": "default", "uses": n + 1, "ttl_seconds": 3600}),
        )
        .await?;
    let token = token["token"].as_str().context("token")?.to_string();
    let config = bcd::config::ConfigWire {
        gateway_url: Some(lab.balancer_url.clone()),
        ca_pin: Some(lab.ca_pin.clone()),
        join_public_key: Some(lab.join_public_key.clone()),
        state_dir: Some(dir.join("bcd")),
        gpu_backend: Some("none".into()),
        hardware_root: None,
        cdi_dir: None,
        tunnels: None,
    }
    .validate("bench")?;
    let creds = join_all(&config, &token, n).await?;
    let ca_pem = std::fs::read_to_string(lab.state_dir.join("ca.crt"))?;
    let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes())?;
    let base = gateways_rss(&lab);
    let base_rate = commit_rate(&url, 10).await?;
    println!(
        "{gateways} gateways' RSS with 0 sessions: {:.1} MiB; database commits/s (all processes): {base_rate:.1}",
        base as f64 / 1024.0
    );

    let mut fleet = match spread_plan.load_processes {
        1 => Fleet::new(ca),
        k => Fleet::in_processes(ca, &ca_pem, &creds, &lab.balancer_urls, k, dir)?,
    };
    let mut figures = Vec::new();
    let mut steps = vec![1_000.min(n), 10_000.min(n), n];
    steps.dedup();
    for step in steps {
        let t0 = Instant::now();
        let urls = &lab.balancer_urls;
        let daemon_url = |i: usize| urls[i % urls.len()].clone();
        fleet
            .grow(&creds, step, daemon_url, Duration::from_secs(600))
            .await;
        let up_after = t0.elapsed();
        let up = fleet.up();
        // The connect burst's commits land in pg_stat_database up to a while later; let the gateways settle.
        tokio::time::sleep(Duration::from_secs(30)).await;
        let rss = gateways_rss(&lab);
        let per = rss.saturating_sub(base) as f64 / up.max(1) as f64;
        let cpu0 = Cpu::now(&lab, &fleet.pids());
        let statements0 = statements_reset(&url);
        let rate = commit_rate(&url, 20).await?;
        let statements = statements0.and_then(|w0| statements_since(&url, w0));
        let cpu1 = Cpu::now(&lab, &fleet.pids());
        println!(
            "{up} idle sessions, CPU per session and second over 20 s: {}",
            cpu0.per(&cpu1, up * 20),
        );
        match statements {
            Ok(lines) => {
                println!("the database over those 20 s, by statement (most time first):");
                for l in lines {
                    println!("  {l}");
                }
            }
            Err(e) => println!("the database over those 20 s, by statement: not measured ({e:#})"),
        }
        println!(
            "{up} sessions up in {:.1} s: gateways' RSS {:.1} MiB ({}), {per:.1} KiB per session; database commits/s, \
             every process and autovacuum: {rate:.1}; online by gateway: {}",
            up_after.as_secs_f64(),
            rss as f64 / 1024.0,
            lab.gateways
                .iter()
                .map(|g| format!("{} {:.1} MiB", g.id, rss_kib(g.pid) as f64 / 1024.0))
                .collect::<Vec<_>>()
                .join(", "),
            spread(&url)?,
        );
        println!("up to {up} sessions and idle: {}", fleet.reasons());
        figures.push((up, per, rate));
        if up < step {
            bail!("only {up} of {step} sessions came up within 600 s");
        }
    }

    // Reconnect storm: every gateway killed and started again on its address.
    let epochs_before = query_i64(&url, "SELECT coalesce(sum(session_epoch), 0) FROM nodes")?;
    // CPU of each part over the storm (the gateways: their new processes, from zero).
    let storm_cpu0 = Cpu {
        gateways: 0.0,
        ..Cpu::now(&lab, &fleet.pids())
    };
    let statements0 = statements_reset(&url);
    let t0 = Instant::now();
    for i in 0..lab.gateways.len() {
        lab.kill_gateway(i);
    }
    fleet.drain(Duration::from_secs(30)).await;
    let down_after = t0.elapsed();
    lab = tokio::task::spawn_blocking({
        let bins = bins.clone();
        move || -> Result<GatewayLab, String> {
            let all: Vec<usize> = (0..lab.gateways.len()).collect();
            lab.restart_gateways(&bins, &all)?;
            Ok(lab)
        }
    })
    .await?
    .map_err(anyhow::Error::msg)?;
    let restart = t0.elapsed();
    let (back, p99, all) = fleet.storm_back(Duration::from_secs(180), t0).await;
    println!("storm: {}", fleet.reasons());
    println!(
        "the gateways' connection policy closed, from the start (their logs): {}",
        policy_closed(&spec.dir)
    );
    println!(
        "storm CPU per reconnect, from the kill until the last came back: {}",
        storm_cpu0.per(&Cpu::now(&lab, &fleet.pids()), back)
    );
    match statements0.and_then(|u0| statements_since(&url, u0)) {
        Ok(lines) => {
            println!(
                "the database over the storm, by statement (pg_stat_statements; most time first):"
            );
            for l in lines {
                println!("  {l}");
            }
        }
        Err(e) => println!("the database over the storm, by statement: not measured ({e:#})"),
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let online = query_i64(&url, "SELECT count(*) FROM nodes WHERE online")?;
    let epochs_after = query_i64(&url, "SELECT coalesce(sum(session_epoch), 0) FROM nodes")?;
    let twice = query_i64(&url, "SELECT count(*) FROM nodes WHERE session_epoch > 2")?;
    let fmt = |d: Option<Duration>| {
        d.map(|d| format!("{:.1} s", d.as_secs_f64()))
            .unwrap_or_else(|| "not reached".into())
    };
    println!(
        "reconnect storm: sessions down in {:.1} s, every gateway serving again {:.1} s after the kill; {back} of {n} \
         sessions back; 99% at {}, 100% at {} (goal: 99% within 60 s; 99% at {} after the gateways served again); \
         online {online}, by gateway: {}; \
         session epochs +{} (one reconnect per node: +{n}); nodes past their second session: {twice}",
        down_after.as_secs_f64(),
        restart.as_secs_f64(),
        fmt(p99),
        fmt(all),
        fmt(p99.map(|d| d.saturating_sub(restart))),
        spread(&url)?,
        epochs_after - epochs_before,
    );
    // BC_SESSIONS_ROLLING=0: stop after the storm (an A/B of the storm alone).
    let rolled = match gateways {
        _ if std::env::var("BC_SESSIONS_ROLLING").is_ok_and(|v| v == "0") => {
            Err("BC_SESSIONS_ROLLING=0".to_string())
        }
        1 => Err("one gateway: nowhere for its sessions to go".to_string()),
        g => spread_for(n, g - 1, limit)
            .map(|_| ())
            .map_err(|why| format!("while one gateway is down, {why}")),
    };
    let rolled = match rolled {
        Ok(()) => {
            let (back, worst) = rolling_restart(lab, &mut fleet, &bins, &url).await?;
            lab = back;
            Some(worst)
        }
        Err(why) => {
            println!("rolling restart: not run: {why}");
            None
        }
    };
    fleet.stop();
    drop(lab);
    if std::env::var_os("BC_SESSIONS_KEEP").is_some() {
        std::mem::forget(tmp);
    }
    for (up, per, rate) in &figures {
        println!(
            "sessions-{up} ({gateways} gateways): {per:.1} KiB/session, {rate:.1} database commits/s"
        );
    }
    let (up, per, _) = figures.last().copied().unwrap_or((0, 0.0, 0.0));
    println!("sessions-storm: 99% back at {} of {n}", fmt(p99));
    println!("sessions-rss: {per:.1} KiB/session at {up} sessions over {gateways} gateways");
    if let Some((exit, back)) = rolled {
        println!(
            "sessions-rolling: each gateway exited within {:.1} s of SIGTERM, every session back within {} of it",
            exit.as_secs_f64(),
            fmt(back)
        );
    }
    Ok(())
}

/// How long a stopped gateway may take to exit: the control plane's stop grace (10 s) with room.
const GATEWAY_STOP: Duration = Duration::from_secs(30);

/// How long the sessions of a stopped gateway may take to be up again on the others.
const MOVED_BACK: Duration = Duration::from_secs(120);

/// A rolling restart, as an upgrade does it: each gateway in turn stopped (SIGTERM) and started again at once, its
/// sessions moving to the others through the balancer. Prints, per gateway, how long it took to exit, how many
/// sessions it held and when every session was up again, and what the database did meanwhile. Returns the lab and
/// the slowest exit and return (None: not every session came back).
async fn rolling_restart(
    mut lab: GatewayLab,
    fleet: &mut Fleet,
    bins: &Binaries,
    url: &str,
) -> anyhow::Result<(GatewayLab, (Duration, Option<Duration>))> {
    let (mut slowest_exit, mut slowest_back) = (Duration::ZERO, Some(Duration::ZERO));
    for i in 0..lab.gateways.len() {
        let id = lab.gateways[i].id.clone();
        let held = query_i64(
            url,
            &format!("SELECT count(*) FROM nodes WHERE online AND gateway_id = '{id}'"),
        )?;
        let epochs0 = query_i64(url, "SELECT coalesce(sum(session_epoch), 0) FROM nodes")?;
        let offline0 = query_i64(url, OFFLINE_RECORDED)?;
        let statements0 = statements_reset(url);
        let t0 = Instant::now();
        let bins = bins.clone();
        let job = tokio::task::spawn_blocking(move || {
            let stopped = lab.stop_gateway(i, GATEWAY_STOP);
            let restarted = lab.restart_gateway(&bins, i);
            (lab, stopped, restarted)
        });
        let moved = fleet.while_moving(job, t0, MOVED_BACK).await;
        let (back, stopped, restarted) = moved.out?;
        lab = back;
        restarted.map_err(anyhow::Error::msg)?;
        let (exit, took) = match stopped {
            Ok((status, took)) => (status.to_string(), took),
            Err(killed) => (killed, GATEWAY_STOP),
        };
        slowest_exit = slowest_exit.max(took);
        slowest_back = slowest_back.zip(moved.all_back).map(|(a, b)| a.max(b));
        println!(
            "rolling restart, {id} (held {held} sessions): exited ({exit}) {:.2} s after SIGTERM; {} sessions ended; \
             every session up again {} after the SIGTERM; node.offline recorded {}; session epochs +{}; online by \
             gateway: {}; {}",
            took.as_secs_f64(),
            moved.downs,
            moved
                .all_back
                .map_or("never".into(), |d| format!("{:.2} s", d.as_secs_f64())),
            query_i64(url, OFFLINE_RECORDED)? - offline0,
            query_i64(url, "SELECT coalesce(sum(session_epoch), 0) FROM nodes")? - epochs0,
            spread(url)?,
            fleet.reasons(),
        );
        match statements0.and_then(|u0| statements_since(url, u0)) {
            Ok(lines) => lines.iter().for_each(|l| println!("  {l}")),
            Err(e) => println!("  the database meanwhile, by statement: not measured ({e:#})"),
        }
    }
    Ok((lab, (slowest_exit, slowest_back)))
}

/// The `node.offline` audit rows: a session's close as its gateway recorded it.
const OFFLINE_RECORDED: &str =
    "SELECT count(*) FROM audit_events WHERE action = 'node.offline' AND actor = 'gateway'";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_counters_are_summed_over_every_gateway_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let line = |e: u64, s: u64| {
            format!(
                "2026-12-04T15:21:10Z  WARN bc_gateway::accept: gateway closed stalled or unauthenticated connections \
                 in the last 10 s expired={e} shed_at_cap=0 shed_per_source={s} shed_for_descriptors=0 refused=1 \
                 open=15278 stalled=44 busy=0 pressure=\"0.87\"\n"
            )
        };
        std::fs::write(dir.path().join("gw0.log"), line(3, 98) + &line(4, 0)).expect("gw0");
        std::fs::write(dir.path().join("gw0-restarted.log"), line(10, 2)).expect("gw0 again");
        std::fs::write(dir.path().join("haproxy.log"), line(1000, 1000)).expect("not a gateway's");
        assert_eq!(
            policy_closed(dir.path()),
            "expired 17, shed_at_cap 0, shed_per_source 100, shed_for_descriptors 0, refused 3"
        );
    }

    #[test]
    fn the_load_is_spread_over_processes_only_where_one_may_not_hold_it() {
        // 9,000 sessions over two gateways fit one HAProxy and one load tool under 20,000 descriptors.
        assert_eq!(
            spread_for(9_000, 2, 20_000),
            Ok(Spread {
                balancers: 1,
                max_connections: 9_200,
                load_processes: 1
            })
        );
        // 50,000 do not fit two gateways, and the refusal names the fewest that fit.
        let e = spread_for(50_000, 2, 20_000).expect_err("too many for two gateways");
        assert!(e.contains("BC_SESSIONS_GATEWAYS=3 or more"), "{e}");
        let s = spread_for(50_000, 4, 20_000).expect("four gateways");
        assert_eq!(s.max_connections, 9_500);
        // 57,500 connections' room (15% over 50,000) in HAProxy processes of 9,500 each; 50,000 daemons in load
        // processes of 17,100 each.
        assert_eq!((s.balancers, s.load_processes), (7, 3));
        assert!(s.balancers * s.max_connections as usize >= 50_000 * 23 / 20);
    }
}
