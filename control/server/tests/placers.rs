//! The placer chosen by configuration (`[capacity] placer`), against a real PostgreSQL with several control-plane
//! instances in this test process: with `pool-lease`, each pool has one holder among the scheduler processes
//! (its only booking writer) and every reservation is placed once, in its pool; when the holder stops, another
//! takes its pools within the lease expiry and books. A scheduler-only process never holds a controllers' shard;
//! `initialize` says so when pool-lease is configured and no scheduler runs.

use bc_control::client::{ApiClient, ClientError};
use bc_control::config::{Roles, ServeConfig};
use bc_mod_capacity::Placer;
use bc_store::Store;
use bc_store::sqlx;
use bc_store::testing::{seed_gpu_nodes, test_db};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;

const H100: &str = "NVIDIA H100 80GB HBM3";
const POOLS: [&str; 6] = ["pa", "pb", "pc", "pd", "pe", "pf"];
const LEASE: Duration = Duration::from_millis(1000);

fn config(dir: &std::path::Path, roles: Roles, placer: Placer) -> ServeConfig {
    ServeConfig {
        shard_lease: Some(LEASE),
        capacity_reload: Some(Duration::from_millis(200)),
        placer,
        ..ServeConfig::loopback(dir.to_path_buf(), "test.bc", roles)
    }
}

fn scheduler_only() -> Roles {
    Roles {
        scheduler: true,
        ..Roles::default()
    }
}

fn api_only() -> Roles {
    Roles {
        api: true,
        ..Roles::default()
    }
}

async fn until<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        match f().await {
            Ok(()) => return,
            Err(e) if tokio::time::Instant::now() > deadline => panic!("{what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The valid pool leases: pool → (owner, fence).
async fn pool_holders(store: &Store) -> HashMap<String, (String, i64)> {
    bc_mod_capacity::queries::pool_leases(store)
        .await
        .expect("pool leases")
        .into_iter()
        .filter(|(_, _, _, valid)| *valid)
        .map(|(pool, owner, fence, _)| (pool, (owner, fence)))
        .collect()
}

async fn live_schedulers(store: &Store) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT id FROM workers WHERE role = 'scheduler' AND expires_at > now() ORDER BY id",
    )
    .fetch_all(store.pool())
    .await
    .expect("workers")
}

fn code(r: &Result<Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, message }) => format!("{code}: {message}"),
        Err(e) => format!("transport: {e}"),
    }
}

/// Creates one 1-GPU reservation in each pool of `pools`, `rounds` times (keys tagged `tag`); returns (id, pool)
/// of each, all placed.
async fn book(
    admin: &ApiClient,
    tag: &str,
    pools: &[&str],
    rounds: usize,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for round in 0..rounds {
        for pool in pools {
            let r = admin
                .call(
                    "reservations",
                    "create",
                    json!({"tenant": "root", "gpus": 1, "duration_s": 600, "pool": pool,
                           "idempotency_key": format!("{tag}-{pool}-{round}")}),
                )
                .await;
            let v = r.unwrap_or_else(|e| panic!("create in {pool}: {e}"));
            let shown: bc_core::api::capacity::ReservationAnswer =
                serde_json::from_value(v.clone()).expect("typed answer");
            assert_eq!(
                shown.reservation.reservation.state,
                bc_core::reservation::ReservationState::Placed,
                "{v}"
            );
            out.push((
                shown.reservation.reservation.id.to_string(),
                pool.to_string(),
            ));
        }
    }
    out
}

