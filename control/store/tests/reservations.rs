//! Reservation queries against a real PostgreSQL: the placer's booking is fenced against drains (a node that left
//! `adopted` is never booked, and a drain waits for a placement that read the node as bookable), and a node's
//! failed desired-state acknowledgements reach the node's status and the reservations they carry.

use bc_core::node::{LiveState, NodeState, NodeVerb};
use bc_core::reservation::{Delivery, ReservationState};
use bc_store::Store;
use bc_store::reservations::{Decision, NewReservation, NodeStateChange};
use bc_store::testing::{seed_gpu_nodes, test_db};
use std::time::Duration;

fn rsv(id: &str) -> bc_core::ids::ReservationId {
    bc_core::ids::ReservationId::parse(id).expect("id")
}

const MODEL: &str = "NVIDIA H100 80GB HBM3";

async fn admit(store: &Store, id: &str) {
    let request = serde_json::json!({"tenant": "root", "gpus": 1, "duration_s": 60});
    store
        .admit_reservation(NewReservation {
            id,
            principal_id: "admin",
            key: id,
            body_hash: "h",
            tenant: "root",
            request: &request,
            duration_s: 60,
        })
        .await
        .expect("admit");
}

fn place_on(id: &str, node: &str) -> Decision {
    Decision::Place {
        id: id.to_string(),
        devices: vec![(
            format!("{node}/gpu/GPU-{node}-0"),
            node.to_string(),
            serde_json::json!({"node": node, "uuid": format!("GPU-{node}-0"), "index": 0, "model": MODEL}),
        )],
        duration_s: 60,
    }
}

fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

fn all_shards() -> Vec<i16> {
    (0..256).collect()
}

/// Issue 10 item 14: a placement decided on a stale view (the node was drained after the placer read capacity) is
/// not booked: it comes back for a retry, the reservation stays pending and the node's devices stay free. After
/// undrain the same decision books.
#[tokio::test]
async fn a_placement_on_a_node_that_left_adopted_is_retried_not_booked() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "gpu", "n", 2, 2, MODEL)
        .await
        .expect("seed");
    admit(&store, "rsv-1").await;
    let (tx, pending) = store.claim_pending(&all_shards(), 10).await.expect("claim");
    assert_eq!(pending.len(), 1);
    // The drain lands between the placer's read of capacity and its commit.
    let drained = store
        .set_node_schedulable("n-1", NodeVerb::Drain, "test")
        .await
        .expect("drain");
    assert_eq!(
        drained,
        NodeStateChange::Changed {
            from: LiveState::Adopted
        }
    );
    let retry = store
        .commit_placements(tx, &[place_on("rsv-1", "n-1")])
        .await
        .expect("commit");
    assert_eq!(retry, vec!["rsv-1".to_string()]);
    let booked: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(booked, 0);
    let r = store
        .reservation(&rsv("rsv-1"))
        .await
        .expect("read")
        .expect("row");
    assert_eq!(r.state, ReservationState::Pending);
    assert!(
        store
            .free_devices(None)
            .await
            .expect("free")
            .iter()
            .all(|d| d.node_id != "n-1"),
        "a draining node offers no capacity"
    );

    // Undrain: bookable again.
    assert_eq!(
        store
            .set_node_schedulable("n-1", NodeVerb::Undrain, "test")
            .await
            .expect("undrain"),
        NodeStateChange::Changed {
            from: LiveState::Draining
        }
    );
    let (tx, _) = store.claim_pending(&all_shards(), 10).await.expect("claim");
    let retry = store
        .commit_placements(tx, &[place_on("rsv-1", "n-1")])
        .await
        .expect("commit");
    assert!(retry.is_empty());
    let r = store
        .reservation(&rsv("rsv-1"))
        .await
        .expect("read")
        .expect("row");
    assert_eq!(r.state, ReservationState::Placed);
    assert_eq!(
        r.nodes,
        vec![bc_core::ids::NodeId::parse("n-1").expect("id")]
    );

    // Verbs on a state they do not apply to change nothing.
    assert_eq!(
        store
            .set_node_schedulable("n-2", NodeVerb::Undrain, "test")
            .await
            .expect("undrain adopted"),
        NodeStateChange::Unchanged
    );
    store
        .set_node_schedulable("n-2", NodeVerb::Revoke, "test")
        .await
        .expect("revoke");
    assert_eq!(
        store
            .set_node_schedulable("n-2", NodeVerb::Drain, "test")
            .await
            .expect("drain revoked"),
        NodeStateChange::Refused {
            state: NodeState::Revoked,
            reason: "node n-2 is revoked; nothing to change".into()
        }
    );
    assert!(matches!(
        store
            .set_node_schedulable("nope", NodeVerb::Drain, "test")
            .await,
        Err(bc_store::StoreError::NotFound { .. })
    ));
}

