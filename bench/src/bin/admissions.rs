//! `scripts/bench admissions`: reservation admission throughput and latency with 10,000 nodes × 8 GPUs in the
//! store, two API processes and one scheduler process (real `better-compute serve` processes) on one embedded
//! PostgreSQL. Phase 1 saturates (256 concurrent clients); phase 2 offers 1,000 admissions/s open-loop and reports
//! latency percentiles. Statements per admission come from pg_stat_statements (BEGIN/COMMIT included).
//! The database is fresh: nothing analyzes it after the warm-up, so the reservation tables were empty when every
//! statement was prepared (the control plane's own statistics check must cope); the fleet is analyzed after seeding,
//! as an existing fleet would be, unless `BC_SEED_ANALYZE=0`. `BC_EXPERIMENT_DB_SET` applies `ALTER DATABASE …
//! SET` clauses (separated by `;`) before the processes start (e.g. `plan_cache_mode = force_custom_plan`), for
//! experiments.
//! There is no peer in the same run: the issue sets absolute targets (≥ 1,000/s, p99 < 25 ms).

use anyhow::Context as _;
use bc_bench::{cpu_s, machine_cpu_s, percentile_ms, pg_pids};
use bc_store::embedded::{Durability, EmbeddedPostgres};
use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const NODES: i32 = 10_000;
const GPUS: i32 = 8;
/// Clients in the saturated phase: 256, or `BC_ADMISSIONS_CLIENTS`. A ceiling needs a load that keeps the machine
/// busy: with 64 clients each waits on its own admission's round trips, and the machine sat idle between them (a
/// sixth of both cores on the 2-core machine, 13 of 16 cores on a 16-core one), so the figure was the clients'
/// latency, not the system's ceiling. The CPU line's machine idle time says whether a run saturated.
fn clients() -> anyhow::Result<usize> {
    bc_bench::knob("BC_ADMISSIONS_CLIENTS", 256, 1)
}
const SATURATED: Duration = Duration::from_secs(10);
/// The paced phase's offered rate: 1,000/s (the reservations issue's figure), or `BC_ADMISSIONS_PACED_RATE`
/// (issue 18 asks for p99 at 2,000/s).
fn paced_rate() -> anyhow::Result<f64> {
    bc_bench::knob("BC_ADMISSIONS_PACED_RATE", 1000.0, 1.0)
}
const PACED: Duration = Duration::from_secs(10);
/// Admissions of one client before the measured phases.
const WARM_UP: usize = 2_000;

struct Serve(Child);

/// CPU seconds per part: (api1, api2, scheduler, postgres, this load generator), then the machine's busy and idle
/// seconds (every core, every process).
fn cpu_parts(pids: &[u32; 3], data: &std::path::Path) -> [f64; 7] {
    let (busy, idle) = machine_cpu_s();
    [
        cpu_s(pids[0]),
        cpu_s(pids[1]),
        cpu_s(pids[2]),
        pg_pids(data).into_iter().map(cpu_s).sum(),
        cpu_s(std::process::id()),
        busy,
        idle,
    ]
}

fn print_cpu(label: &str, before: [f64; 7], after: [f64; 7], n: usize) {
    let per = |i: usize| (after[i] - before[i]) * 1e6 / n.max(1) as f64;
    let names = ["api1", "api2", "scheduler", "postgres", "load generator"];
    let parts: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| format!("{name} {:.0} µs", per(i)))
        .collect();
    println!(
        "  CPU per admission ({label}): {}; the machine (every core, every process) {:.0} µs busy and {:.0} µs idle",
        parts.join(", "),
        per(5),
        per(6)
    );
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(
    bin: &std::path::Path,
    dir: &std::path::Path,
    name: &str,
    url: &str,
    roles: &str,
) -> anyhow::Result<(Serve, Option<String>)> {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "state_dir = {:?}\ndatabase_url = {url:?}\nroles = {roles:?}\napi_listen = \"127.0.0.1:0\"\n\
             gateway_listen = \"127.0.0.1:0\"\n\
             # Three processes on one machine: telemetry's default /metrics address fits one of them.\n\
             [telemetry]\nmetrics_listen = \"off\"\n",
            dir.join(name)
        ),
    )?;
    let mut child = Command::new(bin.join("better-compute"))
        .args(["serve", "--no-migrate", "--config"])
        .arg(&cfg)
        .env("BC_LOG", "warn,sqlx=error")
        .stdout(Stdio::piped())
        .spawn()
        .context("spawning better-compute serve")?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut api = None;
    for line in lines.by_ref() {
        let line = line?;
        if let Some(rest) = line.strip_prefix("serving: api=") {
            let a = rest.split_whitespace().next().unwrap_or("-");
            if a != "-" {
                api = Some(format!("http://{a}/api/compute/reservations/create"));
            }
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Ok((Serve(child), api))
}

async fn admit(http: &reqwest::Client, url: &str, key: &str, i: usize) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let r = http
        .post(url)
        .bearer_auth(key)
        .json(&serde_json::json!({"tenant": "root", "gpus": 1, "duration_s": 3600, "idempotency_key": format!("b{i}")}))
        .send()
        .await?;
    let status = r.status();
    let body: serde_json::Value = r.json().await?;
    if !status.is_success() || body["reservation"]["state"] != "placed" {
        anyhow::bail!("admission {i} failed: {status} {body}");
    }
    Ok(t.elapsed())
}

