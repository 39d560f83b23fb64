//! `scripts/bench instances`: VPS instances, under the accelerator bcd's probe picks (TCG here).
//!
//! 1. Create → cloud-init done: bcd's VMM supervisor in this process (the node side alone: the desired list is
//!    handed to `InstanceHost::apply` as the session would; bcd/tests/vmm.rs goes through the control plane)
//!    creates an instance from the lab image (images/build-instance-image) served by Python's http.server on 127.0.0.1, and the time to
//!    cloud-init's final message on the serial console is taken; the instance is then deleted. The peer, in the
//!    same run and interleaved with it: plain QEMU started by hand with the same arguments on a ready overlay and
//!    seed (no fetch, no verification, no supervisor), timed to the same console line. 3 runs each, medians.
//! 2. The supervisor's overhead per running VM: this process's RSS and CPU (utime+stime) over a window with no VM,
//!    then with BC_INSTANCES_VMS (2) VMs running after their cloud-init finished, per VM; beside each QEMU's RSS.
//!
//! 0. Instance admissions on a hosted pool of 1,000 nodes through the control plane ([`admissions`]): saturated
//!    admissions/s, and latency percentiles at 500/s offered. BC_INSTANCES_ADMISSIONS_ONLY=1 stops after it.
//!
//! Ends with `instances: <s> s create-to-cloud-init median`. BC_INSTANCES_WINDOW: the measured window (30 s).

#[path = "instances/admissions.rs"]
mod admissions;