/// A drain waits for a placement transaction that read the node as bookable (FOR KEY SHARE against the drain's FOR
/// UPDATE), so whatever that placement books is committed before the drain returns, never after.
#[tokio::test]
async fn a_drain_waits_for_a_placement_in_flight_on_the_node() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "gpu", "n", 1, 1, MODEL)
        .await
        .expect("seed");
    let mut placing = db.pool.begin().await.expect("begin");
    bc_store::sqlx::query("SELECT 1 FROM nodes WHERE id = 'n-1' FOR KEY SHARE")
        .execute(&mut *placing)
        .await
        .expect("key share");
    let drain = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .set_node_schedulable("n-1", NodeVerb::Drain, "test")
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !drain.is_finished(),
        "the drain did not wait for the placement"
    );
    placing.commit().await.expect("commit");
    let done = tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .expect("drain finishes once the placement commits")
        .expect("task")
        .expect("drain");
    assert_eq!(
        done,
        NodeStateChange::Changed {
            from: LiveState::Adopted
        }
    );
}

/// Issue 10 item 12: a failed acknowledgement records the node's reason and does not count as applied (so the
/// generation is sent again on the next session); the reservations it carries show it failed with that reason
/// until the node applies that generation or a newer one. Stale failures change nothing; reasons are bounded and
/// a NUL from the node cannot break the write.
#[tokio::test]
async fn a_failed_acknowledgement_reaches_the_node_and_the_reservations_it_carries() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "gpu", "n", 1, 2, MODEL)
        .await
        .expect("seed");
    bc_store::sqlx::query("UPDATE nodes SET session_epoch = 1")
        .execute(&db.pool)
        .await
        .expect("epoch");
    assert!(
        store
            .ack_desired("n-1", 1, 1, true, "")
            .await
            .expect("ack 1")
    );
    admit(&store, "rsv-1").await;
    let (tx, _) = store.claim_pending(&all_shards(), 10).await.expect("claim");
    assert!(
        store
            .commit_placements(tx, &[place_on("rsv-1", "n-1")])
            .await
            .expect("place")
            .is_empty()
    );
    let ids = vec!["rsv-1".to_string()];
    let nodes = vec!["n-1".to_string()];
    let delivered = |store: Store| async move {
        store
            .deliveries(&["rsv-1".to_string()])
            .await
            .expect("deliveries")["rsv-1"][0]
            .clone()
    };
    let d = delivered(store.clone()).await;
    assert_eq!((d.generation, d.state), (2, Delivery::Pending), "{d:?}");

    // The node cannot apply generation 2.
    let long = format!(
        "writing /etc/cdi/x.json: Read-only file system\0{}",
        "é".repeat(3000)
    );
    assert!(
        store
            .ack_desired("n-1", 1, 2, false, &long)
            .await
            .expect("ack failed")
    );
    let status = store.desired_status(&nodes).await.expect("status")["n-1"].clone();
    assert!(status.failing(), "{status:?}");
    assert_eq!(
        (status.applied_generation, status.failed_generation),
        (1, 2)
    );
    let reason = status.message.clone().unwrap_or_default();
    assert!(
        reason.starts_with("writing /etc/cdi/x.json: Read-only file system\u{fffd}"),
        "{reason}"
    );
    assert!(reason.len() <= bc_store::sessions::MAX_ACK_REASON_BYTES);
    let since = status.failing_since_ms.expect("failing since");
    assert!(
        status
            .condition()
            .is_some_and(|c| c.contains("generation 2") && c.contains("Read-only"))
    );
    let d = delivered(store.clone()).await;
    assert_eq!(d.state, Delivery::Failed);
    assert_eq!(d.message.as_deref(), Some(reason.as_str()));
    // Not applied: the pull of waiting messages still offers generation 2.
    let out = store
        .pending_for(&[("n-1".to_string(), 1)], now_ms())
        .await
        .expect("pending");
    assert!(
        out.iter().any(|o| matches!(
            o,
            bc_store::sessions::Outgoing::Desired { generation: 2, .. }
        )),
        "generation 2 is not offered again: {out:?}"
    );

    // A later failure with another reason: the reason follows, the run of failures keeps its start.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        store
            .ack_desired("n-1", 1, 2, false, "another reason")
            .await
            .expect("again")
    );
    let status = store.desired_status(&nodes).await.expect("status")["n-1"].clone();
    assert_eq!(status.message.as_deref(), Some("another reason"));
    assert_eq!(status.failing_since_ms, Some(since));

    // A stale session's acknowledgement is refused.
    assert!(
        !store
            .ack_desired("n-1", 0, 2, true, "")
            .await
            .expect("stale")
    );

    // Applied: the node and the reservation clear; a late failure of an older generation changes nothing.
    assert!(
        store
            .ack_desired("n-1", 1, 2, true, "")
            .await
            .expect("applied")
    );
    let status = store.desired_status(&nodes).await.expect("status")["n-1"].clone();
    assert!(
        !status.failing() && status.condition().is_none(),
        "{status:?}"
    );
    assert_eq!(status.failing_since_ms, None);
    let d = delivered(store.clone()).await;
    assert_eq!((d.state, d.message), (Delivery::Applied, None));
    assert!(
        store
            .ack_desired("n-1", 1, 1, false, "late")
            .await
            .expect("late")
    );
    assert!(!store.desired_status(&nodes).await.expect("status")["n-1"].failing());
    // Released reservations have no delivery.
    store
        .end_reservation(&rsv("rsv-1"), ReservationState::Released, "test")
        .await
        .expect("release");
    assert!(store.deliveries(&ids).await.expect("deliveries").is_empty());
}

