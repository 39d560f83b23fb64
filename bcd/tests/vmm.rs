//! Instances end to end: a real control plane (API, gateway, controllers, scheduler on a fresh PostgreSQL) and
//! the real `bcd` binary with a `[vmm]` table, joined and adopted into a `vps-host` pool; QEMU under TCG (or KVM
//! where the probe boot proves it usable) boots the lab's instance image (images/build-instance-image: Debian 12
//! with Debian's cloud-init reading the NoCloud seed), served over HTTP on 127.0.0.1 and verified by digest. One
//! VM carries every step, each driven through `instances.*` and observed through what the node reports:
//!
//! a bad image digest → failed with that reason, nothing left behind → delete; create → running → cloud-init done
//! (its final message on the serial console) → a create asking for the vCPUs it holds is refused → stop (graceful)
//! → start → the `bcd` process killed and started again while the VM runs (the same QEMU PID re-adopted, reported
//! running by the new process) → delete (process, disk, seed, socket and the unused image gone) → the atoms are back
//! (a create of the node's whole capacity is placed).
//!
//! Needs qemu-system-x86_64, qemu-img, mkfs.vfat and mcopy (scripts/setup) and the built image (run
//! images/build-instance-image as root); without them it prints `SKIP: …`. It takes ≈ 2–4 min under TCG on 2 cores.
//! A second test, without QEMU: a node without `[vmm]` refuses a desired state that lists instances.

#![cfg(feature = "vmm")]

mod common;

use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Generous: one run took 262 s with the 2-core machine at load ≈ 9 (70 s when quiet).
const CLOUD_INIT_DEADLINE: Duration = Duration::from_secs(420);
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

/// The fake hardware tree of a small VPS host: 4 vCPUs, 8 GiB of memory, one fixed 20 GiB disk (what its
/// inventory advertises as atoms).
fn vps_hardware(root: &Path, seed: &str) -> std::io::Result<()> {
    fake_hardware(root, seed)?;
    let cpu: String = (0..4)
        .map(|i| format!("processor\t: {i}\nmodel name\t: Lab CPU\n\n"))
        .collect();
    std::fs::write(root.join("proc/cpuinfo"), cpu)?;
    std::fs::write(
        root.join("proc/meminfo"),
        "MemTotal:        8388608 kB\nSwapTotal:             0 kB\n",
    )?;
    let disk = root.join("sys/block/vda");
    std::fs::create_dir_all(disk.join("device"))?;
    std::fs::write(disk.join("size"), format!("{}\n", 20u64 << 21))?;
    std::fs::write(disk.join("removable"), "0\n")?;
    Ok(())
}

/// A node of the `default` pool (made a vps-host pool), joined with one fixture GPU, its files under `dir`.
struct Node {
    id: String,
    dir: PathBuf,
    config: PathBuf,
    fixture: PathBuf,
    log: PathBuf,
    /// The VMM's state directory, where each instance's serial console is kept.
    vmm: Option<PathBuf>,
}

