//! Phase 0 of `scripts/bench instances` (included by instances.rs): instance admissions on a hosted pool of
//! 1,000 `vps-host` nodes (64 vCPUs, 256 GiB, 2 TiB each, as their inventory sections advertise), through a real
//! control plane (`bc_control::start`, api + scheduler roles, in this process) on an embedded PostgreSQL with
//! durable commits. Saturated: 64 concurrent clients for 10 s; then 500 admissions/s offered open-loop for 10 s,
//! latency percentiles. Every admission is placed (tx 1 + tx 2 in the call) or the phase fails. No peer in the
//! same run: the issue sets absolute targets (≥ 1,000/s saturated, p99 < 25 ms at 500/s).

use bc_bench::percentile_ms;
use bc_store::embedded::{Durability, EmbeddedPostgres};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const HOSTS: i32 = 1_000;
const CONCURRENCY: usize = 64;
const SATURATED: Duration = Duration::from_secs(10);
const PACED_RATE: f64 = 500.0;
const PACED: Duration = Duration::from_secs(10);

async fn admit(http: &reqwest::Client, url: &str, key: &str, i: usize) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let r = http
        .post(url)
        .bearer_auth(key)
        .json(&serde_json::json!({"tenant": "root", "pool": "vps", "vcpus": 1, "memory_mib": 512, "disk_gib": 1,
            "image": {"url": "http://127.0.0.1:9/x.qcow2", "sha256": "0".repeat(64)},
            "idempotency_key": format!("b{i}")}))
        .send()
        .await?;
    let status = r.status();
    let body: serde_json::Value = r.json().await?;
    if !status.is_success() || body["instance"]["state"] != "placed" {
        anyhow::bail!("admission {i} failed: {status} {body}");
    }
    Ok(t.elapsed())
}

/// Runs the phase and prints its figures; returns (saturated admissions/s, p99 ms at the paced rate).
pub async fn hosted_admissions() -> anyhow::Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let pg = EmbeddedPostgres::start(&dir.path().join("pg"), Durability::Durable)?;
    let pool = pg.pool("postgres", 8).await?;
    bc_control::migrate(&bc_store::Store::new(pool.clone())).await?;
    bc_store::testing::seed_gpu_nodes(&pool, "vps", "h", HOSTS, 0, "none").await?;
    bc_store::sqlx::query(
        "INSERT INTO inventory_sections (node_id, name, hash, payload) \
         SELECT n.id, s.name, md5(s.name), s.payload FROM nodes n, (VALUES \
           ('cpu', '{\"threads\": 64}'::jsonb), \
           ('memory', '{\"total_bytes\": 274877906944}'::jsonb), \
           ('disks', '{\"disks\": [{\"name\": \"nvme0n1\", \"size_bytes\": 2199023255552, \"removable\": false}]}'::jsonb)) \
           AS s(name, payload)",
    )
    .execute(&pool)
    .await?;
    bc_store::sqlx::query("ANALYZE").execute(&pool).await?;
    let store = bc_store::Store::new(pg.pool("postgres", 32).await?);
    let config = bc_control::config::ServeConfig::loopback(
        dir.path().join("cp"),
        "bench.bc",
        bc_control::config::Roles {
            api: true,
            scheduler: true,
            ..Default::default()
        },
    );
    let running = bc_control::start(&config, store.clone()).await?;
    let key = bc_control::bootstrap_admin(&store).await?;
    let base = format!(
        "http://{}/api/compute/instances",
        running.api_addr.ok_or_else(|| anyhow::anyhow!("no api"))?
    );
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{base}/set-pool"))
        .bearer_auth(&key)
        .json(&serde_json::json!({"pool": "vps", "class": "vps-host"}))
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "set-pool: {}", r.text().await?);
    let url = format!("{base}/create");
    println!(
        "hosted pool: {HOSTS} vps-host nodes (64 vCPU, 256 GiB, 2 TiB advertised each), one in-process control \
         plane (api + scheduler) on embedded PostgreSQL, durable commits"
    );
    // Warm-up.
    for i in 0..200 {
        admit(&http, &url, &key, 1_000_000 + i).await?;
    }

    // Saturated.
    let next = Arc::new(AtomicUsize::new(0));
    let end = Instant::now() + SATURATED;
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
        let (http, url, key, next) = (http.clone(), url.clone(), key.clone(), next.clone());
        set.spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < end {
                let i = next.fetch_add(1, Ordering::Relaxed);
                lat.push(admit(&http, &url, &key, i).await?);
            }
            anyhow::Ok(lat)
        });
    }
    let mut lat = Vec::new();
    while let Some(r) = set.join_next().await {
        lat.extend(r??);
    }
    let took = t0.elapsed().as_secs_f64();
    lat.sort();
    let saturated = lat.len() as f64 / took;
    println!(
        "  saturated ({CONCURRENCY} clients, {:.1} s): {} admissions, {saturated:.0}/s; p50 {:.1} ms, p99 {:.1} ms",
        took,
        lat.len(),
        percentile_ms(&lat, 0.50),
        percentile_ms(&lat, 0.99)
    );

    // Paced, open loop.
    let n = (PACED_RATE * PACED.as_secs_f64()) as usize;
    let start = Instant::now();
    let base_i = next.load(Ordering::Relaxed) + 10;
    let mut set = tokio::task::JoinSet::new();
    for k in 0..n {
        let at = start + Duration::from_secs_f64(k as f64 / PACED_RATE);
        tokio::time::sleep_until(at.into()).await;
        let (http, url, key) = (http.clone(), url.clone(), key.clone());
        set.spawn(async move { admit(&http, &url, &key, base_i + k).await });
    }
    let mut lat = Vec::new();
    while let Some(r) = set.join_next().await {
        lat.push(r??);
    }
    lat.sort();
    let p99 = percentile_ms(&lat, 0.99);
    println!(
        "  paced ({PACED_RATE:.0}/s offered for {} s, open loop): {} admissions; p50 {:.1} ms, p90 {:.1} ms, p99 \
         {p99:.1} ms, max {:.1} ms",
        PACED.as_secs(),
        lat.len(),
        percentile_ms(&lat, 0.50),
        percentile_ms(&lat, 0.90),
        lat.last().map(|d| d.as_secs_f64() * 1000.0).unwrap_or(0.0)
    );
    running.shutdown().await;
    pg.stop();
    Ok((saturated, p99))
}
