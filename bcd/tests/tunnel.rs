//! Tunnels end to end (issue 14): `better-compute tunnel`'s client (in process) ⇄ the API process's upgraded
//! route ⇄ the gateway ⇄ the real `bcd run` binary ⇄ a local service, on a real PostgreSQL with mutual TLS on
//! loopback.

mod common;
// Not in common/mod.rs: bcd-ramdisk's tests include that file and have no ring or getrandom.
#[path = "common/duplex.rs"]
mod duplex;

use bc_control::tunnel_cli::{self, Api, Forwarded};
use bc_core::iam::Grant;
use bc_proto::token::{Token, TokenKind};
use common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Child;

use duplex::{Echo, echo};

/// A port nothing listens on.
async fn dead_port() -> u16 {
    // Outside the ephemeral range: no other test's listener takes it meanwhile.
    bc_testkit::gateways::dead_port().expect("a dead port")
}

struct Lab {
    p: Plane,
    node: String,
    _bcd: Child,
    api: Api,
    /// Allowed by the pool and the node.
    echo: Echo,
    /// Allowed by both; nothing listens.
    dead: u16,
    /// Allowed by the pool and the node: [`big`] bytes both ways at once.
    duplex: duplex::Duplex,
    /// Allowed by the pool, not by the node.
    node_refuses: Echo,
    /// Allowed by the node, not by the pool.
    pool_refuses: Echo,
}

async fn lab() -> Lab {
    lab_with(|_| {}).await
}