/// Every reservation placed exactly once, on one GPU of a node of its own pool.
async fn placed_once_in_their_pools(store: &Store, booked: &[(String, String)]) {
    for (id, pool) in booked {
        let rows: Vec<(String,)> = sqlx::query_as(
            "SELECT n.pool_id FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.reservation_id = $1",
        )
        .bind(id)
        .fetch_all(store.pool())
        .await
        .expect("devices");
        assert_eq!(rows.len(), 1, "reservation {id} holds {} GPUs", rows.len());
        assert_eq!(
            &rows[0].0, pool,
            "reservation {id} was booked outside its pool"
        );
    }
    let total: i64 =
        sqlx::query_scalar("SELECT count(*) FROM devices WHERE reservation_id IS NOT NULL")
            .fetch_one(store.pool())
            .await
            .expect("booked");
    assert_eq!(total as usize, booked.len(), "a GPU was booked for nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_lease_books_each_pool_from_its_one_holder_and_hands_over_when_it_stops() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    for pool in POOLS {
        seed_gpu_nodes(&db.pool, pool, pool, 2, 4, H100)
            .await
            .expect("seed");
    }
    let admin_key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().expect("dir")).collect();
    let s1 = bc_control::start(
        &config(dirs[0].path(), scheduler_only(), Placer::PoolLease),
        store.clone(),
    )
    .await
    .expect("scheduler 1");
    until(5, "scheduler 1 is a live worker", || async {
        let w = live_schedulers(&store).await;
        if w.len() == 1 {
            Ok(())
        } else {
            Err(format!("{w:?}"))
        }
    })
    .await;
    let w1 = live_schedulers(&store).await.remove(0);
    let s2 = bc_control::start(
        &config(dirs[1].path(), scheduler_only(), Placer::PoolLease),
        store.clone(),
    )
    .await
    .expect("scheduler 2");
    let api = bc_control::start(
        &config(dirs[2].path(), api_only(), Placer::PoolLease),
        store.clone(),
    )
    .await
    .expect("api");
    assert!(
        api.notes.is_empty(),
        "schedulers run, yet initialize warned: {:?}",
        api.notes
    );
    let admin = ApiClient::new(
        &format!("http://{}", api.api_addr.expect("api addr")),
        &admin_key,
    );

    // Each pool has exactly one holder, a live scheduler, as rendezvous hashing over the two of them says.
    until(10, "every pool held by its rendezvous owner", || async {
        let workers = live_schedulers(&store).await;
        let holders = pool_holders(&store).await;
        if workers.len() != 2 {
            return Err(format!("{} live schedulers", workers.len()));
        }
        for pool in POOLS {
            let want = bc_core::shards::key_owner(pool, &workers);
            if holders.get(pool).map(|(o, _)| o.as_str()) != want {
                return Err(format!(
                    "{pool}: held by {:?}, want {want:?}",
                    holders.get(pool)
                ));
            }
        }
        Ok(())
    })
    .await;
    let before = pool_holders(&store).await;

    // A reservation without a pool cannot be placed by pool: a clear INVALID_ARGUMENT.
    let no_pool = admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 60}),
        )
        .await;
    let said = code(&no_pool);
    assert!(
        said.starts_with("INVALID_ARGUMENT") && said.contains("pool-lease"),
        "{said}"
    );

    let mut booked = book(&admin, "before", &POOLS, 2).await;
    placed_once_in_their_pools(&store, &booked).await;
    // No lease changed hands while they were booked: each pool's bookings came from its one holder.
    assert_eq!(pool_holders(&store).await, before);
    // The shard placer's leases are not taken in pool-lease mode.
    assert!(
        store
            .shard_leases("scheduler")
            .await
            .expect("leases")
            .is_empty()
    );

    // The holder of pa stops: the other scheduler takes its pools within the lease expiry and books in them.
    let pa_holder = before["pa"].0.clone();
    let (mut stopped, survivor) = if pa_holder == w1 { (s1, s2) } else { (s2, s1) };
    stopped.stop().await;
    let t0 = tokio::time::Instant::now();
    until(10, "the survivor holds every pool", || async {
        let workers = live_schedulers(&store).await;
        let holders = pool_holders(&store).await;
        match workers.as_slice() {
            [w] if POOLS
                .iter()
                .all(|p| holders.get(*p).map(|h| &h.0) == Some(w)) =>
            {
                Ok(())
            }
            _ => Err(format!("workers {workers:?}, holders {holders:?}")),
        }
    })
    .await;
    let took = t0.elapsed();
    assert!(
        took < LEASE * 2 + Duration::from_millis(1500),
        "the pools took {took:?} to move with a {LEASE:?} lease"
    );
    let moved = pool_holders(&store).await;
    assert!(
        moved["pa"].1 > before["pa"].1,
        "a new holder must hold pa with a higher fence: {:?} then {:?}",
        before["pa"],
        moved["pa"]
    );
    booked.extend(book(&admin, "after", &POOLS, 1).await);
    placed_once_in_their_pools(&store, &booked).await;
    survivor.shutdown().await;
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_only_process_never_holds_a_controllers_shard() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    seed_gpu_nodes(&db.pool, "gpu", "n", 2, 4, H100)
        .await
        .expect("seed");
    let d1 = tempfile::tempdir().expect("dir");
    let d2 = tempfile::tempdir().expect("dir");
    let shard = bc_control::start(
        &config(d1.path(), scheduler_only(), Placer::Shard),
        store.clone(),
    )
    .await
    .expect("shard scheduler");
    let pool = bc_control::start(
        &config(d2.path(), scheduler_only(), Placer::PoolLease),
        store.clone(),
    )
    .await
    .expect("pool-lease scheduler");
    // Both are members of the scheduler role, so the shard placer holds its rendezvous share of the shards (all 256
    // only while it is the only member: waiting for 256 raced the pool-lease process's first heartbeat, and failed in
    // CI on 2026-12-05 with 132).
    until(
        10,
        "both schedulers are members and the shard placer leases shards",
        || async {
            let held = store
                .shard_leases("scheduler")
                .await
                .map_err(|e| e.to_string())?;
            let valid = held.iter().filter(|l| l.3).count();
            let members: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM workers WHERE role = 'scheduler' AND expires_at > now()",
            )
            .fetch_one(store.pool())
            .await
            .map_err(|e| e.to_string())?;
            if members == 2 && valid > 0 {
                Ok(())
            } else {
                Err(format!(
                    "{members} scheduler members, {valid} valid scheduler shard leases"
                ))
            }
        },
    )
    .await;
    // Several membership renewals later, still nothing in the controllers' role.
    tokio::time::sleep(LEASE * 2).await;
    let controllers = store.shard_leases("controllers").await.expect("leases");
    assert!(
        controllers.is_empty(),
        "scheduler-only processes took controllers' shards: {controllers:?}"
    );
    let members: i64 = sqlx::query_scalar("SELECT count(*) FROM workers WHERE role <> 'scheduler'")
        .fetch_one(store.pool())
        .await
        .expect("workers");
    assert_eq!(members, 0, "a scheduler-only process joined another role");
    shard.shutdown().await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initialize_says_so_when_pool_lease_is_configured_and_no_scheduler_runs() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root");
    let d1 = tempfile::tempdir().expect("dir");
    let api = bc_control::start(
        &config(d1.path(), api_only(), Placer::PoolLease),
        store.clone(),
    )
    .await
    .expect("api");
    assert!(
        api.notes
            .iter()
            .any(|n| n.contains("no scheduler process is running")
                && n.contains("--roles scheduler")),
        "{:?}",
        api.notes
    );
    // The same configuration with the shard placer, or a process that runs the scheduler itself: no such note.
    let d2 = tempfile::tempdir().expect("dir");
    let shard = bc_control::start(&config(d2.path(), api_only(), Placer::Shard), store.clone())
        .await
        .expect("api, shard");
    assert!(shard.notes.is_empty(), "{:?}", shard.notes);
    let d3 = tempfile::tempdir().expect("dir");
    let both = Roles {
        api: true,
        scheduler: true,
        ..Roles::default()
    };
    let itself = bc_control::start(&config(d3.path(), both, Placer::PoolLease), store.clone())
        .await
        .expect("api and scheduler");
    assert!(itself.notes.is_empty(), "{:?}", itself.notes);
    // Once a scheduler runs, a new API process is not warned.
    let d4 = tempfile::tempdir().expect("dir");
    until(5, "the scheduler's worker row", || async {
        match bc_mod_capacity::queries::live_workers(&store, "scheduler").await {
            Ok(n) if n > 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let later = bc_control::start(
        &config(d4.path(), api_only(), Placer::PoolLease),
        store.clone(),
    )
    .await
    .expect("api, later");
    assert!(later.notes.is_empty(), "{:?}", later.notes);
    for r in [api, shard, itself, later] {
        r.shutdown().await;
    }
}
