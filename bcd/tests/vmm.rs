//! The VMM for real: QEMU under TCG (or KVM where the probe boot proves it usable) booting the lab's instance image
//! (images/build-instance-image: Debian 12 with Debian's cloud-init reading the NoCloud seed), served over HTTP on
//! 127.0.0.1 and verified by digest. One test walks the whole life of an instance through the supervisor, the way
//! the session drives it (`InstanceHost::apply` with each new desired list):
//!
//! a bad image digest → failed with that reason, nothing left behind; create → running → cloud-init done (its final
//! message on the serial console) → stop → start → the supervisor restarted while the VM runs (the same QEMU PID is
//! re-adopted, status running) → delete (process, disk, seed, socket and the unused image gone).
//!
//! Needs qemu-system-x86_64, qemu-img, mkfs.vfat and mcopy (scripts/setup) and the built image (run
//! images/build-instance-image as root); without them it prints `SKIP: …`. It takes ≈ 2–4 min under TCG on 2 cores.

#![cfg(feature = "vmm")]

use bcd::vmm::config::{NetworkWire, VmmWire};
use bcd::vmm::image::ImageStore;
use bcd::vmm::qemu::Qemu;
use bcd::vmm::supervisor::Supervisor;
use bcd::vmm::vfio::FakeKernel;
use bcd::vmm::{InstanceHost, InstanceSpec, InstanceState, InstanceStatus};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLOUD_INIT_DEADLINE: Duration = Duration::from_secs(300);
/// The graceful-stop deadline the test configures (`[vmm] stop_timeout_s`).
const STOP_TIMEOUT: Duration = Duration::from_secs(90);

fn image() -> PathBuf {
    let out = std::env::var_os("BC_IMAGES_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/out"));
    out.join("instance/debian-12-bc.qcow2")
}

fn have(tool: &str) -> bool {
    std::process::Command::new(tool)
        .arg("--version")
        .output()
        .is_ok()
}