/// The lab on a plane whose configuration `edit` adjusts.
async fn lab_with(edit: impl FnOnce(&mut bc_control::config::ServeConfig)) -> Lab {
    let p = plane_with_config(
        Options {
            controllers: false,
            fast: true,
            leaf_lifetime: None,
        },
        edit,
    )
    .await;
    let (echo, node_refuses, pool_refuses) = (echo().await, echo().await, echo().await);
    let duplex = duplex::duplex(big()).await;
    let dead = dead_port().await;
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let out = join(&p, "tn", &token, claims("tn", 1)).await.expect("join");
    let node = out.identity.node_id;
    let dir = p.dir.path();
    let fixture = dir.join("tn-gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(1, "tn")).expect("fixture");
    fake_hardware(&dir.join("tn-hw"), "tn").expect("hw");
    let config = dir.join("tn-bcd.toml");
    std::fs::write(
        &config,
        format!(
            "[tunnels]\nallow = [{}, {dead}, {}, {}]\n",
            echo.port, pool_refuses.port, duplex.port
        ),
    )
    .expect("bcd.toml");
    // `bcd run` as common::bcd_run starts it, with this config file (the node's tunnel allowlist).
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_bcd"));
    cmd.arg("--config")
        .arg(&config)
        .arg("--state-dir")
        .arg(dir.join("tn"))
        .args(["run", "--gateway-url", &p.running.gateway_url])
        .args(["--ca-pin", &p.running.ca_pin])
        .args(["--join-public-key", &p.running.join_public_key])
        .arg("--gpu-backend")
        .arg(format!("fixture:{}", fixture.display()))
        .arg("--hardware-root")
        .arg(dir.join("tn-hw"))
        .env("BCD_LOG", "info")
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCD_JOIN_TOKEN_FILE")
        .kill_on_drop(true);
    let bcd = cmd.spawn().expect("spawn bcd run");
    wait_node(&p, &node, 60, "session", |n| n.online).await;
    p.admin
        .call(
            "tunnels",
            "set-ports",
            json!({"pool": "default", "ports": [echo.port, dead, node_refuses.port, duplex.port]}),
        )
        .await
        .expect("set-ports");
    let api = Api {
        url: format!("http://{}", p.running.api_addr.expect("api")),
        key: p.admin.key().to_string(),
    };
    Lab {
        p,
        node,
        _bcd: bcd,
        api,
        echo,
        dead,
        duplex,
        node_refuses,
        pool_refuses,
    }
}

impl Lab {
    /// `better-compute tunnel <node> <port>` listening on a free local port.
    async fn forward(&self, api: &Api, port: u16) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind local");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(tunnel_cli::listen(api.clone(), self.node.clone(), port, l));
        addr
    }

    /// One tunnel connection through the CLI's code, with a local socket pair: how it ended.
    async fn once(&self, api: &Api, port: u16, send: &[u8]) -> (Forwarded, Vec<u8>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let client = TcpStream::connect(addr);
        let (client, accepted) = tokio::join!(client, l.accept());
        let (mut client, (local, _)) = (client.expect("connect"), accepted.expect("accept"));
        let http = tunnel_cli::http_client();
        let node = self.node.clone();
        let api = api.clone();
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

    fn opens_sent(&self) -> u64 {
        self.p
            .running
            .tunnels
            .as_ref()
            .map_or(0, |t| t.stats().opens_sent)
    }

    async fn audit(&self) -> Vec<serde_json::Value> {
        audit(&self.p, &self.node).await
    }

    async fn finished_audit(&self) -> Vec<serde_json::Value> {
        finished_audit(&self.p, &self.node).await
    }

    async fn finished_row(&self) -> Result<serde_json::Value, String> {
        finished_row(&self.p, &self.node).await
    }

    /// A principal holding exactly `grants`, as an API caller.
    async fn principal(&self, id: &str, grants: &[(&str, &str)]) -> Api {
        let key = Token::generate(TokenKind::ApiKey).expect("key");
        let grants: Vec<Grant> = grants
            .iter()
            .map(|(p, s)| Grant {
                permission: p.to_string(),
                scope: s.to_string(),
            })
            .collect();
        self.p
            .store
            .upsert_principal(id, "root", id, key.id(), &key.secret().hash(), &grants)
            .await
            .expect("principal");
        Api {
            url: self.api.url.clone(),
            key: key.reveal(),
        }
    }
}

/// The node's tunnel audit rows, newest first.
async fn audit(p: &Plane, node: &str) -> Vec<serde_json::Value> {
    let v = p
        .admin
        .call("tunnels", "list", json!({"node": node}))
        .await
        .expect("tunnels.list");
    v["tunnels"].as_array().cloned().unwrap_or_default()
}

/// The node's audit rows once none is `OPEN`. A row is closed when its relay has ended, just after the relay's last
/// frame to the operator, so an operator's side that has ended may still find its row open for a moment.
async fn finished_audit(p: &Plane, node: &str) -> Vec<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let rows = audit(p, node).await;
        if rows.iter().all(|r| r["outcome"] != "OPEN") {
            return rows;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "an audit row stayed open 10 s after its tunnel ended: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The newest audit row, once every row is finished.
async fn finished_row(p: &Plane, node: &str) -> Result<serde_json::Value, String> {
    finished_audit(p, node)
        .await
        .into_iter()
        .next()
        .ok_or_else(|| format!("no audit row for node {node}"))
}

/// Bytes of the big transfer, each way: 1 GiB unless `BC_TUNNEL_TEST_BYTES` says otherwise.
fn big() -> u64 {
    std::env::var("BC_TUNNEL_TEST_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 30)
}

/// Both ways at once, through the duplex service (an echo can stall loopback TCP on this kernel: `duplex`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gib_each_way_at_once_goes_through_hashed_and_the_audit_row_counts_it() -> TestResult {
    let mut lab = lab().await;
    let addr = lab.forward(&lab.api, lab.duplex.port).await;
    let n = big();
    let started = std::time::Instant::now();
    let (sent, got) = duplex::exchange(addr, n).await?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "tunnel duplex: {n} bytes each way in {secs:.1} s ({:.0} MB/s each way)",
        n as f64 / secs / 1e6
    );
    let served = lab.duplex.served(Duration::from_secs(10)).await?;
    assert_eq!(
        served.read, sent,
        "what reached the node's port differs from what was sent"
    );
    assert_eq!(
        got, served.wrote,
        "what came back differs from what the node's port sent"
    );
    assert_eq!((sent.bytes, got.bytes), (n, n));
    let row = lab.finished_row().await?;
    assert_eq!(row["outcome"], "OK", "{row}");
    assert_eq!(row["bytes_to_node"], n, "{row}");
    assert_eq!(row["bytes_from_node"], n, "{row}");
    assert_eq!(row["principal"], "admin");
    assert_eq!(row["port"], lab.duplex.port);
    assert!(
        row["stopped_at_ms"].as_i64() >= row["started_at_ms"].as_i64(),
        "{row}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_concurrent_tunnel_connections_each_carry_their_own_bytes() -> TestResult {
    let lab = lab().await;
    let addr = lab.forward(&lab.api, lab.echo.port).await;
    let tasks: Vec<_> = (0..100)
        .map(|_| tokio::spawn(duplex::exchange(addr, 1 << 20)))
        .collect();
    for t in tasks {
        let (sent, back) = t.await??;
        assert_eq!(back.bytes, 1 << 20);
        assert_eq!(sent, back);
    }
    assert_eq!(lab.echo.accepted(), 100);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_close_only_their_own_tunnel_and_say_why() -> TestResult {
    let lab = lab().await;
    // A refused dial beside a working one: both at once, the working one unharmed.
    let payload = vec![42u8; 3 << 20];
    let ((ok, back), (refused, _)) = tokio::join!(
        lab.once(&lab.api, lab.echo.port, &payload),
        lab.once(&lab.api, lab.dead, b"hello")
    );
    assert_eq!(ok.closed, None, "{ok:?}");
    assert_eq!(back, payload);
    let (code, reason) = refused.closed.clone().expect("refused");
    assert_eq!(code, "DIAL_REFUSED", "{reason}");
    assert!(reason.contains("nothing listens"), "{reason}");
    // The node's allowlist refuses a port the pool allows: the node never dials it.
    let (f, _) = lab.once(&lab.api, lab.node_refuses.port, b"x").await;
    let (code, reason) = f.closed.expect("refused by the node");
    assert_eq!(code, "PORT_NOT_ALLOWED", "{reason}");
    assert!(reason.contains("bcd.toml"), "{reason}");
    assert_eq!(lab.node_refuses.accepted(), 0);
    // The pool's allowlist refuses a port the node allows: the node is never asked.
    let before = lab.opens_sent();
    let (f, _) = lab.once(&lab.api, lab.pool_refuses.port, b"x").await;
    let (code, reason) = f.closed.expect("refused by the pool");
    assert!(
        code == "API" && reason.contains("ACCESS_DENIED"),
        "{code}: {reason}"
    );
    assert!(reason.contains("tunnel allowlist"), "{reason}");
    assert_eq!(lab.opens_sent(), before, "the node was asked");
    assert_eq!(lab.pool_refuses.accepted(), 0);
    // No grant: ACCESS_DENIED, nothing sent to the node.
    let nogrant = lab
        .principal("viewer", &[("compute:nodes:list", "pool/default")])
        .await;
    let other_pool = lab
        .principal("elsewhere", &[("compute:tunnels:open", "pool/strict")])
        .await;
    for api in [&nogrant, &other_pool] {
        let (f, _) = lab.once(api, lab.echo.port, b"x").await;
        let (code, reason) = f.closed.expect("refused");
        assert!(
            code == "API" && reason.contains("ACCESS_DENIED"),
            "{code}: {reason}"
        );
        assert!(
            reason.contains("compute:tunnels:open on pool/default"),
            "{reason}"
        );
    }
    assert_eq!(
        lab.opens_sent(),
        before,
        "the node was asked without a grant"
    );
    // A grant on the node's pool suffices.
    let operator = lab
        .principal("operator", &[("compute:tunnels:open", "pool/default")])
        .await;
    let (f, back) = lab.once(&operator, lab.echo.port, b"granted").await;
    assert_eq!((f.closed, back.as_slice()), (None, b"granted".as_slice()));
    // Every connection left one audit row with its outcome.
    let rows = lab.finished_audit().await;
    let outcomes: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["principal"].as_str().unwrap_or_default().to_string(),
                r["outcome"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    for (who, what) in [
        ("admin", "DIAL_REFUSED"),
        ("admin", "PORT_NOT_ALLOWED"),
        ("admin", "ACCESS_DENIED"),
        ("viewer", "ACCESS_DENIED"),
        ("elsewhere", "ACCESS_DENIED"),
        ("operator", "OK"),
    ] {
        assert!(
            outcomes.contains(&(who.to_string(), what.to_string())),
            "no {who} {what} row in {outcomes:?}"
        );
    }
    let ok_rows = rows.iter().filter(|r| r["outcome"] == "OK").count();
    assert_eq!(ok_rows, 2, "{rows:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_tunnel_reader_never_delays_heartbeats() -> TestResult {
    let lab = lab().await;
    // The echo service answers what it gets: send without end and read nothing, so the answers back up through
    // the tunnel to the node and the echo service stops reading too.
    let stalled = lab.forward(&lab.api, lab.echo.port).await;
    let mut s = TcpStream::connect(stalled).await?;
    let buf = vec![1u8; 64 << 10];
    let mut sent = 0u64;
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), s.write(&buf)).await {
        sent += n as u64;
    }
    println!("stalled after {sent} bytes sent and none read");
    // The tunnel is stalled now (writes block). Heartbeats must still reach the gateway every second, and the
    // stall may last longer than reqwest's default TCP_USER_TIMEOUT (30 s), which once aborted such a tunnel.
    // The gateway's own last-seen (the store keeps it only to within a minute while the session lives).
    let registry = lab.p.running.sessions.as_ref().ok_or("no gateway")?;
    let mut last = registry.last_seen_ms(&lab.node);
    let mut worst = 0i64;
    let until = tokio::time::Instant::now() + Duration::from_secs(STALL_SECS);
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let seen = registry.last_seen_ms(&lab.node);
        if seen > last {
            last = seen;
        }
        worst = worst.max(now_ms() - last.unwrap_or(0));
    }
    println!(
        "longest gap between recorded heartbeats while stalled {STALL_SECS} s: {worst} ms (heartbeat 1000 ms)"
    );
    assert!(
        worst < 2500,
        "heartbeats were delayed by the stalled tunnel: {worst} ms"
    );
    // The Session still carries new tunnels beside the stalled one.
    let (f, back) = lab.once(&lab.api, lab.echo.port, b"beside").await;
    assert_eq!((f.closed, back.as_slice()), (None, b"beside".as_slice()));
    // The stalled tunnel survived: reading now gets every byte back.
    s.shutdown().await?;
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut back)).await??;
    assert_eq!(back.len() as u64, sent, "the stalled tunnel lost bytes");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_that_ends_ends_its_tunnels() -> TestResult {
    let lab = lab().await;
    let addr = lab.forward(&lab.api, lab.echo.port).await;
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(b"ping").await?;
    let mut buf = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut buf)).await??;
    assert_eq!(&buf, b"ping");
    // The gateway ends the node's session; the connection itself stays up (bcd reconnects on a new one), so only
    // bcd holding its tunnels per session ends this tunnel.
    let sessions = lab.p.running.sessions.as_ref().ok_or("no gateway")?;
    let opened = sessions.opened();
    sessions.close(&lab.node, "test: the session ends");
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "the tunnel outlived its session");
    // The node is back on a new session, and a new tunnel works.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sessions.opened() == opened {
        assert!(tokio::time::Instant::now() < deadline, "no new session");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_node(&lab.p, &lab.node, 30, "session", |n| n.online).await;
    let (f, back) = lab.once(&lab.api, lab.echo.port, b"again").await;
    assert_eq!((f.closed, back.as_slice()), (None, b"again".as_slice()));
    let row = lab
        .finished_audit()
        .await
        .into_iter()
        .find(|r| r["bytes_to_node"] == 4)
        .ok_or("row")?;
    assert_eq!(row["outcome"], "ABORTED", "{row}");
    Ok(())
}

