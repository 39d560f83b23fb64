//! Agent mode in QEMU: a real control plane (bcd's test harness: PostgreSQL, JoinService, gateway) on the host,
//! reachable from the guest at 10.99.0.1:8443 inside the test's network namespace, and the ramdisk booted with
//! `bc.url`, `bc.ca_pin`, `bc.join_key` and a one-use `bc.boot_token` on its kernel command line. The guest must
//! get a lease with its own DHCP client, join as the machine's node, open a session, and answer a queued
//! `ramdisk.diagnose` with its report signed by the node key.
//!
//! The gateway listens on the host's loopback; a relay in the test binds 10.99.0.1:8443 *inside* the namespace
//! (a socket created by a thread that entered it) and forwards each connection to it, so TLS, the certificate
//! names (the gateway certificate covers 10.99.0.1) and mTLS are end to end. Skips (`SKIP: …`) without QEMU, the
//! images, root, or PostgreSQL.
//!
//! The second test is the whole deploy over the session: `ramdisk.stream` writes the lab OS image (served by the
//! namespace's HTTP server) to the guest's virtio disk with progress stored while it runs, then `ramdisk.kexec`
//! with a fresh one-use join token answers `loaded` (signed) before the jump, and the serial console shows the
//! installed system booting with the NoCloud seed holding that token. The two guests run one at a time.

#[path = "../../bcd/tests/common/mod.rs"]
mod common;
#[allow(dead_code)]
#[path = "qemu/lab.rs"]
mod lab;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bcd_ramdisk::agent::{DIAGNOSE_KIND, DIAGNOSE_PAYLOAD_TYPE, KEXEC_KIND, STREAM_KIND};
use bcd_ramdisk::commands::{KEXEC_PAYLOAD_TYPE, STREAM_PAYLOAD_TYPE};
use common::Options;
use serde_json::json;

