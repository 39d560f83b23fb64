//! Identity and joining in the store, against a real PostgreSQL: the join commit's accounting of retries, the
//! replay window, a reclaim superseding the node's key, and a GPU UUID belonging to one node at a time.

use bc_core::join::{Expectations, REPLAY_WINDOW_MS};
use bc_core::node::NodeVerb;
use bc_store::Store;
use bc_store::join_tokens::NewJoinToken;
use bc_store::nodes::{JoinCandidate, JoinCommit};
use bc_store::reservations::NodeStateChange;
use bc_store::sessions::OpenRefusal;
use bc_store::sqlx;
use bc_store::testing::test_db;
use serde_json::json;

const TOKEN: &str = "0123456789abcdef";
const RECLAIM: &str = "fedcba9876543210";

async fn store_with_tokens(uses: i32) -> Store {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root tenant");
    store
        .ensure_pool("p1", "root", "pool one", true)
        .await
        .expect("pool");
    for (id, reclaim) in [(TOKEN, false), (RECLAIM, true)] {
        store
            .create_join_token(NewJoinToken {
                id,
                pool_id: "p1",
                secret_hash: "00",
                uses,
                expires_at_ms: i64::MAX / 2_000_000,
                expect: &Expectations::default(),
                reclaim,
                created_by: "test",
            })
            .await
            .expect("token");
    }
    store
}

fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

/// Machine `m` joining with key `key` as node `node` (a fresh id per attempt, as JoinService makes them).
fn machine(node: &str, m: u32, key: &str, hardware_key: bool) -> JoinCandidate {
    JoinCandidate {
        node_id: node.to_string(),
        reclaim: false,
        hardware_key: hardware_key.then(|| format!("hk-{m}")),
        claims: json!({"m": m}),
        join_key_hash: key.to_string(),
        cert_serial: format!("serial-{node}"),
        not_after_ms: 1_900_000_000_000,
        public_key_hex: hex_point(key),
    }
}

/// A distinct public point per key name (what `nodes.public_key` holds).
fn hex_point(key: &str) -> String {
    format!("04{}", hex::encode(key))
}

fn point(key: &str) -> Vec<u8> {
    hex::decode(hex_point(key)).expect("hex")
}

async fn uses_left(store: &Store, id: &str) -> i32 {
    store
        .join_token(id)
        .await
        .expect("read")
        .expect("token")
        .uses_left
}

fn joined(node: &str) -> JoinCommit {
    JoinCommit::Joined {
        node_id: node.into(),
        reclaimed: false,
    }
}

#[tokio::test]
async fn a_batch_mixing_retries_and_new_machines_admits_new_machines_up_to_the_uses() {
    let store = store_with_tokens(4).await;
    let first = [machine("a", 1, "k1", true), machine("b", 2, "k2", true)];
    let out = store
        .commit_joins(TOKEN, "p1", &first, now_ms())
        .await
        .expect("commit");
    assert_eq!(out, vec![joined("a"), joined("b")]);
    assert_eq!(uses_left(&store, TOKEN).await, 2);
    // The two first machines retry (their replies were lost) in the same batch as three new machines: the retries
    // spend nothing, so the two uses left go to the first two new machines.
    let batch = [
        machine("a-retry", 1, "k1", true),
        machine("b-retry", 2, "k2", true),
        machine("c", 3, "k3", true),
        machine("d", 4, "k4", false),
        machine("e", 5, "k5", true),
    ];
    let out = store
        .commit_joins(TOKEN, "p1", &batch, now_ms())
        .await
        .expect("commit");
    assert_eq!(
        out,
        vec![
            JoinCommit::Replay {
                node_id: "a".into()
            },
            JoinCommit::Replay {
                node_id: "b".into()
            },
            joined("c"),
            joined("d"),
            JoinCommit::Exhausted,
        ]
    );
    assert_eq!(uses_left(&store, TOKEN).await, 0);
    assert_eq!(store.list_nodes().await.expect("list").len(), 4);
}

