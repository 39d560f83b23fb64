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

#[path = "../../bcd/tests/common/mod.rs"]
mod common;
#[allow(dead_code)]
#[path = "qemu/lab.rs"]
mod lab;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bcd_ramdisk::agent::{DIAGNOSE_KIND, DIAGNOSE_PAYLOAD_TYPE};
use common::Options;
use serde_json::json;

const GATEWAY_PORT: u16 = 8443;

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
        Err(why) => {
            println!("SKIP: qemu ramdisk agent: {why}");
            return;
        }
    };
    if !lab::is_root() {
        println!("SKIP: qemu ramdisk agent: needs root for the network namespace");
        return;
    }
    // The only guest of this test binary (lab::SERIAL serializes guests within one binary; it is not held here
    // because the checks await while QEMU runs).
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
            return Err("no node joined within 200 s".into());
        }
        tick().await;
    };
    let joined_at = started.elapsed();
    let online_at = loop {
        let row = p
            .store
            .node(&node_id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("node row vanished")?;
        if row.online && row.session_epoch >= 1 {
            break started.elapsed();
        }
        if Instant::now() > deadline {
            return Err(format!(
                "session of {node_id} did not open: {} online={} epoch={}",
                row.state, row.online, row.session_epoch
            ));
        }
        tick().await;
    };
    let deadline_ms = (time::OffsetDateTime::now_utc().unix_timestamp() + 120) * 1000;
    p.store
        .queue_command(
            "qemu-diag-1",
            &node_id,
            DIAGNOSE_KIND,
            &json!({}),
            deadline_ms,
        )
        .await
        .map_err(|e| e.to_string())?;
    let (state, result, error, envelope) = loop {
        let row: (
            String,
            Option<serde_json::Value>,
            Option<String>,
            Option<Vec<u8>>,
        ) = bc_store::sqlx::query_as(
            "SELECT state, result, error, envelope FROM commands WHERE id = 'qemu-diag-1'",
        )
        .fetch_one(p.store.pool())
        .await
        .map_err(|e| e.to_string())?;
        if !matches!(row.0.as_str(), "pending" | "sent") {
            break row;
        }
        if Instant::now() > deadline {
            return Err(format!("ramdisk.diagnose still {} at the deadline", row.0));
        }
        tick().await;
    };
    let done_at = started.elapsed();
    if state != "done" {
        return Err(format!("ramdisk.diagnose ended {state}: {error:?}"));
    }
    let result = result.ok_or("no stored result")?;
    // The guest's own hardware: QEMU's virtio NIC with the MAC the lab gives it.
    let macs = result["nics"].to_string();
    if !macs.contains("52:54:00:12:34:56") {
        return Err(format!("the report is not the guest's: nics {macs}"));
    }
    let env: bc_proto::v1::SignedEnvelope =
        prost::Message::decode(envelope.ok_or("no stored envelope")?.as_slice())
            .map_err(|e| e.to_string())?;
    if env.payload_type != DIAGNOSE_PAYLOAD_TYPE {
        return Err(format!("payload type {}", env.payload_type));
    }
    let key = p
        .store
        .node_public_key(&node_id)
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
    Ok(Checks {
        node_id,
        joined_at,
        online_at,
        done_at,
    })
}