const GATEWAY_PORT: u16 = 8443;
/// One guest at a time in this binary (TCG on two cores); held across awaits, hence tokio's mutex.
static GUEST: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Binds `SERVER_IP:GATEWAY_PORT` inside network namespace `ns` and forwards every connection to `target` (in the
/// test's own namespace). Threads end with the test process; the namespace's deletion closes the listener.
#[allow(unsafe_code)] // setns(2) has no safe wrapper in std or libc
fn relay_into_namespace(ns: &str, target: SocketAddr) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel::<TcpStream>();
    // Connections to the gateway are made from a thread that stays in the test's namespace.
    std::thread::spawn(move || {
        for inbound in rx {
            let Ok(outbound) = TcpStream::connect(target) else {
                continue;
            };
            for (mut from, mut to) in [
                (inbound.try_clone(), outbound.try_clone()),
                (outbound.try_clone(), inbound.try_clone()),
            ]
            .into_iter()
            .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
            {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: setns on this thread only (CLONE_NEWNET), with a valid namespace fd; the thread is then used for
        // nothing but this listener.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            let _ = bound_tx.send(Err(format!("setns: {}", std::io::Error::last_os_error())));
            return;
        }
        let listener = match TcpListener::bind((lab::SERVER_IP, GATEWAY_PORT)) {
            Ok(l) => l,
            Err(e) => {
                let _ = bound_tx.send(Err(format!("bind in the namespace: {e}")));
                return;
            }
        };
        let _ = bound_tx.send(Ok(()));
        for conn in listener.incoming().flatten() {
            if tx.send(conn).is_err() {
                return;
            }
        }
    });
    bound_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|e| format!("relay: {e}"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_joins_from_qemu_and_answers_a_signed_diagnose() {
    let images = match lab::images(false) {
        Ok(i) => i,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    if !lab::is_root() {
        bc_testkit::skip!("needs root for the network namespace");
    }
    let _one = GUEST.lock().await;
    let p = common::plane_with_config(
        Options {
            fast: true,
            ..Options::default()
        },
        |c| c.gateway_hosts = vec![lab::SERVER_IP.into(), "127.0.0.1".into()],
    )
    .await;
    let gateway = p.running.gateway_addr.expect("gateway address");
    let served = tempfile::tempdir().expect("tempdir");
    let ns = lab::Netns::create(served.path()).expect("network namespace");
    relay_into_namespace(&ns.name, gateway).expect("relay into the namespace");
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let cmdline = format!(
        "bc.url=https://{}:{GATEWAY_PORT} bc.ca_pin={} bc.join_key={} bc.boot_token={token}",
        lab::SERVER_IP,
        p.running.ca_pin,
        p.running.join_public_key
    );
    let stop = AtomicBool::new(false);
    let work = tempfile::tempdir().expect("tempdir");
    // Probe the accelerator first, so the timings below start with QEMU.
    lab::accel(&images);
    let started = Instant::now();
    let (checks, run) = std::thread::scope(|scope| {
        let guest = scope.spawn(|| {
            lab::boot_until(
                &images,
                work.path(),
                &cmdline,
                &[],
                Some(&ns),
                Duration::from_secs(240),
                &stop,
            )
        });
        // The checks run on this test's runtime while QEMU runs on the scoped thread; then the guest is stopped.
        let checks = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(checks(&p, started))
        });
        stop.store(true, Ordering::Relaxed);
        (checks, guest.join().expect("qemu thread"))
    });
    println!("qemu run: {:?}", run.elapsed);
    let checks = checks.unwrap_or_else(|e| panic!("{e}\n{}", run.dump()));
    println!(
        "node {} joined {:.1} s after qemu started (guest: DHCP at {:?} ms, join took {} ms); session open at {:.1} s; signed diagnose at {:.1} s",
        checks.node_id,
        checks.joined_at.as_secs_f64(),
        run.phase("dhcp").map(|p| p.0),
        run.report("join")
            .map(|j| j["elapsed_ms"].clone())
            .unwrap_or_default(),
        checks.online_at.as_secs_f64(),
        checks.done_at.as_secs_f64(),
    );
    let dhcp = run
        .report("dhcp")
        .unwrap_or_else(|| panic!("no lease\n{}", run.dump()));
    assert!(
        dhcp["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.99.0.")),
        "{dhcp}"
    );
    let join = run
        .report("join")
        .unwrap_or_else(|| panic!("no join report\n{}", run.dump()));
    assert_eq!(join["node_id"], checks.node_id.as_str(), "{join}");
    let done = run
        .report("command")
        .unwrap_or_else(|| panic!("no command report\n{}", run.dump()));
    assert_eq!(done["kind"], DIAGNOSE_KIND);
    assert_eq!(done["ok"], true, "{done}");
    assert!(!run.has_line("bc-fatal"), "{}", run.dump());
}

struct Checks {
    node_id: String,
    joined_at: Duration,
    online_at: Duration,
    done_at: Duration,
}

/// Waits (≤ 200 s under TCG) for the node row, its session, then queues `ramdisk.diagnose` and checks the signed
/// result against the key the control plane recorded at join.
async fn checks(p: &common::Plane, started: Instant) -> Result<Checks, String> {
    let deadline = started + Duration::from_secs(200);
    let (node_id, joined_at, online_at) = wait_online(p, started, deadline).await?;
    queue(p, "qemu-diag-1", &node_id, DIAGNOSE_KIND, json!({})).await?;
    let done = wait_finished(p, "qemu-diag-1", deadline, |_| {}).await?;
    let done_at = started.elapsed();
    if done.state != "done" {
        return Err(format!(
            "ramdisk.diagnose ended {}: {:?}",
            done.state, done.error
        ));
    }
    let result = done.result.ok_or("no stored result")?;
    // The guest's own hardware: QEMU's virtio NIC with the MAC the lab gives it.
    let macs = result["nics"].to_string();
    if !macs.contains("52:54:00:12:34:56") {
        return Err(format!("the report is not the guest's: nics {macs}"));
    }
    verify_signed(p, &node_id, done.envelope, DIAGNOSE_PAYLOAD_TYPE).await?;
    Ok(Checks {
        node_id,
        joined_at,
        online_at,
        done_at,
    })
}

/// Waits for the node row and its open session: (node id, joined at, online at), as times since `started`.
async fn wait_online(
    p: &common::Plane,
    started: Instant,
    deadline: Instant,
) -> Result<(String, Duration, Duration), String> {
    let tick = || tokio::time::sleep(Duration::from_millis(200));
    let node_id = loop {
        let id: Option<String> = bc_store::sqlx::query_scalar("SELECT id FROM nodes LIMIT 1")
            .fetch_optional(p.store.pool())
            .await
            .map_err(|e| e.to_string())?;
        if let Some(id) = id {
            break id;
        }
        if Instant::now() > deadline {
            return Err("no node joined in time".into());
        }
        tick().await;
    };
    let joined_at = started.elapsed();
    loop {
        let row = p
            .store
            .node(&node_id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("node row vanished")?;
        if row.online && row.session_epoch >= 1 {
            return Ok((node_id, joined_at, started.elapsed()));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "session of {node_id} did not open: {} online={} epoch={}",
                row.state, row.online, row.session_epoch
            ));
        }
        tick().await;
    }
}

