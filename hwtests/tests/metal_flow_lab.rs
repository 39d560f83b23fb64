//! The metal flow end to end against real parts: a QEMU (TCG) domain that libvirtd runs on the lab's boot segment,
//! powered and pointed at PXE by sushy-tools' libvirt driver (HTTP Basic), dnsmasq as the segment's DHCP, the real
//! `better-compute dev` (real PostgreSQL, real mTLS) in the site namespace with its gateway on the segment, the real
//! `bcd site run` enrolled in it (proxy DHCP, TFTP, boot HTTP, the BMC worker, the site report), the real ramdisk
//! from images/ netbooted with the attempt's boot token, and the lab OS image (with the real `bcd`) streamed to the
//! domain's disk and kexec'd into. Driven only through `better-compute metal …` and read back with `metal show`.
//!
//! One lab, one VM for the happy path, in order, with each phase's time printed:
//! (a) enroll → provide → ready: inspection (Redfish), the ramdisk's signed diagnose and signed wipe evidence in
//!     `metal show`, the last DHCP the site saw from the machine;
//! (f) + (b) deploy: the control plane is stopped and started again while the ramdisk streams the image; the flow
//!     resumes from the stored record, the ramdisk ran the stream and the kexec once each (its own console says so),
//!     the installed system's bcd joins with the single-use token and reclaims the same node id: deployed, one power
//!     cycle from enroll;
//! (c) in parallel with (a): a domain whose NIC is on the isolated bridge is re-kicked k = 2 times and fails with
//!     "never joined: 2 PXE attempts, no DHCP seen from …" within its bounded deadlines (`[metal]` of dev's config);
//! (d) in parallel: a machine behind a BMC that accepts the boot override and does not apply it (a proxy in front of
//!     sushy that answers the PATCH with 204 and drops it) fails at once with what was read back;
//! (e) after (b), while (c) still runs: release netboots the ramdisk again (the same node, by reclaim), and an abort while it wipes fails
//!     the machine in wiping with the open wipe cancelled.
//!
//! Skips (`SKIP: metal_flow_lab: <why>`) without root, libvirt, QEMU, dnsmasq, the sushy venv, the iPXE loaders or
//! the images (`images/build-ramdisk`, `images/build-lab-os`); `BC_HWTESTS_REQUIRE_LAB=1` turns a skip into a failure.

use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bc_hwtests::lab::Domain;
use bc_hwtests::lab::{self, BasicAuth, LabOptions, MetalLab, Ns, Segment};
use bc_hwtests::metal_flow::{
    Clock, Images, LOADERS, PASSWORD, QUIRK_PROXY, USER, check_deployed, check_ready, define,
    deploy, enroll, failed, images, metal_config, phase_is, site_and_image, start_plane,
    state_line,
};
use bc_hwtests::skip;

mod common;
use common::{bcd_binary, control_binary};

const TEST: &str = "metal_flow_lab";
/// Bounded failure cases: a PXE attempt waits this long for the join, k attempts. The ramdisk's PXE boot and join
/// take about 20 s here under TCG ((a) and (e) in CI's runs of 2026-12-03: 20.2 s and 21.3 s), and took 77 s with
/// the machine shared with four builds (load average 20, docs/metal.md); 100 s is five times the first and above
/// the second. (c), which never boots, fails after k of these, which is most of this test's time (2 × 150 s
/// before 2026-12-03).
const NETBOOT_TIMEOUT_S: u64 = 100;
const NETBOOT_ATTEMPTS: u32 = 2;

