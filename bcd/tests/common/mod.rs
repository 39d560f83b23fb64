//! The test harness shared by bcd's end-to-end tests: a real control plane (chosen roles) on a fresh PostgreSQL
//! database, TLS on loopback, simulated machines (claims, fake /sys and /proc trees).
#![allow(dead_code)]

pub mod sushy;

use bc_control::client::ApiClient;
use bc_control::config::{Roles, ServeConfig, SessionTiming};
use bc_control::lifecycle::LifecycleTiming;
use bc_proto::v1;
use bc_store::Store;
use bc_store::testing::{TestDb, test_db};
use bcd::config::ConfigWire;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Default, Clone)]
pub struct Options {
    pub controllers: bool,
    /// Workload certificate lifetime (renewal tests); None is the 24 h default.
    pub leaf_lifetime: Option<Duration>,
    /// Short intervals so sessions, liveness and acceptance happen within a test's patience.
    pub fast: bool,
}

pub async fn plane() -> Plane {
    plane_with(Options::default()).await
}

pub fn serve_config(dir: &Path, opts: &Options, gateway_listen: SocketAddr) -> ServeConfig {
    ServeConfig {
        state_dir: dir.join("control"),
        database_url: None,
        trust_domain: "test.bc".into(),
        roles: Roles {
            api: true,
            gateway: true,
            controllers: opts.controllers,
            scheduler: opts.controllers,
            ..Roles::default()
        },
        api_listen: "127.0.0.1:0".parse().expect("addr"),
        gateway_listen,
        gateway_hosts: vec!["localhost".into(), "127.0.0.1".into()],
        gateway_url: None,
        session_timing: opts.fast.then_some(SessionTiming {
            heartbeat: Duration::from_secs(1),
            liveness_interval: Duration::from_millis(200),
            pending_interval: Duration::from_millis(100),
            idle_timeout: Duration::from_secs(10),
            revocation_interval: Duration::from_millis(500),
        }),
        lifecycle_timing: opts.fast.then_some(LifecycleTiming {
            tick: Duration::from_millis(100),
            recheck_after: Duration::from_millis(300),
            deadline: Duration::from_secs(20),
        }),
        leaf_lifetime: opts.leaf_lifetime,
        cert_renewal: None,
        shard_lease: None,
        capacity_reload: None,
        instances: None,
        placer: Default::default(),
        telemetry: None,
        gateway_id: None,
        gateway_relay_url: None,
        gateway_proxy_protocol_from: Default::default(),
        tunnels: Default::default(),
        metal: Default::default(),
    }
}

pub async fn plane_with(opts: Options) -> Plane {
    plane_with_config(opts, |_| {}).await
}

/// A plane whose configuration `edit` adjusts after `opts` built it.
pub async fn plane_with_config(opts: Options, edit: impl FnOnce(&mut ServeConfig)) -> Plane {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root tenant");
    store
        .ensure_pool("default", "root", "default", true)
        .await
        .expect("pool");
    store
        .ensure_pool("strict", "root", "no reclaim", false)
        .await
        .expect("pool");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = serve_config(dir.path(), &opts, "127.0.0.1:0".parse().expect("addr"));
    edit(&mut config);
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start control plane");
    let key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let api = format!("http://{}", running.api_addr.expect("api addr"));
    Plane {
        running,
        store,
        db,
        dir,
        admin: ApiClient::new(&api, &key),
        opts,
    }
}

pub struct Plane {
    pub running: bc_control::Running,
    pub store: Store,
    pub db: TestDb,
    pub dir: tempfile::TempDir,
    pub admin: ApiClient,
    opts: Options,
}

impl Plane {
    pub fn node_config(&self, name: &str) -> bcd::config::Config {
        ConfigWire {
            gateway_url: Some(self.running.gateway_url.clone()),
            ca_pin: Some(self.running.ca_pin.clone()),
            join_public_key: Some(self.running.join_public_key.clone()),
            state_dir: Some(self.dir.path().join(name)),
            gpu_backend: Some("none".into()),
            hardware_root: None,
            cdi_dir: Some(self.dir.path().join(name).join("cdi")),
            tunnels: None,
        }
        .validate("test")
        .expect("node config")
    }

    pub async fn token(&self, body: Value) -> String {
        let v = self
            .admin
            .call("join-tokens", "create", body)
            .await
            .expect("create token");
        v["token"].as_str().expect("token").to_string()
    }

    /// (nodes, sum of uses left, audit events): what a refused join must leave unchanged.
    pub async fn snapshot(&self) -> (i64, i64, i64) {
        let q = "SELECT (SELECT count(*) FROM nodes), (SELECT COALESCE(sum(uses_left), 0) FROM join_tokens), \
                 (SELECT count(*) FROM audit_events)";
        sqlx_row(&self.store, q).await
    }
}