async fn queue(
    p: &common::Plane,
    id: &str,
    node_id: &str,
    kind: &str,
    args: serde_json::Value,
) -> Result<(), String> {
    let deadline_ms = (time::OffsetDateTime::now_utc().unix_timestamp() + 300) * 1000;
    p.store
        .queue_command(id, node_id, kind, &args, deadline_ms)
        .await
        .map_err(|e| e.to_string())
}

/// (state, result, error, envelope, progress) of a command.
type CommandRow = (
    String,
    Option<serde_json::Value>,
    Option<String>,
    Option<Vec<u8>>,
    Option<serde_json::Value>,
);

/// A finished command's row.
struct Finished {
    state: String,
    result: Option<serde_json::Value>,
    error: Option<String>,
    envelope: Option<Vec<u8>>,
}

/// Polls command `id` until it leaves pending/sent; `progress` sees each distinct progress stored meanwhile.
async fn wait_finished(
    p: &common::Plane,
    id: &str,
    deadline: Instant,
    mut progress: impl FnMut(&serde_json::Value),
) -> Result<Finished, String> {
    let mut last: Option<serde_json::Value> = None;
    loop {
        let row: CommandRow = bc_store::sqlx::query_as(
            "SELECT state, result, error, envelope, progress FROM commands WHERE id = $1",
        )
        .bind(id)
        .fetch_one(p.store.pool())
        .await
        .map_err(|e| e.to_string())?;
        if let Some(pr) = &row.4
            && last.as_ref() != Some(pr)
        {
            progress(pr);
            last = Some(pr.clone());
        }
        if !matches!(row.0.as_str(), "pending" | "sent") {
            return Ok(Finished {
                state: row.0,
                result: row.1,
                error: row.2,
                envelope: row.3,
            });
        }
        if Instant::now() > deadline {
            return Err(format!("{id} still {} at the deadline", row.0));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Checks a stored envelope: its payload type, its signature by the key recorded at join, and that a changed
/// payload fails.
async fn verify_signed(
    p: &common::Plane,
    node_id: &str,
    envelope: Option<Vec<u8>>,
    payload_type: &str,
) -> Result<(), String> {
    let env: bc_proto::v1::SignedEnvelope =
        prost::Message::decode(envelope.ok_or("no stored envelope")?.as_slice())
            .map_err(|e| e.to_string())?;
    if env.payload_type != payload_type {
        return Err(format!("payload type {}", env.payload_type));
    }
    let key = p
        .store
        .node_public_key(node_id)
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no recorded key")?;
    let spiffe = format!("spiffe://test.bc/node/{node_id}");
    bc_proto::envelope::verify(&env, &key, &spiffe).map_err(|e| format!("signature: {e}"))?;
    let mut forged = env.clone();
    forged.payload.push(b' ');
    if bc_proto::envelope::verify(&forged, &key, &spiffe).is_ok() {
        return Err("a changed payload still verifies".into());
    }
    Ok(())
}

// === the whole deploy over the session ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_streams_the_lab_os_and_kexecs_into_it_over_the_session() {
    let images = match lab::images(true) {
        Ok(i) => i,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    if !lab::is_root() {
        bc_testkit::skip!("needs root for the network namespace");
    }
    let _one = GUEST.lock().await;
    let p = common::plane_with_config(
        Options {
            fast: true,
            ..Options::default()
        },
        |c| c.gateway_hosts = vec![lab::SERVER_IP.into(), "127.0.0.1".into()],
    )
    .await;
    let gateway = p.running.gateway_addr.expect("gateway address");
    // The namespace's HTTP server serves images/out: lab-os.img.zst is the image the session streams.
    let ns = lab::Netns::create(&images.dir).expect("network namespace");
    relay_into_namespace(&ns.name, gateway).expect("relay into the namespace");
    let boot_token = p.token(json!({"pool": "default", "uses": 1})).await;
    let cmdline = format!(
        "bc.url=https://{}:{GATEWAY_PORT} bc.ca_pin={} bc.join_key={} bc.boot_token={boot_token}",
        lab::SERVER_IP,
        p.running.ca_pin,
        p.running.join_public_key
    );
    let work = tempfile::tempdir().expect("tempdir");
    let vda = work.path().join("vda.img");
    // Empty and sparse: the stream must write the whole image.
    std::fs::File::create(&vda)
        .and_then(|f| f.set_len(64 << 20))
        .expect("vda");
    let stop = AtomicBool::new(false);
    lab::accel(&images);
    let started = Instant::now();
    let (deploy, run) = std::thread::scope(|scope| {
        let guest = scope.spawn(|| {
            lab::boot_until(
                &images,
                work.path(),
                &cmdline,
                &[lab::Disk {
                    path: &vda,
                    kind: "virtio",
                    serial: "bc-vd-1",
                }],
                Some(&ns),
                Duration::from_secs(300),
                &stop,
            )
        });
        let deploy = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(deploy(
                &p,
                &images,
                &work.path().join("serial.log"),
                started,
            ))
        });
        // After a good deploy the installed system powers off by itself (-no-reboot ends QEMU); otherwise stop it.
        if deploy.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        (deploy, guest.join().expect("qemu thread"))
    });
    println!("qemu run: {:?}", run.elapsed);
    let d = deploy.unwrap_or_else(|e| panic!("{e}\n{}", run.dump()));
    println!(
        "online at {:.1} s; stream done at {:.1} s; kexec answered at {:.1} s; progress rows seen while streaming:",
        d.online_at.as_secs_f64(),
        d.stream_done_at.as_secs_f64(),
        d.kexec_done_at.as_secs_f64(),
    );
    for row in &d.progress {
        println!("  {row}");
    }
    for line in run.log.lines().filter(|l| {
        l.contains("bc-kexec") || l.contains("bc-report command") || l.contains("bc-report stream")
    }) {
        println!("console: {}", line.chars().take(300).collect::<String>());
    }
    assert!(
        !run.timed_out,
        "the installed system did not power off\n{}",
        run.dump()
    );
    let marker = run.log.find("BC-LAB-OS booted");
    println!(
        "jump seen at {} s, installed OS marker at {} s after qemu started; QEMU exited at {:.1} s",
        d.jump_at
            .map(|t| format!("{:.1}", t.as_secs_f64()))
            .unwrap_or_else(|| "?".into()),
        d.marker_at
            .map(|t| format!("{:.1}", t.as_secs_f64()))
            .unwrap_or_else(|| "?".into()),
        run.elapsed.as_secs_f64()
    );
    assert!(marker.is_some(), "{}", run.dump());
    // The token is left on the installed root (0600), not in the seed: the lab OS names it by its digest. The
    // installed system's own join and rejoin as the same node is hwtests/tests/metal_flow_lab.rs's (b); here its
    // join may be refused, and with no identity it powers off.
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        format!("{}\n", d.seed_token).as_bytes(),
    ));
    let token_line = format!(
        "BC-LAB-OS: join token on the root (sha256 {})",
        &digest[..16]
    );
    assert!(
        run.has_line(&token_line),
        "the installed OS must find the fresh join token on its root\n{}",
        run.dump()
    );
    assert!(
        run.has_line("BC-LAB-OS-SEED meta-data: instance-id: bc-525400123456-"),
        "{}",
        run.dump()
    );
    assert!(
        run.has_line("bc-kexec: answer handed to the session"),
        "the jump waited for the answer\n{}",
        run.dump()
    );
    let answer = run.log.find("bc-kexec: answer handed to the session");
    let jump = run.log.find("bc-kexec: jumping into the installed kernel");
    assert!(
        answer.is_some() && jump.is_some() && answer < jump && jump < marker,
        "answer, jump, then the installed system\n{}",
        run.dump()
    );
    assert!(!run.has_line("bc-fatal"), "{}", run.dump());
}

