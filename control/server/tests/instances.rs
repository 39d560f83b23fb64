//! Instances against a real PostgreSQL: the admission sequence as reservations have it (tenant check before any
//! database access, idempotency replay and CONFLICT, also concurrent, capacity exhausted), placement on a hosted
//! pool's atoms (vCPU, memory and disk from the nodes' inventory, GPUs never booked to a reservation and an
//! instance at once), the node's desired state carrying the instance, later operations changing only desired
//! state, and delete giving the atoms back only once the node confirms the VM is gone; instances on a drained node
//! (shown as such, nothing new placed there) and a revoked one (failed with the reason, atoms back).

use bc_control::client::{ApiClient, ClientError};
use bc_control::config::{Roles, ServeConfig};
use bc_store::Store;
use bc_store::sqlx;
use bc_store::sqlx::postgres::PgPoolOptions;
use bc_store::testing::{seed_gpu_nodes, test_db};
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

const SHA: &str = "0000000000000000000000000000000000000000000000000000000000000001";

fn code(r: &Result<Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, .. }) => code.clone(),
        Err(e) => format!("transport: {e}"),
    }
}

fn message(r: &Result<Value, ClientError>) -> String {
    match r {
        Err(ClientError::Api { message, .. }) => message.clone(),
        other => code(other),
    }
}

struct Plane {
    store: Store,
    _dir: tempfile::TempDir,
    running: bc_control::Running,
    back: bc_control::Running,
    admin: ApiClient,
    admin_key: String,
    url: String,
    acquires: Arc<AtomicU64>,
    _db: bc_store::testing::TestDb,
}

/// An API-only process on a pool that counts every connection it hands out, and a second "process" (same test
/// binary, its own roles and pool) running the scheduler, so that the count is the API's alone; with `nodes` adopted nodes in
/// pool `vps` (a vps-host pool), each advertising 8 vCPUs, 16 GiB of memory, 100 GiB of disk and `gpus` GPUs, and
/// one node in the plain pool `gpu`.
async fn plane(nodes: i32, gpus: i32) -> Plane {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root");
    seed_gpu_nodes(&db.pool, "vps", "h", nodes, gpus, "NVIDIA L4")
        .await
        .expect("seed");
    seed_gpu_nodes(&db.pool, "gpu", "g", 1, 2, "NVIDIA L4")
        .await
        .expect("seed");
    sqlx::query(
        "INSERT INTO inventory_sections (node_id, name, hash, payload) \
         SELECT n.id, s.name, md5(s.name), s.payload FROM nodes n, (VALUES \
           ('cpu', '{\"threads\": 8}'::jsonb), \
           ('memory', '{\"total_bytes\": 17179869184}'::jsonb), \
           ('disks', '{\"disks\": [{\"name\": \"nvme0n1\", \"size_bytes\": 107374182400, \"removable\": false}, \
                                   {\"name\": \"sdz\", \"size_bytes\": 1099511627776, \"removable\": true}]}'::jsonb)) \
           AS s(name, payload)",
    )
    .execute(&db.pool)
    .await
    .expect("inventory");
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
    let dir = tempfile::tempdir().expect("dir");
    for role in ["api", "back"] {
        std::fs::create_dir(dir.path().join(role)).expect("state dir");
    }
    let running = bc_control::start(
        &ServeConfig::loopback(
            dir.path().join("api"),
            "test.bc",
            Roles {
                api: true,
                ..Roles::default()
            },
        ),
        Store::new(counted),
    )
    .await
    .expect("start");
    let back = bc_control::start(
        &ServeConfig::loopback(
            dir.path().join("back"),
            "test.bc",
            Roles {
                scheduler: true,
                ..Roles::default()
            },
        ),
        store.clone(),
    )
    .await
    .expect("start the scheduler");
    let url = format!("http://{}", running.api_addr.expect("api addr"));
    let admin_key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let admin = ApiClient::new(&url, &admin_key);
    admin
        .call(
            "instances",
            "set-pool",
            json!({"pool": "vps", "class": "vps-host"}),
        )
        .await
        .expect("set-pool");
    Plane {
        store,
        _dir: dir,
        running,
        back,
        admin,
        admin_key,
        url,
        acquires,
        _db: db,
    }
}