pub async fn sqlx_row(store: &Store, q: &'static str) -> (i64, i64, i64) {
    bc_store::sqlx::query_as::<_, (i64, i64, i64)>(q)
        .fetch_one(store.pool())
        .await
        .expect("snapshot")
}

/// Claims of a distinct simulated machine.
pub fn claims(seed: &str, gpus: u32) -> v1::HardwareClaims {
    let fixture: Value =
        serde_json::from_str(&bcd::gpu::fixture::synthetic(gpus, seed)).expect("fixture");
    let h = bc_proto::sha256(seed.as_bytes());
    v1::HardwareClaims {
        dmi: Some(v1::DmiClaims {
            system_uuid: format!("uuid-{seed}"),
            system_serial: format!("SN-{seed}"),
            vendor: "Test".into(),
            product: "GPU box".into(),
            ..Default::default()
        }),
        nics: vec![v1::NicClaim {
            name: "eth0".into(),
            mac: format!(
                "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                h[0], h[1], h[2], h[3], h[4]
            ),
            ..Default::default()
        }],
        gpus: fixture["gpus"]
            .as_array()
            .expect("gpus")
            .iter()
            .map(|g| v1::GpuClaim {
                index: g["index"].as_u64().unwrap_or(0) as u32,
                uuid: g["uuid"].as_str().unwrap_or_default().into(),
                serial: g["serial"].as_str().unwrap_or_default().into(),
                model: g["model"].as_str().unwrap_or_default().into(),
                pci_bus_id: g["pci_bus_id"].as_str().unwrap_or_default().into(),
                memory_mib: g["memory_mib"].as_u64().unwrap_or(0),
            })
            .collect(),
        hostname: seed.into(),
        arch: "x86_64".into(),
        gpu_backend: "fixture".into(),
        collection_notes: vec![],
    }
}

pub async fn join(
    p: &Plane,
    state: &str,
    token: &str,
    c: v1::HardwareClaims,
) -> Result<bcd::join::JoinOutcome, bcd::join::JoinError> {
    bcd::join::join(
        &p.node_config(state),
        token,
        bcd::join::JoinOptions {
            attempts: 1,
            claims: c,
        },
    )
    .await
}

impl Plane {
    pub fn admin_key_secret(&self) -> String {
        self.admin
            .key()
            .split('.')
            .nth(1)
            .unwrap_or_default()
            .to_string()
    }
}

pub fn fake_hardware(root: &Path, seed: &str) -> std::io::Result<()> {
    let dmi = root.join("sys/class/dmi/id");
    std::fs::create_dir_all(&dmi)?;
    std::fs::write(dmi.join("product_uuid"), format!("uuid-{seed}\n"))?;
    std::fs::write(dmi.join("product_serial"), format!("SN-{seed}\n"))?;
    std::fs::write(dmi.join("sys_vendor"), "Test\n")?;
    let nic = root.join("sys/class/net/eth0");
    std::fs::create_dir_all(nic.join("device"))?;
    let h = bc_proto::sha256(seed.as_bytes());
    std::fs::write(
        nic.join("address"),
        format!("02:{:02x}:{:02x}:{:02x}:00:01\n", h[0], h[1], h[2]),
    )?;
    std::fs::create_dir_all(root.join("proc/sys/kernel"))?;
    std::fs::write(root.join("proc/sys/kernel/hostname"), format!("{seed}\n"))?;
    Ok(())
}

/// `bcd run` for a node whose state is in `state`, against the plane's gateway, with the fixture GPU backend
/// `fixture` and the fake hardware tree `hardware_root`; join tokens from the environment removed. `bcd` is the
/// binary (`env!("CARGO_BIN_EXE_bcd")` in bcd's own tests).
pub fn bcd_run(
    bcd: &Path,
    p: &Plane,
    state: &Path,
    fixture: &Path,
    hardware_root: &Path,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bcd);
    cmd.args(["--config", "/nonexistent", "--state-dir"])
        .arg(state)
        .args(["run", "--gateway-url", &p.running.gateway_url])
        .args(["--ca-pin", &p.running.ca_pin])
        .args(["--join-public-key", &p.running.join_public_key])
        .arg("--gpu-backend")
        .arg(format!("fixture:{}", fixture.display()))
        .arg("--hardware-root")
        .arg(hardware_root)
        .env("BCD_LOG", "info")
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCD_JOIN_TOKEN_FILE");
    cmd
}

/// Polls the node's row until `f` holds for it, or fails after `secs` naming `what` and the row's state.
pub async fn wait_node(
    p: &Plane,
    id: &str,
    secs: u64,
    what: &str,
    f: impl Fn(&bc_store::nodes::NodeRow) -> bool,
) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let row = p.store.node(id).await.expect("read").expect("node exists");
        if f(&row) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: node is {} online={} gen={}/{} conditions={}",
            row.state,
            row.online,
            row.desired_generation,
            row.acked_generation,
            row.conditions
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
