//! Store tests against a real PostgreSQL (the harness starts a private cluster).

use bc_core::join::Expectations;
use bc_core::node::NodeVerb;
use bc_store::Store;
use bc_store::join_tokens::NewJoinToken;
use bc_store::nodes::{JoinCandidate, JoinCommit};
use bc_store::reservations::NodeStateChange;
use bc_store::testing::{seed_gpu_nodes, test_db};

async fn seeded(uses: i32) -> Store {
    let db = test_db().await;
    seed(Store::new(db.pool.clone()), uses).await
}

/// `store` with the root tenant, pool p1 and a join token of `uses` uses.
async fn seed(store: Store, uses: i32) -> Store {
    store.ensure_root_tenant().await.expect("root tenant");
    store
        .ensure_pool("p1", "root", "pool one", true)
        .await
        .expect("pool");
    store
        .create_join_token(NewJoinToken {
            id: "0123456789abcdef",
            pool_id: "p1",
            secret_hash: "00",
            uses,
            expires_at_ms: i64::MAX / 2_000_000,
            expect: &Expectations::default(),
            reclaim: false,
            created_by: "test",
        })
        .await
        .expect("token");
    store
}

/// The public point `candidate` records ("04ab").
const KEY: [u8; 2] = [0x04, 0xab];

fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

fn candidate(n: u32, hk: &str) -> JoinCandidate {
    JoinCandidate {
        node_id: format!("node-{n}"),
        reclaim: false,
        hardware_key: Some(hk.to_string()),
        claims: serde_json::json!({"n": n}),
        join_key_hash: format!("key-{n}"),
        cert_serial: format!("{n:02x}"),
        not_after_ms: 1_900_000_000_000,
        public_key_hex: "04ab".into(),
    }
}

#[tokio::test]
async fn batch_grants_at_most_uses_left_and_refuses_duplicate_hardware() {
    let store = seeded(3).await;
    // A refused candidate (duplicate hardware) takes no use from the ones after it.
    let batch = vec![
        candidate(1, "hk-a"),
        candidate(2, "hk-a"),
        candidate(3, "hk-c"),
        candidate(4, "hk-d"),
        candidate(5, "hk-e"),
    ];
    let out = store
        .commit_joins("0123456789abcdef", "p1", &batch, now_ms())
        .await
        .expect("commit");
    assert_eq!(
        out[0],
        JoinCommit::Joined {
            node_id: "node-1".into(),
            reclaimed: false
        }
    );
    assert_eq!(
        out[1],
        JoinCommit::HardwareTaken {
            node_id: "node-1".into(),
        }
    );
    for (i, n) in [(2, 3), (3, 4)] {
        assert_eq!(
            out[i],
            JoinCommit::Joined {
                node_id: format!("node-{n}"),
                reclaimed: false
            }
        );
    }
    assert_eq!(out[4], JoinCommit::Exhausted);
    let token = store
        .join_token("0123456789abcdef")
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(
        token.uses_left, 0,
        "the three nodes actually created spend the three uses"
    );
    assert_eq!(store.list_nodes().await.expect("list").len(), 3);
}

#[tokio::test]
async fn migrations_are_idempotent() {
    let db = test_db().await;
    assert_eq!(
        bc_store::migrate::migrate(&db.pool).await.expect("migrate"),
        0
    );
}

/// `migrate` (the base schema, as `serve` and `dev` run it before the kernel) on a database where a module's
/// migration was applied: it leaves that one to the kernel instead of refusing the database as newer (a second
/// `dev` failed so once the tunnels module had a migration); the kernel's list still refuses one it lacks.
#[tokio::test]
async fn the_base_migration_leaves_modules_migrations_to_the_kernel() {
    use bc_store::migrate::{MigrateError, Migration, migrate, migrate_with};
    let db = test_db().await;
    let module = Migration {
        version: 1999,
        name: "a module's table",
        sql: "CREATE TABLE module_test (id int)",
    };
    assert_eq!(migrate_with(&db.pool, &[module]).await.expect("module"), 1);
    assert_eq!(migrate(&db.pool).await.expect("base after a module's"), 0);
    assert_eq!(migrate_with(&db.pool, &[module]).await.expect("again"), 0);
    let other = Migration {
        version: 1998,
        name: "another module",
        sql: "SELECT 1",
    };
    let e = migrate_with(&db.pool, &[other]).await.err();
    assert!(
        matches!(e, Some(MigrateError::DatabaseNewer { version: 1999 })),
        "{e:?}"
    );
}

