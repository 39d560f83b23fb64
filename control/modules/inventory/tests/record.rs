//! The inventory module against a real PostgreSQL: a section is checked, stored under the node's current session
//! epoch (a stale one is not), and a typed `gpus` section becomes bookable devices; a malformed one keeps nothing.

use bc_core::api::inventory::{InventoryRefusal, Recorded, SectionReport};
use bc_core::ids::NodeId;
use bc_mod_inventory::Inventory;
use bc_store::Store;
use bc_store::testing::{seed_gpu_nodes, test_db};

fn report<'a>(
    node: &'a NodeId,
    epoch: i64,
    name: &'a str,
    payload: &'a [u8],
    hash: &'a [u8],
) -> SectionReport<'a> {
    SectionReport {
        node,
        epoch,
        name,
        hash,
        payload,
    }
}

async fn devices(store: &Store, node: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT uuid FROM devices WHERE node_id = $1 AND present ORDER BY uuid")
        .bind(node)
        .fetch_all(store.pool())
        .await
        .expect("devices")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sections_are_checked_stored_and_gpus_become_devices() {
    let db = test_db().await;
    seed_gpu_nodes(&db.pool, "p", "n", 1, 0, "H100")
        .await
        .expect("seed");
    let store = Store::new(db.pool.clone());
    let inventory = Inventory::new(store.clone());
    let node = NodeId::parse("n-1").expect("id");
    let epoch: i64 = sqlx::query_scalar("SELECT session_epoch FROM nodes WHERE id = 'n-1'")
        .fetch_one(&db.pool)
        .await
        .expect("epoch");

    let gpus = br#"{"backend":"fixture","gpus":[{"index":0,"uuid":"GPU-a","model":"H100"},{"index":1,"uuid":"GPU-b","model":"H100","clique":"f/1"}],"notes":[]}"#;
    let hash = bc_proto::sha256(gpus);
    assert_eq!(
        inventory
            .record_section(report(&node, epoch, "gpus", gpus, &hash))
            .await,
        Ok(Recorded::Stored)
    );
    assert_eq!(devices(&store, "n-1").await, vec!["GPU-a", "GPU-b"]);
    let stored = store.inventory("n-1").await.expect("inventory");
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].2["gpus"][1]["clique"], "f/1");

    // Another session's section: nothing stored.
    let cpu = br#"{"model":"x"}"#;
    let cpu_hash = bc_proto::sha256(cpu);
    assert_eq!(
        inventory
            .record_section(report(&node, epoch + 7, "cpu", cpu, &cpu_hash))
            .await,
        Ok(Recorded::Stale)
    );
    assert_eq!(store.inventory("n-1").await.expect("inventory").len(), 1);

    // Refusals say why and keep nothing: an unknown name, a wrong hash, not JSON, a `gpus` section of the wrong shape.
    let refused = |r: Result<Recorded, InventoryRefusal>| match r {
        Err(InventoryRefusal::Invalid(why)) => why,
        other => format!("not refused as invalid: {other:?}"),
    };
    let why = refused(
        inventory
            .record_section(report(&node, epoch, "bios", cpu, &cpu_hash))
            .await,
    );
    assert!(why.contains("unknown inventory section \"bios\""), "{why}");
    let why = refused(
        inventory
            .record_section(report(&node, epoch, "cpu", cpu, &hash))
            .await,
    );
    assert!(why.contains("hash does not match"), "{why}");
    let junk = b"{not json";
    let junk_hash = bc_proto::sha256(junk);
    let why = refused(
        inventory
            .record_section(report(&node, epoch, "cpu", junk, &junk_hash))
            .await,
    );
    assert!(why.contains("not JSON"), "{why}");
    let wrong = br#"{"gpus":[{"index":"zero","uuid":"GPU-c","model":"H100"}]}"#;
    let wrong_hash = bc_proto::sha256(wrong);
    let why = refused(
        inventory
            .record_section(report(&node, epoch, "gpus", wrong, &wrong_hash))
            .await,
    );
    assert!(why.starts_with("section gpus:"), "{why}");
    assert_eq!(devices(&store, "n-1").await, vec!["GPU-a", "GPU-b"]);
    let stored = store.inventory("n-1").await.expect("inventory");
    assert_eq!(
        stored[0].2["gpus"][0]["uuid"], "GPU-a",
        "the malformed section replaced nothing"
    );

    // A later section without GPU-b: it is no longer bookable.
    let fewer = br#"{"backend":"fixture","gpus":[{"index":0,"uuid":"GPU-a","model":"H100"}]}"#;
    let fewer_hash = bc_proto::sha256(fewer);
    assert_eq!(
        inventory
            .record_section(report(&node, epoch, "gpus", fewer, &fewer_hash))
            .await,
        Ok(Recorded::Stored)
    );
    assert_eq!(devices(&store, "n-1").await, vec!["GPU-a"]);
}