impl Plane {
    async fn stop(self) {
        self.running.shutdown().await;
        self.back.shutdown().await;
    }

    /// A principal of `tenant` allowed everything on instances (and reservations) in its tenant.
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
                       "grants": [{"permission": "compute:instances:*", "scope": format!("tenant/{tenant}")},
                                  {"permission": "compute:reservations:*", "scope": format!("tenant/{tenant}")}]}),
            )
            .await
            .expect("principal");
        ApiClient::new(&self.url, p["api_key"].as_str().expect("key"))
    }

    /// The node applied its desired state and reports the instances `ids` in its `instances` section, as bcd does
    /// once a deleted VM is gone.
    async fn node_reports(&self, node: &str, ids: &[&str]) {
        sqlx::query("UPDATE nodes SET acked_generation = desired_generation WHERE id = $1")
            .bind(node)
            .execute(self.store.pool())
            .await
            .expect("ack");
        let list: Vec<Value> = ids
            .iter()
            .map(|i| json!({"id": i, "generation": 1, "state": "running"}))
            .collect();
        sqlx::query(
            "INSERT INTO inventory_sections (node_id, name, hash, payload) VALUES ($1, 'instances', md5($2::text), $2) \
             ON CONFLICT (node_id, name) DO UPDATE SET payload = EXCLUDED.payload, hash = EXCLUDED.hash",
        )
        .bind(node)
        .bind(json!({ "instances": list }))
        .execute(self.store.pool())
        .await
        .expect("report");
    }

    /// One step of the instances reconciler's hosted sweep over every shard (what the controllers role runs).
    async fn sweep(&self) -> bc_mod_instances::hosted::Swept {
        let leases: Vec<bc_core::shards::ShardLease> = (0..256)
            .map(|s| bc_core::shards::ShardLease {
                shard: bc_core::shards::Shard::new(s).expect("shard"),
                fence: 0,
            })
            .collect();
        let instances = bc_mod_instances::Instances::new(
            self.store.clone(),
            bc_mod_instances::Config {
                delete_deadline: std::time::Duration::from_secs(2),
                ..Default::default()
            },
        );
        bc_mod_instances::hosted::step(&instances, "test", &leases, bc_mod_instances::now_ms())
            .await
            .expect("sweep")
    }

    async fn desired(&self, node: &str) -> (i64, Value) {
        sqlx::query_as("SELECT desired_generation, desired_spec FROM nodes WHERE id = $1")
            .bind(node)
            .fetch_one(self.store.pool())
            .await
            .expect("node")
    }
}

fn body(tenant: &str, vcpus: u32, gpus: u32, key: &str) -> Value {
    json!({"tenant": tenant, "pool": "vps", "vcpus": vcpus, "memory_mib": 1024, "disk_gib": 10, "gpus": gpus,
           "image": {"url": "http://127.0.0.1:9/debian.qcow2", "sha256": SHA},
           "user_data": "#cloud-config\n{}", "ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN test@example"],
           "idempotency_key": key})
}

fn id_of(v: &Value) -> String {
    v["instance"]["id"].as_str().unwrap_or_default().to_string()
}

