//! A reservation reaches the node: the real `bcd` binary joined and adopted with 8 fixture GPUs, a reservation
//! created through the API is placed by the scheduler role, becomes the node's next desired-state generation, the
//! daemon writes a CDI spec naming exactly the booked GPUs and acknowledges; release removes them.

mod common;

use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use tokio::process::Child;

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Daemon {
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

fn run_bcd(p: &Plane, name: &str, fixture: &Path, cdi: &Path) -> Daemon {
    let child = common::bcd_run(
        Path::new(env!("CARGO_BIN_EXE_bcd")),
        p,
        &p.dir.path().join(name),
        fixture,
        &p.dir.path().join(format!("{name}-hw")),
    )
    .arg("--cdi-dir")
    .arg(cdi)
    .kill_on_drop(true)
    .spawn()
    .expect("spawn bcd run");
    Daemon { child }
}

fn cdi_devices(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path.join(bcd::cdi::FILE_NAME)).ok()?;
    serde_json::from_str(&text).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_becomes_a_cdi_spec_of_exactly_the_booked_gpus_and_release_removes_it()
-> TestResult {
    let p = plane_with(Options {
        controllers: true,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let name = "cdi8";
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let node_id = join(&p, name, &token, claims(name, 8))
        .await?
        .identity
        .node_id;
    let fixture: PathBuf = p.dir.path().join("cdi8-gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(8, name))?;
    fake_hardware(&p.dir.path().join(format!("{name}-hw")), name)?;
    let cdi = p.dir.path().join("cdi");
    let _daemon = run_bcd(&p, name, &fixture, &cdi);
    wait_node(&p, &node_id, 60, "adoption", |n| {
        n.state == "adopted" && n.acked_generation == 1
    })
    .await;
    assert!(cdi_devices(&cdi).is_none(), "nothing booked yet, no spec");

    // The GPU devices follow the node's inventory.
    let devices: i64 =
        bc_store::sqlx::query_scalar("SELECT count(*) FROM devices WHERE node_id = $1")
            .bind(&node_id)
            .fetch_one(p.store.pool())
            .await?;
    assert_eq!(devices, 8);

    let r = p
        .admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 3, "duration_s": 600, "idempotency_key": "e2e"}),
        )
        .await?;
    assert_eq!(r["reservation"]["state"], "placed", "{r}");
    let id = r["reservation"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut booked: Vec<String> = r["reservation"]["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| g["uuid"].as_str().unwrap_or_default().to_string())
        .collect();
    booked.sort();
    assert_eq!(booked.len(), 3);

    // The node acknowledges generation 2 and its CDI spec lists exactly those GPUs.
    wait_node(&p, &node_id, 60, "booking ack", |n| n.acked_generation >= 2).await;
    let spec = cdi_devices(&cdi).ok_or("no CDI spec after the booking")?;
    assert_eq!(spec["kind"], bcd::cdi::KIND);
    let names: Vec<String> = spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| d["name"].as_str().unwrap_or_default().to_string())
        .collect();
    let mut gpu_names: Vec<String> = names
        .iter()
        .filter(|n| n.starts_with("GPU-"))
        .cloned()
        .collect();
    gpu_names.sort();
    assert_eq!(gpu_names, booked, "CDI devices {names:?}");
    assert!(
        names.contains(&id),
        "the reservation device is missing: {names:?}"
    );
    let whole = spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["name"] == id.as_str())
        .map(|d| {
            d["containerEdits"]["env"][0]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .unwrap_or_default();
    for g in &booked {
        assert!(whole.contains(g.as_str()), "{whole}");
    }

    // Release: the next generation removes them; with nothing booked the spec is gone.
    p.admin
        .call("reservations", "release", json!({"id": id}))
        .await?;
    wait_node(&p, &node_id, 60, "release ack", |n| n.acked_generation >= 3).await;
    assert!(
        cdi_devices(&cdi).is_none(),
        "spec still present after release: {:?}",
        cdi_devices(&cdi)
    );
    Ok(())
}

/// A directory the daemon cannot write until [`ReadOnlyDir::make_writable`] (or drop): mode 0555, which stops an
/// unprivileged daemon; where that does not stop this user (root), the immutable attribute (`chattr +i`) as well.
struct ReadOnlyDir {
    dir: PathBuf,
    immutable: bool,
}

impl ReadOnlyDir {
    /// Err(why) when neither way makes `dir` read-only for this user here.
    fn new(dir: &Path) -> Result<ReadOnlyDir, String> {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let probe = |d: &Path| std::fs::File::create(d.join(".probe")).is_err();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555))
            .map_err(|e| e.to_string())?;
        let mut guard = ReadOnlyDir {
            dir: dir.to_path_buf(),
            immutable: false,
        };
        if probe(dir) {
            return Ok(guard);
        }
        let _ = std::fs::remove_file(dir.join(".probe"));
        let chattr = std::process::Command::new("chattr")
            .arg("+i")
            .arg(dir)
            .output()
            .map_err(|e| {
                format!("mode 0555 does not stop this user and chattr is unavailable: {e}")
            })?;
        if !chattr.status.success() {
            return Err(format!(
                "mode 0555 does not stop this user and chattr +i failed: {}",
                String::from_utf8_lossy(&chattr.stderr).trim()
            ));
        }
        guard.immutable = true;
        if probe(dir) {
            Ok(guard)
        } else {
            Err("neither mode 0555 nor chattr +i stops this user from writing".into())
        }
    }

    fn make_writable(&mut self) {
        use std::os::unix::fs::PermissionsExt as _;
        if self.immutable {
            let _ = std::process::Command::new("chattr")
                .arg("-i")
                .arg(&self.dir)
                .status();
            self.immutable = false;
        }
        let _ = std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o755));
    }
}