/// How long the stalled-reader test holds the stall: past reqwest's 30 s TCP_USER_TIMEOUT.
const STALL_SECS: u64 = 35;

/// An open tunnel through `addr` (a forwarder): one byte echoed, the connection kept.
async fn held(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"h").await.expect("write");
    let mut b = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut b))
        .await
        .expect("echo in time")
        .expect("echo");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_principals_cap_counts_its_tunnels_through_every_api_process() -> TestResult {
    let lab = lab().await;
    // A second API process on the same database and CA, with a cap of 2 tunnels per principal.
    let dir2 = tempfile::tempdir()?;
    let mut config = serve_config(dir2.path(), &Options::default(), "127.0.0.1:0".parse()?);
    config.state_dir = lab.p.dir.path().join("control");
    config.roles = bc_control::config::Roles {
        api: true,
        ..Default::default()
    };
    config.tunnels.per_principal = 2;
    let second = bc_control::start(&config, lab.p.store.clone()).await?;
    let api2 = Api {
        url: format!("http://{}", second.api_addr.ok_or("api")?),
        key: lab.api.key.clone(),
    };
    // Two tunnels held through the first process (its cap is the default), then the second refuses a third.
    let first_fwd = lab.forward(&lab.api, lab.echo.port).await;
    let a = held(first_fwd).await;
    let _b = held(first_fwd).await;
    let (f, _) = lab.once(&api2, lab.echo.port, b"x").await;
    let (code, reason) = f.closed.ok_or("the third tunnel was not refused")?;
    assert!(
        code == "API" && reason.contains("already holds 2 tunnels open"),
        "{code}: {reason}"
    );
    assert_eq!(lab.audit().await[0]["outcome"], "LIMIT");
    // One closed: the second process lets one more through.
    drop(a);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (f, back) = lab.once(&api2, lab.echo.port, b"y").await;
        if f.closed.is_none() {
            assert_eq!(back, b"y");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still refused: {f:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The rows of an API process that died are closed LOST by the sweeper's query; a live process's rows stay.
    let pool = lab.p.store.pool();
    let live: String = bc_store::sqlx::query_scalar(
        "SELECT api_worker FROM tunnel_connections WHERE stopped_at IS NULL LIMIT 1",
    )
    .fetch_one(pool)
    .await?;
    bc_store::sqlx::query(
        "INSERT INTO tunnel_connections (id, principal_id, node_id, pool_id, port, outcome, started_at, api_worker) \
         VALUES (gen_random_uuid(), 'ghost', $1, 'default', 1, 'OPEN', now() - interval '1 minute', 'api-that-died')",
    )
    .bind(&lab.node)
    .execute(pool)
    .await?;
    assert_eq!(
        bc_mod_tunnels::queries::close_orphans(&lab.p.store).await?,
        1
    );
    let (outcome, open): (String, i64) = bc_store::sqlx::query_as(
        "SELECT (SELECT outcome FROM tunnel_connections WHERE principal_id = 'ghost'), \
                (SELECT count(*) FROM tunnel_connections WHERE stopped_at IS NULL AND api_worker = $1)",
    )
    .bind(&live)
    .fetch_one(pool)
    .await?;
    assert_eq!((outcome.as_str(), open), ("LOST", 1));
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A node that answers its tunnels by hand, as a broken or hostile node might: its session and one tunnel stream,
/// opened by an operator's connection through the CLI's code, with the node's first bytes ("hi") read by the
/// operator.
struct Keeper {
    p: Plane,
    node: String,
    /// The operator's end of the forwarded connection.
    client: TcpStream,
    operator: tokio::task::JoinHandle<Result<Forwarded, String>>,
    /// The node's sending half of its tunnel stream, held: the node never ends it.
    _tunnel_tx: tokio::sync::mpsc::Sender<bc_proto::v1::TunnelFrame>,
    /// What the gateway sends the node on it.
    from_gateway: tonic::Streaming<bc_proto::v1::TunnelFrame>,
    _session: (
        tokio::sync::mpsc::Sender<bc_proto::v1::NodeMessage>,
        tonic::Streaming<bc_proto::v1::GatewayMessage>,
    ),
}

/// `then`: what the node sends after its first bytes (before the operator reads them).
async fn keeper(
    then: Vec<bc_proto::v1::tunnel_frame::Frame>,
) -> Result<Keeper, Box<dyn std::error::Error>> {
    use bc_proto::v1;
    use rustls_pki_types::{PrivateKeyDer, pem::PemObject as _};
    use tokio_stream::wrappers::ReceiverStream;
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let out = join(&p, "keeper", &token, claims("keeper", 1)).await?;
    let node = out.identity.node_id;
    // The node's own client: its certificate and key from the state directory the join wrote.
    let state = bcd::state::StateDir::open(&p.dir.path().join("keeper"))?;
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(state.trust_bundle()?),
        Some((
            vec![state.certificate()?],
            PrivateKeyDer::from_pem_file(state.path("node.key"))?,
        )),
    )?;
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls).await?;
    let (session_tx, session_rx) = tokio::sync::mpsc::channel(8);
    session_tx
        .send(v1::NodeMessage {
            msg: Some(v1::node_message::Msg::Hello(v1::Hello {
                node_id: node.clone(),
                agent_version: "a node that keeps its tunnels".into(),
                boot_id: "boot-1".into(),
                clock_unix_ms: now_ms(),
                known_inventory: Vec::new(),
            })),
        })
        .await?;
    let mut inbound = v1::session_service_client::SessionServiceClient::new(ch.clone())
        .session(ReceiverStream::new(session_rx))
        .await?
        .into_inner();
    let port = 4444;
    p.admin
        .call(
            "tunnels",
            "set-ports",
            json!({"pool": "default", "ports": [port]}),
        )
        .await?;
    // The operator's tunnel connection, through the CLI's code.
    let api = Api {
        url: format!("http://{}", p.running.api_addr.ok_or("api")?),
        key: p.admin.key().to_string(),
    };
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let (client, accepted) = tokio::join!(TcpStream::connect(l.local_addr()?), l.accept());
    let (mut client, (local, _)) = (client?, accepted?);
    let http = tunnel_cli::http_client();
    let target = node.clone();
    let operator = tokio::spawn(async move {
        tunnel_cli::serve_one(&api, &http, &target, port, local)
            .await
            .map_err(|e| e.to_string())
    });
    // The node answers the OpenTunnel with its stream and a first byte, as bcd would.
    let open = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match inbound.message().await {
                Ok(Some(v1::GatewayMessage {
                    msg: Some(v1::gateway_message::Msg::OpenTunnel(o)),
                })) => return Ok(o),
                Ok(Some(_)) => continue,
                Ok(None) => return Err("the session ended before an OpenTunnel".to_string()),
                Err(s) => return Err(format!("session: {s}")),
            }
        }
    })
    .await??;
    let frame = |f| v1::TunnelFrame { frame: Some(f) };
    let (tunnel_tx, tunnel_rx) = tokio::sync::mpsc::channel(8);
    tunnel_tx
        .send(frame(v1::tunnel_frame::Frame::Open(v1::TunnelOpen {
            tunnel_id: open.tunnel_id,
        })))
        .await?;
    tunnel_tx
        .send(frame(v1::tunnel_frame::Frame::Data(b"hi".to_vec().into())))
        .await?;
    for f in then {
        tunnel_tx.send(frame(f)).await?;
    }
    let from_gateway = v1::tunnel_service_client::TunnelServiceClient::new(ch.clone())
        .tunnel(ReceiverStream::new(tunnel_rx))
        .await?
        .into_inner();
    let mut hi = [0u8; 2];
    tokio::time::timeout(Duration::from_secs(20), client.read_exact(&mut hi)).await??;
    assert_eq!(&hi, b"hi");
    Ok(Keeper {
        p,
        node,
        client,
        operator,
        _tunnel_tx: tunnel_tx,
        from_gateway,
        _session: (session_tx, inbound),
    })
}