async fn xmin(store: &Store, id: &str) -> String {
    bc_store::sqlx::query_scalar("SELECT xmin::text FROM nodes WHERE id = $1")
        .bind(id)
        .fetch_one(store.pool())
        .await
        .expect("xmin")
}

/// The sessions a liveness round of `seen` (at resolution `r`) names to close.
async fn liveness(store: &Store, seen: &[(String, i64, i64)], r: i64) -> Vec<String> {
    store.record_liveness(seen, r).await.expect("liveness")
}

/// A store with node-1 and node-2 joined (key [`KEY`]), no session opened yet.
async fn two_joined_nodes() -> Store {
    let store = seeded(3).await;
    let batch = vec![candidate(1, "hk-1"), candidate(2, "hk-2")];
    store
        .commit_joins("0123456789abcdef", "p1", &batch, now_ms())
        .await
        .expect("commit");
    store
}

#[tokio::test]
async fn liveness_rewrites_a_row_only_when_last_seen_moved_and_names_sessions_to_close() {
    let store = two_joined_nodes().await;
    for node in ["node-1", "node-2"] {
        let opened = store.open_session(node, &KEY).await.expect("open");
        assert_eq!(opened.expect("opened").epoch, 1);
    }
    let t = 1_800_000_000_000i64;
    let seen = |ms: i64| {
        vec![
            ("node-1".to_string(), 1i64, ms),
            ("node-2".to_string(), 1, ms),
        ]
    };
    assert!(liveness(&store, &seen(t), 0).await.is_empty());
    let v1 = xmin(&store, "node-1").await;
    // Nothing new from the node: the row is not rewritten.
    assert!(liveness(&store, &seen(t), 0).await.is_empty());
    assert_eq!(
        xmin(&store, "node-1").await,
        v1,
        "an unchanged last-seen rewrote the row"
    );
    // A message arrived: last-seen moves.
    assert!(liveness(&store, &seen(t + 15_000), 0).await.is_empty());
    assert_ne!(xmin(&store, "node-1").await, v1);
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!(row.last_seen_ms, Some(t + 15_000));
    assert!(row.online);
    // An earlier last-seen (a session opened since, whose Hello the open's own time follows) does not move it back
    // and does not rewrite the row.
    let v2 = xmin(&store, "node-1").await;
    assert!(liveness(&store, &seen(t + 5_000), 0).await.is_empty());
    assert_eq!(
        xmin(&store, "node-1").await,
        v2,
        "an earlier last-seen rewrote the row"
    );
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!(row.last_seen_ms, Some(t + 15_000));
    // A stale epoch and a revoked node must close, even when their last-seen did not move.
    assert!(matches!(
        store
            .set_node_schedulable("node-2", NodeVerb::Revoke, "test")
            .await
            .expect("revoke"),
        NodeStateChange::Changed { .. }
    ));
    let both = [
        ("node-1".to_string(), 7, t + 15_000),
        ("node-2".to_string(), 1, t + 15_000),
    ];
    let close = liveness(&store, &both, 0).await;
    assert_eq!(close.len(), 2, "{close:?}");
    // A session whose close the store holds (written while the round was under way, or the node taken for dead
    // while its gateway was cut off) must close too, and liveness does not mark its node online again.
    store.close_session("node-1", 1).await.expect("close");
    let close = liveness(&store, &[("node-1".into(), 1, t + 30_000)], 0).await;
    assert_eq!(close, ["node-1"]);
    let row = store.node("node-1").await.expect("read").expect("node");
    assert!(
        !row.online && row.last_seen_ms == Some(t + 15_000),
        "{row:?}"
    );
    // The revocation reaches a reader once, by watermark.
    let revoked = store.revoked_identities_since(None).await.expect("revoked");
    assert_eq!(revoked.nodes, vec!["node-2".to_string()]);
    assert!(revoked.sites.is_empty(), "{revoked:?}");
    assert!(revoked.watermark_ms > 0);
}