async fn statements(pool: &bc_store::sqlx::PgPool) -> anyhow::Result<i64> {
    Ok(bc_store::sqlx::query_scalar(
        "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname = current_database() AND s.query NOT ILIKE '%pg_stat_statements%'",
    )
    .fetch_one(pool)
    .await?)
}

/// The statements that took the most execution time since the last reset, per admission, and the sum over every
/// statement. Planning time counts only where `pg_stat_statements.track_planning` is on (off by default;
/// `BC_EXPERIMENT_DB_SET='pg_stat_statements.track_planning = on'`).
async fn top_statements(pool: &bc_store::sqlx::PgPool, admissions: usize) -> anyhow::Result<()> {
    let top: Vec<(String, i64, f64, f64, i64, i64)> = bc_store::sqlx::query_as(
        "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 60), calls, total_exec_time, total_plan_time, rows, \
         shared_blks_hit FROM pg_stat_statements s \
         JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = current_database() \
         AND s.query NOT ILIKE '%pg_stat_statements%' ORDER BY total_exec_time + total_plan_time DESC",
    )
    .fetch_all(pool)
    .await?;
    let per_admission = |ms: f64| ms * 1000.0 / admissions.max(1) as f64;
    let (exec, plan): (f64, f64) = top.iter().fold((0.0, 0.0), |(e, p), t| (e + t.2, p + t.3));
    println!(
        "  statements: {:.0} µs executing and {:.0} µs planning per admission, {} distinct",
        per_admission(exec),
        per_admission(plan),
        top.len()
    );
    for (q, calls, ms, plan_ms, rows, blks) in top.into_iter().take(5) {
        let per = calls.max(1) as f64;
        println!(
            "  {:>6.0} µs/admission ({:>3.0} planning) {:>6} calls {:>6.2} ms/call {:>5.1} rows/call {:>6.0} buffers/call  {q}",
            per_admission(ms + plan_ms),
            per_admission(plan_ms),
            calls,
            (ms + plan_ms) / per,
            rows as f64 / per,
            blks as f64 / per
        );
    }
    Ok(())
}

/// PostgreSQL's WAL so far (`pg_stat_wal`): records, full-page images, bytes, syncs.
async fn wal(pool: &bc_store::sqlx::PgPool) -> anyhow::Result<[i64; 4]> {
    let (records, fpi, bytes, syncs): (i64, i64, i64, i64) = bc_store::sqlx::query_as(
        "SELECT wal_records, wal_fpi, wal_bytes::bigint, wal_sync FROM pg_stat_wal",
    )
    .fetch_one(pool)
    .await?;
    Ok([records, fpi, bytes, syncs])
}

fn print_wal(before: [i64; 4], after: [i64; 4], n: usize) {
    let per = |i: usize| (after[i] - before[i]) as f64 / n.max(1) as f64;
    println!(
        "  WAL per admission: {:.1} records, {:.2} full-page images, {:.0} bytes; {:.2} WAL syncs per admission",
        per(0),
        per(1),
        per(2),
        per(3)
    );
}

/// Who analyzed the hot tables so far (the control plane's statistics check, or autovacuum) and the planner's row
/// estimate against the live rows.
async fn print_analyzes(pool: &bc_store::sqlx::PgPool, when: &str) -> anyhow::Result<()> {
    let rows: Vec<(String, i64, i64, f32, i64)> = bc_store::sqlx::query_as(
        "SELECT s.relname::text, s.analyze_count, s.autoanalyze_count, c.reltuples, s.n_live_tup \
         FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
         WHERE s.relname IN ('reservations', 'idempotency', 'work_queue', 'outbox') ORDER BY 1",
    )
    .fetch_all(pool)
    .await?;
    let parts: Vec<String> = rows
        .iter()
        .map(|(t, a, auto, est, live)| {
            format!("{t} {a} ANALYZE + {auto} auto (estimate {est:.0}, live {live})")
        })
        .collect();
    println!("statistics {when}: {}", parts.join("; "));
    Ok(())
}