async fn vps_node(p: &Plane, dir: &Path, name: &str, vmm: Option<&Path>) -> Node {
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let mut c = claims(name, 1);
    c.hostname = name.into();
    let id = join_at(p, &dir.join("state"), &token, c).await;
    let fixture = dir.join("gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(1, name)).expect("fixture");
    vps_hardware(&dir.join("hw"), name).expect("hardware");
    let config = dir.join("bcd.toml");
    let table = match vmm {
        Some(state) => format!(
            "[vmm]\nstate_dir = {state:?}\naccel = {accel:?}\nstop_timeout_s = {stop}\n\n[vmm.network]\nmode = \"user\"\n",
            accel = std::env::var("BC_VMM_ACCEL").unwrap_or_else(|_| "tcg".into()),
            stop = STOP_TIMEOUT.as_secs(),
        ),
        None => String::new(),
    };
    std::fs::write(&config, table).expect("bcd.toml");
    Node {
        id,
        log: dir.join("bcd.log"),
        dir: dir.to_path_buf(),
        config,
        fixture,
        vmm: vmm.map(Path::to_path_buf),
    }
}

/// Joins with the node's state in `state` (bcd's own join, as `bcd join` does it).
async fn join_at(p: &Plane, state: &Path, token: &str, c: bc_proto::v1::HardwareClaims) -> String {
    let mut config = p.node_config("unused");
    config.state_dir = state.to_path_buf();
    bcd::join::join(
        &config,
        token,
        bcd::join::JoinOptions {
            attempts: 1,
            claims: c,
        },
    )
    .await
    .expect("join")
    .identity
    .node_id
}

/// `bcd run` of the real binary for `node`, its log appended to `node.log`.
fn run_bcd(p: &Plane, node: &Node) -> tokio::process::Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&node.log)
        .expect("log");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_bcd"));
    cmd.arg("--config")
        .arg(&node.config)
        .arg("--state-dir")
        .arg(node.dir.join("state"))
        .args(["run", "--gateway-url", &p.running.gateway_url])
        .args(["--ca-pin", &p.running.ca_pin])
        .args(["--join-public-key", &p.running.join_public_key])
        .arg("--gpu-backend")
        .arg(format!("fixture:{}", node.fixture.display()))
        .arg("--hardware-root")
        .arg(node.dir.join("hw"))
        .env("BCD_LOG", "info")
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCD_JOIN_TOKEN_FILE")
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .kill_on_drop(true);
    cmd.spawn().expect("spawn bcd run")
}

async fn show(p: &Plane, id: &str) -> Value {
    p.admin
        .call("instances", "show", json!({"id": id}))
        .await
        .expect("show")["instance"]
        .clone()
}