#[tokio::test]
async fn liveness_at_a_resolution_rewrites_a_row_only_once_it_lags_that_far_and_a_close_writes_the_exact_last_seen()
 {
    let store = two_joined_nodes().await;
    let opened = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened");
    const R: i64 = 60_000;
    let t = 1_800_000_000_000i64;
    let live = |ms: i64| vec![("node-1".to_string(), opened.epoch, ms)];
    // The open stored the database's time, before t: the first round moves it.
    assert!(liveness(&store, &live(t), R).await.is_empty());
    let v1 = xmin(&store, "node-1").await;
    // Heartbeats within the resolution: the row is not rewritten, the stored last-seen stays.
    for ms in [t + 15_000, t + 45_000, t + R] {
        assert!(liveness(&store, &live(ms), R).await.is_empty());
        assert_eq!(
            xmin(&store, "node-1").await,
            v1,
            "rewritten at {} s",
            (ms - t) / 1000
        );
    }
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!(row.last_seen_ms, Some(t));
    // Past it: written, once.
    liveness(&store, &live(t + 75_000), R).await;
    let v2 = xmin(&store, "node-1").await;
    assert_ne!(v2, v1, "a last-seen {R} ms behind was not written");
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!(row.last_seen_ms, Some(t + 75_000));
    // A session that must close is named at any resolution.
    let stale = [("node-1".to_string(), opened.epoch + 1, t + 80_000)];
    assert_eq!(liveness(&store, &stale, R).await, ["node-1"]);
    // The close carries the exact last-seen, which liveness held back.
    store
        .close_sessions(&[("node-1", opened.epoch, Some(t + 100_000))])
        .await
        .expect("close");
    let row = store.node("node-1").await.expect("read").expect("node");
    assert!(!row.online, "{row:?}");
    assert_eq!(row.last_seen_ms, Some(t + 100_000));
    // It never moves last-seen back, and a close without one leaves it.
    let again = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened");
    liveness(&store, &[("node-1".into(), again.epoch, t + 200_000)], 0).await;
    store
        .close_sessions(&[("node-1", again.epoch, Some(t + 150_000))])
        .await
        .expect("close");
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!((row.online, row.last_seen_ms), (false, Some(t + 200_000)));
    let third = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened");
    let before = store.node("node-1").await.expect("read").expect("node");
    store
        .close_session("node-1", third.epoch)
        .await
        .expect("close");
    let row = store.node("node-1").await.expect("read").expect("node");
    assert_eq!((row.online, row.last_seen_ms), (false, before.last_seen_ms));
}

