//! The control plane's own metrics (bc-control `telemetry`) pushed by remote write to Debian's Prometheus and
//! queried back: API calls per method (and calls to methods that do not exist collapsed into one series), the
//! sessions the gateway holds, placement latency, shard leases held and queue depths. A real node (the `bcd` binary,
//! fixture GPUs) holds the session and takes the bookings. Without Prometheus the test prints `SKIP: …`.

#![cfg(feature = "telemetry")]

mod common;

use bc_telemetry::TelemetryWire;
use bc_telemetry::config::EndpointWire;
use bc_testkit::prometheus::Prometheus;
use common::*;
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

/// One instant query's single value, if the result has exactly one series.
async fn value(prom: &Prometheus, q: &str) -> Option<f64> {
    let r = prom.query(q).await.ok()?;
    let [one] = r.as_slice() else {
        return None;
    };
    one["value"][1].as_str()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_planes_own_metrics_reach_prometheus() -> TestResult {
    bc_proto::install_crypto_provider();
    let Some(prom) = Prometheus::start().await? else {
        bc_testkit::skip!("no /usr/bin/prometheus (scripts/setup installs Debian's prometheus)");
    };
    let queue = tempfile::tempdir()?;
    let telemetry = TelemetryWire {
        interval: Some("200ms".into()),
        remote_write: Some(EndpointWire {
            url: Some(prom.write_url()),
            ..Default::default()
        }),
        ..Default::default()
    }
    .validate("test", queue.path().to_path_buf())?;
    let p = plane_with_config(
        Options {
            controllers: true,
            fast: true,
            leaf_lifetime: None,
        },
        |c| c.telemetry = Some(telemetry),
    )
    .await;

    // A node with four fixture GPUs holds a session and is adopted.
    let name = "metrics4";
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let node_id = join(&p, name, &token, claims(name, 4))
        .await?
        .identity
        .node_id;
    let fixture = p.dir.path().join(format!("{name}-gpus.json"));
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(4, name))?;
    let hw = p.dir.path().join(format!("{name}-hw"));
    fake_hardware(&hw, name)?;
    let _daemon = bcd_run(
        Path::new(env!("CARGO_BIN_EXE_bcd")),
        &p,
        &p.dir.path().join(name),
        &fixture,
        &hw,
    )
    .arg("--cdi-dir")
    .arg(p.dir.path().join("cdi"))
    .kill_on_drop(true)
    .spawn()?;
    wait_node(&p, &node_id, 60, "adoption", |n| n.state == "adopted").await;

    // What the API answers: three listings, five calls to methods that do not exist, two placed reservations.
    for _ in 0..3 {
        p.admin.call("nodes", "list", json!({})).await?;
    }
    for i in 0..5 {
        let r = p.admin.call("nodes", &format!("nope-{i}"), json!({})).await;
        assert!(r.is_err(), "nodes.nope-{i} answered");
    }
    for k in 0..2 {
        let r = p
            .admin
            .call(
                "reservations",
                "create",
                json!({"tenant": "root", "gpus": 1, "duration_s": 600, "idempotency_key": format!("m{k}")}),
            )
            .await?;
        assert_eq!(r["reservation"]["state"], "placed", "{r}");
    }

    let expected: [(&str, f64); 10] = [
        (
            r#"bc_api_requests_total{group="nodes",method="list",code="200"}"#,
            3.0,
        ),
        (
            r#"sum(bc_api_requests_total{group="unknown",method="unknown",code="404"})"#,
            5.0,
        ),
        (
            r#"count(bc_api_requests_total{method=~"nope-.*"}) or vector(0)"#,
            0.0,
        ),
        (
            r#"bc_api_request_duration_seconds_count{group="reservations",method="create"}"#,
            2.0,
        ),
        ("bc_placement_duration_seconds_count", 2.0),
        ("sum(bc_gateway_sessions)", 1.0),
        // The join's and the session's handshakes were full ones; nothing resumed was refused.
        (
            r#"count(bc_gateway_tls_handshakes_total{kind="full"} >= 2)"#,
            1.0,
        ),
        (
            r#"sum(bc_gateway_tls_handshakes_total{kind="resumed_refused"})"#,
            0.0,
        ),
        (r#"bc_shard_leases_held{role="controllers"}"#, 256.0),
        (r#"bc_queue_depth{queue="reservations_pending"}"#, 0.0),
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut wrong = Vec::new();
        for (q, want) in &expected {
            let got = value(&prom, q).await;
            if got != Some(*want) {
                wrong.push(format!("{q} = {got:?}, want {want}"));
            }
        }
        if wrong.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("after 30 s, Prometheus has:\n{}", wrong.join("\n")).into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Placement latency is admission to commit: positive, and within the create call's own time.
    let sum = value(&prom, "bc_placement_duration_seconds_sum")
        .await
        .ok_or("no placement latency sum")?;
    let create = value(
        &prom,
        r#"bc_api_request_duration_seconds_sum{group="reservations",method="create"}"#,
    )
    .await
    .ok_or("no create latency sum")?;
    assert!(
        sum > 0.0 && sum <= create,
        "placement {sum} s vs create {create} s"
    );
    Ok(())
}
