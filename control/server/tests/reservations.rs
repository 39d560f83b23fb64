//! Reservations against a real PostgreSQL: the admission sequence (tenant check before any database access,
//! idempotency replay and conflict, also concurrent), no GPU booked twice under 200 concurrent creates for more
//! than exist, release, and expiry by the controllers with no notifications at all.

use bc_control::client::{ApiClient, ClientError};
use bc_control::config::{Roles, ServeConfig};
use bc_core::api::nodes::NodeRef;
use bc_core::ids::NodeId;
use bc_core::node::NodeState;
use bc_mod_nodes::methods::{DrainNodeMethod, RevokeNodeMethod, UndrainNodeMethod};
use bc_store::Store;
use bc_store::sqlx;
use bc_store::sqlx::postgres::PgPoolOptions;
use bc_store::testing::{seed_gpu_nodes, test_db};
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const H100: &str = "NVIDIA H100 80GB HBM3";

/// The scheduler's background capacity refresh runs many times in every test, beside placements and releases: a
/// refresh that lost a change shows as refused creates or unbooked capacity.
const FAST_RELOAD: Duration = Duration::from_millis(100);

fn config(dir: &std::path::Path, roles: Roles, capacity_reload: Duration) -> ServeConfig {
    ServeConfig {
        shard_lease: Some(Duration::from_secs(2)),
        capacity_reload: Some(capacity_reload),
        ..ServeConfig::loopback(dir.to_path_buf(), "test.bc", roles)
    }
}

fn code(r: &Result<Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, .. }) => code.clone(),
        Err(e) => format!("transport: {e}"),
    }
}

struct Fleet {
    store: Store,
    _dirs: Vec<tempfile::TempDir>,
    api: bc_control::Running,
    back: bc_control::Running,
    admin: ApiClient,
    url: String,
    acquires: Arc<AtomicU64>,
    _db: bc_store::testing::TestDb,
}

/// An API-only process on a pool that counts every connection it hands out, and a second "process" (same test
/// binary, separate roles and pool) running the scheduler and the controllers.
async fn fleet(nodes: i32, gpus: i32) -> Fleet {
    fleet_with(nodes, gpus, FAST_RELOAD).await
}

/// Like [`fleet`], with the scheduler's periodic full capacity reload every `capacity_reload`.
async fn fleet_with(nodes: i32, gpus: i32, capacity_reload: Duration) -> Fleet {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root");
    seed_gpu_nodes(&db.pool, "gpu", "n", nodes, gpus, H100)
        .await
        .expect("seed");
    let acquires = Arc::new(AtomicU64::new(0));
    let (a1, a2) = (acquires.clone(), acquires.clone());
    let counted = PgPoolOptions::new()
        .max_connections(16)
        .after_connect(move |_c, _m| {
            a1.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        })
        .before_acquire(move |_c, _m| {
            a2.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(true) })
        })
        .connect_with(db.connect_options())
        .await
        .expect("counted pool");
    let d1 = tempfile::tempdir().expect("dir");
    let d2 = tempfile::tempdir().expect("dir");
    let api = bc_control::start(
        &config(
            d1.path(),
            Roles {
                api: true,
                ..Roles::default()
            },
            capacity_reload,
        ),
        Store::new(counted),
    )
    .await
    .expect("api");
    let back = bc_control::start(
        &config(
            d2.path(),
            Roles {
                scheduler: true,
                controllers: true,
                ..Roles::default()
            },
            capacity_reload,
        ),
        store.clone(),
    )
    .await
    .expect("scheduler");
    let url = format!("http://{}", api.api_addr.expect("api addr"));
    let admin = ApiClient::new(
        &url,
        &bc_control::bootstrap_admin(&store).await.expect("admin"),
    );
    Fleet {
        store,
        _dirs: vec![d1, d2],
        api,
        back,
        admin,
        url,
        acquires,
        _db: db,
    }
}

impl Fleet {
    /// A principal of `tenant` allowed everything on reservations in its tenant.
    async fn tenant_user(&self, tenant: &str) -> ApiClient {
        self.admin
            .call("tenants", "create", json!({"id": tenant}))
            .await
            .expect("tenant");
        let p = self
            .admin
            .call(
                "principals",
                "create",
                json!({"id": format!("{tenant}-user"), "tenant": tenant,
                       "grants": [{"permission": "compute:reservations:*", "scope": format!("tenant/{tenant}")}]}),
            )
            .await
            .expect("principal");
        ApiClient::new(&self.url, p["api_key"].as_str().expect("key"))
    }