/// The statistics of a fleet analyzed while it was offline say no node is online; 10,000 of 40,000 are. A liveness
/// round of 5,000 sessions written as a plain join was planned as a sequential scan of `nodes` joined to every
/// session (50 million rows compared, twice); it must stay one lookup per session.
#[tokio::test]
async fn liveness_stays_one_lookup_per_session_when_the_statistics_say_the_fleet_is_offline() {
    let db = test_db().await;
    seed_gpu_nodes(&db.pool, "p1", "n", 40_000, 0, "none")
        .await
        .expect("seed");
    for sql in [
        "ALTER TABLE nodes SET (autovacuum_enabled = false)",
        "ANALYZE nodes",
        "UPDATE nodes SET online = true, session_epoch = 1 WHERE id IN (SELECT id FROM nodes ORDER BY id LIMIT 10000)",
    ] {
        bc_store::sqlx::query(sql)
            .execute(&db.pool)
            .await
            .expect(sql);
    }
    let store = Store::new(db.pool.clone());
    let ids: Vec<String> =
        bc_store::sqlx::query_scalar("SELECT id FROM nodes WHERE online ORDER BY id LIMIT 5000")
            .fetch_all(&db.pool)
            .await
            .expect("ids");
    let at = now_ms() + 1_000;
    let mut seen: Vec<(String, i64, i64)> = ids.into_iter().map(|id| (id, 1, at)).collect();
    seen.push(("n-nowhere".into(), 1, at));
    let started = std::time::Instant::now();
    let close = liveness(&store, &seen, 0).await;
    let took = started.elapsed();
    assert_eq!(close, ["n-nowhere"]);
    let written: i64 =
        bc_store::sqlx::query_scalar("SELECT count(*) FROM nodes WHERE last_seen_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .expect("written");
    assert_eq!(written, 5000);
    println!("liveness of 5,000 sessions with the fleet analyzed offline: {took:?}");
    assert!(
        took < std::time::Duration::from_secs(2),
        "a liveness round of 5,000 sessions took {took:?}: planned as a scan of every node per session?"
    );
}

/// Command ids `pending_for` hands to the node's session at `epoch`, at the clock `at_ms`.
async fn sent_to(store: &Store, node: &str, epoch: i64, at_ms: i64) -> Vec<String> {
    let mut ids: Vec<String> = store
        .pending_for(&[(node.to_string(), epoch)], at_ms)
        .await
        .expect("pending")
        .into_iter()
        .filter_map(|o| match o {
            bc_store::sessions::Outgoing::Command { id, .. } => Some(id),
            _ => None,
        })
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn a_command_sent_on_a_lost_session_is_sent_again_on_the_next_epoch_until_it_finishes() {
    let store = seeded(1).await;
    store
        .commit_joins("0123456789abcdef", "p1", &[candidate(1, "hk-1")], now_ms())
        .await
        .expect("commit");
    let epoch1 = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened")
        .epoch;
    let now_ms = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
    let args = serde_json::json!({});
    for (id, deadline) in [("c-live", now_ms + 600_000), ("c-late", now_ms + 1_000)] {
        store
            .queue_command(id, "node-1", "diag.nvml", &args, deadline)
            .await
            .expect("queue");
    }
    assert_eq!(
        sent_to(&store, "node-1", epoch1, now_ms).await,
        ["c-late", "c-live"]
    );
    // The same session is not sent them twice.
    assert!(sent_to(&store, "node-1", epoch1, now_ms).await.is_empty());
    // 1.1 s later (a chosen clock, not a sleep): the session died before any result, and the next one gets the live
    // command again, not the one past its deadline.
    let later_ms = now_ms + 1_100;
    let epoch2 = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened")
        .epoch;
    assert_eq!(
        sent_to(&store, "node-1", epoch2, later_ms).await,
        ["c-live"]
    );
    assert!(sent_to(&store, "node-1", epoch2, later_ms).await.is_empty());
    let c = store.command("c-live").await.expect("read").expect("row");
    assert_eq!((c.state.as_str(), c.deliveries), ("sent", 2));
    // A stale epoch neither claims commands nor finishes them.
    assert!(sent_to(&store, "node-1", epoch1, now_ms).await.is_empty());
    let result = serde_json::json!({"ok": true});
    assert!(
        !store
            .finish_command("node-1", epoch1, "c-live", Ok(&result), b"env")
            .await
            .expect("finish")
    );
    assert!(
        store
            .finish_command("node-1", epoch2, "c-live", Ok(&result), b"env")
            .await
            .expect("finish")
    );
    // Finished: no later session gets it again, and a repeated result changes nothing.
    let epoch3 = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened")
        .epoch;
    assert!(sent_to(&store, "node-1", epoch3, later_ms).await.is_empty());
    assert!(
        !store
            .finish_command("node-1", epoch3, "c-live", Ok(&result), b"env")
            .await
            .expect("finish")
    );
    assert!(
        store
            .command_finished("node-1", "c-live")
            .await
            .expect("finished")
    );
    let c = store.command("c-live").await.expect("read").expect("row");
    assert_eq!((c.state.as_str(), c.deliveries), ("done", 2));
    // A signed error the node marked `deadline_passed` (refused as late, or cut at its deadline) is an expiry,
    // whoever saw the deadline first; an error without the mark is the command's own answer.
    for (id, marked) in [("c-cut", true), ("c-err", false)] {
        store
            .queue_command(
                id,
                "node-1",
                "ramdisk.stream",
                &serde_json::json!({}),
                later_ms + 60_000,
            )
            .await
            .expect("queue");
        assert_eq!(sent_to(&store, "node-1", epoch3, later_ms).await, [id]);
        let mut r = serde_json::json!({"error": "ramdisk.stream: the command's deadline passed"});
        if marked {
            r["deadline_passed"] = true.into();
        }
        assert!(
            store
                .finish_command("node-1", epoch3, id, Ok(&r), b"env")
                .await
                .expect("finish")
        );
        let c = store.command(id).await.expect("read").expect("row");
        let want = if marked { "expired" } else { "done" };
        assert_eq!(c.state, want, "{id}");
        assert_eq!(c.result.as_ref(), Some(&r), "{id}");
        assert_eq!(
            c.error.is_some(),
            marked,
            "{id}: the expiry keeps the node's reason"
        );
    }
}

/// The lifecycle's time-dependent decisions run at a clock the caller chooses (no sleeping against deadlines):
/// a command expires only once the given clock passes its deadline, and a failed node is due a re-check only once
/// the given clock is `recheck` past its last check. Acceptance-check selection is `bc_core::lifecycle::needs_check`
/// over the facts `check_candidates` reads.
#[tokio::test]
async fn acceptance_checks_and_command_expiry_are_decided_at_the_given_clock() {
    use bc_core::lifecycle::needs_check;
    const KIND: &str = "diag.nvml";
    const RECHECK_MS: i64 = 300_000;
    let store = seeded(1).await;
    let t0 = now_ms();
    store
        .commit_joins("0123456789abcdef", "p1", &[candidate(1, "hk-1")], t0)
        .await
        .expect("commit");
    let shards: Vec<i16> = (0..bc_core::shards::SHARDS as i16).collect();
    let due = |at: i64| {
        let store = store.clone();
        let shards = shards.clone();
        async move {
            let rows = store
                .check_candidates(KIND, &shards)
                .await
                .expect("candidates");
            rows.into_iter()
                .filter(|(_, _, c)| needs_check(c, at, RECHECK_MS))
                .map(|(id, _, _)| id.into_string())
                .collect::<Vec<_>>()
        }
    };
    // Offline: nothing can reach it.
    assert!(due(t0).await.is_empty());
    let epoch = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened")
        .epoch;
    // Online, but its GPU inventory has not arrived: not even read (it waits on the node).
    assert!(due(t0).await.is_empty());
    assert!(
        store
            .check_candidates(KIND, &shards)
            .await
            .expect("candidates")
            .is_empty(),
        "an adopting node without its GPU inventory was read as a candidate"
    );
    let gpus = serde_json::json!({"gpus": []});
    assert!(
        store
            .put_inventory("node-1", epoch, "gpus", "h1", &gpus)
            .await
            .expect("inventory")
    );
    assert_eq!(due(t0).await, ["node-1"]);
    store
        .queue_command("c-1", "node-1", KIND, &serde_json::json!({}), t0 + 1_000)
        .await
        .expect("queue");
    // Open: no second check.
    assert!(due(t0).await.is_empty());
    assert_eq!(store.expire_commands(t0 + 999).await.expect("expire"), 0);
    assert_eq!(store.expire_commands(t0 + 1_001).await.expect("expire"), 1);
    let c = store.command("c-1").await.expect("read").expect("row");
    assert_eq!(c.state, "expired");
    assert_eq!(c.finished_ms, Some(t0 + 1_001));
    // Finished but not yet acted on: still open.
    assert!(due(t0 + 1_001 + RECHECK_MS).await.is_empty());
    let results = store
        .unconsumed_results(KIND, &shards)
        .await
        .expect("results");
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].state, "expired");
    store
        .apply_lifecycle(
            "c-1",
            "node-1",
            "adopting",
            Some("failed"),
            &serde_json::json!(["diag.nvml timed out"]),
            None,
        )
        .await
        .expect("apply");
    assert_eq!(
        store
            .node("node-1")
            .await
            .expect("read")
            .expect("node")
            .state,
        "failed"
    );
    // Failed: re-checked once the clock is the re-check interval past the last check, not before.
    assert!(due(t0 + 1_001 + RECHECK_MS - 1).await.is_empty());
    assert_eq!(due(t0 + 1_001 + RECHECK_MS).await, ["node-1"]);
}