struct Deploy {
    online_at: Duration,
    stream_done_at: Duration,
    kexec_done_at: Duration,
    progress: Vec<serde_json::Value>,
    seed_token: String,
    /// When the serial log showed the jump, and the installed system's marker (polled, 100 ms).
    jump_at: Option<Duration>,
    marker_at: Option<Duration>,
}

async fn deploy(
    p: &common::Plane,
    images: &lab::Images,
    serial: &std::path::Path,
    started: Instant,
) -> Result<Deploy, String> {
    let deadline = started + Duration::from_secs(240);
    let (node_id, _, online_at) = wait_online(p, started, deadline).await?;
    let sha = std::fs::read_to_string(images.dir.join("lab-os.img.zst.sha256"))
        .map_err(|e| format!("lab-os.img.zst.sha256: {e}"))?
        .trim()
        .to_string();
    let image_len = std::fs::metadata(images.dir.join("lab-os.img"))
        .map_err(|e| format!("lab-os.img: {e}"))?
        .len();
    queue(
        p,
        "qemu-stream-1",
        &node_id,
        STREAM_KIND,
        json!({
            "url": format!("http://{}:8080/lab-os.img.zst", lab::SERVER_IP),
            "sha256": sha,
            "device": "vda",
        }),
    )
    .await?;
    let mut progress = Vec::new();
    let stream = wait_finished(p, "qemu-stream-1", deadline, |v| progress.push(v.clone())).await?;
    let stream_done_at = started.elapsed();
    if stream.state != "done" {
        return Err(format!(
            "ramdisk.stream ended {}: {:?} {:?}",
            stream.state, stream.error, stream.result
        ));
    }
    let result = stream.result.clone().ok_or("no stream result")?;
    if result.to_string().contains("\"error\"") {
        return Err(format!("ramdisk.stream answered an error: {result}"));
    }
    if !result.to_string().contains(&sha) {
        return Err(format!(
            "the stream's result lacks the digest {sha}: {result}"
        ));
    }
    if !result.to_string().contains(&image_len.to_string()) {
        return Err(format!(
            "the stream's result lacks the image size {image_len}: {result}"
        ));
    }
    verify_signed(p, &node_id, stream.envelope, STREAM_PAYLOAD_TYPE).await?;
    if progress.is_empty() {
        return Err("no progress was stored while the stream ran".into());
    }
    let seed_token = p.token(json!({"pool": "default", "uses": 1})).await;
    queue(
        p,
        "qemu-kexec-1",
        &node_id,
        KEXEC_KIND,
        json!({"target": "vda", "seed": {"join_token": seed_token}}),
    )
    .await?;
    let kexec = wait_finished(p, "qemu-kexec-1", deadline, |_| {}).await?;
    let kexec_done_at = started.elapsed();
    let answer = kexec.result.clone().unwrap_or_default();
    if kexec.state != "done" || answer["loaded"] != true {
        return Err(format!(
            "ramdisk.kexec ended {}: {:?} {answer}",
            kexec.state, kexec.error
        ));
    }
    verify_signed(p, &node_id, kexec.envelope, KEXEC_PAYLOAD_TYPE).await?;
    // Timings only; the test asserts on the whole log once QEMU has exited.
    let (mut jump_at, mut marker_at) = (None, None);
    while marker_at.is_none() && Instant::now() < deadline {
        let log = std::fs::read_to_string(serial).unwrap_or_default();
        if jump_at.is_none() && log.contains("bc-kexec: jumping") {
            jump_at = Some(started.elapsed());
        }
        if log.contains("BC-LAB-OS booted") {
            marker_at = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Deploy {
        jump_at,
        marker_at,
        online_at,
        stream_done_at,
        kexec_done_at,
        progress,
        seed_token,
    })
}