    async fn stop(self) {
        self.api.shutdown().await;
        self.back.shutdown().await;
    }
}

fn gpus_of(v: &Value) -> Vec<String> {
    v["reservation"]["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| g["uuid"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// How many windows of refused calls [`cross_tenant_create_is_denied_before_any_database_access`] may try.
const WINDOWS: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_tenant_create_is_denied_before_any_database_access() {
    let f = fleet(1, 8).await;
    let a = f.tenant_user("team-a").await;
    // Warm the authentication cache with an allowed call, then count.
    let listed = a.call("reservations", "list", json!({})).await;
    assert!(code(&listed).starts_with("OK"), "{}", code(&listed));
    // The API process's own loops (the tunnels sweeper's shard leases, about one acquisition a second measured idle)
    // also take connections, so the refused call is repeated in up to ten windows and one window must see no
    // acquisition at all: a refused create that touched the database would move the counter in every window.
    let mut quiet_window = false;
    for _ in 0..WINDOWS {
        let before = f.acquires.load(Ordering::SeqCst);
        let r = a
            .call(
                "reservations",
                "create",
                json!({"tenant": "team-b", "gpus": 1, "duration_s": 60, "idempotency_key": "x"}),
            )
            .await;
        assert_eq!(code(&r), "ACCESS_DENIED");
        if let Err(ClientError::Api { message, .. }) = &r {
            assert!(
                message.contains("team-a") && message.contains("team-b"),
                "{message}"
            );
        }
        if f.acquires.load(Ordering::SeqCst) == before {
            quiet_window = true;
            break;
        }
    }
    assert!(
        quiet_window,
        "the denied create touched the database ({WINDOWS} windows, each with an acquisition)"
    );
    let before = f.acquires.load(Ordering::SeqCst);
    // The counter does move for an admitted create (the test can fail).
    let ok = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 1, "duration_s": 60}),
        )
        .await;
    assert!(code(&ok).starts_with("OK"), "{}", code(&ok));
    assert!(f.acquires.load(Ordering::SeqCst) > before);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_replays_and_conflicts_also_concurrently() {
    let f = fleet(2, 8).await;
    let a = f.tenant_user("team-a").await;
    let body = json!({"tenant": "team-a", "gpus": 2, "duration_s": 600, "idempotency_key": "k1"});
    let first = a
        .call("reservations", "create", body.clone())
        .await
        .expect("create");
    assert_eq!(first["reservation"]["state"], "placed", "{first}");
    assert_eq!(gpus_of(&first).len(), 2);
    let again = a
        .call("reservations", "create", body.clone())
        .await
        .expect("replay");
    assert_eq!(again["reservation"]["id"], first["reservation"]["id"]);
    assert_eq!(gpus_of(&again), gpus_of(&first));
    // The first answer came from the placer's notification, the replay's from a read of the row: the same.
    assert_eq!(again["reservation"], first["reservation"]);
    // Same key, other body (spelled-out default is the same body; a different count is not).
    let same = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 2, "duration_s": 600, "topology": "node", "idempotency_key": "k1"}),
        )
        .await;
    assert!(code(&same).starts_with("OK"), "{}", code(&same));
    let other = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 3, "duration_s": 600, "idempotency_key": "k1"}),
        )
        .await;
    assert_eq!(code(&other), "CONFLICT");
    // A tenant that does not exist: a clear NOT_FOUND, even when batched with good requests.
    let (ghost, good) = tokio::join!(
        f.admin.call(
            "reservations",
            "create",
            json!({"tenant": "ghost", "gpus": 1, "duration_s": 60}),
        ),
        a.call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 1, "duration_s": 60, "idempotency_key": "k-good"}),
        )
    );
    assert_eq!(code(&ghost), "NOT_FOUND");
    assert!(code(&good).starts_with("OK"), "{}", code(&good));

    // Concurrent: 8 identical creates with a fresh key give one reservation.
    let body = json!({"tenant": "team-a", "gpus": 1, "duration_s": 600, "idempotency_key": "k2"});
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (c, b) = (a.clone(), body.clone());
        set.spawn(async move { c.call("reservations", "create", b).await });
    }
    let mut ids = HashSet::new();
    while let Some(r) = set.join_next().await {
        let v = r.expect("join").expect("create");
        assert_eq!(v["reservation"]["state"], "placed", "{v}");
        ids.insert(
            v["reservation"]["id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM reservations")
        .fetch_one(f.store.pool())
        .await
        .expect("count");
    assert_eq!(n, 3);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_creates_never_book_a_gpu_twice() {
    // 10 nodes × 8 = 80 GPUs; 200 creates of 1..=3 GPUs ask for ~400.
    let f = fleet(10, 8).await;
    let a = f.tenant_user("team-a").await;
    let mut set = tokio::task::JoinSet::new();
    for i in 0..200u32 {
        let c = a.clone();
        set.spawn(async move {
            c.call(
                "reservations",
                "create",
                json!({"tenant": "team-a", "gpus": 1 + i % 3, "duration_s": 600, "idempotency_key": format!("c{i}")}),
            )
            .await
        });
    }
    let mut booked: Vec<String> = Vec::new();
    let (mut placed, mut refused) = (0, 0);
    while let Some(r) = set.join_next().await {
        match r.expect("join") {
            Ok(v) => {
                assert_eq!(v["reservation"]["state"], "placed", "{v}");
                let nodes: HashSet<_> = v["reservation"]["gpus"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|g| g["node"].clone())
                    .collect();
                assert_eq!(nodes.len(), 1, "topology node spans one node: {v}");
                booked.extend(gpus_of(&v));
                placed += 1;
            }
            Err(ClientError::Api { code, message }) => {
                assert_eq!(code, "UNAVAILABLE", "{message}");
                assert!(message.contains("no capacity"), "{message}");
                refused += 1;
            }
            Err(e) => panic!("transport: {e}"),
        }
    }
    let unique: HashSet<_> = booked.iter().collect();
    assert_eq!(unique.len(), booked.len(), "a GPU was booked twice");
    assert!(booked.len() <= 80);
    assert!(
        booked.len() >= 78,
        "only {} of 80 GPUs booked with {refused} refusals",
        booked.len()
    );
    assert_eq!(placed + refused, 200);
    // The database agrees: every booked device belongs to a placed reservation.
    let (db_booked, db_placed): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL), \
                (SELECT count(*) FROM reservations WHERE state = 'placed')",
    )
    .fetch_one(f.store.pool())
    .await
    .expect("counts");
    assert_eq!(db_booked as usize, booked.len());
    assert_eq!(db_placed, placed);
    // Each booking reached its node's desired state with an outbox record (delivered or pending).
    let spec_gpus: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(jsonb_array_length(b->'gpus')), 0)::bigint FROM nodes, jsonb_array_elements(desired_spec->'bookings') b",
    )
    .fetch_one(f.store.pool())
    .await
    .expect("spec");
    assert_eq!(spec_gpus as usize, booked.len());
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_and_expiry_runs_without_notifications() {
    let f = fleet(1, 8).await;
    let a = f.tenant_user("team-a").await;
    let r = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 8, "duration_s": 600}),
        )
        .await
        .expect("create");
    let id = r["reservation"]["id"].as_str().expect("id").to_string();
    let full = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 1, "duration_s": 600}),
        )
        .await;
    assert_eq!(code(&full), "UNAVAILABLE");
    let released = a
        .call("reservations", "release", json!({"id": id}))
        .await
        .expect("release");
    assert_eq!(released["reservation"]["state"], "released");
    assert_eq!(
        code(&a.call("reservations", "release", json!({"id": id})).await),
        "CONFLICT"
    );
    // Another tenant cannot see it.
    let b = f.tenant_user("team-b").await;
    assert_eq!(
        code(&b.call("reservations", "get", json!({"id": id})).await),
        "NOT_FOUND"
    );

    // Expiry: no notification drives it; the controllers' tick finds the due work item of a shard it leases.
    let short = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 4, "duration_s": 1}),
        )
        .await
        .expect("short");
    let sid = short["reservation"]["id"].as_str().expect("id").to_string();
    sqlx::query("UPDATE work_queue SET run_at = now() WHERE subject = $1")
        .bind(&sid)
        .execute(f.store.pool())
        .await
        .expect("due");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let state: String = sqlx::query_scalar("SELECT state FROM reservations WHERE id = $1")
            .bind(&sid)
            .fetch_one(f.store.pool())
            .await
            .expect("state");
        if state == "expired" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not expired: {state}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let booked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL")
            .fetch_one(f.store.pool())
            .await
            .expect("booked");
    assert_eq!(booked, 0);
    let audits: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'reservation.expired' AND subject = $1",
    )
    .bind(format!("reservation/{sid}"))
    .fetch_one(f.store.pool())
    .await
    .expect("audit");
    assert_eq!(audits, 1);
    f.stop().await;
}