impl Keeper {
    /// The operator's side ended `ABORTED` because the session ended; the audit row says so, with the bytes each
    /// way.
    async fn ended_with_the_session(&mut self, to_node: i64) -> TestResult {
        let f = tokio::time::timeout(Duration::from_secs(10), &mut self.operator)
            .await
            .map_err(|_| "the tunnel outlived its session at the gateway")???;
        let (code, reason) = f.closed.ok_or("the tunnel ended without a close")?;
        assert_eq!(code, "ABORTED", "{reason}");
        assert!(
            reason.contains(bc_gateway::tunnel::SESSION_ENDED),
            "{reason}"
        );
        let row = finished_row(&self.p, &self.node).await?;
        assert_eq!(
            (
                row["outcome"].as_str(),
                row["bytes_from_node"].as_i64(),
                row["bytes_to_node"].as_i64()
            ),
            (Some("ABORTED"), Some(2), Some(to_node)),
            "{row}"
        );
        Ok(())
    }
}

/// A node that keeps its tunnel stream after the gateway closed its session (bcd ends its tunnels with the session
/// itself; a broken or hostile node need not) is cut off by the gateway: the operator's connection closes `ABORTED`
/// saying why, the node's stream is ended, and the audit row is closed. Before the gateway watched the session, the
/// tunnel went on relaying on the connection that stayed up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_ends_a_tunnel_with_its_session_whatever_the_node_does() -> TestResult {
    use tokio_stream::StreamExt as _;
    let mut k = keeper(Vec::new()).await?;
    // The gateway closes the session. The node keeps its tunnel stream (and so the connection) open.
    let sessions = k.p.running.sessions.as_ref().ok_or("no gateway")?;
    sessions.close(&k.node, "test: the session ends");
    let mut rest = Vec::new();
    let ended =
        tokio::time::timeout(Duration::from_secs(10), k.client.read_to_end(&mut rest)).await;
    assert!(
        ended.is_ok(),
        "the tunnel outlived its session at the gateway"
    );
    // The gateway ended its side of the node's stream too (within its finish bound).
    let drained = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(Ok(_)) = k.from_gateway.next().await {}
    })
    .await;
    assert!(drained.is_ok(), "the node's tunnel stream stayed open");
    k.ended_with_the_session(0).await
}