#[tokio::test]
async fn a_retry_after_the_replay_window_is_refused_naming_the_node_with_or_without_a_hardware_key()
{
    let store = store_with_tokens(5).await;
    let out = store
        .commit_joins(
            TOKEN,
            "p1",
            &[
                machine("with-hk", 1, "k1", true),
                machine("no-hk", 2, "k2", false),
            ],
            now_ms(),
        )
        .await
        .expect("commit");
    assert_eq!(out, vec![joined("with-hk"), joined("no-hk")]);
    let retry = [machine("r1", 1, "k1", true), machine("r2", 2, "k2", false)];
    // Within the window: the same nodes, no use spent.
    let out = store
        .commit_joins(TOKEN, "p1", &retry, now_ms() + REPLAY_WINDOW_MS - 60_000)
        .await
        .expect("commit");
    assert_eq!(
        out,
        vec![
            JoinCommit::Replay {
                node_id: "with-hk".into()
            },
            JoinCommit::Replay {
                node_id: "no-hk".into()
            }
        ]
    );
    // A day later (the nodes joined a day ago): refused, naming each node, and nothing spent or written.
    sqlx::query("UPDATE nodes SET joined_at = now() - interval '1 day'")
        .execute(store.pool())
        .await
        .expect("backdate");
    let out = store
        .commit_joins(TOKEN, "p1", &retry, now_ms())
        .await
        .expect("commit");
    for (o, node) in out.iter().zip(["with-hk", "no-hk"]) {
        match o {
            JoinCommit::KeyTaken {
                node_id,
                joined_at_ms,
                same_token: true,
            } => {
                assert_eq!(node_id, node);
                assert!(now_ms() - joined_at_ms >= 86_000_000, "{joined_at_ms}");
            }
            other => panic!("{node}: a retry a day later was {other:?}"),
        }
    }
    assert_eq!(uses_left(&store, TOKEN).await, 3);
    assert_eq!(store.list_nodes().await.expect("list").len(), 2);
}

#[tokio::test]
async fn a_reclaim_supersedes_the_old_key_which_then_opens_no_session() {
    let store = store_with_tokens(2).await;
    store
        .commit_joins(TOKEN, "p1", &[machine("n1", 1, "old", true)], now_ms())
        .await
        .expect("commit");
    let old_epoch = store
        .open_session("n1", &point("old"))
        .await
        .expect("open")
        .expect("the current key opens a session")
        .epoch;
    // Reinstalled: a new key reclaims the node.
    let mut reclaim = machine("n1", 1, "new", true);
    reclaim.reclaim = true;
    let out = store
        .commit_joins(RECLAIM, "p1", &[reclaim], now_ms())
        .await
        .expect("commit");
    assert_eq!(
        out,
        vec![JoinCommit::Joined {
            node_id: "n1".into(),
            reclaimed: true
        }]
    );
    assert_eq!(
        store
            .open_session("n1", &point("old"))
            .await
            .expect("open")
            .err(),
        Some(OpenRefusal::KeySuperseded),
        "the superseded key opened a session"
    );
    // The old session's writes are refused (the reclaim moved the epoch), and the new key opens sessions.
    assert!(
        !store
            .ack_desired("n1", old_epoch, 0, true, "applied")
            .await
            .expect("ack")
    );
    assert!(
        store
            .open_session("n1", &point("new"))
            .await
            .expect("open")
            .is_ok()
    );
    // The old key is revoked: gateways read it with the revoked identities, and the audit names the certificate.
    let revoked = store.revoked_identities_since(None).await.expect("revoked");
    assert_eq!(revoked.keys, vec!["old".to_string()]);
    let detail: serde_json::Value = sqlx::query_scalar(
        "SELECT detail FROM audit_events WHERE action = 'node.reclaimed' AND subject = 'node/n1'",
    )
    .fetch_one(store.pool())
    .await
    .expect("audit");
    assert_eq!(detail["revoked_cert"], "serial-n1");
    assert_eq!(detail["revoked_key"], "old");
    // An unknown node and a revoked one keep their own refusals.
    assert_eq!(
        store
            .open_session("nobody", &point("new"))
            .await
            .expect("open")
            .err(),
        Some(OpenRefusal::Unknown)
    );
    assert!(matches!(
        store
            .set_node_schedulable("n1", NodeVerb::Revoke, "test")
            .await
            .expect("revoke"),
        NodeStateChange::Changed { .. }
    ));
    assert_eq!(
        store
            .open_session("n1", &point("new"))
            .await
            .expect("open")
            .err(),
        Some(OpenRefusal::Revoked)
    );
}

fn gpus(uuids: &[&str]) -> serde_json::Value {
    json!({"gpus": uuids.iter().enumerate().map(|(i, u)| json!({"index": i, "uuid": u, "model": "H100"}))
        .collect::<Vec<_>>()})
}

async fn audits(store: &Store, action: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE action = $1")
        .bind(action)
        .fetch_one(store.pool())
        .await
        .expect("audit")
}