use anyhow::{Context as _, bail};
use bc_bench::{cpu_ticks, rss_kib};
use bcd::vmm::config::{NetworkWire, VmmWire};
use bcd::vmm::image::ImageStore;
use bcd::vmm::qemu::Qemu;
use bcd::vmm::supervisor::Supervisor;
use bcd::vmm::vfio::FakeKernel;
use bcd::vmm::{InstanceHost, InstanceSpec, InstanceState};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DONE_DEADLINE: Duration = Duration::from_secs(400);

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Python's http.server over the image directory on a free loopback port; killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(dir: &Path) -> anyhow::Result<(Server, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new("python3")
        .args([
            "-m",
            "http.server",
            "--bind",
            "127.0.0.1",
            &port.to_string(),
        ])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("python3 -m http.server")?;
    let server = Server(child);
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > end {
            bail!("http.server did not listen on {port} within 10 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((server, port))
}

fn spec(id: &str, url: &str, sha256: &str) -> anyhow::Result<InstanceSpec> {
    Ok(serde_json::from_value(serde_json::json!({
        "id": id, "generation": 1, "vcpus": 2, "memory_mib": 1024, "disk_gib": 2,
        "image": {"url": url, "sha256": sha256}, "power": "running"
    }))?)
}

async fn wait_until(
    sup: &Supervisor<Qemu>,
    deadline: Duration,
    what: &str,
    ok: impl Fn(&[bcd::vmm::InstanceStatus]) -> bool,
) -> anyhow::Result<()> {
    let end = Instant::now() + deadline;
    loop {
        let st = sup.statuses();
        if ok(&st) {
            return Ok(());
        }
        if let Some(f) = st.iter().find(|s| s.state == InstanceState::Failed) {
            bail!("{} failed: {:?}", f.id, f.reason);
        }
        if Instant::now() > end {
            bail!("not {what} within {} s: {st:?}", deadline.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The peer: QEMU by hand on a fresh overlay and seed (made before the clock starts), to the same console line.
fn peer_run(qemu: &Qemu, image: &Path, n: usize) -> anyhow::Result<f64> {
    let id = format!("peer-{n}");
    let s = spec(&id, "http://127.0.0.1:1/x", &"0".repeat(64))?;
    let dir = bcd::vmm::instance_dir(&qemu.config().state_dir, &id);
    std::fs::create_dir_all(&dir)?;
    // bcd's VMM makes the QMP socket's folder when it starts a VM; the peer is QEMU alone.
    let qmp = bcd::vmm::qmp_socket(&qemu.config().state_dir, &id);
    std::fs::create_dir_all(qmp.parent().context("the QMP socket's folder")?)?;
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(image)
        .arg(dir.join("disk.qcow2"))
        .arg("2G")
        .status()?;
    if !st.success() {
        bail!("qemu-img create failed");
    }
    bcd::vmm::seed::build(&bcd::vmm::seed::render(&s), &dir.join("seed.img"))?;
    let args = qemu.args(&s, &[]);
    let t0 = Instant::now();
    let st = Command::new("qemu-system-x86_64").args(&args).status()?;
    if !st.success() {
        bail!("peer QEMU did not start");
    }
    let log = dir.join("console.log");
    let end = t0 + DONE_DEADLINE;
    let took = loop {
        if bcd::vmm::console::cloud_init_done(&log) {
            break t0.elapsed().as_secs_f64();
        }
        if Instant::now() > end {
            bail!(
                "peer: cloud-init not done within {} s",
                DONE_DEADLINE.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if let Some(pid) = qemu.live_pid(&id) {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    std::thread::sleep(Duration::from_millis(500));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    let (saturated, p99) = admissions::hosted_admissions().await?;
    println!(
        "instance admissions on 1,000 hosted nodes: {saturated:.0}/s saturated (goal ≥ 1,000/s), p99 {p99:.1} ms at \
         500/s offered (goal < 25 ms)"
    );
    if std::env::var("BC_INSTANCES_ADMISSIONS_ONLY").as_deref() == Ok("1") {
        return Ok(());
    }
    let out = std::env::var_os("BC_IMAGES_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("images/out"))
        .join("instance");
    let image = out.join("debian-12-bc.qcow2");
    if !image.is_file() {
        bail!(
            "{} is not built: run images/build-instance-image (as root)",
            image.display()
        );
    }
    // Absolute: qemu-img resolves a relative backing path against the overlay's directory.
    let image = std::fs::canonicalize(&image)?;
    let sha256 = std::fs::read_to_string(image.with_extension("qcow2.sha256"))?
        .trim()
        .to_string();
    let vms: usize = bc_bench::knob("BC_INSTANCES_VMS", 2, 1)?;
    let window = Duration::from_secs(bc_bench::knob("BC_INSTANCES_WINDOW", 30, 1)?);
    let (_server, port) = serve(&out)?;
    let url = format!("http://127.0.0.1:{port}/debian-12-bc.qcow2");
    let tmp = tempfile::Builder::new()
        .prefix("bc-bench-vmm-")
        .tempdir_in("/tmp")?;
    let state = tmp.path().to_path_buf();
    let wire = |dir: &Path| VmmWire {
        state_dir: Some(dir.to_path_buf()),
        network: NetworkWire {
            mode: Some("user".into()),
            bridge: None,
        },
        ..Default::default()
    };
    let cfg = wire(&state).validate("bench", &state)?;
    let (accel, why) = bcd::vmm::accel::choose(&cfg.qemu, cfg.accel, &state).await;
    println!("accelerator: {} ({why})", accel.as_str());
    let images = ImageStore::new(&state.join("images"), None)?;
    let (stop, console) = (cfg.stop_timeout, cfg.console_max_bytes);
    let sup = Supervisor::new(
        Qemu::new(cfg, accel, Arc::new(FakeKernel::new(&[]))),
        &state,
        images,
        stop,
        console,
    )?;
    let peer_state = state.join("peer");
    let peer = Qemu::new(
        wire(&peer_state).validate("bench", &peer_state)?,
        accel,
        Arc::new(FakeKernel::new(&[])),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sup.clone().run(async {
        let _ = stop_rx.await;
    }));

    // 1. Create → cloud-init done, 3 runs each, interleaved with the peer.
    let me = std::process::id();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for n in 0..3 {
        let id = format!("run-{n}");
        let t0 = Instant::now();
        sup.apply(1 + 2 * n as u64, vec![spec(&id, &url, &sha256)?], &[])
            .map_err(anyhow::Error::msg)?;
        wait_until(&sup, DONE_DEADLINE, "cloud-init done", |st| {
            st.iter().any(|s| s.id == id && s.cloud_init_done)
        })
        .await?;
        let took = t0.elapsed().as_secs_f64();
        sup.apply(2 + 2 * n as u64, vec![], &[])
            .map_err(anyhow::Error::msg)?;
        wait_until(&sup, Duration::from_secs(60), "deleted", |st| st.is_empty()).await?;
        let p = tokio::task::block_in_place(|| peer_run(&peer, &image, n))?;
        println!(
            "run {n}: bcd create → cloud-init done {took:.1} s; plain QEMU on a ready disk {p:.1} s"
        );
        ours.push(took);
        theirs.push(p);
    }
    let m = median(&mut ours);
    let mp = median(&mut theirs);

    // 2. The supervisor's RSS and CPU with `vms` VMs running (after their cloud-init), against none (measured
    //    now, after the runs, so both figures are of a warmed-up process).
    let base_rss = rss_kib(me);
    let c0 = cpu_ticks(me);
    tokio::time::sleep(window).await;
    let base_cpu = (cpu_ticks(me) - c0) as f64 / 100.0 / window.as_secs_f64();
    let list: Vec<InstanceSpec> = (0..vms)
        .map(|i| spec(&format!("idle-{i}"), &url, &sha256))
        .collect::<anyhow::Result<_>>()?;
    sup.apply(100, list, &[]).map_err(anyhow::Error::msg)?;
    wait_until(&sup, DONE_DEADLINE * 2, "all cloud-init done", |st| {
        st.len() == vms && st.iter().all(|s| s.cloud_init_done)
    })
    .await?;
    let rss = rss_kib(me);
    let c0 = cpu_ticks(me);
    tokio::time::sleep(window).await;
    let cpu = (cpu_ticks(me) - c0) as f64 / 100.0 / window.as_secs_f64();
    let qemu_rss: Vec<u64> = sup
        .statuses()
        .iter()
        .filter_map(|s| s.pid)
        .map(rss_kib)
        .collect();
    sup.apply(101, vec![], &[]).map_err(anyhow::Error::msg)?;
    wait_until(&sup, Duration::from_secs(60), "deleted", |st| st.is_empty()).await?;
    let _ = stop_tx.send(());
    let _ = run.await;

    println!();
    println!(
        "create → cloud-init done ({}): bcd median {m:.1} s (runs {:?}); plain QEMU on a ready disk median {mp:.1} s; \
         bcd's share (fetch + verify + overlay + seed + supervision) {:.1} s",
        accel.as_str(),
        ours.iter()
            .map(|v| (v * 10.0).round() / 10.0)
            .collect::<Vec<_>>(),
        m - mp
    );
    println!(
        "supervisor (this process): {:.1} MiB RSS and {:.2} % of a core with no VM; {:.1} MiB and {:.2} % with {vms} \
         VMs running: {:+.2} MiB and {:+.3} % of a core per VM; QEMU itself {:?} MiB RSS per VM",
        base_rss as f64 / 1024.0,
        base_cpu * 100.0,
        rss as f64 / 1024.0,
        cpu * 100.0,
        (rss as f64 - base_rss as f64) / 1024.0 / vms as f64,
        (cpu - base_cpu) * 100.0 / vms as f64,
        qemu_rss.iter().map(|k| k / 1024).collect::<Vec<_>>()
    );
    println!("instances: {m:.1} s create-to-cloud-init median");
    Ok(())
}
