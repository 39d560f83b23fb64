//! `/metrics` on every daemon, scraped by Debian's Prometheus: the control plane (api, gateway and controllers
//! roles, in process, with no exporter configured and `/metrics` at its daemon default), a real `bcd run` (fixture
//! GPUs), a real `bcd site run` and a real `bcd site serve` (the file-fed form), none with an exporter: each serves
//! the Prometheus text format on loopback and Prometheus reads its series (`up == 1` and a metric of each). Without
//! Prometheus the test prints `SKIP: …`.

#![cfg(all(feature = "telemetry", feature = "site"))]

mod common;

use bc_testkit::free_port;
use bc_testkit::prometheus::Prometheus;
use common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bcd");

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The sum of an instant query's values (None without a series).
async fn sum(prom: &Prometheus, q: &str) -> Option<f64> {
    let r = prom.query(q).await.ok()?;
    if r.is_empty() {
        return None;
    }
    Some(
        r.iter()
            .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
            .sum(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_metrics_of_the_control_plane_bcd_run_and_both_site_forms() -> TestResult
{
    bc_proto::install_crypto_provider();
    let (plane_m, node_m, site_m, serve_m) = (
        loopback(free_port()?),
        loopback(free_port()?),
        loopback(free_port()?),
        loopback(free_port()?),
    );
    let jobs = [
        ("better-compute", plane_m),
        ("bcd", node_m),
        ("bcd-site", site_m),
        ("bcd-site-serve", serve_m),
    ];
    let Some(prom) = Prometheus::scraping(&jobs).await? else {
        bc_testkit::skip!("no /usr/bin/prometheus (scripts/setup installs Debian's prometheus)");
    };
    let queue = tempfile::tempdir()?;
    // No [telemetry] table, as a configuration file without one gives: no exporter, /metrics at the default (here a
    // free port instead of 9404, so tests do not fight over it).
    let telemetry = bc_telemetry::TelemetryWire {
        interval: Some("500ms".into()),
        ..Default::default()
    }
    .validate_with("test", queue.path().to_path_buf(), Some(plane_m))?;
    assert!(telemetry.metrics_listen_is_default);
    let p = plane_with_config(
        Options {
            controllers: true,
            fast: true,
            leaf_lifetime: None,
        },
        |c| c.telemetry = Some(telemetry),
    )
    .await;
    assert_eq!(p.running.metrics_addr, Some(plane_m));

    // bcd run: a bcd.toml whose [telemetry] table only moves /metrics (no exporter).
    let name = "scrape2";
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let node_id = join(&p, name, &token, claims(name, 2))
        .await?
        .identity
        .node_id;
    let fixture = p.dir.path().join(format!("{name}-gpus.json"));
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(2, name))?;
    let hw = p.dir.path().join(format!("{name}-hw"));
    fake_hardware(&hw, name)?;
    let node_toml = p.dir.path().join("bcd.toml");
    std::fs::write(
        &node_toml,
        format!("[telemetry]\ninterval = \"500ms\"\nmetrics_listen = \"{node_m}\"\n"),
    )?;
    let cmd = bcd_run(Path::new(BIN), &p, &p.dir.path().join(name), &fixture, &hw);
    // bcd_run names /nonexistent; a later --config wins.
    let mut args: Vec<std::ffi::OsString> = cmd.as_std().get_args().map(Into::into).collect();
    args[1] = node_toml.clone().into();
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.args(&args)
        .arg("--cdi-dir")
        .arg(p.dir.path().join("cdi"))
        .env("BCD_LOG", "info")
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCD_JOIN_TOKEN_FILE")
        .kill_on_drop(true);
    let _daemon = cmd.spawn()?;
    wait_node(&p, &node_id, 60, "adoption", |n| n.state == "adopted").await;

    // bcd site run: enrolled with a site token; its agent config's table only moves /metrics.
    let site_dir = p.dir.path().join("site");
    std::fs::create_dir_all(site_dir.join("tftp"))?;
    std::fs::create_dir_all(site_dir.join("artifacts"))?;
    let agent_toml = site_dir.join("bcd.toml");
    std::fs::write(
        &agent_toml,
        format!("[telemetry]\ninterval = \"500ms\"\nmetrics_listen = \"{site_m}\"\n"),
    )?;
    let site_token = p
        .admin
        .call(
            "site-tokens",
            "create",
            json!({"site": "rack-m", "uses": 1}),
        )
        .await?["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let connection = [
        "--gateway-url".to_string(),
        p.running.gateway_url.clone(),
        "--ca-pin".into(),
        p.running.ca_pin.clone(),
        "--join-public-key".into(),
        p.running.join_public_key.clone(),
        "--agent-config".into(),
        agent_toml.display().to_string(),
    ];
    let enrolled = std::process::Command::new(BIN)
        .args(["site", "enroll"])
        .args(&connection)
        .arg("--state-dir")
        .arg(site_dir.join("state"))
        .env("BCD_SITE_TOKEN", &site_token)
        .output()?;
    assert!(
        enrolled.status.success(),
        "{}",
        String::from_utf8_lossy(&enrolled.stderr)
    );
    let udp = || -> std::io::Result<u16> {
        Ok(std::net::UdpSocket::bind("127.0.0.1:0")?
            .local_addr()?
            .port())
    };
    let site_toml_text = |http_port: u16| -> std::io::Result<String> {
        Ok(format!(
            "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = {:?}\nartifacts = {:?}\n\
             dhcp_port = {}\npxe_port = {}\ntftp_port = {}\nhttp_port = {http_port}\nwatch_rogues = false\n\
             report_interval_s = 0\n",
            site_dir.join("tftp").display().to_string(),
            site_dir.join("artifacts").display().to_string(),
            udp()?,
            udp()?,
            udp()?,
        ))
    };
    let site_toml = site_dir.join("site.toml");
    std::fs::write(&site_toml, site_toml_text(free_port()?)?)?;
    let mut site = tokio::process::Command::new(BIN)
        .args(["site", "run"])
        .args(&connection)
        .arg("--config")
        .arg(&site_toml)
        .arg("--state-dir")
        .arg(site_dir.join("state"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(site_dir.join("run.log"))?)
        .kill_on_drop(true)
        .spawn()?;

    // bcd site serve: no agent; its site.toml's own [telemetry] table moves /metrics.
    let serve_http = free_port()?;
    let serve_toml = site_dir.join("serve.toml");
    std::fs::write(
        &serve_toml,
        format!(
            "{}\n[telemetry]\ninterval = \"500ms\"\nmetrics_listen = \"{serve_m}\"\n",
            site_toml_text(serve_http)?
        ),
    )?;
    let mut serve = tokio::process::Command::new(BIN)
        .args(["site", "serve", "--config"])
        .arg(&serve_toml)
        .arg("--state-dir")
        .arg(site_dir.join("serve-state"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(site_dir.join("serve.log"))?)
        .kill_on_drop(true)
        .spawn()?;

    // Something for each to count: API calls, and two boot HTTP requests to the standalone site.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut asked = 0;
    while asked < 2 {
        match reqwest::get(format!("http://127.0.0.1:{serve_http}/artifacts/none")).await {
            Ok(r) => {
                assert_eq!(r.status(), 404);
                asked += 1;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(format!("bcd site serve's HTTP never answered: {e}").into()),
        }
    }
    for _ in 0..3 {
        p.admin.call("nodes", "list", json!({})).await?;
    }
    let checks = [
        r#"up{job="better-compute"}"#,
        r#"up{job="bcd"}"#,
        r#"up{job="bcd-site"}"#,
        r#"bc_api_requests_total{job="better-compute",group="nodes",method="list",code="200"}"#,
        r#"count(DCGM_FI_DEV_GPU_TEMP{job="bcd"})"#,
        r#"bc_site_dhcp_requests_total{job="bcd-site"}"#,
        r#"up{job="bcd-site-serve"}"#,
        r#"bc_site_http_requests_total{job="bcd-site-serve"}"#,
    ];
    let want = [1.0, 1.0, 1.0, 3.0, 2.0, 0.0, 1.0, 2.0];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut wrong = Vec::new();
        for (q, w) in checks.iter().zip(want) {
            let got = sum(&prom, q).await;
            if got != Some(w) {
                wrong.push(format!("{q} = {got:?}, want {w}"));
            }
        }
        if wrong.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(site_dir.join("run.log")).unwrap_or_default();
            let serve_log = std::fs::read_to_string(site_dir.join("serve.log")).unwrap_or_default();
            return Err(format!(
                "after 60 s, Prometheus has:\n{}\nsite log:\n{log}\nsite serve log:\n{serve_log}",
                wrong.join("\n")
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The text format as a scraper gets it, straight from each daemon.
    for (job, addr) in jobs {
        let r = reqwest::get(format!("http://{addr}/metrics")).await?;
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(ct.starts_with("text/plain; version=0.0.4"), "{job}: {ct}");
        assert!(r.text().await?.contains("# TYPE "), "{job}");
    }
    let _ = site.kill().await;
    let _ = serve.kill().await;
    Ok(())
}
