//! Telemetry against real receivers: Debian's Prometheus (started here on loopback with
//! `--web.enable-remote-write-receiver`, its own temp dir and a free port) and oteltap, an OTLP/HTTP receiver from
//! PyPI that decodes with the OpenTelemetry project's opentelemetry-proto (scripts/setup installs both). Values are
//! queried back through Prometheus's HTTP API and compared with what the fixture GPUs served at each sample's
//! timestamp ([`FixtureFile::sample`] is a pure function of time). Without a receiver a test prints `SKIP: …`.
#![cfg(feature = "telemetry")]

use anyhow::{Context as _, Result, bail};
use bc_telemetry::{Registry, Telemetry, TelemetryWire};
use bc_testkit::free_port;
use bc_testkit::prometheus::{PROMETHEUS, Prometheus};
use bcd::gpu::fixture::{self, FixtureFile};
use bcd::gpu::{GpuBackend, GpuSample, Reading};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn init() {
    bc_proto::install_crypto_provider();
}

/// A node: the fixture (file in `dir`), an empty hardware root unless `host` (so the series are only the GPUs'),
/// and the pipeline built from a `[telemetry]` table.
struct Node {
    dir: tempfile::TempDir,
    fixture: PathBuf,
}

impl Node {
    fn new(gpus: u32, seed: &str) -> Result<Node> {
        let dir = tempfile::tempdir()?;
        let fixture = dir.path().join("gpus.json");
        std::fs::write(&fixture, fixture::synthetic(gpus, seed))?;
        std::fs::create_dir_all(dir.path().join("root"))?;
        Ok(Node { dir, fixture })
    }

    fn file(&self) -> Result<FixtureFile> {
        Ok(fixture::parse(&std::fs::read_to_string(&self.fixture)?)?)
    }

    fn edit(&self, f: impl FnOnce(&mut FixtureFile)) -> Result<()> {
        let mut file = self.file()?;
        f(&mut file);
        std::fs::write(&self.fixture, serde_json::to_string(&file)?)?;
        Ok(())
    }

    async fn pipeline(&self, instance: &str, table: &str) -> Result<Telemetry> {
        let wire: TelemetryWire = toml::from_str(table)?;
        let config = wire.validate("test", self.dir.path().join("telemetry"))?;
        let registry = Registry::new();
        let gpu: Arc<dyn GpuBackend> = Arc::new(fixture::FixtureBackend::load(&self.fixture)?);
        let mut sampler = bcd::telemetry::NodeSampler::new(
            &registry,
            Some(gpu),
            &self.dir.path().join("root"),
            self.dir.path(),
        );
        sampler.hostname = instance.to_string();
        registry.register(Arc::new(sampler));
        let origin = bc_telemetry::Origin {
            service: "bcd".into(),
            instance: instance.into(),
        };
        Ok(Telemetry::new(config, registry, origin).await?)
    }
}

/// What the fixture served for `metric` on GPU `index` at `at_ms` (written out here, independently of the
/// sampler's own mapping).
fn served(file: &FixtureFile, index: u32, metric: &str, at_ms: i64) -> Option<f64> {
    let s: GpuSample = file.sample(at_ms).into_iter().find(|g| g.index == index)?;
    let f = |r: &Reading<u64>| r.value().map(|v| *v as f64);
    let g = |r: &Reading<u32>| r.value().map(|v| f64::from(*v));
    match metric {
        "DCGM_FI_DEV_GPU_UTIL" => g(&s.gpu_util_pct),
        "DCGM_FI_DEV_MEM_COPY_UTIL" => g(&s.mem_copy_util_pct),
        "DCGM_FI_DEV_FB_USED" => f(&s.fb_used_mib),
        "DCGM_FI_DEV_FB_FREE" => f(&s.fb_free_mib),
        "DCGM_FI_DEV_POWER_USAGE" => g(&s.power_mw).map(|mw| mw / 1000.0),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" => f(&s.energy_mj),
        "DCGM_FI_DEV_GPU_TEMP" => g(&s.temperature_c),
        "DCGM_FI_DEV_SM_CLOCK" => g(&s.sm_clock_mhz),
        "DCGM_FI_DEV_MEM_CLOCK" => g(&s.mem_clock_mhz),
        "DCGM_FI_DEV_XID_ERRORS" => f(&s.last_xid),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER" => f(&s.pcie_replay),
        _ => None,
    }
}

const CHECKED: [&str; 11] = [
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
];