/// How many windows of refused calls [`cross_tenant_create_is_denied_before_any_database_access`] may try.
const WINDOWS: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_tenant_create_is_denied_before_any_database_access() {
    let p = plane(1, 0).await;
    let a = p.tenant_user("team-a").await;
    // Warm the authentication cache with an allowed call, then count.
    let listed = a.call("instances", "list", json!({})).await;
    assert!(code(&listed).starts_with("OK"), "{}", code(&listed));
    // The API process's own loops (the tunnels sweeper's shard leases, about one acquisition a second measured idle)
    // also take connections, so the refused calls are repeated in up to ten windows and one window must see no
    // acquisition at all: a refused create that touched the database would move the counter in every window.
    let mut quiet_window = false;
    for _ in 0..WINDOWS {
        let before = p.acquires.load(Ordering::SeqCst);
        let r = a
            .call("instances", "create", body("team-b", 1, 0, "x"))
            .await;
        assert_eq!(code(&r), "ACCESS_DENIED");
        assert!(
            message(&r).contains("team-a") && message(&r).contains("team-b"),
            "{}",
            message(&r)
        );
        // A bad request is refused before the database too, naming the field.
        let mut bad = body("team-a", 1, 0, "y");
        bad["memory_mib"] = json!(1);
        let r = a.call("instances", "create", bad).await;
        assert_eq!(code(&r), "INVALID_ARGUMENT");
        assert!(message(&r).contains("memory_mib"), "{}", message(&r));
        if p.acquires.load(Ordering::SeqCst) == before {
            quiet_window = true;
            break;
        }
    }
    assert!(
        quiet_window,
        "a refused create touched the database ({WINDOWS} windows, each with an acquisition)"
    );
    let before = p.acquires.load(Ordering::SeqCst);
    // The counter does move for an admitted create (the test can fail).
    let ok = a
        .call("instances", "create", body("team-a", 1, 0, "z"))
        .await;
    assert!(code(&ok).starts_with("OK"), "{}", code(&ok));
    assert!(p.acquires.load(Ordering::SeqCst) > before);
    // Another tenant's instance does not exist as far as this caller can tell.
    let b = p.tenant_user("team-b").await;
    let id = id_of(ok.as_ref().expect("ok"));
    let seen = b.call("instances", "show", json!({"id": id})).await;
    assert_eq!(code(&seen), "NOT_FOUND");
    let stop = b.call("instances", "stop", json!({"id": id})).await;
    assert_eq!(code(&stop), "NOT_FOUND");
    let listed = b.call("instances", "list", json!({})).await.expect("list");
    assert_eq!(listed["instances"], json!([]));
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_replays_and_conflicts_also_concurrently() {
    let p = plane(2, 0).await;
    let a = p.tenant_user("team-a").await;
    let first = a
        .call("instances", "create", body("team-a", 2, 0, "k1"))
        .await
        .expect("create");
    assert_eq!(first["instance"]["state"], "placed", "{first}");
    let again = a
        .call("instances", "create", body("team-a", 2, 0, "k1"))
        .await
        .expect("replay");
    assert_eq!(id_of(&again), id_of(&first));
    assert_eq!(again["instance"]["node"], first["instance"]["node"]);
    let other = a
        .call("instances", "create", body("team-a", 3, 0, "k1"))
        .await;
    assert_eq!(code(&other), "CONFLICT");
    assert!(
        message(&other).contains(&id_of(&first)),
        "{}",
        message(&other)
    );

    // Concurrent: 8 identical creates with a fresh key give one instance, placed once.
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let c = a.clone();
        set.spawn(async move {
            c.call("instances", "create", body("team-a", 1, 0, "k2"))
                .await
        });
    }
    let mut ids = HashSet::new();
    while let Some(r) = set.join_next().await {
        let v = r.expect("join").expect("create");
        assert_eq!(v["instance"]["state"], "placed", "{v}");
        ids.insert(id_of(&v));
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let (n, vcpus): (i64, i64) =
        sqlx::query_as("SELECT count(*), sum(vcpus) FROM instances WHERE state = 'placed'")
            .fetch_one(p.store.pool())
            .await
            .expect("count");
    assert_eq!((n, vcpus), (2, 3));
    // Every placed instance is in exactly one node's desired state.
    let listed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM nodes, jsonb_array_elements(COALESCE(desired_spec->'instances', '[]')) e",
    )
    .fetch_one(p.store.pool())
    .await
    .expect("desired");
    assert_eq!(listed, 2);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_exhausted_says_what_is_free_and_delete_gives_the_atoms_back() {
    // One node: 8 vCPUs.
    let p = plane(1, 0).await;
    let a = p.tenant_user("team-a").await;
    let first = a
        .call("instances", "create", body("team-a", 6, 0, "big"))
        .await
        .expect("create");
    let r = a
        .call("instances", "create", body("team-a", 4, 0, "more"))
        .await;
    assert_eq!(code(&r), "UNAVAILABLE", "{}", code(&r));
    assert!(
        message(&r).contains("4 vCPU") && message(&r).contains("2 vCPU"),
        "{}",
        message(&r)
    );
    // Memory and disk are atoms too: 16 GiB and 100 GiB (the removable disk does not count).
    let mut mem = body("team-a", 1, 0, "mem");
    mem["memory_mib"] = json!(16 * 1024);
    assert_eq!(
        code(&a.call("instances", "create", mem).await),
        "UNAVAILABLE"
    );
    let mut disk = body("team-a", 1, 0, "disk");
    disk["disk_gib"] = json!(95);
    assert_eq!(
        code(&a.call("instances", "create", disk).await),
        "UNAVAILABLE"
    );
    // A failed create holds nothing and replays as the same refusal.
    let again = a
        .call("instances", "create", body("team-a", 4, 0, "more"))
        .await;
    assert_eq!(code(&again), "UNAVAILABLE");

    let id = id_of(&first);
    p.node_reports("h-1", &[&id]).await;
    let deleted = a
        .call("instances", "delete", json!({"id": id}))
        .await
        .expect("delete");
    // Off the node's desired state at once, but `deleting` and holding its atoms until the node confirms.
    assert_eq!(deleted["instance"]["state"], "deleting");
    let (_, spec) = p.desired("h-1").await;
    assert_eq!(spec["instances"], json!([]), "{spec}");
    let twice = a.call("instances", "delete", json!({"id": id})).await;
    assert_eq!(code(&twice), "CONFLICT");
    assert!(
        message(&twice).contains("being deleted"),
        "{}",
        message(&twice)
    );
    let early = a
        .call("instances", "create", body("team-a", 8, 0, "early"))
        .await;
    assert_eq!(
        code(&early),
        "UNAVAILABLE",
        "the deleting VM still holds its vCPUs"
    );
    // The node has not applied the removal yet (its report still lists the VM): nothing is confirmed.
    assert_eq!(p.sweep().await.confirmed, Vec::<String>::new());
    // Applied, but the VM is still reported: not yet either; past the deadline the instance says why.
    sqlx::query("UPDATE nodes SET acked_generation = desired_generation WHERE id = 'h-1'")
        .execute(p.store.pool())
        .await
        .expect("ack");
    tokio::time::sleep(std::time::Duration::from_millis(2_100)).await;
    let swept = p.sweep().await;
    assert_eq!(
        (swept.confirmed.len(), swept.overdue.clone()),
        (0, vec![id.clone()])
    );
    let shown = a
        .call("instances", "show", json!({"id": id}))
        .await
        .expect("show");
    assert!(
        shown["instance"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("has not confirmed")),
        "{shown}"
    );
    // The node reports the VM gone: deleted, the vCPUs are back and a new key fits now.
    p.node_reports("h-1", &[]).await;
    assert_eq!(p.sweep().await.confirmed, vec![id.clone()]);
    let shown = a
        .call("instances", "show", json!({"id": id}))
        .await
        .expect("show");
    assert_eq!(shown["instance"]["state"], "deleted", "{shown}");
    let fits = a
        .call("instances", "create", body("team-a", 8, 0, "all"))
        .await;
    assert!(code(&fits).starts_with("OK"), "{}", code(&fits));
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_is_never_booked_to_a_reservation_and_an_instance_at_once() {
    // Two hosted nodes with 3 GPUs each.
    let p = plane(2, 3).await;
    let a = p.tenant_user("team-a").await;
    let inst = a
        .call("instances", "create", body("team-a", 2, 2, "gpu"))
        .await
        .expect("create");
    let node = inst["instance"]["node"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let gpus: Vec<String> = serde_json::from_value(inst["instance"]["gpus"].clone()).expect("gpus");
    assert_eq!(gpus.len(), 2);
    // Reservations get every other GPU of the fleet (the third of its node, the other hosted node's 3, the plain
    // pool's 2), never these.
    let mut booked = Vec::new();
    for i in 0..7 {
        let r = a
            .call(
                "reservations",
                "create",
                json!({"tenant": "team-a", "gpus": 1, "duration_s": 600, "idempotency_key": format!("r{i}")}),
            )
            .await;
        if let Ok(v) = &r {
            for g in v["reservation"]["gpus"].as_array().into_iter().flatten() {
                booked.push(g["uuid"].as_str().unwrap_or_default().to_string());
            }
        }
    }
    assert_eq!(booked.len(), 6, "{booked:?}");
    assert!(
        booked.iter().all(|g| !gpus.contains(g)),
        "{booked:?} vs {gpus:?}"
    );
    // With every GPU held, another GPU instance is refused; a CPU-only one still fits.
    let r = a
        .call("instances", "create", body("team-a", 1, 1, "gpu2"))
        .await;
    assert_eq!(code(&r), "UNAVAILABLE");
    // The instance's GPUs reach the node in its instances list, not as a booking (the node's bookings were
    // published again when a reservation booked its third GPU).
    let (_, spec) = p.desired(&node).await;
    assert_eq!(spec["bookings"].as_array().map(Vec::len), Some(1), "{spec}");
    assert_eq!(spec["instances"][0]["gpus"], json!(gpus), "{spec}");
    let in_bookings = spec["bookings"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|b| b["reservation"] == inst["instance"]["id"]);
    assert!(!in_bookings, "{spec}");
    // Delete gives them back only once the node confirms the VM (and its passthrough) gone: until then a
    // reservation cannot book them.
    a.call("instances", "delete", json!({"id": id_of(&inst)}))
        .await
        .expect("delete");
    let r = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 2, "duration_s": 600, "idempotency_key": "before"}),
        )
        .await;
    assert_eq!(
        code(&r),
        "UNAVAILABLE",
        "a deleting VM's GPUs were bookable"
    );
    p.node_reports(&node, &[]).await;
    assert_eq!(p.sweep().await.confirmed, vec![id_of(&inst)]);
    let r = a
        .call(
            "reservations",
            "create",
            json!({"tenant": "team-a", "gpus": 2, "duration_s": 600, "idempotency_key": "after"}),
        )
        .await;
    assert!(code(&r).starts_with("OK"), "{}", code(&r));
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_operations_change_only_desired_state() {
    let p = plane(1, 0).await;
    let a = p.tenant_user("team-a").await;
    let inst = a
        .call("instances", "create", body("team-a", 2, 0, "ops"))
        .await
        .expect("create");
    let id = id_of(&inst);
    let (g1, spec) = p.desired("h-1").await;
    let entry = &spec["instances"][0];
    assert_eq!(entry["id"], id.as_str());
    assert_eq!(entry["power"], "running");
    assert_eq!(entry["generation"], 1);
    assert_eq!(entry["vcpus"], 2);
    assert_eq!(entry["image"]["sha256"], SHA);
    assert_eq!(
        entry["meta"]["ssh_keys"][0],
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN test@example"
    );
    let outbox = |g: i64| {
        let store = p.store.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox WHERE node_id = 'h-1' AND kind = 'desired' AND generation = $1",
            )
            .bind(g)
            .fetch_one(store.pool())
            .await
            .expect("outbox")
        }
    };
    assert_eq!(
        outbox(g1).await,
        1,
        "the placement's delivery is in the outbox"
    );

    let stopped = a
        .call("instances", "stop", json!({"id": id}))
        .await
        .expect("stop");
    assert_eq!(stopped["instance"]["power"], "stopped");
    let (g2, spec) = p.desired("h-1").await;
    assert_eq!(g2, g1 + 1);
    assert_eq!(outbox(g2).await, 1);
    assert_eq!(spec["instances"][0]["power"], "stopped");
    assert_eq!(spec["instances"][0]["generation"], 2);

    a.call("instances", "start", json!({"id": id}))
        .await
        .expect("start");
    a.call("instances", "reboot", json!({"id": id}))
        .await
        .expect("reboot");
    let (g4, spec) = p.desired("h-1").await;
    assert_eq!(g4, g1 + 3);
    assert_eq!(spec["instances"][0]["power"], "running");
    assert_eq!(spec["instances"][0]["reboots"], 1);
    assert_eq!(spec["instances"][0]["generation"], 4);
    // Nothing but desired state changed: still one instance, on the same node, with the same atoms.
    let (n, node, vcpus): (i64, String, i32) =
        sqlx::query_as("SELECT count(*) OVER (), node_id, vcpus FROM instances")
            .fetch_one(p.store.pool())
            .await
            .expect("row");
    assert_eq!((n, node.as_str(), vcpus), (1, "h-1", 2));

    // What the node reports shows with the instance.
    sqlx::query(
        "INSERT INTO inventory_sections (node_id, name, hash, payload) VALUES ('h-1', 'instances', 'x', $1)",
    )
    .bind(json!({"instances": [{"id": id, "generation": 4, "state": "running", "pid": 42, "accel": "tcg",
                                "cloud_init_done": true}]}))
    .execute(p.store.pool())
    .await
    .expect("report");
    let shown = a
        .call("instances", "show", json!({"id": id}))
        .await
        .expect("show");
    assert_eq!(shown["instance"]["observed"]["state"], "running", "{shown}");
    assert_eq!(shown["instance"]["observed"]["cloud_init_done"], true);

    // A pool that hosts no instances is refused with what to do.
    let mut plain = body("team-a", 1, 0, "plain");
    plain["pool"] = json!("gpu");
    let r = a.call("instances", "create", plain).await;
    assert_eq!(code(&r), "FAILED_PRECONDITION");
    assert!(message(&r).contains("set-pool"), "{}", message(&r));
    p.stop().await;
}