#[test]
fn a_machine_goes_from_pxe_to_ready_and_deployed_through_the_real_parts() -> Result<()> {
    if let Some(why) = lab::missing() {
        return skip(TEST, why);
    }
    for l in LOADERS {
        if !Path::new(l).is_file() {
            return skip(TEST, format!("{l} missing (package ipxe)"));
        }
    }
    let images = match images() {
        Ok(i) => i,
        Err(why) => return skip(TEST, why),
    };
    let started = Instant::now();
    let bcd = bcd_binary()?;
    let control = control_binary()?;
    let mut clock = Clock {
        t0: Instant::now(),
        rows: Vec::new(),
    };
    println!(
        "{TEST}: binaries ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let t = Instant::now();
    let mut lab = MetalLab::up(LabOptions {
        basic_auth: Some(BasicAuth {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
    })?;
    let m1 = define(&mut lab, "m1", 0x21, Segment::Boot, 256)?;
    let m2 = define(&mut lab, "m2", 0x22, Segment::Isolated, 64)?;
    let m3 = define(&mut lab, "m3", 0x23, Segment::Boot, 64)?;
    clock.done(
        "lab up: namespaces, dnsmasq, libvirtd, sushy, 3 domains defined",
        t,
    );
    let result = flow(
        &mut lab,
        &mut clock,
        &control,
        &bcd,
        &images,
        [&m1, &m2, &m3],
    );
    if let Err(e) = result {
        let mut logs = lab.logs();
        for f in ["control.log", "site.log"] {
            logs.push_str(&format!(
                "--- {f}:\n{}\n",
                bc_testkit::log_tail(&lab.dir.join(f), 40)
            ));
        }
        logs.push_str(&format!(
            "--- m1 serial:\n{}\n",
            bc_testkit::log_tail(&m1.serial, 60)
        ));
        return Err(e.context(logs));
    }
    println!("{TEST}: phases");
    for (what, s) in &clock.rows {
        println!("  {s:>7.1} s  {what}");
    }
    println!("{TEST}: total {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn flow(
    lab: &mut MetalLab,
    clock: &mut Clock,
    control: &Path,
    bcd: &Path,
    images: &Images,
    [m1, m2, m3]: [&Domain; 3],
) -> Result<()> {
    let t = Instant::now();
    let metal = lab.dir.join("control.toml");
    fs::write(&metal, metal_config(NETBOOT_TIMEOUT_S, NETBOOT_ATTEMPTS))?;
    let data = lab.dir.join("control");
    let mut plane = start_plane(lab, control, &data, &metal)?;
    clock.done(
        "better-compute dev up in the site namespace (PostgreSQL, migrations, CA)",
        t,
    );
    let t = Instant::now();
    let image = site_and_image(lab, &plane, bcd, images)?;
    let quirk = lab.dir.join("quirk-bmc.py");
    fs::write(&quirk, QUIRK_PROXY)?;
    let mut q = lab.command(Ns::Site, "python3");
    q.arg(&quirk)
        .arg("8001")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    lab.spawn("quirk BMC proxy", &mut q)?;
    enroll(lab, &plane, m1, &lab.bmc_url.clone())?;
    enroll(lab, &plane, m2, &lab.bmc_url.clone())?;
    enroll(lab, &plane, m3, "http://127.0.0.1:8001")?;
    clock.done(
        "site enrolled and running; BMC secret, lab OS image uploaded; 3 machines enrolled",
        t,
    );

    // (a), (c), (d) at once.
    let t = Instant::now();
    for d in [m1, m2, m3] {
        plane.cli(lab, &["metal", "provide", &d.mac])?;
    }
    let v3 = plane.wait(
        lab,
        &m3.mac,
        Duration::from_secs(240),
        "failure (d)",
        failed,
    )?;
    let reason = v3["state"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if !(v3["state"]["phase"] == "booting-ramdisk" && reason.contains("one-time PXE boot")) {
        bail!("(d) failed otherwise than on the override: {reason}");
    }
    println!("  (d) {}: {reason}", m3.mac);
    clock.done(
        "(d) override accepted and not applied: failed with what was read back",
        t,
    );
    let v1 = plane.wait(lab, &m1.mac, Duration::from_secs(600), "ready (a)", |v| {
        phase_is(v, "ready") || failed(v)
    })?;
    if !phase_is(&v1, "ready") {
        bail!("(a) {} did not reach ready: {}", m1.mac, state_line(&v1));
    }
    clock.done("(a) enroll → ready (inspect, PXE, join, diagnose, wipe)", t);
    check_ready(&v1, m1)?;

    // (b) + (f): deploy; restart the control plane while the ramdisk streams.
    let t = Instant::now();
    let node = v1["node_id"].as_str().context("node id")?.to_owned();
    deploy(lab, &plane, m1, &image)?;
    plane.wait(
        lab,
        &m1.mac,
        Duration::from_secs(300),
        "the stream sent",
        |v| {
            v["steps"].as_array().is_some_and(|s| {
                s.iter().any(|x| {
                    x["step"] == "stream" && (x["state"] == "sent" || x["state"] == "done")
                })
            }) || failed(v)
        },
    )?;
    let r = Instant::now();
    lab.process(plane.handle).terminate(Duration::from_secs(30));
    println!("  (f) control plane stopped while the ramdisk streams");
    plane = start_plane(lab, control, &data, &metal)?;
    clock.done("(f) control plane restarted mid-deploy", r);
    let v = plane.wait(
        lab,
        &m1.mac,
        Duration::from_secs(900),
        "deployed (b)",
        |v| phase_is(v, "deployed") || failed(v),
    )?;
    if !phase_is(&v, "deployed") {
        bail!("(b) {} did not reach deployed: {}", m1.mac, state_line(&v));
    }
    clock.done(
        "(b) ready → deployed (stream, kexec, the installed system's bcd joined)",
        t,
    );
    check_deployed(&v, m1, &node)?;

    // (e): release → the ramdisk again → abort while it wipes.
    let t = Instant::now();
    // The lab's disk takes a zero-out as fast as QEMU can punch holes (256 MiB in ≈ 150 ms), faster than `metal
    // show` can see the phase; a real disk takes minutes. Throttled to 16 MiB/s (the next power-on's too: the release
    // power-cycles the domain), the wipe lasts ≈ 16 s.
    let mut iotune = vec![
        "blkdeviotune",
        &m1.name,
        "vda",
        "--total-bytes-sec",
        "16777216",
        "--config",
    ];
    if lab.domstate(&m1.name)? == "running" {
        iotune.push("--live");
    }
    lab.virsh(&iotune)?;
    plane.cli(lab, &["metal", "release", &m1.mac])?;
    let v = plane.wait(lab, &m1.mac, Duration::from_secs(600), "wiping (e)", |v| {
        phase_is(v, "wiping") || phase_is(v, "ready") || failed(v)
    })?;
    if !phase_is(&v, "wiping") {
        bail!("(e) {} never observed wiping: {}", m1.mac, state_line(&v));
    }
    if v["node_id"].as_str() != Some(node.as_str()) {
        bail!(
            "(e) the released machine's ramdisk joined as {} not {node}",
            v["node_id"]
        );
    }
    let aborted = plane.cli(lab, &["metal", "abort", &m1.mac]);
    let v = plane.show(lab, &m1.mac)?;
    match aborted {
        Ok(_) if v["state"]["reason"] == "aborted by the operator during wiping" => {
            println!("  (e) {}: {}", m1.mac, state_line(&v));
        }
        other => bail!("(e) abort during wiping: {other:?}; now {}", state_line(&v)),
    }
    clock.done(
        "(e) release → the ramdisk rejoined as the same node → abort while wiping",
        t,
    );

    // (c): bounded, running since the provide.
    let t = Instant::now();
    let v2 = plane.wait(
        lab,
        &m2.mac,
        Duration::from_secs(NETBOOT_ATTEMPTS as u64 * (NETBOOT_TIMEOUT_S + 120)),
        "failure (c)",
        failed,
    )?;
    let reason = v2["state"]["reason"].as_str().unwrap_or_default();
    let want = format!(
        "never joined: {NETBOOT_ATTEMPTS} PXE attempts, no DHCP seen from {}",
        m2.mac
    );
    if reason != want || v2["power_cycles"] != NETBOOT_ATTEMPTS {
        bail!(
            "(c) {}: {reason:?} after {} power cycles; expected {want:?}",
            m2.mac,
            v2["power_cycles"]
        );
    }
    println!("  (c) {}: {reason}", m2.mac);
    clock.done(
        "(c) never PXE boots: k re-kicks, then failed (waited here after (e))",
        t,
    );
    Ok(())
}