/// Polls `instances.show` until `ok` holds for the instance, or fails after `deadline` with the last answer and
/// the daemon's log tail.
async fn wait_instance(
    p: &Plane,
    node: &Node,
    id: &str,
    deadline: Duration,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let end = Instant::now() + deadline;
    loop {
        let v = show(p, id).await;
        if ok(&v) {
            return v;
        }
        if Instant::now() >= end {
            let log = std::fs::read_to_string(&node.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            // The guest's own account: where a boot stopped (a TCG boot once never finished cloud-init).
            let console = node
                .vmm
                .as_ref()
                .and_then(|v| std::fs::read_to_string(console_of(v, id)).ok())
                .unwrap_or_default();
            let screen: Vec<&str> = console.lines().rev().take(40).collect();
            panic!(
                "{id}: not {what} within {} s; last answer {v}\nbcd log (newest first):\n{}\nserial console ({} bytes, newest first):\n{}",
                deadline.as_secs(),
                tail.join("\n"),
                console.len(),
                screen.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// An instance's serial console log under the VMM's state directory.
fn console_of(vmm: &Path, id: &str) -> PathBuf {
    bcd::vmm::instance_dir(vmm, id).join(bcd::vmm::console::FILE)
}

fn observed<'a>(v: &'a Value, field: &str) -> &'a Value {
    &v["observed"][field]
}

fn create_body(url: &str, sha256: &str, vcpus: u32, key: &str) -> Value {
    json!({"tenant": "root", "pool": "default", "vcpus": vcpus, "memory_mib": 1024, "disk_gib": 2,
           "image": {"url": url, "sha256": sha256},
           "user_data": "#cloud-config\nruncmd:\n  - [sh, -c, 'echo bc-lab-runcmd-ran > /dev/ttyS0']\n",
           "ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN0tArEaLkEy lab@example"],
           "idempotency_key": key})
}

fn status_file(vmm: &Path) -> Value {
    std::fs::read_to_string(vmm.join("status.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_lives_its_whole_life_through_the_control_plane_under_qemu() {
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
    let vmm = tmp.path().join("v");
    let _reaper = Reaper(vmm.clone());
    let p = plane_with(Options {
        controllers: true,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    p.admin
        .call(
            "instances",
            "set-pool",
            json!({"pool": "default", "class": "vps-host"}),
        )
        .await
        .expect("set-pool");
    let node = vps_node(&p, tmp.path(), "vps1", Some(&vmm)).await;
    let mut daemon = run_bcd(&p, &node);
    wait_node(&p, &node.id, 90, "adoption", |n| {
        n.state.as_str() == "adopted" && n.acked_generation >= 1
    })
    .await;

    // 1. A bad digest: placed, then failed on the node with the reason, nothing left behind; delete.
    let t = Instant::now();
    let wrong = "0".repeat(64);
    let bad = loop {
        // The node's inventory (its atoms) may still be on its way just after adoption.
        match p
            .admin
            .call("instances", "create", create_body(&url, &wrong, 2, "bad"))
            .await
        {
            Ok(v) => break v["instance"].clone(),
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                println!("create not placed yet: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("create: {e}"),
        }
    };
    let bad_id = bad["id"].as_str().expect("id").to_string();
    assert_eq!(bad["node"], node.id.as_str(), "{bad}");
    let v = wait_instance(&p, &node, &bad_id, Duration::from_secs(60), "failed", |v| {
        observed(v, "state") == "failed"
    })
    .await;
    let reason = observed(&v, "reason").as_str().unwrap_or_default();
    assert!(reason.contains("hashes to"), "reason: {reason}");
    assert!(!vmm.join("instances").join(&bad_id).exists());
    assert!(!vmm.join("images/sha256").join(&wrong).exists());
    p.admin
        .call("instances", "delete", json!({"id": bad_id}))
        .await
        .expect("delete");

    // 2. Create → running → cloud-init done.
    let t0 = Instant::now();
    let created = p
        .admin
        .call("instances", "create", create_body(&url, &sha256, 2, "lab"))
        .await
        .expect("create");
    let id = created["instance"]["id"].as_str().expect("id").to_string();
    let v = wait_instance(&p, &node, &id, Duration::from_secs(120), "running", |v| {
        observed(v, "state") == "running"
    })
    .await;
    let to_running = t0.elapsed();
    let pid = observed(&v, "pid").as_u64().expect("pid") as u32;
    let v = wait_instance(
        &p,
        &node,
        &id,
        CLOUD_INIT_DEADLINE,
        "cloud-init done",
        |v| observed(v, "cloud_init_done") == true,
    )
    .await;
    let to_done = t0.elapsed();
    let console = std::fs::read_to_string(console_of(&vmm, &id)).unwrap_or_default();
    assert!(
        console.contains("DataSourceNoCloud"),
        "cloud-init read the NoCloud seed"
    );
    assert!(console.contains("bc-lab-runcmd-ran"), "the user-data ran");
    println!(
        "{id}: running {:.1} s, cloud-init done {:.1} s after instances.create (pid {pid}, {})",
        to_running.as_secs_f64(),
        to_done.as_secs_f64(),
        observed(&v, "accel")
    );
    // It holds 2 of the node's 4 vCPUs: a create asking for 4 is refused.
    let more = p
        .admin
        .call("instances", "create", create_body(&url, &wrong, 4, "more"))
        .await;
    assert!(
        matches!(&more, Err(bc_control::client::ClientError::Api { code, .. }) if code == "UNAVAILABLE"),
        "{more:?}"
    );

    // 3. Stop (graceful: the ACPI power button), then start again.
    let t = Instant::now();
    p.admin
        .call("instances", "stop", json!({"id": id}))
        .await
        .expect("stop");
    wait_instance(&p, &node, &id, Duration::from_secs(150), "stopped", |v| {
        observed(v, "state") == "stopped" && observed(v, "generation") == 2
    })
    .await;
    let stop_took = t.elapsed();
    assert!(!alive(pid), "QEMU {pid} is gone after the stop");
    println!("{id}: stopped in {:.1} s", stop_took.as_secs_f64());
    assert!(
        stop_took < STOP_TIMEOUT,
        "the stop took {:.1} s: the guest ignored the power button and was forced at the deadline",
        stop_took.as_secs_f64()
    );
    assert!(
        vmm.join("instances").join(&id).join("disk.qcow2").exists(),
        "a stop keeps the disk"
    );
    p.admin
        .call("instances", "start", json!({"id": id}))
        .await
        .expect("start");
    let v = wait_instance(
        &p,
        &node,
        &id,
        Duration::from_secs(120),
        "running again",
        |v| observed(v, "state") == "running" && observed(v, "generation") == 3,
    )
    .await;
    let pid = observed(&v, "pid").as_u64().expect("pid") as u32;

    // 4. The bcd process killed (SIGKILL: no cleanup at all) while the VM runs: the VM keeps running; the binary
    //    started again re-adopts it (the same QEMU PID) and reports it running on its new session.
    daemon.start_kill().expect("kill bcd");
    let _ = daemon.wait().await;
    let epoch = p
        .store
        .node(&node.id)
        .await
        .expect("read")
        .expect("node")
        .session_epoch;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(alive(pid), "the VM outlives bcd");
    let _ = std::fs::remove_file(vmm.join("status.json"));
    let mut daemon = run_bcd(&p, &node);
    wait_node(&p, &node.id, 60, "a new session", |n| {
        n.online && n.session_epoch > epoch
    })
    .await;
    let end = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let s = status_file(&vmm);
        let mine = s["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["id"] == id.as_str())
            .cloned();
        if let Some(m) = mine.filter(|m| m["state"] == "running") {
            break m;
        }
        assert!(
            Instant::now() < end,
            "the restarted bcd reports no running {id}: {s}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(status["pid"], pid, "the same QEMU process: {status}");
    let v = show(&p, &id).await;
    assert_eq!(observed(&v, "state"), "running", "{v}");
    assert_eq!(observed(&v, "pid"), pid, "{v}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        alive(pid),
        "nothing restarted the VM once the desired state arrived again"
    );

    // 5. Delete: the node kills the VM and frees everything; the atoms are back in the pool.
    p.admin
        .call("instances", "delete", json!({"id": id}))
        .await
        .expect("delete");
    let end = Instant::now() + Duration::from_secs(60);
    while vmm.join("instances").join(&id).exists() || alive(pid) {
        assert!(
            Instant::now() < end,
            "{id} not deleted on the node within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let sockets: Vec<_> = std::fs::read_dir(vmm.join("qmp"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(sockets.is_empty(), "QMP sockets left: {sockets:?}");
    let end = Instant::now() + Duration::from_secs(10);
    while vmm.join("images/sha256").join(&sha256).exists() {
        assert!(
            Instant::now() < end,
            "the image no instance uses is not removed"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The control plane confirms the delete once the node reports the VM gone (until then the instance is
    // `deleting` and holds its atoms).
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let v = show(&p, &id).await;
        if v["state"] == "deleted" {
            break;
        }
        assert_eq!(v["state"], "deleting", "{v}");
        assert!(
            Instant::now() < end,
            "{id} not confirmed deleted within 60 s: {v}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The whole node fits again (a bad digest, so nothing boots), and is deleted.
    let all = p
        .admin
        .call("instances", "create", create_body(&url, &wrong, 4, "all"))
        .await
        .expect("the node's 4 vCPUs are free again");
    p.admin
        .call("instances", "delete", json!({"id": all["instance"]["id"]}))
        .await
        .expect("delete");
    daemon.start_kill().expect("kill bcd");
    let _ = daemon.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_vmm_refuses_a_desired_state_that_lists_instances() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = plane_with(Options {
        controllers: true,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    p.admin
        .call(
            "instances",
            "set-pool",
            json!({"pool": "default", "class": "vps-host"}),
        )
        .await
        .expect("set-pool");
    let node = vps_node(&p, tmp.path(), "novmm", None).await;
    let _daemon = run_bcd(&p, &node);
    wait_node(&p, &node.id, 90, "adoption", |n| {
        n.state.as_str() == "adopted" && n.acked_generation >= 1
    })
    .await;
    let t = Instant::now();
    let created = loop {
        match p
            .admin
            .call(
                "instances",
                "create",
                create_body("http://127.0.0.1:9/x.qcow2", &"0".repeat(64), 1, "k"),
            )
            .await
        {
            Ok(v) => break v,
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                println!("create not placed yet: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("create: {e}"),
        }
    };
    assert_eq!(created["instance"]["node"], node.id.as_str());
    let end = Instant::now() + Duration::from_secs(30);
    let message = loop {
        let s = p
            .store
            .desired_status(std::slice::from_ref(&node.id))
            .await
            .expect("status");
        let s = s.get(&node.id).expect("node");
        if s.failing() {
            break s.message.clone().unwrap_or_default();
        }
        assert!(
            Instant::now() < end,
            "the node did not refuse the generation: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        message.contains("runs no VMM") && message.contains("[vmm]"),
        "{message}"
    );
}