/// The placer's transaction runs generic plans ([`Store::begin_placement`]): its claim, booking and placement
/// statements are planned once per connection instead of on every batch (PostgreSQL's default kept making custom
/// plans for them, which cost more than running them), and on a fleet with statistics those generic plans read
/// `devices`, `nodes` and `reservations` by key, never by a scan. One connection, so `pg_prepared_statements` (a
/// session's view) sees every statement the placer ran.
#[tokio::test]
async fn the_placers_statements_run_generic_plans_that_read_by_key() {
    let db = test_db().await;
    seed_gpu_nodes(&db.pool, "gpu", "n", 2_000, 8, MODEL)
        .await
        .expect("seed");
    // Reservations placed long ago, as a fleet in service has (the placement statements update by key among them).
    bc_store::testing::insert_reservations(&db.pool, "rsv-old-", (1, 20_000), "released", "'{}'")
        .await
        .expect("old reservations");
    bc_store::sqlx::query("ANALYZE")
        .execute(&db.pool)
        .await
        .expect("analyze");
    let one = db.one_connection().await;
    let store = Store::new(one.clone());
    // Three batches named by notification, then one found by the queue scan: each placed on a node of its own.
    let mut node = 0;
    for batch in 0..4 {
        let ids: Vec<String> = (0..4).map(|k| format!("rsv-b{batch}-{k}")).collect();
        for id in &ids {
            admit(&store, id).await;
        }
        let (tx, pending) = if batch < 3 {
            store.claim_pending_ids(&ids, &all_shards()).await
        } else {
            store.claim_pending(&all_shards(), 10).await
        }
        .expect("claim");
        assert_eq!(pending.len(), 4, "batch {batch}");
        let decisions: Vec<Decision> = pending
            .iter()
            .map(|p| {
                node += 1;
                place_on(&p.id, &format!("n-{node}"))
            })
            .collect();
        let retry = store
            .commit_placements(tx, &decisions)
            .await
            .expect("commit");
        assert!(retry.is_empty(), "batch {batch}: {retry:?}");
    }
    let booked: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL",
    )
    .fetch_one(&one)
    .await
    .expect("count");
    assert_eq!(booked, 16);

    let placer = |s: &str| {
        s.contains("FOR UPDATE SKIP LOCKED")
            || s.contains("WITH want AS")
            || s.contains("WITH p AS")
    };
    let prepared: Vec<(String, String, i64, i64, i32)> = bc_store::sqlx::query_as(
        "SELECT name, statement, generic_plans, custom_plans, COALESCE(cardinality(parameter_types), 0) \
         FROM pg_prepared_statements",
    )
    .fetch_all(&one)
    .await
    .expect("prepared statements");
    let ran: Vec<_> = prepared.iter().filter(|p| placer(&p.1)).collect();
    // The named claim, the scan's claim, the booking and the placement.
    assert_eq!(ran.len(), 4, "{prepared:#?}");
    for (_, statement, generic, custom, _) in &ran {
        assert_eq!(
            *custom, 0,
            "a placer statement was planned afresh {custom} times: {statement}"
        );
        assert!(*generic >= 1, "{statement}");
    }
    // What those generic plans do, on this fleet's statistics.
    let mut tx = store.begin_placement().await.expect("begin");
    for (name, statement, _, _, params) in &ran {
        let nulls = vec!["NULL"; usize::try_from(*params).expect("count")].join(", ");
        let plan: Vec<String> = bc_store::sqlx::query_scalar(bc_store::sqlx::AssertSqlSafe(
            format!("EXPLAIN EXECUTE {name}({nulls})"),
        ))
        .fetch_all(&mut *tx)
        .await
        .expect("explain");
        let plan = plan.join("\n");
        for table in ["devices", "nodes", "reservations"] {
            assert!(
                !plan.contains(&format!("Seq Scan on {table}")),
                "the generic plan scans {table}:\n{plan}\nfor {statement}"
            );
        }
    }
    tx.rollback().await.expect("rollback");
}

