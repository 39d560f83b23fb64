//! Tunnels across control-plane processes (issue 14, items 1 and 2): real `better-compute serve` processes on one
//! PostgreSQL (an API process and gateway processes sharing one CA), real `bcd run` processes, mutual TLS on
//! loopback. The API process reaches the gateway that holds a node's session through the tunnel relay (internal
//! mTLS, a control-plane identity); with two gateways the nodes reach them through a real HAProxy in TCP mode with
//! TLS passthrough ([`bc_testkit::gateways`], the lab issue 18 reuses).

mod common;
// Not in common/mod.rs: bcd-ramdisk's tests include that file and have no ring or getrandom.
#[path = "common/duplex.rs"]
mod duplex;

use bc_control::client::ApiClient;
use bc_control::tunnel_cli::{self, Api, Forwarded};
use bc_store::Store;
use bc_store::testing::{TestDb, test_db};
use bc_testkit::gateways::{Binaries, GatewayLab, LabSpec, NO_HAPROXY};
use serde_json::json;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Bytes each way of the relayed transfer: 64 MiB unless `BC_TUNNEL_RELAY_BYTES` says otherwise.
fn relay_bytes() -> u64 {
    std::env::var("BC_TUNNEL_RELAY_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 << 20)
}

async fn dead_port() -> u16 {
    // Outside the ephemeral range: no other test's listener takes it meanwhile.
    bc_testkit::gateways::dead_port().expect("a dead port")
}

struct Lab {
    lab: GatewayLab,
    store: Store,
    _db: TestDb,
    dir: tempfile::TempDir,
    admin: ApiClient,
    api: Api,
    bins: Binaries,
    echo: u16,
    dead: u16,
    /// Allowed by the pool and the nodes: [`relay_bytes`] each way at once.
    duplex: duplex::Duplex,
    /// Allowed by the pool, not by the nodes.
    node_refuses: duplex::Echo,
    /// Each node's `bcd run`, by node id.
    pids: std::collections::BTreeMap<String, u32>,
}

/// The lab, its pool allowing the echo service, a dead port and one the nodes refuse.
async fn lab(balancer: bool, gateways: usize) -> Option<Lab> {
    lab_with(balancer, gateways, "").await
}

/// [`lab`] with `extra` appended to every process's configuration.
async fn lab_with(balancer: bool, gateways: usize, extra: &str) -> Option<Lab> {
    bc_proto::install_crypto_provider();
    let bins =
        match Binaries::beside_with(std::path::Path::new(env!("CARGO_BIN_EXE_bcd")), balancer) {
            Ok(b) => b,
            Err(why) if why == NO_HAPROXY => bc_testkit::skip!("{why}"),
            Err(why) => panic!("{why}"),
        };
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    bc_control::migrate(&store)
        .await
        .expect("module migrations");
    store.ensure_root_tenant().await.expect("root tenant");
    store
        .ensure_pool("default", "root", "default", true)
        .await
        .expect("pool");
    let key = bc_control::bootstrap_admin(&store).await.expect("admin");
    let dir = tempfile::tempdir().expect("dir");
    let mut spec = LabSpec::new(&db.url(), dir.path());
    spec.balancer = balancer;
    spec.gateways = gateways;
    // Every process re-issues its gateway and relay certificates each second (a day by default): tunnels keep
    // working across renewals.
    spec.extra_config = format!("certificate_renewal_s = 1\n{extra}");
    // One HAProxy thread, as the sessions bench gives each of its balancers its share of the cores (the test below
    // checks HAProxy runs as told).
    spec.balancer_threads = Some(1);
    let lab = tokio::task::spawn_blocking({
        let (bins, spec) = (bins.clone(), spec.clone());
        move || GatewayLab::start(&bins, &spec)
    })
    .await
    .expect("task")
    .unwrap_or_else(|e| panic!("{e}"));
    let admin = ApiClient::new(&lab.api_url, &key);
    let (echo, node_refuses, dead) = (
        duplex::echo().await.port,
        duplex::echo().await,
        dead_port().await,
    );
    let duplex = duplex::duplex(relay_bytes()).await;
    admin
        .call(
            "tunnels",
            "set-ports",
            json!({"pool": "default", "ports": [echo, dead, node_refuses.port, duplex.port]}),
        )
        .await
        .expect("set-ports");
    let api = Api {
        url: lab.api_url.clone(),
        key,
    };
    Some(Lab {
        lab,
        store,
        _db: db,
        dir,
        admin,
        api,
        bins,
        echo,
        dead,
        duplex,
        node_refuses,
        pids: Default::default(),
    })
}

impl Lab {
    /// Joins node `name` through the lab's gateway URL and starts its `bcd run`; returns its id once online.
    async fn node(&mut self, name: &str) -> String {
        let v = self
            .admin
            .call(
                "join-tokens",
                "create",
                json!({"pool": "default", "uses": 1}),
            )
            .await
            .expect("token");
        let token = v["token"].as_str().expect("token").to_string();
        let dir = self.dir.path();
        let config = bcd::config::ConfigWire {
            gateway_url: Some(self.lab.balancer_url.clone()),
            ca_pin: Some(self.lab.ca_pin.clone()),
            join_public_key: Some(self.lab.join_public_key.clone()),
            state_dir: Some(dir.join(name)),
            gpu_backend: Some("none".into()),
            hardware_root: None,
            cdi_dir: Some(dir.join(name).join("cdi")),
            tunnels: None,
        }
        .validate("test")
        .expect("node config");
        let out = bcd::join::join(
            &config,
            &token,
            bcd::join::JoinOptions {
                attempts: 5,
                claims: common::claims(name, 1),
            },
        )
        .await
        .expect("join");
        let node = out.identity.node_id;
        let fixture = dir.join(format!("{name}-gpus.json"));
        std::fs::write(&fixture, bcd::gpu::fixture::synthetic(1, name)).expect("fixture");
        common::fake_hardware(&dir.join(format!("{name}-hw")), name).expect("hw");
        let toml = dir.join(format!("{name}-bcd.toml"));
        std::fs::write(
            &toml,
            format!(
                "[tunnels]\nallow = [{}, {}, {}]\n",
                self.echo, self.dead, self.duplex.port
            ),
        )
        .expect("bcd.toml");
        let log = std::fs::File::create(dir.join(format!("{name}-bcd.log"))).expect("log");
        let mut cmd = Command::new(&self.bins.bcd);
        cmd.arg("--config")
            .arg(&toml)
            .arg("--state-dir")
            .arg(dir.join(name))
            .args(["run", "--gateway-url", &self.lab.balancer_url])
            .args(["--ca-pin", &self.lab.ca_pin])
            .args(["--join-public-key", &self.lab.join_public_key])
            .arg("--gpu-backend")
            .arg(format!("fixture:{}", fixture.display()))
            .arg("--hardware-root")
            .arg(dir.join(format!("{name}-hw")))
            .env("BCD_LOG", "info")
            .env_remove("BCD_JOIN_TOKEN")
            .env_remove("BCD_JOIN_TOKEN_FILE")
            .stdout(std::process::Stdio::null())
            .stderr(log);
        let pid = self.lab.spawn(name, &mut cmd).expect("bcd run");
        self.pids.insert(node.clone(), pid);
        self.until(60, &format!("{name} online"), |r| r.online)
            .await;
        node
    }

    /// Waits until `node`'s route satisfies `f`.
    async fn until_node(
        &self,
        node: &str,
        secs: u64,
        what: &str,
        f: impl Fn(&bc_store::gateways::NodeRoute) -> bool,
    ) -> Duration {
        self.until_of(Some(node), secs, &format!("{node} {what}"), f)
            .await
    }

    /// The nodes each gateway holds a session of, by gateway.
    async fn by_gateway(&self) -> std::collections::BTreeMap<String, Vec<String>> {
        let mut by = std::collections::BTreeMap::<String, Vec<String>>::new();
        for n in self.pids.keys() {
            by.entry(self.gateway_of(n).await)
                .or_default()
                .push(n.clone());
        }
        by
    }

    /// `node`'s `node.offline` rows: (actor, detail).
    async fn offline_rows(&self, node: &str) -> Vec<(String, serde_json::Value)> {
        bc_store::sqlx::query_as(
            "SELECT actor, detail FROM audit_events WHERE action = 'node.offline' AND subject = $1 ORDER BY id",
        )
        .bind(format!("node/{node}"))
        .fetch_all(self.store.pool())
        .await
        .expect("audit")
    }

    /// Waits until every node's route satisfies `f`.
    async fn until(
        &self,
        secs: u64,
        what: &str,
        f: impl Fn(&bc_store::gateways::NodeRoute) -> bool,
    ) -> Duration {
        self.until_of(None, secs, what, f).await
    }

    /// Waits until the route of `node` (None: of every node) satisfies `f`.
    async fn until_of(
        &self,
        node: Option<&str>,
        secs: u64,
        what: &str,
        f: impl Fn(&bc_store::gateways::NodeRoute) -> bool,
    ) -> Duration {
        let started = Instant::now();
        loop {
            let ids: Vec<String> = match node {
                Some(n) => vec![n.to_string()],
                None => bc_store::sqlx::query_scalar("SELECT id FROM nodes")
                    .fetch_all(self.store.pool())
                    .await
                    .expect("nodes"),
            };
            let mut all = !ids.is_empty();
            let mut last = None;
            for id in &ids {
                let r = self.store.node_route(id).await.expect("route");
                all &= r.as_ref().is_some_and(&f);
                last = r;
            }
            if all {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < Duration::from_secs(secs),
                "timed out after {secs} s waiting for {what} (last route read: {last:?}); logs in {}",
                self.lab.dir().display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The leaf certificate gateway `i` serves now (a TLS handshake without a client certificate).
    async fn served_leaf(&self, i: usize) -> Vec<u8> {
        let tls = bc_proto::channel::client_config(
            bc_proto::channel::ServerTrust::Pin(self.lab.ca_pin.clone()),
            None,
        )
        .expect("client config");
        let tcp = tokio::net::TcpStream::connect(self.lab.gateways[i].addr)
            .await
            .expect("connect to the gateway");
        let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("name");
        let stream = tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await
            .expect("handshake");
        let (_, conn) = stream.get_ref();
        conn.peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .expect("a served certificate")
    }

    async fn gateway_of(&self, node: &str) -> String {
        let r = self
            .store
            .node_route(node)
            .await
            .expect("route")
            .expect("node");
        r.gateway_id.expect("a gateway")
    }

    /// `better-compute tunnel <node> <port>` on a free local port.
    async fn forward(&self, node: &str, port: u16) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind local");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(tunnel_cli::listen(
            self.api.clone(),
            node.to_string(),
            port,
            l,
        ));
        addr
    }

    /// One tunnel connection through the CLI's code: how it ended and what came back.
    async fn once(&self, node: &str, port: u16, send: &[u8]) -> (Forwarded, Vec<u8>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (mut client, (local, _)) = (client.expect("connect"), accepted.expect("accept"));
        let http = tunnel_cli::http_client();
        let (api, node) = (self.api.clone(), node.to_string());
        let relay =
            tokio::spawn(
                async move { tunnel_cli::serve_one(&api, &http, &node, port, local).await },
            );
        client.write_all(send).await.expect("write");
        client.shutdown().await.expect("shutdown");
        let mut back = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut back)).await;
        let f = tokio::time::timeout(Duration::from_secs(30), relay)
            .await
            .expect("tunnel ends")
            .expect("task")
            .unwrap_or_else(|e| Forwarded {
                to_node: 0,
                from_node: 0,
                closed: Some(("API".into(), bc_error_chain::chain(&e))),
            });
        (f, back)
    }

    /// The audit rows of `node`, newest first.
    async fn audit(&self, node: &str) -> Vec<serde_json::Value> {
        let v = self
            .admin
            .call("tunnels", "list", json!({"node": node}))
            .await
            .expect("tunnels.list");
        v["tunnels"].as_array().cloned().unwrap_or_default()
    }

    /// The newest finished audit row of `node` (waiting for it: the relay records the end just after the last byte).
    async fn finished(&self, node: &str) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let rows = self.audit(node).await;
            if let Some(r) = rows.first().filter(|r| r["outcome"] != "OPEN") {
                return r.clone();
            }
            assert!(Instant::now() < deadline, "no finished audit row: {rows:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A tunnel kept busy: writes without end and reads what comes back, until the tunnel ends; returns how it
/// ended for the local side (the CLI closes the local connection when the tunnel is closed).
async fn busy_until_closed(addr: SocketAddr) -> (u64, std::io::Result<()>) {
    let s = TcpStream::connect(addr).await.expect("connect");
    let (mut r, mut w) = s.into_split();
    let writer = tokio::spawn(async move {
        let buf = vec![7u8; 64 << 10];
        while w.write_all(&buf).await.is_ok() {}
    });
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    let ended = loop {
        match r.read(&mut buf).await {
            Ok(0) => break Ok(()),
            Ok(n) => got += n as u64,
            Err(e) => break Err(e),
        }
    };
    writer.abort();
    (got, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_process_relays_tunnels_to_a_node_held_by_another_process() -> TestResult {
    let Some(mut lab) = lab(false, 1).await else {
        return Ok(());
    };
    let node = lab.node("rn").await;
    assert_eq!(
        lab.gateway_of(&node).await,
        "gw0",
        "the session row names its gateway"
    );
    // Bytes both ways at once through API process → relay (mTLS) → gateway process → bcd, hashed.
    let n = relay_bytes();
    let addr = lab.forward(&node, lab.duplex.port).await;
    let started = Instant::now();
    let (sent, got) = duplex::exchange(addr, n).await?;
    println!(
        "relayed duplex: {n} bytes each way in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let served = lab.duplex.served(Duration::from_secs(10)).await?;
    assert_eq!((served.read, got), (sent, served.wrote));
    assert_eq!((sent.bytes, got.bytes), (n, n));
    let row = lab.finished(&node).await;
    assert_eq!(row["outcome"], "OK", "{row}");
    assert_eq!(
        (
            row["bytes_to_node"].as_u64(),
            row["bytes_from_node"].as_u64()
        ),
        (Some(n), Some(n))
    );
    assert_eq!(row["gateway"], "gw0", "{row}");
    // The node's refusals come through the relay with their codes.
    let (f, _) = lab.once(&node, lab.dead, b"x").await;
    assert_eq!(
        f.closed.as_ref().map(|c| c.0.as_str()),
        Some("DIAL_REFUSED"),
        "{f:?}"
    );
    let (f, _) = lab.once(&node, lab.node_refuses.port, b"x").await;
    assert_eq!(
        f.closed.as_ref().map(|c| c.0.as_str()),
        Some("PORT_NOT_ALLOWED"),
        "{f:?}"
    );
    assert_eq!(lab.node_refuses.accepted(), 0, "refused without a dial");
    assert_eq!(lab.finished(&node).await["outcome"], "PORT_NOT_ALLOWED");
    // A small echo after them: the relay's connection is unharmed.
    let (f, back) = lab.once(&node, lab.echo, b"after").await;
    assert_eq!((f.closed, back.as_slice()), (None, b"after".as_slice()));
    // The gateway renews its serving certificate while it runs (every second here), and tunnels keep working.
    let first = lab.served_leaf(0).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_ne!(
        lab.served_leaf(0).await,
        first,
        "the served certificate was not renewed"
    );
    let (f, back) = lab.once(&node, lab.echo, b"renewed").await;
    assert_eq!((f.closed, back.as_slice()), (None, b"renewed".as_slice()));
    // The gateway process dies mid-transfer: the CLI's side sees the tunnel closed, the audit row an outcome.
    let busy = lab.forward(&node, lab.echo).await;
    let transfer = tokio::spawn(busy_until_closed(busy));
    tokio::time::sleep(Duration::from_secs(1)).await;
    lab.lab.kill_gateway(0);
    let killed = Instant::now();
    let (moved, _) = tokio::time::timeout(Duration::from_secs(30), transfer).await??;
    println!(
        "gateway killed after {moved} bytes came back; the local side closed {:.2} s later",
        killed.elapsed().as_secs_f64()
    );
    assert!(moved > 0, "nothing moved before the kill");
    let row = lab.finished(&node).await;
    assert_eq!(row["outcome"], "ABORTED", "{row}");
    assert!(row["bytes_from_node"].as_u64() > Some(0), "{row}");
    // With its gateway gone, a new tunnel is refused UNAVAILABLE and says which gateway it could not reach.
    let (f, _) = lab.once(&node, lab.echo, b"x").await;
    let (code, reason) = f.closed.expect("refused");
    assert!(
        code == "API" && reason.contains("UNAVAILABLE"),
        "{code}: {reason}"
    );
    // Started again on its address, it takes the node back; the API process reaches it over a new relay
    // connection, presenting the relay certificate it has renewed since it started (several times by now).
    let bins = lab.bins.clone();
    tokio::task::block_in_place(|| lab.lab.restart_gateway(&bins, 0)).map_err(|e| e.to_string())?;
    let restarted = Instant::now();
    loop {
        // Refused (NOT_CONNECTED, UNAVAILABLE) until the node has reconnected with its backoff.
        let (f, back) = lab.once(&node, lab.echo, b"again").await;
        if f.closed.is_none() && back == b"again" {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(90),
            "no tunnel through the restarted gateway within 90 s: {f:?}; logs in {}",
            lab.lab.dir().display()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(lab.gateway_of(&node).await, "gw0");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_takes_only_control_plane_identities() -> TestResult {
    let Some(mut lab) = lab(false, 1).await else {
        return Ok(());
    };
    let node = lab.node("rid").await;
    // The node's own certificate is a valid identity of the CA, but not the control plane's.
    let state = bcd::state::StateDir::open(&lab.dir.path().join("rid"))?;
    let key = {
        use rustls_pki_types::pem::PemObject as _;
        rustls_pki_types::PrivateKeyDer::from_pem_file(state.path("node.key"))?
    };
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(state.trust_bundle()?),
        Some((vec![state.certificate()?], key)),
    )?;
    let url = format!("https://127.0.0.1:{}", lab.lab.gateways[0].addr.port());
    let peers = bc_gateway::relay::Peers::new(tls);
    let e = peers.open(&url, &node, lab.echo).await.err();
    let refused = matches!(
        &e,
        Some(bc_gateway::relay::RelayError::Status {
            code: tonic::Code::PermissionDenied,
            ..
        })
    );
    assert!(refused, "a node identity reached the relay: {e:?}");
    // Nothing was sent to the node: no audit row, and the echo service was never dialled through a tunnel.
    assert!(lab.audit(&node).await.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_behind_haproxy_carry_tunnels_and_one_killed_hands_its_nodes_over()
-> TestResult {
    let Some(mut lab) = lab(true, 2).await else {
        return Ok(());
    };
    assert!(
        !lab.lab.haproxy_pids.is_empty(),
        "the lab started no HAProxy to check"
    );
    for pid in &lab.lab.haproxy_pids {
        let threads = std::fs::read_dir(format!("/proc/{pid}/task"))?.count();
        assert_eq!(
            threads, 1,
            "HAProxy {pid} runs {threads} threads, not its nbthread 1"
        );
    }
    let mut nodes = Vec::new();
    for i in 0..4 {
        nodes.push(lab.node(&format!("h{i}")).await);
    }
    let mut by_gateway = std::collections::BTreeMap::<String, Vec<String>>::new();
    for n in &nodes {
        by_gateway
            .entry(lab.gateway_of(n).await)
            .or_default()
            .push(n.clone());
    }
    println!("nodes by gateway: {by_gateway:?}");
    assert_eq!(
        by_gateway.keys().cloned().collect::<Vec<_>>(),
        ["gw0", "gw1"],
        "the balancer did not spread the nodes"
    );
    // A tunnel through each gateway, each audited with its gateway.
    for (gw, held) in &by_gateway {
        let node = &held[0];
        let addr = lab.forward(node, lab.echo).await;
        let (sent, back) = duplex::exchange(addr, 8 << 20).await?;
        assert_eq!((back.bytes, sent), (8 << 20, back));
        let row = lab.finished(node).await;
        assert_eq!(
            (&row["outcome"], &row["gateway"]),
            (&json!("OK"), &json!(gw)),
            "{row}"
        );
    }
    // Kill gw1 while a tunnel through it is busy.
    let victim = by_gateway["gw1"][0].clone();
    let busy = lab.forward(&victim, lab.echo).await;
    let transfer = tokio::spawn(busy_until_closed(busy));
    tokio::time::sleep(Duration::from_secs(1)).await;
    lab.lab.kill_gateway(1);
    let (moved, _) = tokio::time::timeout(Duration::from_secs(30), transfer).await??;
    assert!(moved > 0);
    let row = lab.finished(&victim).await;
    assert_eq!(row["outcome"], "ABORTED", "{row}");
    // Its nodes come back through the balancer on gw0, within the reconnect goal (RECONNECT's 30 s cap).
    let took = lab
        .until(30, "every node back on gw0", |r| {
            r.online && r.gateway_id.as_deref() == Some("gw0")
        })
        .await;
    println!(
        "gw1's nodes back on gw0 {:.1} s after the kill",
        took.as_secs_f64()
    );
    // And a tunnel to the moved node works through gw0.
    let (f, back) = lab.once(&victim, lab.echo, b"moved").await;
    assert_eq!((f.closed, back.as_slice()), (None, b"moved".as_slice()));
    assert_eq!(lab.finished(&victim).await["gateway"], "gw0");
    // HAProxy's PROXY protocol header (`send-proxy-v2`, health checks included) was read on every connection, and
    // the gateways saw each node's own address, never the balancer's (127.0.1.x).
    let mut joined = 0;
    for gw in ["gw0", "gw1"] {
        let log = std::fs::read_to_string(lab.lab.dir().join(format!("{gw}.log")))?;
        assert!(
            !log.contains("trusted balancer's connection was refused"),
            "{gw} refused HAProxy's header:\n{log}"
        );
        for line in log.lines().filter(|l| l.contains("node joined")) {
            assert!(line.contains("peer=Some(127.0.0.1:"), "{gw}: {line}");
            joined += 1;
        }
    }
    assert_eq!(joined, nodes.len(), "joins logged by the gateways");
    Ok(())
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{signal} {pid} failed");
}

/// A gateway killed with SIGKILL closes none of its sessions: its nodes that live reconnect elsewhere, but one that
/// died with it must not stay online for ever. Restarted, the gateway closes the sessions of its previous run whose
/// node has not reconnected within its lease (the API process, which runs the `controllers` role, is stopped
/// meanwhile, so nothing else could);
/// never restarted, the `controllers` role takes its nodes offline once its row stays unchanged past its lease
/// (three shard leases: 6 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_died_with_its_gateway_goes_offline_whether_the_gateway_restarts_or_not()
-> TestResult {
    let Some(mut lab) = lab_with(true, 2, "shard_lease_ms = 2000").await else {
        return Ok(());
    };
    for i in 0..4 {
        lab.node(&format!("h{i}")).await;
    }
    let by_gateway = lab.by_gateway().await;
    println!("nodes by gateway: {by_gateway:?}");
    let (Some(on0), Some(on1)) = (by_gateway.get("gw0"), by_gateway.get("gw1")) else {
        panic!("the balancer did not spread the nodes: {by_gateway:?}");
    };
    let (dead0, dead1) = (on0[0].clone(), on1[0].clone());

    // 1. gw0 and one of its nodes die together; gw0 starts again at once.
    let api = lab.lab.api_pid;
    signal(api, "STOP");
    signal(lab.pids[&dead0], "STOP");
    lab.lab.kill_gateway(0);
    lab.lab.kill(lab.pids[&dead0]);
    let restarted = Instant::now();
    lab.lab.restart_gateway(&lab.bins, 0)?;
    let took = lab
        .until_node(&dead0, 20, "offline after gw0's restart", |r| !r.online)
        .await;
    println!(
        "gw0 restarted in {:.1} s; {dead0} offline {:.1} s later (gw0's lease: 6 s)",
        restarted.elapsed().as_secs_f64() - took.as_secs_f64(),
        took.as_secs_f64()
    );
    let rows = lab.offline_rows(&dead0).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(
        rows[0].0 == "gateway"
            && rows[0].1["reason"]
                .as_str()
                .is_some_and(|r| r.contains("restarted")),
        "{rows:?}"
    );
    // The nodes that lived reconnected within the lease: their sessions were not closed again.
    for n in lab.pids.keys().filter(|n| **n != dead0) {
        lab.until_node(n, 30, "back online", |r| r.online).await;
        let rows = lab.offline_rows(n).await;
        assert!(rows.is_empty(), "{n}: {rows:?}");
    }
    // Closing them is not the end of the gateway (a task of the plane that ends stops the process).
    let gw0 = lab.lab.gateways[0].pid;
    assert!(
        lab.lab.running(gw0),
        "gw0 exited after closing its previous run's sessions"
    );
    signal(api, "CONT");

    // 2. gw1 and one of its nodes die together, and gw1 stays dead.
    signal(lab.pids[&dead1], "STOP");
    lab.lab.kill_gateway(1);
    lab.lab.kill(lab.pids[&dead1]);
    let took = lab
        .until_node(&dead1, 30, "offline after gw1's death", |r| !r.online)
        .await;
    println!(
        "{dead1} offline {:.1} s after gw1 was killed (its lease: 6 s)",
        took.as_secs_f64()
    );
    let rows = lab.offline_rows(&dead1).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(
        rows[0].0.starts_with("controller/") && rows[0].1["gateway"] == "gw1",
        "{rows:?}"
    );
    assert!(
        rows[0].1["silent_ms"].as_i64().is_some_and(|ms| ms > 6_000),
        "{rows:?}"
    );
    // Every other node is held by gw0, the one gateway left.
    for n in lab.pids.keys().filter(|n| **n != dead0 && **n != dead1) {
        lab.until_node(n, 30, "online on gw0", |r| {
            r.online && r.gateway_id.as_deref() == Some("gw0")
        })
        .await;
    }
    Ok(())
}