/// Issue 10 item 14: once `nodes.drain` returns, no admission places on the node, even with the scheduler's periodic
/// full reload far away (the default 30 s); `nodes.undrain` makes its GPUs bookable again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_takes_no_booking_from_the_moment_drain_returns() {
    let f = fleet_with(2, 4, Duration::from_secs(30)).await;
    // Warm the scheduler's capacity view with both nodes in it.
    let warm = f
        .admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 600}),
        )
        .await
        .expect("warm");
    let warm_id = warm["reservation"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    f.admin
        .call("reservations", "release", json!({"id": warm_id}))
        .await
        .expect("release");
    let drained = "n-1";
    let node = |id: &str| NodeRef {
        id: NodeId::parse(id).expect("a node id"),
    };
    let d = f
        .admin
        .method::<DrainNodeMethod>(&node(drained))
        .await
        .expect("drain");
    assert_eq!((d.state, d.changed), (NodeState::Draining, true), "{d:?}");
    // At once, more single-GPU admissions than the other node holds, concurrently.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..6 {
        let c = f.admin.clone();
        set.spawn(async move {
            c.call(
                "reservations",
                "create",
                json!({"tenant": "root", "gpus": 1, "duration_s": 600, "idempotency_key": format!("d{i}")}),
            )
            .await
        });
    }
    let results = set.join_all().await;
    let mut placed = 0;
    for r in &results {
        match r {
            Ok(v) => {
                let nodes = &v["reservation"]["nodes"];
                assert_eq!(v["reservation"]["state"], "placed", "{v}");
                assert!(
                    !nodes.as_array().into_iter().flatten().any(|n| n == drained),
                    "placed on the drained node: {v}"
                );
                placed += 1;
            }
            Err(e) => assert_eq!(code(r), "UNAVAILABLE", "{e}"),
        }
    }
    assert_eq!(
        placed, 4,
        "the other node's 4 GPUs, and no more: {results:?}"
    );
    let on_drained: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE node_id = $1 AND reservation_id IS NOT NULL",
    )
    .bind(drained)
    .fetch_one(f.store.pool())
    .await
    .expect("count");
    assert_eq!(on_drained, 0);
    // Draining again, or undraining an adopted node, changes nothing.
    let again = f
        .admin
        .method::<DrainNodeMethod>(&node(drained))
        .await
        .expect("drain again");
    assert!(!again.changed, "{again:?}");
    let adopted = f
        .admin
        .method::<UndrainNodeMethod>(&node("n-2"))
        .await
        .expect("undrain an adopted node");
    assert!(!adopted.changed, "{adopted:?}");
    // Undrain: the next admission lands on it at once (the other node is full).
    let u = f
        .admin
        .method::<UndrainNodeMethod>(&node(drained))
        .await
        .expect("undrain");
    assert_eq!(u.state, NodeState::Adopted, "{u:?}");
    let r = f
        .admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 600}),
        )
        .await
        .expect("placed after undrain");
    assert_eq!(r["reservation"]["nodes"], json!([drained]), "{r}");
    // Revoked is terminal: revoking again changes nothing, and drain and undrain are refused saying why.
    let revoked = f
        .admin
        .method::<RevokeNodeMethod>(&node("n-2"))
        .await
        .expect("revoke");
    assert_eq!((revoked.state, revoked.changed), (NodeState::Revoked, true));
    let again = f
        .admin
        .method::<RevokeNodeMethod>(&node("n-2"))
        .await
        .expect("revoke again");
    assert!(!again.changed, "{again:?}");
    for refused in [
        f.admin.method::<DrainNodeMethod>(&node("n-2")).await.err(),
        f.admin
            .method::<UndrainNodeMethod>(&node("n-2"))
            .await
            .err(),
    ] {
        match refused {
            Some(ClientError::Api { code, message }) => {
                assert_eq!(code, "CONFLICT", "{message}");
                assert_eq!(message, "node n-2 is revoked; nothing to change");
            }
            other => panic!("a verb on a revoked node: {other:?}"),
        }
    }
    f.stop().await;
}

