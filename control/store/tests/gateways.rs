//! Sessions whose gateway died, against a real PostgreSQL: a restarted gateway is given its previous run's
//! sessions and closes those whose node did not reconnect; the `controllers` role takes offline the nodes of a gateway silent past its lease, on its leased shards
//! only, once, and never those of a gateway that refreshed its row since the watch looked; a gateway heard from
//! again is told to close those sessions.

use bc_core::gateways::GatewayWatch;
use bc_store::Store;
use bc_store::sqlx;
use bc_store::testing::{seed_gpu_nodes, test_db};

/// Marks `nodes` online in a session of epoch 1 held by `gateway`.
async fn held(store: &Store, gateway: &str, nodes: &[&str]) {
    sqlx::query(
        "UPDATE nodes SET online = true, gateway_id = $2, session_epoch = 1, last_seen_at = now() \
         WHERE id = ANY($1)",
    )
    .bind(nodes)
    .bind(gateway)
    .execute(store.pool())
    .await
    .expect("sessions");
}

async fn online(store: &Store) -> Vec<String> {
    sqlx::query_scalar("SELECT id FROM nodes WHERE online ORDER BY id")
        .fetch_all(store.pool())
        .await
        .expect("online")
}

/// (subject, action, actor, detail's gateway) of the session transitions, in order.
async fn transitions(store: &Store) -> Vec<(String, String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT subject, action, actor, detail ->> 'gateway' FROM audit_events \
         WHERE action IN ('node.online', 'node.offline') ORDER BY id",
    )
    .fetch_all(store.pool())
    .await
    .expect("audit")
}

#[tokio::test]
async fn a_restarted_gateway_closes_the_sessions_of_its_previous_run_whose_node_did_not_reconnect()
{
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "p", "n", 4, 1, "m")
        .await
        .expect("seed");
    store
        .publish_gateway("gw-a", "https://10.0.0.5:7443", 30_000)
        .await
        .expect("publish");
    held(&store, "gw-a", &["n-1", "n-2", "n-3"]).await;
    held(&store, "gw-b", &["n-4"]).await;
    // gw-a was killed and starts again: it reads its previous run's sessions; gw-b's is not its own.
    store
        .publish_gateway("gw-a", "https://10.0.0.5:7443", 30_000)
        .await
        .expect("start");
    let previous = store.sessions_on_gateway("gw-a").await.expect("read");
    assert_eq!(
        previous,
        [
            ("n-1".to_string(), 1),
            ("n-2".to_string(), 1),
            ("n-3".to_string(), 1)
        ]
    );
    assert_eq!(online(&store).await.len(), 4, "reading closes nothing");
    // n-1 reconnects (through gw-b) before the lease is over: its newer session is left as it is.
    sqlx::query("UPDATE nodes SET session_epoch = 2, gateway_id = 'gw-b' WHERE id = 'n-1'")
        .execute(store.pool())
        .await
        .expect("reconnect");
    let closes: Vec<(&str, i64, Option<i64>)> = previous
        .iter()
        .map(|(n, e)| (n.as_str(), *e, None))
        .collect();
    let closed = store
        .close_sessions_because(&closes, Some("its gateway restarted"))
        .await
        .expect("close");
    assert_eq!(closed, 2);
    assert_eq!(online(&store).await, ["n-1", "n-4"]);
    let reasons: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT subject, detail FROM audit_events WHERE action = 'node.offline' ORDER BY subject",
    )
    .fetch_all(store.pool())
    .await
    .expect("audit");
    assert_eq!(
        reasons,
        [
            (
                "node/n-2".to_string(),
                serde_json::json!({"epoch": 1, "reason": "its gateway restarted"})
            ),
            (
                "node/n-3".to_string(),
                serde_json::json!({"epoch": 1, "reason": "its gateway restarted"})
            )
        ]
    );
    // Starting again finds nothing of its own online, and the row carries the new lease.
    store
        .publish_gateway("gw-a", "https://10.0.0.5:7443", 6_000)
        .await
        .expect("start");
    assert!(
        store
            .sessions_on_gateway("gw-a")
            .await
            .expect("read")
            .is_empty()
    );
    let rows = store.gateway_rows().await.expect("rows");
    assert_eq!(
        rows.iter()
            .map(|r| (r.id.as_str(), r.lease_ms))
            .collect::<Vec<_>>(),
        [("gw-a", 6_000)]
    );
}

