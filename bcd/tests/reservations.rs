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