/// Issue 10 items 12 and 14 at the CLI: `reservations show` and `nodes show` print a node's failure to apply a
/// booking (with its reason); `nodes drain` and `nodes undrain` work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_shows_a_failed_delivery_and_drains_and_undrains() {
    let f = fleet(1, 2).await;
    let r = f
        .admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 600}),
        )
        .await
        .expect("create");
    let id = r["reservation"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // The node's session acknowledges generation 2 (the booking) as failed.
    sqlx::query("UPDATE nodes SET session_epoch = 1 WHERE id = 'n-1'")
        .execute(f.store.pool())
        .await
        .expect("epoch");
    let reason = "writing /etc/cdi/bettercompute.io-gpu.json: Read-only file system (os error 30)";
    assert!(
        f.store
            .ack_desired("n-1", 1, 2, false, reason)
            .await
            .expect("ack")
    );
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute"))
            .args(args)
            .env("BC_API_URL", &f.url)
            .env("BC_API_KEY", f.admin.key())
            .output()
            .expect("run cli");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let shown = cli(&["reservations", "show", &id]);
    assert!(shown.contains("delivery: failed"), "{shown}");
    assert!(
        shown.contains(&format!("node n-1 generation 2: failed: {reason}")),
        "{shown}"
    );
    let node = cli(&["nodes", "show", "n-1"]);
    assert!(node.contains("generation 2 FAILED to apply"), "{node}");
    assert!(
        node.contains("condition: desired state generation 2 could not be applied")
            && node.contains(reason),
        "{node}"
    );
    assert!(cli(&["nodes", "drain", "n-1"]).contains("draining n-1"));
    assert!(cli(&["nodes", "undrain", "n-1"]).contains("undrained n-1"));
    f.stop().await;
}