/// A state this version does not know (a newer version wrote it, or a hand edit) is an error naming the row, from
/// every read that parses it, never a panic or a guess; the node verbs refuse to act on it.
#[tokio::test]
async fn an_unknown_node_state_in_a_row_is_an_error_naming_the_row() {
    let store = seeded(1).await;
    store
        .commit_joins("0123456789abcdef", "p1", &[candidate(1, "hk-1")], now_ms())
        .await
        .expect("commit");
    bc_store::sqlx::query("ALTER TABLE nodes DROP CONSTRAINT nodes_state_check")
        .execute(store.pool())
        .await
        .expect("drop the check");
    bc_store::sqlx::query("UPDATE nodes SET state = 'retired' WHERE id = 'node-1'")
        .execute(store.pool())
        .await
        .expect("an unknown state");
    let named = |e: bc_store::StoreError| {
        let m = e.to_string();
        assert!(
            matches!(e, bc_store::StoreError::Corrupt(_))
                && m.contains("node-1")
                && m.contains("retired"),
            "{m}"
        );
    };
    named(store.node("node-1").await.expect_err("node"));
    named(store.list_nodes().await.expect_err("list"));
    named(
        store
            .set_node_schedulable("node-1", bc_core::node::NodeVerb::Drain, "test")
            .await
            .expect_err("drain"),
    );
}