impl Drop for ReadOnlyDir {
    fn drop(&mut self) {
        self.make_writable();
    }
}

/// Polls `reservations.get` until `f` holds for the reservation, or fails after `secs` naming `what`.
async fn wait_reservation(
    p: &Plane,
    id: &str,
    secs: u64,
    what: &str,
    f: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let v = p
            .admin
            .call("reservations", "get", json!({"id": id}))
            .await
            .expect("get reservation");
        if f(&v["reservation"]) {
            return v["reservation"].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Issue 10 item 12: a booking the node cannot apply (its CDI directory is read-only) is visible: the node's reason
/// reaches the reservation (`delivery` failed, with the reason) and the node (a condition, `desired_state`), the
/// generation is not counted as applied, and once the directory is writable the real daemon's own retry applies
/// it: the spec appears and both views clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_that_fails_on_the_node_is_visible_and_applies_once_the_node_is_fixed()
-> TestResult {
    let p = plane_with(Options {
        controllers: true,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let name = "cdiro";
    let cdi = p.dir.path().join("cdi-ro");
    let mut read_only = match ReadOnlyDir::new(&cdi) {
        Ok(g) => g,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let node_id = join(&p, name, &token, claims(name, 2))
        .await?
        .identity
        .node_id;
    let fixture: PathBuf = p.dir.path().join("cdiro-gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(2, name))?;
    fake_hardware(&p.dir.path().join(format!("{name}-hw")), name)?;
    let _daemon = run_bcd(&p, name, &fixture, &cdi);
    // Generation 1 books nothing, so it applies even on a read-only directory.
    wait_node(&p, &node_id, 60, "adoption", |n| {
        n.state == "adopted" && n.acked_generation == 1
    })
    .await;

    let r = p
        .admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 600}),
        )
        .await?;
    assert_eq!(r["reservation"]["state"], "placed", "{r}");
    let id = r["reservation"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let spec_path = cdi.join(bcd::cdi::FILE_NAME);
    let failed = wait_reservation(&p, &id, 30, "the failed delivery", |r| {
        r["delivery"]["state"] == "failed"
    })
    .await;
    assert_eq!(failed["state"], "placed", "{failed}");
    let node_part = &failed["delivery"]["nodes"][0];
    assert_eq!(node_part["node"], node_id.as_str(), "{failed}");
    assert_eq!(node_part["generation"], 2, "{failed}");
    let reason = node_part["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        reason.contains(&spec_path.display().to_string())
            || reason.contains(&cdi.display().to_string()),
        "the reason names the CDI path: {reason:?}"
    );
    // The node: not counted as applied, the reason as a condition and in desired_state.
    let n = get_node(&p, &node_id).await?.node;
    assert_eq!(n.acked_generation, 1, "{n:?}");
    let desired = n.desired_state.clone().ok_or("no desired_state")?;
    assert!(desired.failing, "{n:?}");
    assert_eq!(desired.failed_generation, 2, "{n:?}");
    assert_eq!(desired.message.as_deref(), Some(reason.as_str()), "{n:?}");
    assert!(
        n.conditions
            .iter()
            .any(|c| c.contains("generation 2") && c.contains(&reason)),
        "{n:?}"
    );
    assert!(!spec_path.exists());

    // Fixed on the node, nothing else done: the daemon's retry applies generation 2.
    read_only.make_writable();
    let fixed_at = tokio::time::Instant::now();
    let applied = wait_reservation(
        &p,
        &id,
        bcd::session::DESIRED_RETRY_CAP.as_secs() * 2,
        "the retried delivery",
        |r| r["delivery"]["state"] == "applied",
    )
    .await;
    println!(
        "applied {} ms after the CDI directory became writable",
        fixed_at.elapsed().as_millis()
    );
    assert!(
        applied["delivery"]["nodes"][0]["message"].is_null(),
        "{applied}"
    );
    let spec = cdi_devices(&cdi).ok_or("no CDI spec after the fix")?;
    let booked = applied["gpus"][0]["uuid"].as_str().unwrap_or_default();
    assert!(
        spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|d| d["name"] == booked),
        "{spec}"
    );
    let n = get_node(&p, &node_id).await?.node;
    assert_eq!(n.acked_generation, 2, "{n:?}");
    assert!(
        n.desired_state.as_ref().is_some_and(|d| !d.failing),
        "{n:?}"
    );
    assert!(
        !n.conditions
            .iter()
            .any(|c| c.contains("could not be applied")),
        "{n:?}"
    );
    Ok(())
}

/// `nodes.get`, typed.
async fn get_node(
    p: &Plane,
    id: &str,
) -> Result<bc_core::api::nodes::NodeDetail, Box<dyn std::error::Error>> {
    let request = bc_core::api::nodes::NodeRef {
        id: bc_core::ids::NodeId::parse(id)?,
    };
    Ok(p.admin
        .method::<bc_control::node_methods::GetNodeMethod>(&request)
        .await?)
}