/// The same once the node has half-closed: the gateway no longer reads from the node, and the operator's next bytes
/// must not reach a node whose session has ended. Before the gateway's sends watched the session, "more" was
/// relayed to the node and the tunnel lived on until the operator half-closed or it sat idle past its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_half_closed_gets_nothing_more_once_its_session_ended() -> TestResult {
    use bc_proto::v1;
    use tokio_stream::StreamExt as _;
    let mut k = keeper(vec![v1::tunnel_frame::Frame::HalfClose(
        v1::TunnelHalfClose {},
    )])
    .await?;
    // The node's half-close reaches the operator as EOF.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), k.client.read_to_end(&mut rest)).await??;
    assert!(rest.is_empty(), "{rest:?}");
    let sessions = k.p.running.sessions.as_ref().ok_or("no gateway")?;
    sessions.close(&k.node, "test: the session ends");
    k.client.write_all(b"more").await?;
    k.ended_with_the_session(0).await?;
    // Everything the gateway sent the node after its half-close: no "more", and the stream ended.
    let frames = tokio::time::timeout(Duration::from_secs(30), async {
        let mut frames = Vec::new();
        while let Some(Ok(f)) = k.from_gateway.next().await {
            frames.push(f);
        }
        frames
    })
    .await
    .map_err(|_| "the node's tunnel stream stayed open")?;
    assert!(
        !frames
            .iter()
            .any(|f| matches!(f.frame, Some(v1::tunnel_frame::Frame::Data(_)))),
        "bytes reached a node whose session had ended: {frames:?}"
    );
    Ok(())
}