/// Issue 14: the statement that opens a session names its gateway, and the tunnel relay's route reads that gateway's
/// published relay URL with it; a newer session elsewhere moves the route.
#[tokio::test]
async fn a_session_row_names_its_gateway_and_the_route_follows_the_newest_session() {
    let store = seeded(1).await;
    store
        .commit_joins("0123456789abcdef", "p1", &[candidate(1, "hk-1")], now_ms())
        .await
        .expect("commit");
    let before = store
        .node_route("node-1")
        .await
        .expect("route")
        .expect("node");
    assert_eq!((before.gateway_id, before.online), (None, false));
    assert_eq!(store.node_route("nobody").await.expect("route"), None);
    store
        .publish_gateway("gw-a", "https://10.0.0.5:7443", 30_000)
        .await
        .expect("publish");
    store
        .publish_gateway("gw-b", "https://10.0.0.6:7443", 30_000)
        .await
        .expect("publish");
    let first = store
        .open_session_on("node-1", &KEY, Some("gw-a"))
        .await
        .expect("open")
        .expect("opened");
    let r = store
        .node_route("node-1")
        .await
        .expect("route")
        .expect("node");
    assert_eq!(r.gateway_id.as_deref(), Some("gw-a"));
    assert_eq!(r.relay_url.as_deref(), Some("https://10.0.0.5:7443"));
    assert!(
        r.online && r.gateway_silent_ms.is_some_and(|ms| ms < 60_000),
        "{r:?}"
    );
    // The node reconnects through the other gateway: its row follows; the stale session's close changes nothing.
    store
        .open_session_on("node-1", &KEY, Some("gw-b"))
        .await
        .expect("open")
        .expect("opened");
    store
        .close_session("node-1", first.epoch)
        .await
        .expect("close stale");
    let r = store
        .node_route("node-1")
        .await
        .expect("route")
        .expect("node");
    assert_eq!(
        (r.gateway_id.as_deref(), r.relay_url.as_deref(), r.online),
        (Some("gw-b"), Some("https://10.0.0.6:7443"), true)
    );
    // A gateway republishing (a restart on another address) moves its URL.
    store
        .publish_gateway("gw-b", "https://10.0.0.7:7443", 30_000)
        .await
        .expect("publish");
    assert_eq!(
        store.gateways().await.expect("gateways"),
        [
            ("gw-a".to_string(), "https://10.0.0.5:7443".to_string()),
            ("gw-b".to_string(), "https://10.0.0.7:7443".to_string())
        ]
    );
}

/// A session's open and close are one statement each (a reconnect storm is tens of thousands of them): the open
/// bumps the epoch, records `node.online` only when the node was offline and returns the inventory hashes the store
/// holds; the close records `node.offline` only for the current session of an online node.
#[tokio::test]
async fn opening_and_closing_a_session_audit_only_the_transitions_and_return_the_stored_hashes() {
    let store = seeded(1).await;
    store
        .commit_joins("0123456789abcdef", "p1", &[candidate(1, "hk-1")], now_ms())
        .await
        .expect("commit");
    let transitions = || async {
        sqlx::query_as::<_, (String, serde_json::Value)>(
            "SELECT action, detail FROM audit_events WHERE subject = 'node/node-1' \
             AND action IN ('node.online', 'node.offline') ORDER BY id",
        )
        .fetch_all(store.pool())
        .await
        .expect("audit")
    };
    let first = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened");
    assert!(first.stored_hashes.is_empty());
    assert_eq!(
        transitions().await,
        [(
            "node.online".into(),
            serde_json::json!({"epoch": first.epoch})
        )]
    );
    for (name, hash) in [("gpus", "h-gpus"), ("disks", "h-disks")] {
        assert!(
            store
                .put_inventory("node-1", first.epoch, name, hash, &serde_json::json!({}))
                .await
                .expect("inventory")
        );
    }
    // A reconnect while the row is still online (the old gateway died): a new epoch, no transition recorded.
    let second = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened");
    assert_eq!(second.epoch, first.epoch + 1);
    assert_eq!(
        second.stored_hashes,
        [
            ("disks".to_string(), "h-disks".to_string()),
            ("gpus".to_string(), "h-gpus".to_string())
        ]
    );
    assert_eq!(transitions().await.len(), 1);
    // The stale session's close changes nothing; the current one's records the transition once.
    store
        .close_session("node-1", first.epoch)
        .await
        .expect("close");
    assert_eq!(transitions().await.len(), 1);
    for _ in 0..2 {
        store
            .close_session("node-1", second.epoch)
            .await
            .expect("close");
    }
    assert_eq!(
        transitions().await.last(),
        Some(&(
            "node.offline".into(),
            serde_json::json!({"epoch": second.epoch})
        ))
    );
    assert_eq!(transitions().await.len(), 2);
    // Offline again: the next open records the transition.
    let third = store
        .open_session("node-1", &KEY)
        .await
        .expect("open")
        .expect("opened");
    assert_eq!(
        transitions().await.last(),
        Some(&(
            "node.online".into(),
            serde_json::json!({"epoch": third.epoch})
        ))
    );
}