/// A device's booking and its release are HOT updates (migration 16): no index of `devices` names
/// `reservation_id`, each page keeps room for a new version, so PostgreSQL writes no index entry for them. The
/// lookups that used the dropped index still find every device: a release frees a reservation's GPUs on each of its
/// nodes, and a lost race undoes exactly what the placement booked.
#[tokio::test]
async fn bookings_and_releases_touch_no_index_of_devices() {
    let db = test_db().await;
    let one = db.one_connection().await;
    let store = Store::new(one.clone());
    seed_gpu_nodes(&one, "gpu", "n", 4, 2, MODEL)
        .await
        .expect("seed");
    let indexes: Vec<String> = bc_store::sqlx::query_scalar(
        "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'devices'::regclass",
    )
    .fetch_all(&one)
    .await
    .expect("indexes");
    assert!(
        indexes.iter().all(|d| !d.contains("reservation_id")),
        "{indexes:#?}"
    );
    let options: Option<Vec<String>> =
        bc_store::sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE relname = 'devices'")
            .fetch_one(&one)
            .await
            .expect("reloptions");
    assert_eq!(options, Some(vec!["fillfactor=80".to_string()]));

    let updates = || async {
        bc_store::sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&one)
            .await
            .expect("flush");
        bc_store::sqlx::query_as::<_, (i64, i64)>(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'devices'",
        )
        .fetch_one(&one)
        .await
        .expect("devices statistics")
    };
    let booked = |node: &str| {
        let (one, node) = (one.clone(), node.to_string());
        async move {
            bc_store::sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM devices WHERE node_id = $1 AND reservation_id IS NOT NULL",
            )
            .bind(node)
            .fetch_one(&one)
            .await
            .expect("count")
        }
    };
    let gpu = |node: &str, i: i32| {
        (
            format!("{node}/gpu/GPU-{node}-{i}"),
            node.to_string(),
            serde_json::json!({"node": node, "uuid": format!("GPU-{node}-{i}"), "index": i, "model": MODEL}),
        )
    };
    let (upd0, hot0) = updates().await;
    // rsv-1 takes both GPUs of n-1 and one of n-2; rsv-2 one of n-3.
    admit(&store, "rsv-1").await;
    admit(&store, "rsv-2").await;
    let (tx, pending) = store.claim_pending(&all_shards(), 10).await.expect("claim");
    assert_eq!(pending.len(), 2);
    let retry = store
        .commit_placements(
            tx,
            &[
                Decision::Place {
                    id: "rsv-1".into(),
                    devices: vec![gpu("n-1", 0), gpu("n-1", 1), gpu("n-2", 0)],
                    duration_s: 60,
                },
                Decision::Place {
                    id: "rsv-2".into(),
                    devices: vec![gpu("n-3", 0)],
                    duration_s: 60,
                },
            ],
        )
        .await
        .expect("commit");
    assert!(retry.is_empty(), "{retry:?}");
    assert_eq!(
        (
            booked("n-1").await,
            booked("n-2").await,
            booked("n-3").await
        ),
        (2, 1, 1)
    );
    // A lost race: rsv-3 wants n-3's free GPU and n-1's GPU 0, which rsv-1 holds. The free one it booked is undone.
    admit(&store, "rsv-3").await;
    let (tx, _) = store.claim_pending(&all_shards(), 10).await.expect("claim");
    let retry = store
        .commit_placements(
            tx,
            &[Decision::Place {
                id: "rsv-3".into(),
                devices: vec![gpu("n-3", 1), gpu("n-1", 0)],
                duration_s: 60,
            }],
        )
        .await
        .expect("commit");
    assert_eq!(retry, vec!["rsv-3".to_string()]);
    assert_eq!(booked("n-3").await, 1, "the lost race's booking was undone");
    // Releasing rsv-1 frees its GPUs on both of its nodes, and nothing of rsv-2's.
    let released = store
        .end_reservation(&rsv("rsv-1"), ReservationState::Released, "test")
        .await
        .expect("release")
        .expect("was placed");
    assert_eq!(released.state, ReservationState::Released);
    assert_eq!(
        (
            booked("n-1").await,
            booked("n-2").await,
            booked("n-3").await
        ),
        (0, 0, 1)
    );
    let (upd1, hot1) = updates().await;
    // Booked: 3 + 1, then 1 more and its undo, then 3 freed.
    assert_eq!(upd1 - upd0, 9);
    assert_eq!(
        hot1 - hot0,
        upd1 - upd0,
        "every booking and release should be a HOT update (no index entry)"
    );
}