async fn bookable(store: &Store) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = store
        .free_devices(None)
        .await
        .expect("free")
        .into_iter()
        .map(|d| (d.node_id, d.uuid))
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn a_gpu_uuid_belongs_to_one_node_and_a_second_report_is_a_condition() {
    let store = store_with_tokens(3).await;
    store
        .commit_joins(
            TOKEN,
            "p1",
            &[
                machine("n1", 1, "k1", true),
                machine("n2", 2, "k2", true),
                machine("n3", 3, "k3", true),
            ],
            now_ms(),
        )
        .await
        .expect("commit");
    sqlx::query("UPDATE nodes SET state = 'adopted'")
        .execute(store.pool())
        .await
        .expect("adopt");
    store
        .sync_gpu_devices("n1", &gpus(&["G1", "G2"]))
        .await
        .expect("sync");
    // n2 reports G2 as well (a copied UUID, or a GPU moved while n1 was away).
    let sync = store
        .sync_gpu_devices("n2", &gpus(&["G2", "G3"]))
        .await
        .expect("sync");
    assert_eq!(sync.conflicted.len(), 1);
    let pair = |n: &str, u: &str| (n.to_string(), u.to_string());
    assert_eq!(
        bookable(&store).await,
        vec![pair("n1", "G1"), pair("n1", "G2"), pair("n2", "G3")],
        "one physical GPU is bookable once"
    );
    let n2 = store.node("n2").await.expect("read").expect("node");
    let conditions = n2.conditions.to_string();
    assert!(
        conditions.contains("GPU G2 is also reported by node n1"),
        "{conditions}"
    );
    assert_eq!(audits(&store, "gpu.conflict").await, 1);
    // Reported again (a reconnect): still one device, still one audit event.
    store
        .sync_gpu_devices("n2", &gpus(&["G2", "G3"]))
        .await
        .expect("sync");
    assert_eq!(bookable(&store).await.len(), 3);
    assert_eq!(audits(&store, "gpu.conflict").await, 1);
    // A third node reports G2 too: it waits behind n2.
    store
        .sync_gpu_devices("n3", &gpus(&["G2"]))
        .await
        .expect("sync");
    // n1 reports without G2 (the GPU moved): it goes to n2, which waited longest; n3 now waits for n2.
    store
        .sync_gpu_devices("n1", &gpus(&["G1"]))
        .await
        .expect("sync");
    assert_eq!(
        bookable(&store).await,
        vec![pair("n1", "G1"), pair("n2", "G2"), pair("n2", "G3")]
    );
    assert_eq!(audits(&store, "gpu.handed-over").await, 1);
    let n2 = store.node("n2").await.expect("read").expect("node");
    assert!(
        !n2.conditions.to_string().contains("G2"),
        "{}",
        n2.conditions
    );
    let n3 = store.node("n3").await.expect("read").expect("node");
    assert!(
        n3.conditions
            .to_string()
            .contains("GPU G2 is also reported by node n2"),
        "{}",
        n3.conditions
    );
    // Revoking n2 (the operator's path, `nodes revoke`) releases its GPUs: G2 goes to n3.
    let change = store
        .set_node_schedulable("n2", bc_core::node::NodeVerb::Revoke, "test")
        .await
        .expect("revoke");
    assert!(
        matches!(
            change,
            bc_store::reservations::NodeStateChange::Changed { .. }
        ),
        "{change:?}"
    );
    assert_eq!(
        bookable(&store).await,
        vec![pair("n1", "G1"), pair("n3", "G2")]
    );
    // The invariant, whatever the path: no UUID is present on two nodes.
    let doubles: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT uuid FROM devices WHERE present GROUP BY uuid HAVING count(*) > 1) d",
    )
    .fetch_one(store.pool())
    .await
    .expect("count");
    assert_eq!(doubles, 0);
}

#[tokio::test]
async fn two_nodes_reporting_one_new_gpu_at_once_get_one_device() {
    let store = store_with_tokens(8).await;
    let batch: Vec<JoinCandidate> = (1..=8)
        .map(|m| machine(&format!("n{m}"), m, &format!("k{m}"), true))
        .collect();
    store
        .commit_joins(TOKEN, "p1", &batch, now_ms())
        .await
        .expect("commit");
    sqlx::query("UPDATE nodes SET state = 'adopted'")
        .execute(store.pool())
        .await
        .expect("adopt");
    let mut tasks = tokio::task::JoinSet::new();
    for m in 1..=8 {
        let store = store.clone();
        tasks.spawn(async move {
            store
                .sync_gpu_devices(&format!("n{m}"), &gpus(&["SHARED", &format!("OWN-{m}")]))
                .await
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("task").expect("sync");
    }
    let shared: Vec<(String, String)> = bookable(&store)
        .await
        .into_iter()
        .filter(|(_, u)| u == "SHARED")
        .collect();
    assert_eq!(shared.len(), 1, "{shared:?}");
    assert_eq!(bookable(&store).await.len(), 9);
    assert_eq!(audits(&store, "gpu.conflict").await, 7);
}