/// Closes grouped into one statement take only the sessions that are still current: of three nodes, the one whose
/// epoch is current goes offline (one `node.offline`), the one that reconnected meanwhile stays online, and one
/// named twice (its stale epoch and its current one) goes offline once.
#[tokio::test]
async fn grouped_closes_take_only_current_sessions() {
    let store = seeded(3).await;
    store
        .commit_joins(
            "0123456789abcdef",
            "p1",
            &[
                candidate(1, "hk-1"),
                candidate(2, "hk-2"),
                candidate(3, "hk-3"),
            ],
            now_ms(),
        )
        .await
        .expect("commit");
    let mut epochs = Vec::new();
    for n in 1..=3 {
        let opened = store
            .open_session(&format!("node-{n}"), &KEY)
            .await
            .expect("open")
            .expect("opened");
        epochs.push(opened.epoch);
    }
    // node-2 reconnected (elsewhere) before its old session's close; node-3's old and new sessions both close.
    let reopened = store
        .open_session("node-2", &KEY)
        .await
        .expect("open")
        .expect("opened");
    let newer = store
        .open_session("node-3", &KEY)
        .await
        .expect("open")
        .expect("opened");
    store
        .close_sessions(&[
            ("node-1", epochs[0], None),
            ("node-2", epochs[1], None),
            ("node-3", epochs[2], None),
            ("node-3", newer.epoch, None),
        ])
        .await
        .expect("close");
    let rows = sqlx::query_as::<_, (String, bool)>("SELECT id, online FROM nodes ORDER BY id")
        .fetch_all(store.pool())
        .await
        .expect("nodes");
    assert_eq!(
        rows,
        [
            ("node-1".to_string(), false),
            ("node-2".to_string(), true),
            ("node-3".to_string(), false)
        ]
    );
    let offline = sqlx::query_as::<_, (String, serde_json::Value)>(
        "SELECT subject, detail FROM audit_events WHERE action = 'node.offline' ORDER BY subject",
    )
    .fetch_all(store.pool())
    .await
    .expect("audit");
    assert_eq!(
        offline,
        [
            (
                "node/node-1".to_string(),
                serde_json::json!({"epoch": epochs[0]})
            ),
            (
                "node/node-3".to_string(),
                serde_json::json!({"epoch": newer.epoch})
            )
        ]
    );
    assert_eq!(reopened.epoch, epochs[1] + 1);
}

/// Opens grouped into one statement answer each open as opening it alone would, in the order asked: a node named
/// twice opens twice (epochs 1 and 2), an unknown node and a key that is not the node's are refused without
/// failing the others, and an offline node's open is recorded once as a transition.
#[tokio::test]
async fn grouped_opens_answer_each_as_alone_and_a_node_named_twice_opens_twice() {
    let store = two_joined_nodes().await;
    let other_key = [0x04u8, 0xcd];
    let answers = store
        .open_sessions_on(
            &[
                ("node-1", &KEY),
                ("node-2", &KEY),
                ("nobody", &KEY),
                ("node-1", &KEY),
                ("node-2", &other_key),
            ],
            Some("gw-test"),
        )
        .await
        .expect("open");
    let epochs: Vec<Result<i64, bc_store::sessions::OpenRefusal>> =
        answers.into_iter().map(|a| a.map(|o| o.epoch)).collect();
    use bc_store::sessions::OpenRefusal::{KeySuperseded, Unknown};
    assert_eq!(
        epochs,
        [Ok(1), Ok(1), Err(Unknown), Ok(2), Err(KeySuperseded)]
    );
    let n1 = store.node("node-1").await.expect("read").expect("node");
    assert_eq!((n1.session_epoch, n1.online), (2, true));
    let online_events: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'node.online' AND subject = 'node/node-1'",
    )
    .fetch_one(store.pool())
    .await
    .expect("audit");
    assert_eq!(
        online_events, 1,
        "one offline → online transition for node-1"
    );
}

/// `nodes`' update counters (all, HOT) as the statistics hold them once this connection's pending counts are flushed.
async fn node_updates(store: &Store) -> (i64, i64) {
    bc_store::sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(store.pool())
        .await
        .expect("flush");
    bc_store::sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'nodes'",
    )
    .fetch_one(store.pool())
    .await
    .expect("nodes statistics")
}

