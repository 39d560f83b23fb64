//! `scripts/bench telemetry`: what telemetry costs a node and what it delivers.
//!
//! Three real `bcd run` daemons on 8 fixture GPUs each, joined to a `better-compute dev` control plane, run side by
//! side: one without telemetry (the peer), one sampling every 1 s and one every 10 s, both pushing Prometheus remote
//! write to Debian's Prometheus on loopback. Over the measured window: each daemon's CPU (utime+stime from /proc) and
//! RSS, and for the 1 s daemon the delay from a sample's timestamp to the moment Prometheus answers a query with it
//! (polled every 50 ms). Then the push ceiling: a queue pre-filled with batches of 10,000 series drained by one
//! exporter into the same Prometheus, samples/s and the exporter's CPU per million samples. Ends with
//! `telemetry: <pct> % CPU at 1 s` (the 1 s daemon's CPU minus the peer's, in % of one core).
//!
//! BC_BIN_DIR: where `bcd` and `better-compute` are (target/release); BC_TELEMETRY_SECONDS: the window (60).

use anyhow::{Context as _, bail};
use bc_bench::{Dev, cpu_ticks, percentile_ms, rss_kib};
use bc_telemetry::export::{ExporterCounters, HttpSink, Outbox, Protocol, Sink};
use bc_telemetry::{Family, Kind, Labels, Registry};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// This process's CPU seconds (the in-process exporter of the push test).
fn self_cpu_s() -> f64 {
    cpu_ticks(std::process::id()) as f64 / 100.0
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Prometheus {
    _child: Kill,
    url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start() -> anyhow::Result<Prometheus> {
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        std::fs::write(dir.path().join("p.yml"), "global:\n  scrape_interval: 1h\n")?;
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("p.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--web.enable-remote-write-receiver")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting prometheus (scripts/setup installs Debian's)")?;
        let p = Prometheus {
            _child: Kill(child),
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !reqwest::get(format!("{}/-/ready", p.url))
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            if Instant::now() > deadline {
                bail!("prometheus not ready after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(p)
    }

    async fn scalar(&self, q: &str) -> anyhow::Result<Option<f64>> {
        let enc: String = q
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        let v: serde_json::Value = reqwest::get(format!("{}/api/v1/query?query={enc}", self.url))
            .await?
            .json()
            .await?;
        Ok(v["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|s| s.parse().ok()))
    }
}

struct Daemon {
    name: &'static str,
    child: Kill,
}

async fn start_daemon(
    bin: &Path,
    dev: &Dev,
    dir: &Path,
    name: &'static str,
    interval: Option<&str>,
    write_url: &str,
) -> anyhow::Result<Daemon> {
    let state = dir.join(name);
    std::fs::create_dir_all(&state)?;
    // Eight GPUs with serials of their own: each daemon is a distinct machine to the join's hardware key.
    let fixture = state.join("gpus.json");
    std::fs::write(
        &fixture,
        bcd::gpu::fixture::synthetic(8, &format!("bench{name}")),
    )?;
    let mut cfg = format!(
        "gateway_url = \"{}\"\nca_pin = \"{}\"\njoin_public_key = \"{}\"\nstate_dir = \"{}\"\ngpu_backend = \"fixture:{}\"\ncdi_dir = \"{}\"\n",
        dev.env["BC_GATEWAY_URL"],
        dev.env["BC_CA_PIN"],
        dev.env["BC_JOIN_KEY"],
        state.display(),
        fixture.display(),
        state.join("cdi").display(),
    );
    if let Some(i) = interval {
        cfg.push_str(&format!(
            "[telemetry]\ninterval = \"{i}\"\n[telemetry.labels]\ninstance = \"bench-{name}\"\n[telemetry.remote_write]\nurl = \"{write_url}\"\n"
        ));
    }
    let path = state.join("bcd.toml");
    std::fs::write(&path, cfg)?;
    let token: serde_json::Value = reqwest::Client::new()
        .post(format!(
            "{}/api/compute/join-tokens/create",
            dev.env["BC_API_URL"]
        ))
        .bearer_auth(&dev.env["BC_API_KEY"])
        .json(&serde_json::json!({"pool": "default", "uses": 1, "ttl_seconds": 3600}))
        .send()
        .await?
        .json()
        .await?;
    let join = Command::new(bin.join("bcd"))
        .arg("--config")
        .arg(&path)
        .arg("join")
        .env(
            "BCD_JOIN_TOKEN",
            token["token"].as_str().unwrap_or_default(),
        )
        .output()?;
    if !join.status.success() {
        bail!(
            "bcd join ({name}) failed: {}",
            String::from_utf8_lossy(&join.stderr)
        );
    }
    let child = Command::new(bin.join("bcd"))
        .arg("--config")
        .arg(&path)
        .arg("run")
        .env("BCD_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    Ok(Daemon {
        name,
        child: Kill(child),
    })
}

/// A synthetic snapshot of `n` series (the push test), as a remote-write body at `ts`.
fn batch(n: usize, ts: i64) -> Vec<u8> {
    let mut f = Family::new("bench_series", Kind::Gauge, "1", "synthetic");
    for i in 0..n {
        f.push(
            Labels::new()
                .with("gpu", (i % 8).to_string())
                .with("series", i.to_string()),
            (i as i64 + ts) as f64,
        );
    }
    let mut book = bc_telemetry::budget::SeriesBook::new(n);
    let a = book.admit(
        bc_telemetry::Snapshot {
            timestamp_ms: ts,
            families: vec![f],
        },
        &[],
    );
    bc_telemetry::remote_write::encode(&bc_telemetry::remote_write::request(&a))
}

async fn push_ceiling(
    prom: &Prometheus,
    series: usize,
    batches: usize,
) -> anyhow::Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let (q, _) = bc_telemetry::queue::DiskQueue::open(dir.path(), 4 << 30)?;
    let registry = Registry::new();
    let out = Outbox {
        protocol: Protocol::RemoteWrite,
        queue: Arc::new(Mutex::new(q)),
        notify: Arc::new(tokio::sync::Notify::new()),
        counters: ExporterCounters::register(&registry, "remote_write"),
    };
    let start = now_ms() - batches as i64 * 1000 - 60_000;
    for b in 0..batches {
        out.push(&batch(series, start + b as i64 * 1000), series as u32);
    }
    let wire = bc_telemetry::config::TelemetryWire {
        remote_write: Some(bc_telemetry::config::EndpointWire {
            url: Some(format!("{}/api/v1/write", prom.url)),
            ..Default::default()
        }),
        ..Default::default()
    };
    let cfg = wire.validate("bench", dir.path().to_path_buf())?;
    let ep = cfg.remote_write.context("endpoint")?;
    let sink: Arc<dyn Sink> = Arc::new(HttpSink::new(Protocol::RemoteWrite, &ep)?);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let cpu0 = self_cpu_s();
    let t0 = Instant::now();
    let task = tokio::spawn(out.clone().run(sink, || 0.5, stop_rx));
    while out.depth().0 > 0 {
        if t0.elapsed() > Duration::from_secs(300) {
            bail!("push test did not drain in 300 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = self_cpu_s() - cpu0;
    let _ = stop_tx.send(true);
    task.await?;
    let sent = out.counters.sent.get() as f64;
    if out.counters.rejected.get() > 0 {
        bail!(
            "Prometheus refused {} samples in the push test",
            out.counters.rejected.get()
        );
    }
    Ok((sent / secs, cpu / (sent / 1e6)))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    let bin =
        PathBuf::from(std::env::var("BC_BIN_DIR").unwrap_or_else(|_| "target/release".into()));
    let window: u64 = bc_bench::knob("BC_TELEMETRY_SECONDS", 60, 1)?;
    let data = tempfile::tempdir()?;
    let prom = Prometheus::start().await?;
    let write_url = format!("{}/api/v1/write", prom.url);
    let dev = Dev::start(&bin, &data.path().join("dev"), "127.0.0.1:0")?;
    let mut daemons = Vec::new();
    for (name, interval) in [("none", None), ("1s", Some("1s")), ("10s", Some("10s"))] {
        daemons.push(start_daemon(&bin, &dev, data.path(), name, interval, &write_url).await?);
    }
    // Warm-up: sessions up, inventories sent, the first samples pushed.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let c0: Vec<u64> = daemons.iter().map(|d| cpu_ticks(d.child.0.id())).collect();
    let mut rss_max = vec![0u64; daemons.len()];
    let t0 = Instant::now();
    let mut delays = Vec::new();
    let mut last_ts = 0.0;
    while t0.elapsed() < Duration::from_secs(window) {
        if let Some(ts) = prom
            .scalar("timestamp(DCGM_FI_DEV_GPU_TEMP{instance=\"bench-1s\",gpu=\"0\"})")
            .await?
            && ts > last_ts
        {
            if last_ts > 0.0 {
                delays.push(Duration::from_millis(
                    (now_ms() - (ts * 1000.0) as i64).max(0) as u64,
                ));
            }
            last_ts = ts;
        }
        for (m, d) in rss_max.iter_mut().zip(&daemons) {
            *m = (*m).max(rss_kib(d.child.0.id()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu: Vec<f64> = daemons
        .iter()
        .zip(&c0)
        .map(|(d, c)| (cpu_ticks(d.child.0.id()) - c) as f64 / 100.0 / secs * 100.0)
        .collect();
    for d in &mut daemons {
        if let Some(status) = d.child.0.try_wait()? {
            bail!("bcd {} exited during the run: {status}", d.name);
        }
    }
    let series_1s = prom
        .scalar("count({instance=\"bench-1s\"})")
        .await?
        .unwrap_or(0.0);
    let series_10s = prom
        .scalar("count({instance=\"bench-10s\"})")
        .await?
        .unwrap_or(0.0);
    println!(
        "bcd run on 8 fixture GPUs, {secs:.0} s window, side by side (CPU in % of one core, RSS max):"
    );
    for (i, d) in daemons.iter().enumerate() {
        println!(
            "  {:<5} CPU {:>6.3} %  RSS {:>6.1} MiB  (vs none: {:+.3} % CPU, {:+.1} MiB)",
            d.name,
            cpu[i],
            rss_max[i] as f64 / 1024.0,
            cpu[i] - cpu[0],
            (rss_max[i] as f64 - rss_max[0] as f64) / 1024.0
        );
    }
    println!("  goals: < 1 % of a core at 1 s, < 8 MiB extra RSS");
    println!(
        "series per sample: {series_1s} (1 s node), {series_10s} (10 s node); the 1 s node pushes {series_1s} samples/s"
    );
    delays.sort();
    println!(
        "sample to queryable (1 s node, Prometheus polled every 50 ms): p50 {:.0} ms, p90 {:.0} ms, max {:.0} ms over {} samples",
        percentile_ms(&delays, 0.5),
        percentile_ms(&delays, 0.9),
        percentile_ms(&delays, 1.0),
        delays.len()
    );
    drop(daemons);
    dev.stop()?;
    let (rate, cpu_per_m) = push_ceiling(&prom, 10_000, 60).await?;
    println!(
        "push ceiling: {rate:.0} samples/s from one exporter into Prometheus (60 batches × 10,000 series), \
         {cpu_per_m:.2} CPU s per million samples on the exporter side"
    );
    println!("telemetry: {:.2} % CPU at 1 s", cpu[1] - cpu[0]);
    Ok(())
}