#[tokio::test]
async fn a_silent_gateways_nodes_go_offline_on_the_leased_shards_once_and_its_sessions_close_if_it_is_heard_again()
 {
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "p", "n", 6, 1, "m")
        .await
        .expect("seed");
    for gw in ["gw-a", "gw-b"] {
        store
            .publish_gateway(gw, &format!("https://{gw}:7443"), 1_000)
            .await
            .expect("publish");
    }
    held(&store, "gw-a", &["n-1", "n-2", "n-3", "n-4"]).await;
    held(&store, "gw-b", &["n-5"]).await;
    // The controller leases every shard but n-4's (and whatever other node shares it).
    let n4: i16 = sqlx::query_scalar("SELECT shard FROM nodes WHERE id = 'n-4'")
        .fetch_one(&db.pool)
        .await
        .expect("shard");
    let shards: Vec<i16> = (0..256).filter(|s| *s != n4).collect();
    let leased_gw_a: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM nodes WHERE gateway_id = 'gw-a' AND shard <> $1 ORDER BY id",
    )
    .bind(n4)
    .fetch_all(&db.pool)
    .await
    .expect("nodes");
    assert!(leased_gw_a.len() >= 2, "{leased_gw_a:?}");

    let mut watch = GatewayWatch::new();
    assert!(
        watch
            .observe(0, &store.gateway_rows().await.expect("rows"))
            .is_empty()
    );
    let silent = watch.observe(1_001, &store.gateway_rows().await.expect("rows"));
    assert_eq!(silent.len(), 2, "{silent:?}");
    // gw-b refreshes its row after the watch looked: the decision about it is stale and changes nothing.
    store
        .publish_gateway("gw-b", "https://gw-b:7443", 1_000)
        .await
        .expect("refresh");

    // A lease that ran out writes nothing.
    let expired = store
        .sync_leases("controllers", "c", &shards, 100)
        .await
        .expect("leases");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let none = store
        .offline_on_silent_gateways("controllers", "c", &expired, &silent, 100)
        .await
        .expect("fenced");
    assert!(none.is_empty(), "an expired lease wrote {none:?}");
    assert_eq!(online(&store).await.len(), 5);

    let leases = store
        .sync_leases("controllers", "c", &shards, 30_000)
        .await
        .expect("leases");
    // One node per statement: the caller repeats until a statement takes fewer than the limit.
    let mut taken = Vec::new();
    loop {
        let got = store
            .offline_on_silent_gateways("controllers", "c", &leases, &silent, 1)
            .await
            .expect("sweep");
        let done = got.is_empty();
        taken.extend(got);
        if done {
            break;
        }
    }
    assert_eq!(
        taken,
        leased_gw_a
            .iter()
            .map(|n| (n.clone(), "gw-a".to_string()))
            .collect::<Vec<_>>()
    );
    let still: Vec<String> = online(&store).await;
    assert!(
        still.contains(&"n-4".to_string()) && still.contains(&"n-5".to_string()),
        "{still:?}"
    );
    let t = transitions(&store).await;
    assert_eq!(t.len(), leased_gw_a.len(), "{t:?}");
    assert!(
        t.iter()
            .all(|(_, action, actor, gw)| action == "node.offline"
                && actor == "controller/c"
                && gw.as_deref() == Some("gw-a")),
        "{t:?}"
    );

    // gw-a was only cut off from the database: its next liveness round is told to close those sessions (the
    // nodes reconnect, and their opens record them online), and marks no node online.
    let now_ms = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("ms");
    let seen: Vec<(String, i64, i64)> = leased_gw_a
        .iter()
        .map(|n| (n.clone(), 1, now_ms + 5_000))
        .collect();
    assert_eq!(
        store.record_liveness(&seen, 0).await.expect("liveness"),
        leased_gw_a
    );
    assert_eq!(online(&store).await.len(), 5 - leased_gw_a.len());
    assert_eq!(transitions(&store).await.len(), leased_gw_a.len());
}