/// Migration 18: no column of the base schema is generated through a SQL function (PostgreSQL 15 inlined `bc_shard`,
/// parsing its body, on every statement that wrote the table), and every writer of a shard or a pool writes the value
/// the generated column gave: `bc_shard(<key>)` and `request ->> 'pool'`. Written here by the group commit's and the
/// single admission, the placement (reservation, outbox and expiry rows), the join's seeding path and `queue_work`.
#[tokio::test]
async fn shards_and_pools_are_written_by_their_statements_as_the_generated_columns_wrote_them() {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    assert_eq!(
        bc_store::testing::generated_columns_calling_sql_functions(&db.pool)
            .await
            .expect("catalog"),
        Vec::<String>::new()
    );
    seed_gpu_nodes(&db.pool, "gpu", "n", 3, 1, MODEL)
        .await
        .expect("seed");
    let pooled = serde_json::json!({"tenant": "root", "gpus": 1, "duration_s": 60, "pool": "gpu"});
    let plain = serde_json::json!({"tenant": "root", "gpus": 1, "duration_s": 60});
    fn new<'a>(id: &'a str, request: &'a serde_json::Value) -> NewReservation<'a> {
        NewReservation {
            id,
            principal_id: "admin",
            key: id,
            body_hash: "h",
            tenant: "root",
            request,
            duration_s: 60,
        }
    }
    let recorded = store
        .admit_reservations(&[new("rsv-batch-a", &pooled), new("rsv-batch-b", &plain)])
        .await
        .expect("group commit");
    assert_eq!(recorded, vec![true, true]);
    store
        .admit_reservation(new("rsv-single", &pooled))
        .await
        .expect("single");
    let (tx, pending) = store.claim_pending(&all_shards(), 10).await.expect("claim");
    assert_eq!(pending.len(), 3);
    let retry = store
        .commit_placements(
            tx,
            &[
                place_on("rsv-batch-a", "n-1"),
                place_on("rsv-batch-b", "n-2"),
                place_on("rsv-single", "n-3"),
            ],
        )
        .await
        .expect("place");
    assert!(retry.is_empty(), "{retry:?}");
    store
        .queue_work("test.kind", "subject-1", now_ms())
        .await
        .expect("queue");
    let counts: (i64, i64, i64) = bc_store::sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM work_queue), \
                (SELECT count(*) FROM reservations WHERE pool IS NOT DISTINCT FROM request ->> 'pool')",
    )
    .fetch_one(&db.pool)
    .await
    .expect("counts");
    assert_eq!(
        counts,
        (3, 4, 3),
        "outbox rows, work items, reservations with their pool"
    );
    let pools: Vec<Option<String>> =
        bc_store::sqlx::query_scalar("SELECT pool FROM reservations ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("pools");
    assert_eq!(pools, vec![Some("gpu".into()), None, Some("gpu".into())]);
    let misplaced = bc_store::testing::misplaced_shards(
        &db.pool,
        &[
            ("reservations", "id"),
            ("outbox", "node_id"),
            ("work_queue", "subject"),
            ("nodes", "id"),
        ],
    )
    .await
    .expect("shards");
    assert!(misplaced.is_empty(), "{misplaced:?}");
}