/// Issue 17 item 1 at the CLI: reads print a header and aligned columns (`-o table`, more with `-o wide`), or the
/// API's answer as JSON or YAML with times as RFC 3339; the API flags go anywhere after the group; a profile's
/// named context supplies the URL and key, and an unknown context is named with the ones there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_tables_json_and_yaml_and_takes_flags_anywhere_and_contexts() {
    let f = fleet(1, 2).await;
    f.admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 600}),
        )
        .await
        .expect("create");
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute"));
        cmd.args(args)
            .env_remove("BC_API_URL")
            .env_remove("BC_API_KEY")
            .env_remove("BC_CONTEXT")
            .env("BC_CONFIG", dir.path().join("absent.toml"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("run cli")
    };
    let key = f.admin.key().to_string();
    let ok = |args: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--api-url", &f.url, "--api-key", &key]);
        let out = run(&all, &[]);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // A table: the header first, then a row per node; wide adds columns.
    let table = ok(&["nodes", "list"]);
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NODE", "POOL", "STATE", "ONLINE", "GPUS", "SEEN", "HOSTNAME"
        ],
        "{table}"
    );
    assert!(lines.any(|l| l.starts_with("n-1 ")), "{table}");
    let wide = ok(&["nodes", "list", "-o", "wide"]);
    assert!(
        wide.lines()
            .next()
            .unwrap_or_default()
            .ends_with("CONDITIONS"),
        "{wide}"
    );
    let reservations = ok(&["reservations", "list"]);
    assert!(reservations.starts_with("ID "), "{reservations}");
    assert_eq!(reservations.lines().count(), 2, "{reservations}");
    // JSON: the API's answer, its instants as RFC 3339 under the name without `_ms`.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["nodes", "list", "-o", "json"])).expect("json");
    let joined = v["nodes"][0]["joined_at"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        time::OffsetDateTime::parse(&joined, &time::format_description::well_known::Rfc3339)
            .is_ok(),
        "{v}"
    );
    assert!(v["nodes"][0].get("joined_at_ms").is_none(), "{v}");
    let yaml = ok(&["reservations", "list", "-o", "yaml"]);
    assert!(yaml.starts_with("reservations:\n- "), "{yaml}");
    // `info`: what a node or operator needs to trust and reach the control plane, and the versions.
    let info = ok(&["info"]);
    assert!(
        info.starts_with("FIELD ") && info.contains("CA pin") && info.contains("sha256:"),
        "{info}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["info", "-o", "json"])).expect("json");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"), "{v}");
    // `cordon` is drain's kubectl name.
    assert!(ok(&["nodes", "cordon", "n-1"]).contains("draining n-1"));
    assert!(ok(&["nodes", "uncordon", "n-1"]).contains("undrained n-1"));
    // The flags before the subcommand work too.
    let out = run(
        &["nodes", "--api-key", &key, "--api-url", &f.url, "list"],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A profile: the current context, a named one, an unknown one.
    let key_file = dir.path().join("admin.key");
    std::fs::write(&key_file, format!("{key}\n")).expect("key");
    let profile = dir.path().join("config.toml");
    std::fs::write(
        &profile,
        format!(
            "current = \"lab\"\n[contexts.lab]\napi_url = {:?}\napi_key_file = {key_file:?}\n\
             [contexts.other]\napi_url = \"http://127.0.0.1:1\"\napi_key = \"bcak_x\"\n",
            f.url
        ),
    )
    .expect("profile");
    let config = profile.to_str().unwrap_or_default();
    let out = run(&["nodes", "list"], &[("BC_CONFIG", config)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("n-1"));
    let out = run(
        &["nodes", "list", "--context", "staging"],
        &[("BC_CONFIG", config)],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no context \"staging\"") && err.contains("lab, other"),
        "{err}"
    );
    // No key anywhere: named with where one comes from.
    let out = run(&["nodes", "list"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no API key") && err.contains("--api-key"),
        "{err}"
    );
    f.stop().await;
}

/// A decision whose notification was lost (the placer's `bc_reservation_decided` sent while the API's LISTEN
/// connection was being replaced, as at a move of the database primary) reaches the waiting `create` when the
/// listener is back: the kernel's `Resync` makes the decisions reconciler read every reservation a call waits for.
/// Without that read the call waits out its 5 s for the decision and then reads the row itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_whose_notification_was_lost_is_read_back_when_listening_resumes() {
    let f = fleet(1, 8).await;
    let a = f.tenant_user("team-a").await;
    // No placer from here on: the reservation stays pending until this test decides it.
    f.back.shutdown().await;
    let create = tokio::spawn(async move {
        let r = a
            .call(
                "reservations",
                "create",
                json!({"tenant": "team-a", "gpus": 1, "duration_s": 600}),
            )
            .await;
        (r, tokio::time::Instant::now())
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let id: String = loop {
        let pending: Option<String> =
            sqlx::query_scalar("SELECT id FROM reservations WHERE state = 'pending'")
                .fetch_optional(f.store.pool())
                .await
                .expect("pending");
        if let Some(id) = pending {
            break id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no pending reservation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Decided without a notification (one lost), then the API's listening connection ended under it.
    sqlx::query("UPDATE reservations SET state = 'placed' WHERE id = $1")
        .bind(&id)
        .execute(f.store.pool())
        .await
        .expect("placed");
    let cut = tokio::time::Instant::now();
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%') t",
    )
    .fetch_one(f.store.pool())
    .await
    .expect("terminate");
    assert_eq!(ended, 1, "the API process's one listening connection");
    let (r, answered) = create.await.expect("create task");
    let r = r.expect("create");
    assert_eq!(r["reservation"]["id"], id.as_str(), "{r}");
    assert_eq!(r["reservation"]["state"], "placed", "{r}");
    let after = answered - cut;
    assert!(
        after < Duration::from_millis(2500),
        "answered {after:?} after the listener was cut (the call's own wait is 5 s)"
    );
    println!("answered {after:?} after the listening connection ended");
    f.api.shutdown().await;
}