async fn run_for(t: Telemetry, d: Duration) -> Result<()> {
    tokio::spawn(t.run(tokio::time::sleep(d))).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_queried_back_from_prometheus_equal_what_the_fixture_served() -> Result<()> {
    init();
    let Some(prom) = Prometheus::start().await? else {
        bc_testkit::skip!("no /usr/bin/prometheus (scripts/setup installs Debian's prometheus)");
    };
    let node = Node::new(8, "rw")?;
    node.edit(|f| {
        f.set_faults(3, vec![bcd::gpu::fault::Fault::Xid(79)]);
    })?;
    let t = node
        .pipeline(
            "node-rw",
            &format!(
                "interval = \"500ms\"\n[remote_write]\nurl = \"{}\"\n",
                prom.write_url()
            ),
        )
        .await?;
    run_for(t, Duration::from_millis(3_200)).await?;
    let file = node.file()?;
    let mut checked = 0;
    for metric in CHECKED {
        let series = prom
            .samples(&format!("{metric}{{instance=\"node-rw\"}}"))
            .await?;
        assert_eq!(series.len(), 8, "{metric}: one series per GPU");
        for (labels, points) in series {
            let index: u32 = labels["gpu"].parse()?;
            assert_eq!(labels["UUID"], format!("GPU-rw-{index:04}"));
            assert_eq!(labels["Hostname"], "node-rw");
            assert_eq!(labels["device"], format!("nvidia{index}"));
            assert_eq!(labels["modelName"], "NVIDIA H100 80GB HBM3");
            assert_eq!(
                labels["pci_bus_id"],
                format!("0000:{:02x}:00.0", 0x18 + index * 0x10)
            );
            assert!(
                points.len() >= 5,
                "{metric} gpu {index}: {} samples in 3.2 s at 500 ms",
                points.len()
            );
            for (ts, v) in points {
                let want = served(&file, index, metric, ts).context("served value")?;
                assert_eq!(v, want, "{metric} gpu {index} at {ts}");
                checked += 1;
            }
        }
    }
    let xid = prom
        .samples("DCGM_FI_DEV_XID_ERRORS{instance=\"node-rw\",gpu=\"3\"}")
        .await?;
    assert!(xid[0].1.iter().all(|(_, v)| *v == 79.0));
    println!("{checked} samples queried back from Prometheus equal what the fixture served");
    Ok(())
}

/// A remote-write receiver in front of Prometheus: answers 503 until `open_at`, then forwards, recording every
/// forwarded sample (series, timestamp) so duplicates show.
#[derive(Clone)]
struct Flaky {
    open_at: Instant,
    target: String,
    seen: Arc<Mutex<BTreeMap<(String, i64), u32>>>,
    refused: Arc<Mutex<u64>>,
}

async fn flaky_write(
    axum::extract::State(f): axum::extract::State<Flaky>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    use axum::http::StatusCode;
    if Instant::now() < f.open_at {
        if let Ok(mut r) = f.refused.lock() {
            *r += 1;
        }
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    let mut req = reqwest::Client::new().post(&f.target).body(body.to_vec());
    for h in [
        "content-type",
        "content-encoding",
        "x-prometheus-remote-write-version",
    ] {
        if let Some(v) = headers.get(h).and_then(|v| v.to_str().ok()) {
            req = req.header(h, v);
        }
    }
    let status = match req.send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 502,
    };
    if (200..300).contains(&status)
        && let Ok(w) = bc_telemetry::remote_write::decode(&body)
        && let Ok(mut seen) = f.seen.lock()
    {
        for ts in w.timeseries {
            let key: Vec<String> = ts
                .labels
                .iter()
                .map(|l| format!("{}={}", l.name, l.value))
                .collect();
            for s in ts.samples {
                *seen.entry((key.join(","), s.timestamp)).or_default() += 1;
            }
        }
    }
    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_503_for_30_s_loses_and_duplicates_no_sample() -> Result<()> {
    init();
    let Some(prom) = Prometheus::start().await? else {
        bc_testkit::skip!("no /usr/bin/prometheus (scripts/setup installs Debian's prometheus)");
    };
    let flaky = Flaky {
        open_at: Instant::now() + Duration::from_secs(30),
        target: prom.write_url(),
        seen: Arc::default(),
        refused: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route("/api/v1/write", axum::routing::post(flaky_write))
        .with_state(flaky.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let node = Node::new(8, "flaky")?;
    let t = node
        .pipeline(
            "node-flaky",
            &format!("interval = \"1s\"\n[remote_write]\nurl = \"http://{addr}/api/v1/write\"\n"),
        )
        .await?;
    let latest = t.latest();
    run_for(t, Duration::from_secs(42)).await?;
    server.abort();
    let refused = flaky.refused.lock().map(|r| *r).unwrap_or(0);
    assert!(
        refused >= 5,
        "the receiver refused {refused} requests during its 30 s outage"
    );
    let seen = flaky.seen.lock().map(|s| s.clone()).unwrap_or_default();
    let dups: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        dups.is_empty(),
        "samples delivered more than once: {:?}",
        &dups[..dups.len().min(5)]
    );
    // Every tick's sample reached Prometheus, outage included: one per second without a gap.
    let series = prom
        .samples("DCGM_FI_DEV_GPU_TEMP{instance=\"node-flaky\",gpu=\"0\"}")
        .await?;
    let ts: Vec<i64> = series
        .first()
        .context("the series is in Prometheus")?
        .1
        .iter()
        .map(|p| p.0)
        .collect();
    assert!(ts.len() >= 40, "{} samples over 42 s at 1 s", ts.len());
    for w in ts.windows(2) {
        assert!(
            w[1] - w[0] <= 1_500,
            "a gap between {} and {}: a sample was lost",
            w[0],
            w[1]
        );
    }
    let forwarded: BTreeSet<i64> = seen
        .keys()
        .filter(|(k, _)| k.contains("__name__=DCGM_FI_DEV_GPU_TEMP") && k.contains(",gpu=0,"))
        .map(|(_, t)| *t)
        .collect();
    assert_eq!(forwarded, ts.iter().copied().collect::<BTreeSet<i64>>());
    // The exporter's own counters agree: nothing dropped or refused, retries made.
    let own = latest.get();
    let get = |name: &str, l: &[(&str, &str)]| own.value(name, l).unwrap_or(-1.0);
    assert!(get("bc_telemetry_retries_total", &[]) > 0.0);
    assert_eq!(get("bc_telemetry_samples_rejected_total", &[]), 0.0);
    assert_eq!(
        get(
            "bc_telemetry_samples_dropped_total",
            &[("reason", "queue_full")]
        ),
        0.0
    );
    println!(
        "503 for 30 s: {refused} requests refused, {} samples delivered once each, {} ticks without a gap",
        seen.len(),
        ts.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_has_no_util_series_and_carries_instance_labels_ended_series_go_stale_the_budget_holds()
-> Result<()> {
    init();
    let Some(prom) = Prometheus::start().await? else {
        bc_testkit::skip!("no /usr/bin/prometheus (scripts/setup installs Debian's prometheus)");
    };
    let url = prom.write_url();
    // MIG, and a GPU that falls off the bus half-way (its series must end at once, not linger 5 minutes).
    let mig = Node::new(3, "mig")?;
    mig.edit(|f| {
        f.set_faults(1, vec![bcd::gpu::fault::Fault::MigEnabled]);
    })?;
    let t = mig
        .pipeline(
            "node-mig",
            &format!("interval = \"500ms\"\n[remote_write]\nurl = \"{url}\"\n"),
        )
        .await?;
    let run = tokio::spawn(t.run(tokio::time::sleep(Duration::from_secs(4))));
    tokio::time::sleep(Duration::from_secs(2)).await;
    mig.edit(|f| {
        f.set_faults(2, vec![bcd::gpu::fault::Fault::Missing]);
    })?;
    // Budget: 8 GPUs export ~150 series; allow 40.
    let big = Node::new(8, "budget")?;
    let b = big
        .pipeline(
            "node-budget",
            &format!("interval = \"500ms\"\nmax_series = 40\n[remote_write]\nurl = \"{url}\"\n"),
        )
        .await?;
    let blatest = b.latest();
    run_for(b, Duration::from_secs(2)).await?;
    run.await?;

    let utils = prom
        .query("{__name__=~\"DCGM_FI_DEV_.*_UTIL\",instance=\"node-mig\"}[10m]")
        .await?;
    let gpus: BTreeSet<String> = utils
        .iter()
        .filter_map(|s| s["metric"]["gpu"].as_str().map(String::from))
        .collect();
    assert_eq!(
        gpus,
        ["0", "2"].iter().map(|s| s.to_string()).collect(),
        "no *_UTIL series for the MIG GPU"
    );
    let fb = prom
        .samples("DCGM_FI_DEV_FB_USED{instance=\"node-mig\",gpu=\"1\"}")
        .await?;
    assert_eq!(fb.len(), 7, "one FB_USED series per GPU instance");
    let ids: BTreeSet<String> = fb.iter().map(|(l, _)| l["GPU_I_ID"].clone()).collect();
    assert_eq!(ids, (7..14).map(|i| i.to_string()).collect());
    assert!(fb.iter().all(|(l, _)| l["GPU_I_PROFILE"] == "1g.10gb"));
    assert!(
        !prom
            .samples("DCGM_FI_DEV_FB_USED{instance=\"node-mig\",gpu=\"0\"}")
            .await?[0]
            .0
            .contains_key("GPU_I_ID")
    );
    // The missing GPU had samples, and is gone from an instant query now: the stale marker ended its series.
    assert!(
        !prom
            .samples("DCGM_FI_DEV_GPU_TEMP{instance=\"node-mig\",gpu=\"2\"}")
            .await?
            .is_empty()
    );
    assert!(
        prom.query("DCGM_FI_DEV_GPU_TEMP{instance=\"node-mig\",gpu=\"2\"}")
            .await?
            .is_empty()
    );
    assert_eq!(
        prom.query("DCGM_FI_DEV_GPU_TEMP{instance=\"node-mig\",gpu=\"0\"}")
            .await?
            .len(),
        1
    );

    let n = prom
        .query("count({instance=\"node-budget\",__name__!~\"bc_telemetry_.*\"})")
        .await?
        .first()
        .and_then(|r| r["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()))
        .context("series count")?;
    assert_eq!(n, 40.0, "the budget of 40 series holds in Prometheus");
    let overflow = blatest
        .get()
        .value("bc_telemetry_series_overflow_total", &[])
        .unwrap_or(0.0);
    assert!(overflow > 100.0, "overflow counted: {overflow}");
    let exported = prom
        .query("bc_telemetry_series_overflow_total{instance=\"node-budget\"}")
        .await?;
    assert_eq!(
        exported.len(),
        1,
        "the overflow counter itself is exported (outside the budget)"
    );
    Ok(())
}

/// RSS of a process, KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn du(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

async fn metrics_value(url: &str, name_and_labels: &str) -> Result<f64> {
    let text = reqwest::get(url).await?.text().await?;
    text.lines()
        .filter(|l| l.starts_with(name_and_labels.split('{').next().unwrap_or_default()))
        .find(|l| {
            name_and_labels
                .split(['{', '}', ','])
                .skip(1)
                .filter(|p| !p.is_empty())
                .all(|p| l.contains(p))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .with_context(|| format!("{name_and_labels} in /metrics"))
}

/// A child process killed on drop.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_past_the_queue_bound_drops_oldest_counted_with_the_daemon_healthy_and_memory_bounded()
-> Result<()> {
    init();
    if !Path::new(PROMETHEUS).exists() {
        bc_testkit::skip!("no /usr/bin/prometheus (scripts/setup installs Debian's prometheus)");
    }
    let node = Node::new(8, "bound")?;
    let port = free_port()?;
    let metrics_port = free_port()?;
    let bound = 96 * 1024;
    let cfg = node.dir.path().join("bcd.toml");
    std::fs::write(
        &cfg,
        format!(
            "gpu_backend = \"fixture:{}\"\nstate_dir = \"{}\"\nhardware_root = \"{}\"\n\
             [telemetry]\ninterval = \"100ms\"\nqueue_max_bytes = {bound}\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n\
             [telemetry.remote_write]\nurl = \"http://127.0.0.1:{port}/api/v1/write\"\ntimeout = \"2s\"\n",
            node.fixture.display(),
            node.dir.path().join("state").display(),
            node.dir.path().join("root").display(),
        ),
    )?;
    let started_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let mut bcd = Kill(
        Command::new(env!("CARGO_BIN_EXE_bcd"))
            .args(["--config"])
            .arg(&cfg)
            .arg("telemetry")
            .env("BCD_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let metrics = format!("http://127.0.0.1:{metrics_port}/metrics");
    let queue = node.dir.path().join("state/telemetry/remote_write");
    // Fill past the bound, then watch memory while the receiver stays down.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rss_early = rss_kib(bcd.0.id());
    let dropped_early = metrics_value(
        &metrics,
        "bc_telemetry_samples_dropped_total{reason=\"queue_full\"}",
    )
    .await?;
    let mut max_queue = 0;
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        max_queue = max_queue.max(du(&queue));
        assert!(
            bcd.0.try_wait()?.is_none(),
            "bcd exited while the receiver was down"
        );
    }
    let rss_late = rss_kib(bcd.0.id());
    let dropped = metrics_value(
        &metrics,
        "bc_telemetry_samples_dropped_total{reason=\"queue_full\"}",
    )
    .await?;
    let queued = metrics_value(
        &metrics,
        "bc_telemetry_queue_bytes{exporter=\"remote_write\"}",
    )
    .await?;
    assert!(
        dropped > dropped_early && dropped_early > 0.0,
        "drops counted: {dropped_early} then {dropped}"
    );
    assert!(
        max_queue <= bound,
        "queue {max_queue} B on disk, bound {bound} B"
    );
    assert!(queued <= bound as f64);
    assert!(
        rss_late < rss_early + 4 * 1024,
        "RSS grew from {rss_early} KiB to {rss_late} KiB while the receiver was down"
    );
    // The receiver comes back: the newest batches (those within the bound) arrive, the oldest were dropped.
    let prom = Prometheus::start_on(port).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let series = loop {
        let s = prom.samples("DCGM_FI_DEV_GPU_TEMP{gpu=\"0\"}").await?;
        if s.first().is_some_and(|(_, p)| p.len() > 20) || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let points = &series
        .first()
        .context("samples after the receiver returned")?
        .1;
    let first = points.first().map(|p| p.0).unwrap_or_default();
    // Down for 20 s with room for a few seconds of batches: what arrives starts well after the outage began.
    assert!(
        first > started_ms + 12_000,
        "the oldest batches were dropped: first kept sample {first}, start {started_ms}"
    );
    assert!(bcd.0.try_wait()?.is_none());
    println!(
        "receiver down 20 s with a {bound} B queue: {dropped} samples dropped (oldest), queue ≤ {max_queue} B, \
         RSS {rss_early} → {rss_late} KiB; after it returned the oldest sample kept is {} s after the start",
        (first - started_ms) / 1000
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_to_a_receiver_nobody_here_wrote_carries_what_the_fixture_served() -> Result<()> {
    init();
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-oteltap/bin/python");
    if !python.exists() {
        bc_testkit::skip!("no .venv-oteltap (scripts/setup installs oteltap from PyPI)");
    }
    let port = free_port()?;
    let out = tempfile::NamedTempFile::new()?;
    let _tap = Kill(
        Command::new(&python)
            .args(["-m", "oteltap", "--port", &port.to_string()])
            .stdout(out.reopen()?)
            .stderr(Stdio::null())
            .spawn()?,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("oteltap did not listen on {port}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let node = Node::new(4, "otlp")?;
    let t = node
        .pipeline(
            "node-otlp",
            &format!(
                "interval = \"500ms\"\n[otlp]\nurl = \"http://127.0.0.1:{port}/v1/metrics\"\n"
            ),
        )
        .await?;
    run_for(t, Duration::from_millis(2_700)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let file = node.file()?;
    let text = std::fs::read_to_string(out.path())?;
    let mut checked = 0;
    let mut sums = 0;
    for line in text.lines().filter(|l| l.starts_with('{')) {
        let m: Value = serde_json::from_str(line)?;
        let Some(name) = m["name"].as_str() else {
            continue;
        };
        if !CHECKED.contains(&name) {
            continue;
        }
        let (points, is_sum) = match (&m["gauge"]["dataPoints"], &m["sum"]["dataPoints"]) {
            (Value::Array(p), _) => (p.clone(), false),
            (_, Value::Array(p)) => (p.clone(), true),
            _ => bail!("{name}: neither gauge nor sum: {m}"),
        };
        if is_sum {
            assert_eq!(m["sum"]["isMonotonic"], true, "{name}");
            assert_eq!(m["sum"]["aggregationTemporality"], 2, "{name}: cumulative");
            sums += 1;
        }
        for p in points {
            let attr = |k: &str| {
                p["attributes"]
                    .as_array()
                    .and_then(|a| a.iter().find(|kv| kv["key"] == k))
                    .and_then(|kv| kv["value"]["stringValue"].as_str().map(String::from))
            };
            let index: u32 = attr("gpu").context("gpu attribute")?.parse()?;
            assert_eq!(
                attr("UUID").as_deref(),
                Some(format!("GPU-otlp-{index:04}").as_str())
            );
            let ns: i64 = p["timeUnixNano"].as_str().context("time")?.parse()?;
            let v = p["asDouble"].as_f64().context("asDouble")?;
            assert_eq!(
                Some(v),
                served(&file, index, name, ns / 1_000_000),
                "{name} gpu {index} at {ns}"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 4 * CHECKED.len() * 4,
        "{checked} OTLP points checked"
    );
    assert!(sums > 0);
    println!("{checked} OTLP data points received by oteltap equal what the fixture served");
    Ok(())
}