/// `better-compute instances …`, the real binary against this plane: (success, stdout, stderr).
fn cli(p: &Plane, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .arg("instances")
        .args(args)
        .args(["-o", "json"])
        .env("BC_API_URL", &p.url)
        .env("BC_API_KEY", &p.admin_key)
        .output()
        .expect("run better-compute");
    // JSON compacted, so the checks below read one spelling whatever the CLI's indentation.
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stdout = match serde_json::from_str::<Value>(&stdout) {
        Ok(v) => v.to_string(),
        Err(_) => stdout,
    };
    (
        out.status.success(),
        stdout,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_stops_and_deletes_an_instance() {
    let p = plane(1, 0).await;
    let (ok, out, err) = tokio::task::block_in_place(|| {
        cli(
            &p,
            &[
                "create",
                "--tenant",
                "root",
                "--pool",
                "vps",
                "--vcpus",
                "2",
                "--image-url",
                "http://127.0.0.1:9/x.qcow2",
                "--image-sha256",
                SHA,
                "--ssh-key",
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN k@x",
                "--idempotency-key",
                "cli",
            ],
        )
    });
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["instance"]["state"], "placed", "{v}");
    let id = id_of(&v);
    let (ok, out, err) = tokio::task::block_in_place(|| cli(&p, &["stop", &id]));
    assert!(ok, "{err}");
    assert!(out.contains("\"power\":\"stopped\""), "{out}");
    let (ok, out, _) = tokio::task::block_in_place(|| cli(&p, &["list"]));
    assert!(ok && out.contains(&id), "{out}");
    let (ok, out, err) = tokio::task::block_in_place(|| cli(&p, &["delete", &id]));
    assert!(ok, "{err}");
    assert!(out.contains("\"state\":\"deleting\""), "{out}");
    // A bad request is refused by the CLI itself, naming the field; a bad class too.
    let (ok, _, err) = tokio::task::block_in_place(|| {
        cli(
            &p,
            &[
                "create",
                "--tenant",
                "root",
                "--pool",
                "vps",
                "--memory-mib",
                "1",
                "--image-url",
                "http://127.0.0.1:9/x.qcow2",
                "--image-sha256",
                SHA,
            ],
        )
    });
    assert!(!ok && err.contains("memory_mib"), "{err}");
    let (ok, _, err) = tokio::task::block_in_place(|| cli(&p, &["set-pool", "vps", "cloud"]));
    assert!(!ok && err.contains("vps-host"), "{err}");
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_keeps_its_instances_and_a_revoked_one_fails_them() {
    // Two nodes with one GPU each.
    let p = plane(2, 1).await;
    let a = p.tenant_user("team-a").await;
    let one = a
        .call("instances", "create", body("team-a", 4, 1, "one"))
        .await
        .expect("create");
    let two = a
        .call("instances", "create", body("team-a", 8, 1, "two"))
        .await
        .expect("create");
    let node_of = |v: &Value| {
        v["instance"]["node"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let (n1, n2) = (node_of(&one), node_of(&two));
    assert_ne!(n1, n2);
    // Drained: the instance stays, shown with its node's state; nothing new goes there.
    p.admin
        .call("nodes", "drain", json!({"id": n1}))
        .await
        .expect("drain");
    let shown = a
        .call("instances", "show", json!({"id": id_of(&one)}))
        .await
        .expect("show");
    assert_eq!(shown["instance"]["state"], "placed", "{shown}");
    assert_eq!(shown["instance"]["node_state"], "draining", "{shown}");
    a.call("instances", "delete", json!({"id": id_of(&two)}))
        .await
        .expect("delete");
    p.node_reports(&n2, &[]).await;
    p.sweep().await;
    let next = a
        .call("instances", "create", body("team-a", 1, 0, "next"))
        .await
        .expect("create");
    // The drained node is the fullest that fits (4 vCPUs free against 8): only its state keeps the create off it.
    assert_eq!(node_of(&next), n2, "placed on the drained node");
    // Revoked: its instances fail with the reason, their GPUs and atoms back.
    p.admin
        .call("nodes", "revoke", json!({"id": n2}))
        .await
        .expect("revoke");
    let swept = p.sweep().await;
    assert_eq!(swept.revoked, vec![id_of(&next)]);
    let shown = a
        .call("instances", "show", json!({"id": id_of(&next)}))
        .await
        .expect("show");
    assert_eq!(shown["instance"]["state"], "failed", "{shown}");
    assert!(
        shown["instance"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("was revoked")),
        "{shown}"
    );
    assert_eq!(shown["instance"]["node_state"], "revoked", "{shown}");
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM devices WHERE reservation_id = $1")
        .bind(id_of(&one))
        .fetch_one(p.store.pool())
        .await
        .expect("devices");
    assert_eq!(held, 1, "the drained node's instance keeps its GPU");
    p.stop().await;
}

/// A placement and a change on the same node at the same moment both stay in the node's desired state. The change
/// (here a stop) rewrites the node's whole list; read before the placement committed, its list lacked the new
/// instance and, written after the placement, took it off the node (found while reworking placement's publish).
/// Now the change locks the node's row before it reads the list, so it waits for the placement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_beside_a_placement_on_the_same_node_keeps_both_on_the_node() {
    use bc_mod_instances::queries;
    let p = plane(1, 0).await;
    let a = p.tenant_user("team-a").await;
    let x = id_of(
        &a.call("instances", "create", body("team-a", 1, 0, "x"))
            .await
            .expect("create x"),
    );
    // Instance y placed by hand, its transaction held open after it published.
    let req = serde_json::from_value::<bc_core::api::instances::CreateInstance>(body(
        "team-a", 1, 0, "y",
    ))
    .expect("request")
    .request();
    let y = "inst-y-by-hand";
    let mut conn = p.store.pool().acquire().await.expect("connection");
    let admitted = queries::admit_if_hosted(
        &mut conn,
        queries::NewInstance {
            id: y,
            principal_id: "team-a-user",
            key: "y",
            body_hash: &req.body_hash(),
            request: &req,
        },
    )
    .await
    .expect("admit y");
    assert!(matches!(admitted, Some(queries::Admission::Recorded)));
    drop(conn);
    let mut tx = p.store.pool().begin().await.expect("begin");
    let node = queries::claim_node(&mut tx, &req, &[])
        .await
        .expect("claim")
        .expect("a node fits");
    assert_eq!(node, "h-1");
    let entry = queries::placement_entry(y, &req, json!([]));
    queries::place_and_publish(&mut tx, y, &node, &[], entry)
        .await
        .expect("place")
        .expect("pending");
    let stop = tokio::spawn({
        let a = a.clone();
        let x = x.clone();
        async move { a.call("instances", "stop", json!({"id": x})).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        !stop.is_finished(),
        "the stop did not wait for the placement on its node"
    );
    tx.commit().await.expect("commit");
    stop.await.expect("join").expect("stop");
    let (_, spec) = p.desired("h-1").await;
    let ids: HashSet<&str> = spec["instances"]
        .as_array()
        .expect("instances list")
        .iter()
        .filter_map(|e| e["id"].as_str())
        .collect();
    assert_eq!(
        ids,
        HashSet::from([x.as_str(), y]),
        "desired state after a stop beside a placement: {spec}"
    );
    let power: Vec<&str> = spec["instances"]
        .as_array()
        .expect("instances list")
        .iter()
        .filter(|e| e["id"] == x.as_str())
        .filter_map(|e| e["power"].as_str())
        .collect();
    assert_eq!(power, ["stopped"]);
}

/// The module declares its tables hot (`Module::hot_tables`) and the kernel's statistics loop, which this plane's
/// scheduler role runs, analyzes them once they outgrow the planner's estimate: without that, a statement prepared
/// while `instances` was empty kept scanning it (78 buffers per placement, BENCHMARKS.md stop 27).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kernel_keeps_the_module_tables_statistics_current() {
    let p = plane(1, 0).await;
    let before = p
        .store
        .planner_row_estimate("instances")
        .await
        .expect("estimate");
    assert!(before < 1000.0, "estimate before the rows: {before}");
    sqlx::query(
        "INSERT INTO instances (id, tenant_id, principal_id, pool_id, request, state, vcpus, memory_mib, disk_gib) \
         SELECT 'inst-filler-' || g, 'root', 'admin', 'vps', '{}', 'failed', 1, 1, 1 FROM generate_series(1, 3000) g",
    )
    .execute(p.store.pool())
    .await
    .expect("fill");
    // The loop checks every 2 s; PostgreSQL publishes the live-row count within about a second of the commit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let now = p
            .store
            .planner_row_estimate("instances")
            .await
            .expect("estimate");
        if now >= 3000.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "instances still estimated at {now} rows 30 s after 3,000 were written: the kernel's statistics loop \
             does not cover the module's hot tables"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
