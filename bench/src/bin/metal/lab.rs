//! The metal flow's happy path in the QEMU lab (the parts of `hwtests/tests/metal_flow_lab.rs`: libvirtd +
//! sushy-tools' libvirt driver, dnsmasq, `better-compute dev`, `bcd site run`, the real ramdisk and the lab OS
//! image), one run in a fresh lab: enroll → provide → ready, then deploy → deployed (the installed system's `bcd`
//! rejoined as the same node); both totals, the time in each phase from `metal show`'s timeline, the power cycles.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bc_hwtests::lab::{BasicAuth, LabOptions, MetalLab, Segment};
use bc_hwtests::metal_flow::{
    PASSWORD, USER, check_deployed, check_ready, define, deploy, enroll, failed, metal_config,
    phase_is, site_and_image, start_plane, state_line,
};
use serde_json::Value;

/// One run's figures.
pub struct Run {
    pub ready_s: f64,
    pub deployed_s: f64,
    pub power_cycles: u64,
    /// Seconds in each phase (summed over its attempts), from the timeline.
    pub phases: BTreeMap<String, f64>,
}

pub fn one_run(control: &Path, bcd: &Path, images: &bc_hwtests::metal_flow::Images) -> Result<Run> {
    let mut lab = MetalLab::up(LabOptions {
        basic_auth: Some(BasicAuth {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
    })?;
    let m1 = define(&mut lab, "m1", 0x21, Segment::Boot, 256)?;
    let config = lab.dir.join("control.toml");
    fs::write(&config, metal_config(150, 2))?;
    let data = lab.dir.join("control");
    let plane = start_plane(&mut lab, control, &data, &config)?;
    let image = site_and_image(&mut lab, &plane, bcd, images)?;
    enroll(&lab, &plane, &m1, &lab.bmc_url.clone())?;

    let t = Instant::now();
    plane.cli(&lab, &["metal", "provide", &m1.mac])?;
    let v = plane.wait(&lab, &m1.mac, Duration::from_secs(600), "ready", |v| {
        phase_is(v, "ready") || failed(v)
    })?;
    if !phase_is(&v, "ready") {
        bail!("{} did not reach ready: {}", m1.mac, state_line(&v));
    }
    let ready_s = t.elapsed().as_secs_f64();
    check_ready(&v, &m1)?;
    let node = v["node_id"].as_str().context("node id")?.to_owned();

    let t = Instant::now();
    deploy(&lab, &plane, &m1, &image)?;
    let v = plane.wait(&lab, &m1.mac, Duration::from_secs(900), "deployed", |v| {
        phase_is(v, "deployed") || failed(v)
    })?;
    if !phase_is(&v, "deployed") {
        bail!("{} did not reach deployed: {}", m1.mac, state_line(&v));
    }
    let deployed_s = t.elapsed().as_secs_f64();
    check_deployed(&v, &m1, &node)?;
    Ok(Run {
        ready_s,
        deployed_s,
        power_cycles: v["power_cycles"].as_u64().unwrap_or(0),
        phases: phase_seconds(&v),
    })
}

/// Seconds per phase from the timeline's closed rows (epoch-millisecond `start` and `end`).
pub fn phase_seconds(v: &Value) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for row in v["timeline"].as_array().into_iter().flatten() {
        let (Some(phase), Some(start), Some(end)) = (
            row["phase"].as_str(),
            row["start"].as_i64(),
            row["end"].as_i64(),
        ) else {
            continue;
        };
        *out.entry(phase.to_owned()).or_insert(0.0) += (end - start) as f64 / 1000.0;
    }
    out
}