/// Serves `bytes` at `/image.qcow2` on 127.0.0.1 (with a Content-Length, as the image store requires).
async fn serve(bytes: Vec<u8>) -> String {
    let bytes = axum::body::Bytes::from(bytes);
    let app = axum::Router::new().route(
        "/image.qcow2",
        axum::routing::get(move || {
            let b = bytes.clone();
            async move { b }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}/image.qcow2")
}

/// Kills every QEMU whose pidfile is under the state directory, by PID, when the test ends (even by a panic).
struct Reaper(PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        let Ok(dirs) = std::fs::read_dir(self.0.join("instances")) else {
            return;
        };
        for d in dirs.flatten() {
            if let Ok(pid) = std::fs::read_to_string(d.path().join("qemu.pid"))
                && let Ok(pid) = pid.trim().parse::<i32>()
                && our_qemu(pid, &self.0)
            {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// Whether `pid` is still a QEMU with this test's state directory on its command line (not a reused PID).
fn our_qemu(pid: i32, state: &Path) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&*state.to_string_lossy()))
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

struct Lab {
    state: PathBuf,
    url: String,
    sha256: String,
}

impl Lab {
    fn supervisor(&self) -> Supervisor<Qemu> {
        let cfg = VmmWire {
            state_dir: Some(self.state.clone()),
            accel: Some(std::env::var("BC_VMM_ACCEL").unwrap_or_else(|_| "tcg".into())),
            stop_timeout_s: Some(STOP_TIMEOUT.as_secs()),
            network: NetworkWire {
                mode: Some("user".into()),
                bridge: None,
            },
            ..Default::default()
        }
        .validate("test", &self.state)
        .expect("config");
        let accel = match cfg.accel {
            bcd::vmm::config::AccelChoice::Kvm => bcd::vmm::Accel::Kvm,
            _ => bcd::vmm::Accel::Tcg,
        };
        let images = ImageStore::new(&self.state.join("images"), None).expect("images");
        let (stop, console) = (cfg.stop_timeout, cfg.console_max_bytes);
        Supervisor::new(
            Qemu::new(cfg, accel, Arc::new(FakeKernel::new(&[]))),
            &self.state,
            images,
            stop,
            console,
        )
        .expect("supervisor")
    }

    fn spec(&self, id: &str, generation: u64, power: &str, sha256: &str) -> InstanceSpec {
        serde_json::from_value(serde_json::json!({
            "id": id, "generation": generation, "vcpus": 2, "memory_mib": 1024, "disk_gib": 2,
            "image": {"url": self.url, "sha256": sha256},
            "user_data": "#cloud-config\nruncmd:\n  - [sh, -c, 'echo bc-lab-runcmd-ran > /dev/ttyS0']\n",
            "meta": {"ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN0tArEaLkEy lab@example"]},
            "power": power
        }))
        .expect("spec")
    }
}

/// Polls the supervisor's status of `id` until `ok` holds (or `None` is wanted: the instance is gone).
async fn wait_for(
    sup: &Supervisor<Qemu>,
    id: &str,
    deadline: Duration,
    what: &str,
    ok: impl Fn(Option<&InstanceStatus>) -> bool,
) -> Option<InstanceStatus> {
    let end = Instant::now() + deadline;
    loop {
        let st = sup.statuses().into_iter().find(|s| s.id == id);
        if ok(st.as_ref()) {
            return st;
        }
        assert!(
            Instant::now() < end,
            "{id}: not {what} within {} s; last status {st:?}",
            deadline.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_lives_its_whole_life_under_qemu() {
    for tool in ["qemu-system-x86_64", "qemu-img", "mkfs.vfat", "mcopy"] {
        if !have(tool) {
            bc_testkit::skip!("{tool} is not installed (scripts/setup)");
        }
    }
    let img = image();
    let Ok(bytes) = std::fs::read(&img) else {
        bc_testkit::skip!(
            "{} is not built (run images/build-instance-image as root)",
            img.display()
        );
    };
    let sha256 = hex::encode(bc_proto::sha256(&bytes));
    let url = serve(bytes).await;
    // Short: QMP sockets live under it.
    let tmp = tempfile::Builder::new()
        .prefix("bc-vmm-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let lab = Lab {
        state: tmp.path().to_path_buf(),
        url,
        sha256,
    };
    let _reaper = Reaper(lab.state.clone());

    let sup = lab.supervisor();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sup.clone().run(async {
        let _ = stop_rx.await;
    }));

    // 1. A bad digest: failed with the reason, nothing left behind.
    let wrong = "0".repeat(64);
    sup.apply(1, vec![lab.spec("bad-1", 1, "running", &wrong)], &[])
        .expect("apply");
    let st = wait_for(&sup, "bad-1", Duration::from_secs(60), "failed", |s| {
        s.is_some_and(|s| s.state == InstanceState::Failed)
    })
    .await
    .expect("status");
    let reason = st.reason.unwrap_or_default();
    assert!(reason.contains("hashes to"), "reason: {reason}");
    assert!(!lab.state.join("instances/bad-1").exists());
    assert!(!lab.state.join("images/sha256").join(&wrong).exists());
    let leftovers: Vec<_> = std::fs::read_dir(lab.state.join("images"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        leftovers.iter().all(|n| n == "sha256"),
        "temporary files left: {leftovers:?}"
    );
    sup.apply(2, vec![], &[]).expect("apply");
    wait_for(&sup, "bad-1", Duration::from_secs(10), "gone", |s| {
        s.is_none()
    })
    .await;

    // 2. Create → running → cloud-init done.
    let t0 = Instant::now();
    sup.apply(3, vec![lab.spec("lab-1", 1, "running", &lab.sha256)], &[])
        .expect("apply");
    let st = wait_for(&sup, "lab-1", Duration::from_secs(120), "running", |s| {
        s.is_some_and(|s| s.state == InstanceState::Running)
    })
    .await
    .expect("status");
    let pid = st.pid.expect("pid");
    let to_running = t0.elapsed();
    wait_for(&sup, "lab-1", CLOUD_INIT_DEADLINE, "cloud-init done", |s| {
        s.is_some_and(|s| s.cloud_init_done)
    })
    .await;
    let to_done = t0.elapsed();
    let console =
        std::fs::read_to_string(lab.state.join("instances/lab-1/console.log")).unwrap_or_default();
    assert!(
        console.contains("DataSourceNoCloud"),
        "cloud-init read the NoCloud seed"
    );
    assert!(console.contains("bc-lab-runcmd-ran"), "the user-data ran");
    println!(
        "lab-1: running {:.1} s, cloud-init done {:.1} s after create (pid {pid}, {:?})",
        to_running.as_secs_f64(),
        to_done.as_secs_f64(),
        st.accel
    );

    // 3. Only power changes: stop (graceful: ACPI power button), then start again.
    let t = Instant::now();
    sup.apply(4, vec![lab.spec("lab-1", 2, "stopped", &lab.sha256)], &[])
        .expect("apply");
    wait_for(&sup, "lab-1", Duration::from_secs(150), "stopped", |s| {
        s.is_some_and(|s| s.state == InstanceState::Stopped && s.generation == 2)
    })
    .await;
    let stop_took = t.elapsed();
    assert!(!alive(pid), "QEMU {pid} is gone after the stop");
    println!("lab-1: stopped in {:.1} s", stop_took.as_secs_f64());
    // Graceful: the guest powered itself off on the ACPI power button before the deadline forced it.
    assert!(
        stop_took < STOP_TIMEOUT,
        "the stop took {:.1} s: the guest ignored the power button and was forced at the deadline",
        stop_took.as_secs_f64()
    );
    assert!(
        lab.state.join("instances/lab-1/disk.qcow2").exists(),
        "a stop keeps the disk"
    );
    sup.apply(5, vec![lab.spec("lab-1", 3, "running", &lab.sha256)], &[])
        .expect("apply");
    let st = wait_for(
        &sup,
        "lab-1",
        Duration::from_secs(120),
        "running again",
        |s| s.is_some_and(|s| s.state == InstanceState::Running && s.generation == 3),
    )
    .await
    .expect("status");
    let pid = st.pid.expect("pid");

    // 4. The supervisor stops (as with bcd's) while the VM runs: the VM keeps running, and a new supervisor over
    //    the same state directory re-adopts it without being told anything (same PID, running).
    let _ = stop_tx.send(());
    run.await.expect("supervisor task");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(alive(pid), "the VM outlives its supervisor");
    let sup = lab.supervisor();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sup.clone().run(async {
        let _ = stop_rx.await;
    }));
    let st = wait_for(&sup, "lab-1", Duration::from_secs(20), "re-adopted", |s| {
        s.is_some()
    })
    .await
    .expect("status");
    assert_eq!(st.state, InstanceState::Running, "{st:?}");
    assert_eq!(st.pid, Some(pid), "the same QEMU process");
    // The desired state arrives again on the new session: nothing restarts.
    sup.apply(6, vec![lab.spec("lab-1", 3, "running", &lab.sha256)], &[])
        .expect("apply");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let st = sup
        .statuses()
        .into_iter()
        .find(|s| s.id == "lab-1")
        .expect("status");
    assert_eq!((st.state, st.pid), (InstanceState::Running, Some(pid)));

    // 5. Removed from the desired state: deleted, everything freed.
    sup.apply(7, vec![], &[]).expect("apply");
    wait_for(&sup, "lab-1", Duration::from_secs(60), "deleted", |s| {
        s.is_none()
    })
    .await;
    assert!(!alive(pid), "QEMU is gone");
    assert!(
        !lab.state.join("instances/lab-1").exists(),
        "disk, seed and console removed"
    );
    let sockets: Vec<_> = std::fs::read_dir(lab.state.join("qmp"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(sockets.is_empty(), "QMP sockets left: {sockets:?}");
    assert!(
        !lab.state.join("images/sha256").join(&lab.sha256).exists(),
        "the image no instance uses is removed"
    );
    let _ = stop_tx.send(());
    run.await.expect("supervisor task");
}
