//! Debian's Prometheus as a real remote-write receiver for tests (feature `prometheus`): started on loopback with
//! `--web.enable-remote-write-receiver`, its own temp dir and port, killed on drop; queried back through its HTTP
//! API. Used by bcd's telemetry tests and the control plane's.

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// Where scripts/setup's Debian package puts it.
pub const PROMETHEUS: &str = "/usr/bin/prometheus";

/// A Prometheus child process, killed on drop.
pub struct Prometheus {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    pub async fn start_on(port: u16) -> Result<Prometheus> {
        Prometheus::start_with(port, "global:\n  scrape_interval: 1h\n").await
    }

    /// A Prometheus that scrapes `/metrics` of each `(job, address)` every second (and still receives remote
    /// write); None without the binary.
    pub async fn scraping(jobs: &[(&str, std::net::SocketAddr)]) -> Result<Option<Prometheus>> {
        if !Path::new(PROMETHEUS).exists() {
            return Ok(None);
        }
        let mut cfg =
            String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n");
        for (job, addr) in jobs {
            cfg.push_str(&format!(
                "  - job_name: {job:?}\n    static_configs:\n      - targets: [{:?}]\n",
                addr.to_string()
            ));
        }
        Ok(Some(Prometheus::start_with(free_port()?, &cfg).await?))
    }

    async fn start_with(port: u16, config: &str) -> Result<Prometheus> {
        let dir = tempfile::tempdir()?;
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(&cfg, config)?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--web.enable-remote-write-receiver")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let http = reqwest::Client::new();
        loop {
            if let Ok(r) = http.get(format!("{}/-/ready", p.url)).send().await
                && r.status().is_success()
            {
                return Ok(p);
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(p._dir.path().join("prometheus.log"))
                    .unwrap_or_default();
                bail!("prometheus not ready after 30 s:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn start() -> Result<Option<Prometheus>> {
        if !Path::new(PROMETHEUS).exists() {
            return Ok(None);
        }
        Ok(Some(Prometheus::start_on(free_port()?).await?))
    }

    pub fn write_url(&self) -> String {
        format!("{}/api/v1/write", self.url)
    }

    /// An instant query's result vector/matrix.
    pub async fn query(&self, q: &str) -> Result<Vec<Value>> {
        let encoded: String = q
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        let v: Value = reqwest::Client::new()
            .get(format!("{}/api/v1/query?query={encoded}", self.url))
            .send()
            .await?
            .json()
            .await?;
        if v["status"] != "success" {
            bail!("query {q}: {v}");
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// Raw samples of every series matching `selector` in the last 10 minutes: labels → [(ms, value)].
    pub async fn samples(
        &self,
        selector: &str,
    ) -> Result<Vec<(BTreeMap<String, String>, Vec<(i64, f64)>)>> {
        let mut out = Vec::new();
        for s in self.query(&format!("{selector}[10m]")).await? {
            let labels: BTreeMap<String, String> = serde_json::from_value(s["metric"].clone())?;
            let mut points = Vec::new();
            for p in s["values"].as_array().cloned().unwrap_or_default() {
                let t = p[0].as_f64().context("timestamp")?;
                let v: f64 = p[1].as_str().context("value")?.parse()?;
                points.push(((t * 1000.0).round() as i64, v));
            }
            out.push((labels, points));
        }
        Ok(out)
    }
}