/// A node's frequent writes (heartbeats, session opens, certificate renewals, a placement's desired state) are
/// written as HOT updates: no column they set is indexed, and each page keeps room for a new version, so PostgreSQL
/// adds no index entry for them. Before migration 15, `updated_at` was indexed (for the revocation feed), so a
/// renewal or placement wrote one entry into each of the table's indexes, and full pages pushed heartbeats out of
/// place too. The revocation feed now reads `revoked_at`, which a trigger sets whichever statement revokes.
#[tokio::test]
async fn a_nodes_frequent_writes_touch_no_index_and_a_revocation_still_reaches_the_feed() {
    let db = test_db().await;
    // One connection, so every write below is counted by the one backend whose counts are flushed.
    let pool = db.one_connection().await;
    let store = seed(Store::new(pool), 3).await;
    let batch = vec![
        candidate(1, "hk-1"),
        candidate(2, "hk-2"),
        candidate(3, "hk-3"),
    ];
    store
        .commit_joins("0123456789abcdef", "p1", &batch, now_ms())
        .await
        .expect("commit");

    let indexes: Vec<String> = bc_store::sqlx::query_scalar(
        "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'nodes'::regclass",
    )
    .fetch_all(store.pool())
    .await
    .expect("indexes");
    let written_often = [
        "updated_at",
        "last_seen_at",
        "online",
        "session_epoch",
        "gateway_id",
        "desired_generation",
        "desired_spec",
        "acked_generation",
        "cert_serial",
        "cert_not_after",
        "conditions",
    ];
    for def in &indexes {
        let words: Vec<&str> = def
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .collect();
        for column in written_often {
            assert!(
                !words.contains(&column),
                "{column} is written by a node's frequent updates, but an index names it: {def}"
            );
        }
    }
    let options: Option<Vec<String>> =
        bc_store::sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE relname = 'nodes'")
            .fetch_one(store.pool())
            .await
            .expect("reloptions");
    assert_eq!(options, Some(vec!["fillfactor=80".to_string()]));

    // node-2 in a session (liveness writes only a node online in that session).
    assert!(
        store
            .open_session("node-2", &KEY)
            .await
            .expect("open")
            .is_ok()
    );
    let (upd0, hot0) = node_updates(&store).await;
    let t = now_ms() + 1_000;
    for i in 0..3 {
        store
            .record_node_cert("node-1", &format!("serial-{i}"), t + 86_400_000)
            .await
            .expect("renewal");
        liveness(&store, &[("node-2".to_string(), 1, t + i * 1000)], 0).await;
    }
    assert!(
        store
            .open_session("node-1", &KEY)
            .await
            .expect("open")
            .is_ok()
    );
    let (upd1, hot1) = node_updates(&store).await;
    assert_eq!(upd1 - upd0, 7, "three renewals, three heartbeats, one open");
    assert_eq!(
        hot1 - hot0,
        upd1 - upd0,
        "every one of those writes should be a HOT update (no index entry)"
    );

    // Revoked nodes reach the feed by `revoked_at`.
    assert!(matches!(
        store
            .set_node_schedulable("node-2", NodeVerb::Revoke, "test")
            .await
            .expect("revoke"),
        NodeStateChange::Changed { .. }
    ));
    store
        .set_node_schedulable("node-3", NodeVerb::Revoke, "test")
        .await
        .expect("revoke by verb");
    let revoked = store.revoked_identities_since(None).await.expect("revoked");
    let mut nodes = revoked.nodes.clone();
    nodes.sort();
    assert_eq!(nodes, vec!["node-2".to_string(), "node-3".to_string()]);
    let stamped: Vec<String> = bc_store::sqlx::query_scalar(
        "SELECT id FROM nodes WHERE revoked_at IS NOT NULL AND revoked_at <= now() ORDER BY id",
    )
    .fetch_all(store.pool())
    .await
    .expect("revoked_at");
    assert_eq!(stamped, vec!["node-2".to_string(), "node-3".to_string()]);
    // A reader past the revocations (and the minute of overlap) is not told again, even after a later write.
    store
        .record_node_cert("node-2", "late", t)
        .await
        .expect("late write");
    let later = store
        .revoked_identities_since(Some(revoked.watermark_ms + 61_000))
        .await
        .expect("later");
    assert!(later.nodes.is_empty(), "{later:?}");
}