/// A decision's notification carries each reservation as decided, so a waiting API call answers without reading it:
/// what it carries equals a read of the row after the commit, every payload stays under PostgreSQL's 8,000-byte
/// limit however many decisions a batch has, and a row too large to carry (here a failure's long reason) comes as
/// its bare id, which the API reads. A scheduler of an older build sent the ids separated by commas.
#[tokio::test]
async fn a_decisions_notification_carries_each_reservation_as_a_read_returns_it() {
    use bc_store::reservations::{DECIDED_CHANNEL, decided_entries, decided_reservation};
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "gpu", "n", 20, 1, MODEL)
        .await
        .expect("seed");
    let mut listener = bc_store::sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .expect("listener");
    listener.listen(DECIDED_CHANNEL).await.expect("listen");
    let ids: Vec<String> = (1..=21).map(|i| format!("rsv-d{i:02}")).collect();
    for id in &ids {
        admit(&store, id).await;
    }
    let (tx, pending) = store.claim_pending(&all_shards(), 64).await.expect("claim");
    assert_eq!(pending.len(), 21);
    let mut decisions: Vec<Decision> = (1..=20)
        .map(|i| place_on(&format!("rsv-d{i:02}"), &format!("n-{i}")))
        .collect();
    let long_reason = "no capacity: ".to_string() + &"x".repeat(5_000);
    decisions.push(Decision::Fail {
        id: "rsv-d21".into(),
        error: long_reason.clone(),
    });
    let retry = store
        .commit_placements(tx, &decisions)
        .await
        .expect("commit");
    assert!(retry.is_empty(), "{retry:?}");

    let mut carried = std::collections::BTreeMap::new();
    let mut bare = Vec::new();
    let mut payloads = 0;
    while carried.len() + bare.len() < 21 {
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("a notification within 5 s")
            .expect("notification");
        payloads += 1;
        assert!(n.payload().len() < 8_000, "{} bytes", n.payload().len());
        for (id, json) in decided_entries(n.payload()) {
            match json {
                Some(json) => {
                    carried.insert(id.to_string(), decided_reservation(json).expect("parse"));
                }
                None => bare.push(id.to_string()),
            }
        }
    }
    assert!(payloads >= 2, "20 placements do not fit one payload");
    assert_eq!(
        bare,
        vec!["rsv-d21".to_string()],
        "the long failure comes as its id"
    );
    assert_eq!(carried.len(), 20);
    for (id, r) in &carried {
        let read = store
            .reservation(&rsv(id))
            .await
            .expect("read")
            .expect("row");
        assert_eq!(r, &read, "{id}: carried and read differ");
        assert_eq!(r.state, ReservationState::Placed);
        assert_eq!(r.gpus.len(), 1);
        assert!(r.placed_at_ms.is_some() && r.expires_at_ms.is_some());
    }
    let failed = store
        .reservation(&rsv("rsv-d21"))
        .await
        .expect("read")
        .expect("row");
    assert_eq!(failed.error.as_deref(), Some(long_reason.as_str()));
    // An older scheduler's payload: ids separated by commas, each to be read.
    assert_eq!(
        decided_entries("rsv-1,rsv-2").collect::<Vec<_>>(),
        vec![("rsv-1", None), ("rsv-2", None)]
    );
    assert!(
        decided_reservation("{\"id\": \"rsv-1\"}").is_err(),
        "an incomplete row is refused, not guessed"
    );
}