fn main() -> anyhow::Result<()> {
    bc_bench::runtime()?.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    let (concurrency, rate) = (clients()?, paced_rate()?);
    let bin =
        PathBuf::from(std::env::var("BC_BIN_DIR").unwrap_or_else(|_| "target/release".into()));
    let dir = tempfile::tempdir()?;
    let pg = EmbeddedPostgres::start(&dir.path().join("pg"), Durability::Durable)?;
    let url = pg.url("postgres");
    let pool = pg.pool("postgres", 8).await?;
    bc_control::migrate(&bc_store::Store::new(pool.clone())).await?;
    let t = Instant::now();
    bc_store::testing::seed_gpu_nodes(&pool, "gpu", "n", NODES, GPUS, "NVIDIA H100 80GB HBM3")
        .await?;
    // An existing fleet: its nodes and devices have statistics (autoanalyze saw them arrive). BC_SEED_ANALYZE=0
    // skips it: a database whose fleet was loaded moments before the processes started.
    let seed_analyze = std::env::var("BC_SEED_ANALYZE").as_deref() != Ok("0");
    if seed_analyze {
        bc_store::sqlx::query("ANALYZE").execute(&pool).await?;
    }
    println!(
        "store: {NODES} adopted nodes × {GPUS} GPUs seeded in {:.1} s (durable commits: fsync on); ANALYZE after \
         seeding: {}; no ANALYZE after warm-up (reservations, idempotency, work_queue, outbox start empty)",
        t.elapsed().as_secs_f64(),
        if seed_analyze {
            "yes"
        } else {
            "no (BC_SEED_ANALYZE=0)"
        }
    );
    print_analyzes(&pool, "after seeding").await?;
    let store = bc_store::Store::new(pool.clone());
    let key = bc_control::bootstrap_admin(&store).await?;
    bc_store::sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .context("pg_stat_statements (needs shared_preload_libraries)")?;

    // Several clauses are separated by `;`.
    for set in std::env::var("BC_EXPERIMENT_DB_SET")
        .unwrap_or_default()
        .split(';')
    {
        let set = set.trim();
        if set.is_empty() {
            continue;
        }
        bc_store::sqlx::query(bc_store::sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE postgres SET {set}"
        )))
        .execute(&pool)
        .await?;
        println!("experiment: ALTER DATABASE postgres SET {set}");
    }
    let (a1, u1) = serve(&bin, dir.path(), "api1", &url, "api")?;
    let (a2, u2) = serve(&bin, dir.path(), "api2", &url, "api")?;
    let (sc, _) = serve(&bin, dir.path(), "sched", &url, "scheduler")?;
    let pids = [a1.0.id(), a2.0.id(), sc.0.id()];
    let pg_data = dir.path().join("pg").join("data");
    let urls = Arc::new([u1.context("api1 address")?, u2.context("api2 address")?]);
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    println!(
        "processes: 2 × `serve --roles api`, 1 × `serve --roles scheduler`, PostgreSQL 15; {cores} cores shared by all"
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    // Warm up: caches (principals, capacity), connections, plans.
    let next = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let mut lat = Vec::with_capacity(WARM_UP);
    let mut c0 = None;
    for i in 0..WARM_UP {
        if i == WARM_UP / 2 {
            c0 = Some(cpu_parts(&pids, &pg_data));
        }
        lat.push(admit(&http, &urls[i % 2], &key, i).await?);
    }
    let c1 = cpu_parts(&pids, &pg_data);
    lat.sort();
    println!(
        "warm-up (1 client, the database's first admissions): {WARM_UP} in {:.1} s, p50 {:.1} ms, p99 {:.1} ms",
        t.elapsed().as_secs_f64(),
        percentile_ms(&lat, 0.50),
        percentile_ms(&lat, 0.99)
    );
    // One admission at a time, nothing queued behind it: the CPU each part spends on one admission, without the
    // contention of the loaded phases (the first half is left out: it prepares every statement).
    if let Some(c0) = c0 {
        print_cpu(
            "one client, the warm-up's second half",
            c0,
            c1,
            WARM_UP - WARM_UP / 2,
        );
    }
    next.store(WARM_UP, Ordering::SeqCst);
    // No ANALYZE here: the system must hold its plans on tables that were empty when its statements were prepared.
    print_analyzes(&pool, "after warm-up").await?;

    // Phase 1: saturated (BC_ADMISSIONS_SATURATED=0 skips it: the paced phase then runs on the database as the
    // warm-up left it, the "fresh database").
    let saturated = std::env::var("BC_ADMISSIONS_SATURATED").map_or(true, |v| v != "0");
    let (sat_rate, saturated_n) = if saturated {
        bc_store::sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&pool)
            .await?;
        let s0 = statements(&pool).await?;
        let w0 = wal(&pool).await?;
        let c0 = cpu_parts(&pids, &pg_data);
        // Each admission books one GPU: the saturated phase stops early rather than take GPUs the paced phase needs
        // (a fast machine admits more than the fleet holds in SATURATED); its rate is over the time it ran.
        let paced_total = (rate * PACED.as_secs_f64()) as usize;
        let capacity = usize::try_from(NODES * GPUS)?;
        let budget = capacity.saturating_sub(paced_total + 1_000);
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..concurrency {
            let (http, urls, key, next) = (http.clone(), urls.clone(), key.clone(), next.clone());
            tasks.spawn(async move {
                let mut lat = Vec::new();
                while t0.elapsed() < SATURATED {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= budget {
                        break;
                    }
                    lat.push(admit(&http, &urls[i % 2], &key, i).await?);
                }
                anyhow::Ok(lat)
            });
        }
        let mut lat = Vec::new();
        while let Some(r) = tasks.join_next().await {
            lat.extend(r??);
        }
        let wall = t0.elapsed();
        let stmts = statements(&pool).await? - s0;
        lat.sort();
        let sat_rate = lat.len() as f64 / wall.as_secs_f64();
        println!(
            "saturated ({concurrency} clients, {:.1} s): {} admissions, {:.0}/s, p50 {:.1} ms, p99 {:.1} ms, {:.2} statements/admission",
            wall.as_secs_f64(),
            lat.len(),
            sat_rate,
            percentile_ms(&lat, 0.50),
            percentile_ms(&lat, 0.99),
            stmts as f64 / lat.len() as f64
        );
        print_cpu("saturated", c0, cpu_parts(&pids, &pg_data), lat.len());
        print_wal(w0, wal(&pool).await?, lat.len());
        top_statements(&pool, lat.len()).await?;
        (sat_rate, lat.len())
    } else {
        println!("saturated phase skipped (BC_ADMISSIONS_SATURATED=0)");
        (0.0, 0)
    };

    // Phase 2: paced, open loop.
    bc_store::sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(&pool)
        .await?;
    let s0 = statements(&pool).await?;
    let w0 = wal(&pool).await?;
    let c0 = cpu_parts(&pids, &pg_data);
    let total = (rate * PACED.as_secs_f64()) as usize;
    let t0 = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..total {
        let at = t0 + Duration::from_secs_f64(k as f64 / rate);
        tokio::time::sleep_until(at).await;
        let (http, urls, key) = (http.clone(), urls.clone(), key.clone());
        let i = next.fetch_add(1, Ordering::SeqCst);
        tasks.spawn(async move { admit(&http, &urls[i % 2], &key, i).await });
    }
    let mut lat = Vec::new();
    while let Some(r) = tasks.join_next().await {
        lat.push(r??);
    }
    let wall = t0.elapsed();
    let stmts = statements(&pool).await? - s0;
    lat.sort();
    let p99 = percentile_ms(&lat, 0.99);
    println!(
        "paced ({rate:.0}/s offered, {} admissions): done in {:.1} s = {:.0}/s, p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms, {:.2} statements/admission",
        lat.len(),
        wall.as_secs_f64(),
        lat.len() as f64 / wall.as_secs_f64(),
        percentile_ms(&lat, 0.50),
        percentile_ms(&lat, 0.90),
        p99,
        percentile_ms(&lat, 1.0),
        stmts as f64 / lat.len() as f64
    );
    print_cpu("paced", c0, cpu_parts(&pids, &pg_data), lat.len());
    print_wal(w0, wal(&pool).await?, lat.len());
    top_statements(&pool, lat.len()).await?;
    let booked: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL",
    )
    .fetch_one(&pool)
    .await?;
    // Every admission answered (warm-up, saturated, paced), not the indices handed out: a saturated client that
    // stopped at the budget took one it did not use.
    let admitted = WARM_UP + saturated_n + lat.len();
    anyhow::ensure!(
        booked as usize == admitted,
        "{booked} devices booked for {admitted} admissions"
    );
    println!("check: {booked} GPUs booked for {admitted} admissions, none twice");
    print_analyzes(&pool, "at the end").await?;
    if saturated {
        println!("admissions: {sat_rate:.0} admissions/s (paced {rate:.0}/s p99 {p99:.1} ms)");
    } else {
        println!("admissions: saturated phase skipped (paced {rate:.0}/s p99 {p99:.1} ms)");
    }
    Ok(())
}