/// A tunnel that moves nothing either way for its idle limit is closed `IDLE`, both sides told and the audit row
/// saying so, and not before: bytes restart the clock. The limit is 3 s here (the config file takes 60 s to a week,
/// one hour by default, so an idle tunnel lives at least an hour unless its operator asks for less).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_tunnel_is_closed_at_its_limit_and_not_before() -> TestResult {
    let idle = Duration::from_secs(3);
    let lab = lab_with(|c| c.tunnels.idle = idle).await;
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let (client, accepted) = tokio::join!(TcpStream::connect(l.local_addr()?), l.accept());
    let (mut client, (local, _)) = (client?, accepted?);
    let (api, http, node, port) = (
        lab.api.clone(),
        tunnel_cli::http_client(),
        lab.node.clone(),
        lab.echo.port,
    );
    let relay = tokio::spawn(async move {
        tunnel_cli::serve_one(&api, &http, &node, port, local)
            .await
            .map_err(|e| e.to_string())
    });
    // A byte each way every 1.5 s for 6 s: twice the limit in all, never the limit without a byte.
    let mut b = [0u8; 1];
    for _ in 0..4 {
        client.write_all(b"x").await?;
        tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut b)).await??;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!relay.is_finished(), "the tunnel closed while bytes moved");
    }
    // Quiet from here (the last byte came back 1.5 s ago).
    let quiet = tokio::time::Instant::now() - Duration::from_millis(1500);
    let f = tokio::time::timeout(Duration::from_secs(20), relay).await???;
    let waited = quiet.elapsed();
    let (code, reason) = f.closed.ok_or("the tunnel ended without a close")?;
    assert_eq!(code, "IDLE", "{reason}");
    assert!(reason.contains("idle limit"), "{reason}");
    assert!(
        waited >= idle - Duration::from_millis(100) && waited < idle + Duration::from_secs(5),
        "closed {waited:?} after the last byte, with a limit of {idle:?}"
    );
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut rest)).await??;
    let row = lab.finished_row().await?;
    assert_eq!(
        (row["outcome"].as_str(), row["bytes_to_node"].as_i64()),
        (Some("IDLE"), Some(4)),
        "{row}"
    );
    Ok(())
}
