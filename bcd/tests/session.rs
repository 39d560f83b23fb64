//! `bcd run` and the gateway's Session end to end: a real control plane (api, gateway, controllers) on a real
//! PostgreSQL, mutual TLS on loopback, the real `bcd` binary with a fixture of 8 GPUs.

mod common;

use bc_core::node::NodeVerb;
use bc_proto::spiffe::Role;
use bc_proto::v1;
use bc_store::reservations::NodeStateChange;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::{Child, Command};

/// A joined simulated machine and its running daemon.
struct Node {
    id: String,
    state: PathBuf,
    fixture: PathBuf,
    child: Option<Child>,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.start_kill();
        }
    }
}

async fn joined_node(p: &Plane, name: &str, gpus: u32) -> Node {
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let out = join(p, name, &token, claims(name, gpus))
        .await
        .expect("join");
    let fixture = p.dir.path().join(format!("{name}-gpus.json"));
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(gpus, name)).expect("fixture");
    let hw = p.dir.path().join(format!("{name}-hw"));
    fake_hardware(&hw, name).expect("hw");
    Node {
        id: out.identity.node_id,
        state: p.dir.path().join(name),
        fixture,
        child: None,
    }
}

fn spawn_run(p: &Plane, node: &mut Node, name: &str) {
    let child = run_command(p, node, name)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn bcd run");
    node.child = Some(child);
}

fn run_command(p: &Plane, node: &Node, name: &str) -> Command {
    common::bcd_run(
        Path::new(env!("CARGO_BIN_EXE_bcd")),
        p,
        &node.state,
        &node.fixture,
        &p.dir.path().join(format!("{name}-hw")),
    )
}

async fn node_row(p: &Plane, id: &str) -> bc_store::nodes::NodeRow {
    p.store.node(id).await.expect("read").expect("node exists")
}

fn fast() -> Options {
    Options {
        controllers: true,
        fast: true,
        leaf_lifetime: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_run_inventory_diag_adopted_and_generation_one_acknowledged() -> TestResult {
    let p = plane_with(fast()).await;
    let mut node = joined_node(&p, "gpu8", 8).await;
    spawn_run(&p, &mut node, "gpu8");
    wait_node(&p, &node.id, 60, "adoption", |n| {
        n.state == "adopted" && n.acked_generation == 1
    })
    .await;
    let row = node_row(&p, &node.id).await;
    assert!(row.online);
    assert_eq!(row.conditions, json!([]));
    let sections: Vec<String> = p
        .store
        .inventory(&node.id)
        .await?
        .into_iter()
        .map(|s| s.0)
        .collect();
    for s in ["cpu", "disks", "gpus", "memory", "nics", "system"] {
        assert!(
            sections.contains(&s.to_string()),
            "section {s} missing: {sections:?}"
        );
    }
    let gpus = p
        .store
        .inventory(&node.id)
        .await?
        .into_iter()
        .find(|s| s.0 == "gpus")
        .map(|s| s.2)
        .unwrap_or_default();
    assert_eq!(gpus.to_string().matches("GPU-gpu8-").count(), 8, "{gpus}");
    // The acceptance check's result was signed by the node and verified.
    let (state, kind, envelope): (String, String, Option<Vec<u8>>) =
        bc_store::sqlx::query_as("SELECT state, kind, envelope FROM commands WHERE node_id = $1")
            .bind(&node.id)
            .fetch_one(p.store.pool())
            .await?;
    assert_eq!((state.as_str(), kind.as_str()), ("done", "diag.nvml"));
    let env: v1::SignedEnvelope = prost::Message::decode(envelope.unwrap_or_default().as_slice())?;
    assert_eq!(env.signer, format!("spiffe://test.bc/node/{}", node.id));
    // The desired state reached the node.
    let desired: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.state.join("desired.json"))?)?;
    assert_eq!(desired["generation"], 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dbe_fault_fails_the_node_and_clearing_it_recovers() -> TestResult {
    let p = plane_with(fast()).await;
    let mut node = joined_node(&p, "faulty", 8).await;
    let mut fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&node.fixture)?)?;
    fixture["gpus"][3]["faults"] = json!(["dbe"]);
    std::fs::write(&node.fixture, fixture.to_string())?;
    spawn_run(&p, &mut node, "faulty");
    wait_node(&p, &node.id, 60, "failure", |n| n.state == "failed").await;
    let row = node_row(&p, &node.id).await;
    let conditions = row.conditions.to_string();
    assert!(
        conditions.contains("GPU 3") || conditions.contains("gpu 3"),
        "{conditions}"
    );
    assert!(
        conditions.to_lowercase().contains("dbe") || conditions.contains("double-bit"),
        "{conditions}"
    );
    assert_eq!(
        row.acked_generation, 0,
        "a failed node gets no desired state"
    );
    // Clear the fault: the periodic re-check brings the node back.
    fixture["gpus"][3]["faults"] = json!([]);
    std::fs::write(&node.fixture, fixture.to_string())?;
    wait_node(&p, &node.id, 60, "recovery", |n| {
        n.state == "adopted" && n.acked_generation == 1
    })
    .await;
    assert_eq!(node_row(&p, &node.id).await.conditions, json!([]));
    Ok(())
}

/// A raw session client: the given identity, the given Hello.
async fn raw_session(
    p: &Plane,
    cert: rustls::pki_types::CertificateDer<'static>,
    key_pem: &str,
    hello_node_id: &str,
) -> Result<
    (
        tokio::sync::mpsc::Sender<v1::NodeMessage>,
        tonic::Streaming<v1::GatewayMessage>,
    ),
    tonic::Status,
> {
    use rustls::pki_types::pem::PemObject as _;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key");
    let ca_pem = std::fs::read_to_string(p.dir.path().join("control/ca.crt")).expect("ca");
    let ca = rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("ca");
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(vec![ca]),
        Some((vec![cert], key)),
    )
    .expect("tls");
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls)
        .await
        .map_err(|e| tonic::Status::unavailable(bc_error_chain::chain(&e)))?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let hello = v1::Hello {
        node_id: hello_node_id.into(),
        agent_version: "test".into(),
        ..Default::default()
    };
    tx.send(v1::NodeMessage {
        msg: Some(v1::node_message::Msg::Hello(hello)),
    })
    .await
    .expect("send hello");
    let mut client = v1::session_service_client::SessionServiceClient::new(ch);
    let mut inbound = client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    // The Welcome (or the refusal) comes first.
    match inbound.message().await? {
        Some(v1::GatewayMessage {
            msg: Some(v1::gateway_message::Msg::Welcome(w)),
        }) => {
            // The gateway's clock, which the node reads command deadlines against (same host: within a minute).
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0);
            assert!(
                (w.clock_unix_ms - now).abs() < 60_000,
                "Welcome carries the gateway's clock: {} vs {now}",
                w.clock_unix_ms
            );
            Ok((tx, inbound))
        }
        other => Err(tonic::Status::internal(format!(
            "expected Welcome, got {other:?}"
        ))),
    }
}

/// A certificate from the control plane's CA (or `ca_dir`'s) for a fresh key, as `role`/`id`, issued at `at`.
fn issue(
    ca_dir: &Path,
    role: Role,
    id: &str,
    at: time::OffsetDateTime,
) -> (rustls::pki_types::CertificateDer<'static>, String) {
    let ca = bc_control::ca::Ca::load_or_create(ca_dir, "test.bc").expect("ca");
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let csr = rcgen::CertificateParams::default()
        .serialize_request(&key)
        .expect("csr");
    let verified = bc_control::ca::verify_csr(csr.der()).expect("verify");
    let issued = ca.issue_workload(&verified, role, id, at).expect("issue");
    (issued.cert_der.into(), key.serialize_pem())
}

fn node_identity(node: &Node) -> (rustls::pki_types::CertificateDer<'static>, String) {
    let state = bcd::state::StateDir::open(&node.state).expect("state");
    (
        state.certificate().expect("cert"),
        std::fs::read_to_string(state.path("node.key")).expect("key"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_at_the_handshake_and_at_hello() -> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let node = joined_node(&p, "ident", 1).await;
    let other = joined_node(&p, "other", 1).await;
    let (cert, key) = node_identity(&node);
    let now = time::OffsetDateTime::now_utc();
    let ca_dir = p.dir.path().join("control");

    // The genuine identity works.
    assert!(raw_session(&p, cert.clone(), &key, &node.id).await.is_ok());
    // SPIFFE ID ≠ Hello.node_id.
    let e = raw_session(&p, cert.clone(), &key, &other.id)
        .await
        .expect_err("refused");
    assert!(
        e.message().contains("does not match Hello.node_id"),
        "{e:?}"
    );
    // A certificate from another CA: refused at the handshake (seen at the first RPC with TLS 1.3).
    let (foreign, fkey) = issue(&p.dir.path().join("another-ca"), Role::Node, &node.id, now);
    let e = raw_session(&p, foreign, &fkey, &node.id)
        .await
        .expect_err("refused");
    assert_ne!(e.code(), tonic::Code::Ok, "{e:?}");
    assert!(!e.message().contains("Welcome"), "{e:?}");
    // An expired certificate from our CA.
    let (old, okey) = issue(&ca_dir, Role::Node, &node.id, now - time::Duration::days(2));
    let e = raw_session(&p, old, &okey, &node.id)
        .await
        .expect_err("refused");
    assert!(!e.message().contains("Welcome"), "{e:?}");
    // A site identity on the node endpoint.
    let (site, skey) = issue(&ca_dir, Role::Site, "rack-1", now);
    let e = raw_session(&p, site, &skey, "rack-1")
        .await
        .expect_err("refused");
    assert!(e.message().contains("site identity"), "{e:?}");
    // A revoked node: refused in the TLS handshake, so the call fails in the transport (TLS 1.3: the alert arrives
    // after the client's side of the handshake; hyper reports a closed connection), not with Hello's refusal.
    p.admin
        .call("nodes", "revoke", json!({"id": node.id}))
        .await?;
    let e = raw_session(&p, cert.clone(), &key, &node.id)
        .await
        .expect_err("refused");
    assert_ne!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(!e.message().contains("is revoked"), "{e:?}");
    let e = tls_probe(&p, cert, &key).await.expect_err("refused");
    assert!(e.contains("CertificateRevoked"), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_with_one_identity_only_the_newest_epoch_writes() -> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let node = joined_node(&p, "twin", 1).await;
    let (cert, key) = node_identity(&node);
    let (old_tx, mut old_rx) = raw_session(&p, cert.clone(), &key, &node.id).await?;
    let epoch_old = node_row(&p, &node.id).await.session_epoch;
    let (new_tx, mut new_rx) = raw_session(&p, cert, &key, &node.id).await?;
    let epoch_new = node_row(&p, &node.id).await.session_epoch;
    assert_eq!(epoch_new, epoch_old + 1);
    // The older session is closed by the gateway.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match old_rx.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return "ended".to_string(),
                Err(s) => return s.message().to_string(),
            }
        }
    })
    .await?;
    assert!(
        closed.contains("superseded") || closed == "ended",
        "{closed}"
    );
    // Its writes are refused; the new session's are stored.
    // Different sections, so a stored write of the old session could not hide under the new one's.
    let section = |n: &str| {
        let payload = format!("{{\"from\":\"{n}\"}}").into_bytes();
        v1::NodeMessage {
            msg: Some(v1::node_message::Msg::Inventory(v1::InventorySection {
                name: if n == "old" { "cpu" } else { "system" }.into(),
                hash: bc_proto::sha256(&payload).to_vec(),
                payload,
            })),
        }
    };
    let _ = old_tx.send(section("old")).await;
    if new_tx.send(section("new")).await.is_err() {
        // The gateway ended the new session: say how, for the log.
        let why = match new_rx.message().await {
            Ok(m) => format!("{m:?}"),
            Err(s) => s.message().to_string(),
        };
        return Err(
            format!("the gateway ended the new session, not only the old one: {why}").into(),
        );
    }
    // Wait for the new session's write (a loaded machine can take seconds), then check it is the only one: the
    // old session's write, sent first, was refused rather than stored and then overwritten.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let stored = loop {
        let stored = p.store.inventory(&node.id).await?;
        if !stored.is_empty() || tokio::time::Instant::now() > deadline {
            // The old session's write went out first; give it as long again to have landed, were it accepted.
            tokio::time::sleep(Duration::from_millis(500)).await;
            break p.store.inventory(&node.id).await?;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].2, json!({"from": "new"}));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_restart_daemons_reconnect_by_themselves() -> TestResult {
    let mut p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let mut node = joined_node(&p, "steady", 2).await;
    spawn_run(&p, &mut node, "steady");
    wait_node(&p, &node.id, 30, "first session", |n| {
        n.online && n.session_epoch == 1
    })
    .await;
    let gateway = p.running.gateway_addr.expect("gateway addr");
    // Stop the whole control plane, then start it again on the same gateway address and state.
    let t0 = std::time::Instant::now();
    p.running.stop().await;
    let took = t0.elapsed();
    println!("the control plane stopped in {took:?}, its daemon reconnecting");
    // Before stop 46 the draining gateway took the daemon's reconnection: its stop waited 5 s for the sessions to
    // leave, then 5 s of grace, and in CI ran out of the kernel's 10 s, leaving the port held.
    assert!(
        took < Duration::from_secs(4),
        "the stop took {took:?}: does the draining gateway take new sessions?"
    );
    // The stop returns once the sessions recorded their close. (With one session the write wins its race with the
    // connection's end even when the gateway does not wait for it; `control/gateway/tests/drain.rs` slows the close
    // down to test that it does.)
    let row = node_row(&p, &node.id).await;
    assert!(
        !row.online && row.session_epoch == 1,
        "after the stop the node is offline at epoch 1: {row:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = serve_config(
        p.dir.path(),
        &Options {
            controllers: false,
            fast: true,
            leaf_lifetime: None,
        },
        gateway,
    );
    p.running = bc_control::start(&again, p.store.clone()).await?;
    wait_node(&p, &node.id, 90, "reconnect", |n| {
        n.online && n.session_epoch == 2
    })
    .await;
    // The daemon resumed its TLS session with a ticket the stopped gateway sealed (the same join key and CA, so the
    // same ticket key), rather than repeating the whole mTLS handshake.
    let counts = p.running.handshakes.clone().expect("gateway role");
    assert_eq!(
        counts.resumed.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the daemon's reconnect did not resume its session"
    );
    // Nothing duplicated: still one node, its inventory sections stored once each.
    assert_eq!(p.snapshot().await.0, 1);
    let sections = p.store.inventory(&node.id).await?;
    let mut names: Vec<_> = sections.iter().map(|s| s.0.clone()).collect();
    names.dedup();
    assert_eq!(names.len(), sections.len());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_revoked_while_its_gateway_was_down_is_refused_when_it_resumes() -> TestResult {
    let opts = Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    };
    let mut p = plane_with(opts.clone()).await;
    let mut node = joined_node(&p, "resumer", 1).await;
    spawn_run(&p, &mut node, "resumer");
    wait_node(&p, &node.id, 30, "first session", |n| n.online).await;
    let gateway = p.running.gateway_addr.expect("gateway addr");
    p.running.stop().await;
    // Revoked while no gateway ran: the daemon holds tickets sealed before, which still open.
    assert!(matches!(
        p.store
            .set_node_schedulable(&node.id, NodeVerb::Revoke, "test/while-down")
            .await?,
        NodeStateChange::Changed { .. }
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    p.running =
        bc_control::start(&serve_config(p.dir.path(), &opts, gateway), p.store.clone()).await?;
    // The daemon resumes, the gateway closes the connection for the certificate the ticket holds, and the daemon's
    // full handshake (its probe) is refused with `certificate_revoked`: it stops instead of reconnecting for ever.
    let mut child = node.child.take().expect("bcd run");
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
    assert_eq!(
        status.code(),
        Some(bcd::session::EXIT_REFUSED),
        "bcd run: {status}"
    );
    let counts = p.running.handshakes.clone().expect("gateway role");
    assert!(
        counts
            .resumed_refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "the daemon did not try to resume (the refusal was a full handshake's)"
    );
    assert_eq!(counts.resumed.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert!(!node_row(&p, &node.id).await.online);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renews_with_the_same_key_and_uses_the_new_cert_next_time() -> TestResult {
    // 24 s certificates: the daemon renews at 50% ±10% (9.6–14.4 s after it received one); generous against a
    // loaded machine (the suite runs these tests in parallel).
    let opts = Options {
        controllers: false,
        fast: true,
        leaf_lifetime: Some(Duration::from_secs(24)),
    };
    let p = plane_with(opts).await;
    let mut node = joined_node(&p, "renewer", 1).await;
    let state = bcd::state::StateDir::open(&node.state)?;
    let first = state.certificate()?;
    let first_point = bc_proto::envelope::cert_public_point(&first)?;
    spawn_run(&p, &mut node, "renewer");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    let renewed = loop {
        let now = state.certificate()?;
        if now != first {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no renewal within 45 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        bc_proto::envelope::cert_public_point(&renewed)?,
        first_point,
        "renewal keeps the node key"
    );
    let (nb, na) = bc_proto::channel::cert_validity_ms(&renewed).expect("validity");
    let (_, first_na) = bc_proto::channel::cert_validity_ms(&first).expect("validity");
    assert!(na > first_na && nb < na);
    // The daemon lives past the first certificate's expiry: it reconnects with the renewed one.
    let now_ms = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(first_na + 2_000 - now_ms).unwrap_or(0),
    ))
    .await;
    let row = node_row(&p, &node.id).await;
    assert!(
        row.online,
        "node went offline after its first certificate expired"
    );
    assert!(row.cert_not_after_ms >= na - 1000);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_signed_by_another_key_is_refused() -> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let node = joined_node(&p, "pop", 1).await;
    let (cert, key) = node_identity(&node);
    let serial_before: String =
        bc_store::sqlx::query_scalar("SELECT cert_serial FROM nodes WHERE id = $1")
            .bind(&node.id)
            .fetch_one(p.store.pool())
            .await?;
    let (tx, mut rx) = raw_session(&p, cert, &key, &node.id).await?;
    let renew_with = |k: &rcgen::KeyPair| v1::NodeMessage {
        msg: Some(v1::node_message::Msg::Renew(v1::RenewRequest {
            csr_der: rcgen::CertificateParams::default()
                .serialize_request(k)
                .expect("csr")
                .der()
                .to_vec(),
        })),
    };
    let stranger = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    tx.send(renew_with(&stranger)).await?;
    assert!(
        next_renewal(&mut rx, Duration::from_secs(3)).await.is_err(),
        "a CSR from another key got a certificate"
    );
    let serial_after: String =
        bc_store::sqlx::query_scalar("SELECT cert_serial FROM nodes WHERE id = $1")
            .bind(&node.id)
            .fetch_one(p.store.pool())
            .await?;
    assert_eq!(serial_before, serial_after);
    // The node's own key is renewed (positive control).
    let own = rcgen::KeyPair::from_pem(&key)?;
    tx.send(renew_with(&own)).await?;
    let r = next_renewal(&mut rx, Duration::from_secs(3))
        .await?
        .expect("renewal answered");
    assert_eq!(
        bc_proto::envelope::cert_public_point(&r.cert_der)?,
        own.public_key_raw()
    );
    Ok(())
}

async fn next_renewal(
    rx: &mut tonic::Streaming<v1::GatewayMessage>,
    wait: Duration,
) -> Result<Option<v1::RenewResponse>, tokio::time::error::Elapsed> {
    tokio::time::timeout(wait, async {
        loop {
            match rx.message().await {
                Ok(Some(v1::GatewayMessage {
                    msg: Some(v1::gateway_message::Msg::Renew(r)),
                })) => return Some(r),
                Ok(Some(_)) => continue,
                _ => return None,
            }
        }
    })
    .await
}

/// A bare TLS connection with `cert`/`key` to the gateway: Ok once the gateway has answered with HTTP/2 bytes (its
/// SETTINGS), Err with the TLS error when it refused the handshake.
async fn tls_probe(
    p: &Plane,
    cert: rustls::pki_types::CertificateDer<'static>,
    key_pem: &str,
) -> Result<(), String> {
    use rustls::pki_types::pem::PemObject as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key");
    let ca_pem = std::fs::read_to_string(p.dir.path().join("control/ca.crt")).expect("ca");
    let ca = rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("ca");
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(vec![ca]),
        Some((vec![cert], key)),
    )
    .expect("tls");
    let addr = p.running.gateway_addr.expect("gateway addr");
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e:?}"))?;
    // HTTP/2 preface and an empty SETTINGS frame; the server's first bytes (or its alert) follow.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    stream
        .write_all(&hello)
        .await
        .map_err(|e| format!("write: {e:?}"))?;
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => Ok(()),
        Ok(Ok(_)) => Err("closed without a word".into()),
        Ok(Err(e)) => Err(format!("read: {e:?}")),
        Err(_) => Err("no answer within 5 s".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_node_is_refused_in_the_tls_handshake_and_its_session_closed() -> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let mut node = joined_node(&p, "revokee", 1).await;
    let mut elsewhere = joined_node(&p, "elsewhere", 1).await;
    let bystander = joined_node(&p, "bystander", 1).await;
    let (cert, key) = node_identity(&node);
    // Positive control: the handshake completes and the gateway speaks HTTP/2.
    tls_probe(&p, cert.clone(), &key).await?;
    spawn_run(&p, &mut node, "revokee");
    wait_node(&p, &node.id, 30, "session", |n| n.online).await;

    // Revoked through the API of this process: the very next handshake is refused, and the live session is closed
    // with PERMISSION_DENIED, so the daemon stops (exit 4) instead of reconnecting.
    p.admin
        .call("nodes", "revoke", json!({"id": node.id}))
        .await?;
    let e = tls_probe(&p, cert, &key)
        .await
        .expect_err("a revoked certificate completed the handshake");
    assert!(e.contains("CertificateRevoked"), "{e}");
    let mut child = node.child.take().expect("bcd run");
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait()).await??;
    assert_eq!(
        status.code(),
        Some(bcd::session::EXIT_REFUSED),
        "bcd run: {status}"
    );
    // Started again (as a service manager would): refused in the handshake, it stops rather than retrying.
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        run_command(&p, &node, "revokee")
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(bcd::session::EXIT_REFUSED),
        "{stderr}"
    );
    assert!(stderr.contains("at the TLS handshake"), "{stderr}");

    // Revoked by another control-plane process (here: straight in the store, which this process's API never saw):
    // the gateway reads it on its interval, without a restart.
    let (cert, key) = node_identity(&elsewhere);
    tls_probe(&p, cert.clone(), &key).await?;
    spawn_run(&p, &mut elsewhere, "elsewhere");
    wait_node(&p, &elsewhere.id, 30, "session", |n| n.online).await;
    assert!(matches!(
        p.store
            .set_node_schedulable(&elsewhere.id, NodeVerb::Revoke, "test/other-process")
            .await?,
        NodeStateChange::Changed { .. }
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let e = loop {
        match tls_probe(&p, cert.clone(), &key).await {
            Err(e) => break e,
            Ok(()) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(()) => panic!("a node revoked elsewhere still completes the handshake after 10 s"),
        }
    };
    assert!(e.contains("CertificateRevoked"), "{e}");
    // Its live session was closed too, and its daemon stopped.
    let mut child = elsewhere.child.take().expect("bcd run");
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait()).await??;
    assert_eq!(
        status.code(),
        Some(bcd::session::EXIT_REFUSED),
        "bcd run: {status}"
    );
    assert!(!node_row(&p, &elsewhere.id).await.online);

    // Everyone else is untouched.
    let (cert, key) = node_identity(&bystander);
    tls_probe(&p, cert, &key).await?;
    let stats = p.admin.call("system", "stats", json!({})).await?;
    assert_eq!(stats["gateway"]["revoked"], 2, "{stats}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_rejoins_by_reclaim_or_stops_asking_for_a_token() -> TestResult {
    // 8 s certificates: the node is "offline" (not running) until its certificate has expired.
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: Some(Duration::from_secs(8)),
    })
    .await;
    let name = "lapsed";
    let fixture = p.dir.path().join(format!("{name}-gpus.json"));
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(2, name))?;
    let hw = p.dir.path().join(format!("{name}-hw"));
    fake_hardware(&hw, name)?;
    // Join with the claims `bcd run` will collect, so a reclaim matches the hardware key.
    let gpus = bcd::gpu::fixture::FixtureBackend::load(&fixture)?;
    let claims = bcd::hardware::collect(&hw, Some(&gpus), None);
    let first = p.token(json!({"pool": "default", "uses": 1})).await;
    let joined = join(&p, name, &first, claims).await?;
    let mut node = Node {
        id: joined.identity.node_id.clone(),
        state: p.dir.path().join(name),
        fixture,
        child: None,
    };
    let state = bcd::state::StateDir::open(&node.state)?;
    let first_point = bc_proto::envelope::cert_public_point(&state.certificate()?)?;
    let wait = joined.identity.not_after_ms + 500
        - time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
    tokio::time::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(0))).await;

    // No token: `bcd run` stops before dialling, with exit 3 and the commands to run.
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        run_command(&p, &node, name).kill_on_drop(true).output(),
    )
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(bcd::session::EXIT_NEEDS_TOKEN),
        "{stderr}"
    );
    for needle in [
        "expired",
        "better-compute join-tokens create --pool default --reclaim",
        "bcd join",
        &node.id,
    ] {
        assert!(
            stderr.contains(needle),
            "message lacks {needle:?}: {stderr}"
        );
    }
    assert_eq!(
        node_row(&p, &node.id).await.session_epoch,
        0,
        "it dialled with an expired certificate"
    );

    // A token without reclaim: refused (the hardware belongs to the node), exit 3 with the control plane's reason,
    // and no use spent.
    let plain = p.token(json!({"pool": "default", "uses": 1})).await;
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        run_command(&p, &node, name)
            .env("BCD_JOIN_TOKEN", &plain)
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(bcd::session::EXIT_NEEDS_TOKEN),
        "{stderr}"
    );
    assert!(
        stderr.contains("already belongs to node") && stderr.contains("reclaim"),
        "{stderr}"
    );
    assert_eq!(p.snapshot().await.0, 1, "a plain token made a second node");

    // With a reclaim token in BCD_JOIN_TOKEN: it rejoins as the same node with a new key, and its session opens.
    let reclaim = p
        .token(json!({"pool": "default", "uses": 1, "reclaim": true}))
        .await;
    let child = run_command(&p, &node, name)
        .env("BCD_JOIN_TOKEN", &reclaim)
        .kill_on_drop(true)
        .spawn()?;
    node.child = Some(child);
    wait_node(&p, &node.id, 30, "the reclaimed node's session", |n| {
        n.online
    })
    .await;
    let id = state.identity()?.ok_or("identity")?;
    assert_eq!(id.node_id, node.id, "reclaim keeps the node id");
    let point = bc_proto::envelope::cert_public_point(&state.certificate()?)?;
    assert_ne!(point, first_point, "the rejoin uses a new key");
    let key = rcgen::KeyPair::from_pem(&std::fs::read_to_string(state.path("node.key"))?)?;
    assert_eq!(
        point,
        key.public_key_raw(),
        "node.key is the key the new certificate certifies"
    );
    assert!(!state.path("node.key.next").exists());
    assert_eq!(p.store.node_public_key(&node.id).await?, Some(point));
    assert_eq!(p.snapshot().await.0, 1, "no second node");
    let uses: i32 = bc_store::sqlx::query_scalar("SELECT uses_left FROM join_tokens WHERE id = $1")
        .bind(bc_proto::token::Token::parse(bc_proto::token::TokenKind::Join, &reclaim)?.id())
        .fetch_one(p.store.pool())
        .await?;
    assert_eq!(uses, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acceptance_and_desired_state_travel_by_notification_not_by_polling() -> TestResult {
    // The gateway's pull and the lifecycle controller tick once a minute here: within 30 s only notifications can
    // carry a node to adopted (check queued, sent, result applied, generation 1 delivered and acknowledged).
    let p = plane_with_config(fast(), |c| {
        if let Some(t) = c.session_timing.as_mut() {
            t.pending_interval = Duration::from_secs(60);
        }
        if let Some(t) = c.lifecycle_timing.as_mut() {
            t.tick = Duration::from_secs(60);
        }
    })
    .await;
    let mut node = joined_node(&p, "poked", 2).await;
    spawn_run(&p, &mut node, "poked");
    wait_node(&p, &node.id, 30, "adoption without polling", |n| {
        n.state == "adopted" && n.acked_generation == 1
    })
    .await;
    let stats = p.admin.call("system", "stats", json!({})).await?;
    assert!(
        stats["gateway"]["pending_pulls"].as_u64().unwrap_or(0) >= 2,
        "{stats}"
    );
    Ok(())
}

/// The next `Command` on a raw session, skipping other messages; None when none comes within `secs`.
async fn next_command(
    rx: &mut tonic::Streaming<v1::GatewayMessage>,
    secs: u64,
) -> Option<v1::Command> {
    tokio::time::timeout(Duration::from_secs(secs), async {
        loop {
            match rx.message().await {
                Ok(Some(v1::GatewayMessage {
                    msg: Some(v1::gateway_message::Msg::Command(c)),
                })) => return Some(c),
                Ok(Some(_)) => continue,
                _ => return None,
            }
        }
    })
    .await
    .ok()
    .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_whose_session_died_before_its_result_is_sent_again_and_finishes_once()
-> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let mut node = joined_node(&p, "lossy", 2).await;
    let (cert, key) = node_identity(&node);
    // A session that takes the command and dies without answering (the daemon never got it, as far as the
    // control plane can tell).
    let (tx, mut rx) = raw_session(&p, cert.clone(), &key, &node.id).await?;
    let deadline_ms = time::OffsetDateTime::now_utc().unix_timestamp() * 1000 + 120_000;
    let args = json!({"expected_gpu_count": 2});
    p.store
        .queue_command("lost-1", &node.id, "diag.nvml", &args, deadline_ms)
        .await?;
    // A command whose deadline passes while its session is gone is not sent again (it expires).
    p.store
        .queue_command(
            "lost-late",
            &node.id,
            "diag.nvml",
            &args,
            time::OffsetDateTime::now_utc().unix_timestamp() * 1000 + 1_500,
        )
        .await?;
    let mut got = Vec::new();
    while got.len() < 2 {
        let c = next_command(&mut rx, 10)
            .await
            .ok_or("the first session got no command")?;
        got.push(c.id);
    }
    got.sort();
    assert_eq!(got, ["lost-1", "lost-late"]);
    let first = p.store.command("lost-1").await?.ok_or("command row")?;
    assert_eq!((first.state.as_str(), first.deliveries), ("sent", 1));
    drop((tx, rx));
    tokio::time::sleep(Duration::from_millis(1_600)).await;

    // The daemon's session is a new epoch: the command is delivered again, runs once and finishes.
    spawn_run(&p, &mut node, "lossy");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let done = loop {
        let c = p.store.command("lost-1").await?.ok_or("command row")?;
        if c.state != "sent" {
            break c;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("lost-1 never finished: {c:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(done.state, "done", "{done:?}");
    assert_eq!(
        done.deliveries, 2,
        "sent on the dead session and again on the new one"
    );
    assert_eq!(
        done.result
            .as_ref()
            .map(|r| r["observed_gpu_count"].clone()),
        Some(json!(2)),
        "{done:?}"
    );
    let late = p.store.command("lost-late").await?.ok_or("command row")?;
    assert_eq!(
        late.deliveries, 1,
        "past its deadline, not sent again: {late:?}"
    );
    assert!(late.result.is_none());

    // Finished means finished: a later session (another epoch) gets neither command again, and the stored
    // result is the one from the run above.
    if let Some(mut c) = node.child.take() {
        c.kill().await?;
    }
    let (_tx, mut rx) = raw_session(&p, cert, &key, &node.id).await?;
    assert!(
        next_command(&mut rx, 2).await.is_none(),
        "a finished command is not delivered again"
    );
    let again = p.store.command("lost-1").await?.ok_or("command row")?;
    assert_eq!((again.deliveries, again.finished_ms), (2, done.finished_ms));
    Ok(())
}

/// Regression (issue 18, seen once in the failover test): a result the store could not write was dropped with the
/// session kept, so the daemon counted it delivered and its command stayed `sent` for good. Now the session ends,
/// and the daemon's next session sends the result again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_could_not_write_ends_the_session_and_arrives_again() -> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let mut node = joined_node(&p, "blip", 2).await;
    spawn_run(&p, &mut node, "blip");
    wait_node(&p, &node.id, 30, "a session", |n| n.session_epoch >= 1).await;
    let epoch = node_row(&p, &node.id).await.session_epoch;
    // The first write of a result fails (as when the database is failing over); a sequence is not rolled back
    // with the failed statement, so only the first one does.
    for q in [
        "CREATE SEQUENCE result_blips",
        "CREATE FUNCTION result_blip() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF nextval('result_blips') = 1 THEN RAISE EXCEPTION 'injected: result write failed'; END IF; \
           RETURN NEW; END $$",
        "CREATE TRIGGER result_blip BEFORE UPDATE ON commands FOR EACH ROW \
           WHEN (NEW.state = 'done' AND OLD.state <> 'done') EXECUTE FUNCTION result_blip()",
    ] {
        bc_store::sqlx::query(q).execute(p.store.pool()).await?;
    }
    let deadline_ms = time::OffsetDateTime::now_utc().unix_timestamp() * 1000 + 120_000;
    p.store
        .queue_command(
            "blip-1",
            &node.id,
            "diag.nvml",
            &json!({"expected_gpu_count": 2}),
            deadline_ms,
        )
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let done = loop {
        let c = p.store.command("blip-1").await?.ok_or("command row")?;
        if c.state != "sent" && c.state != "pending" {
            break c;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("blip-1 still {} 30 s after it was queued: {c:?}", c.state).into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(done.state, "done", "{done:?}");
    let (blips,): (i64,) = bc_store::sqlx::query_as("SELECT last_value FROM result_blips")
        .fetch_one(p.store.pool())
        .await?;
    assert!(
        blips >= 2,
        "the first write failed and a later one landed: {blips}"
    );
    let after = node_row(&p, &node.id).await.session_epoch;
    assert!(
        after > epoch,
        "the session ended and the daemon opened a new one: {epoch} -> {after}"
    );
    Ok(())
}

fn renewal_request(key: &rcgen::KeyPair) -> v1::NodeMessage {
    v1::NodeMessage {
        msg: Some(v1::node_message::Msg::Renew(v1::RenewRequest {
            csr_der: rcgen::CertificateParams::default()
                .serialize_request(key)
                .expect("csr")
                .der()
                .to_vec(),
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reclaim_the_old_key_opens_no_session_and_renews_nothing() -> TestResult {
    let p = plane_with(Options {
        controllers: false,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let node = joined_node(&p, "reinstalled", 1).await;
    let (old_cert, old_key) = node_identity(&node);
    // A session of the old key, open before the reclaim (the old installation is still running somewhere).
    let (tx, mut rx) = raw_session(&p, old_cert.clone(), &old_key, &node.id).await?;
    // Reinstalled: a new state directory (a new key), the same hardware, a reclaim token.
    let reclaim = p
        .token(json!({"pool": "default", "uses": 1, "reclaim": true}))
        .await;
    let new = join(&p, "reinstalled-again", &reclaim, claims("reinstalled", 1)).await?;
    assert!(new.reclaimed, "{new:?}");
    assert_eq!(new.identity.node_id, node.id);
    let serial_after_reclaim: String =
        bc_store::sqlx::query_scalar("SELECT cert_serial FROM nodes WHERE id = $1")
            .bind(&node.id)
            .fetch_one(p.store.pool())
            .await?;

    // The old key renews nothing on its old session, which the gateway then closes. The gateway may have closed it
    // already, on the reclaim's revocation: then the request cannot even be sent (seen in CI on 2026-12-05, "Error:
    // SendError"), and the checks below still hold.
    if tx
        .send(renewal_request(&rcgen::KeyPair::from_pem(&old_key)?))
        .await
        .is_ok()
    {
        assert!(
            !matches!(
                next_renewal(&mut rx, Duration::from_secs(3)).await,
                Ok(Some(_))
            ),
            "the superseded key renewed its certificate"
        );
    }
    let serial: String =
        bc_store::sqlx::query_scalar("SELECT cert_serial FROM nodes WHERE id = $1")
            .bind(&node.id)
            .fetch_one(p.store.pool())
            .await?;
    assert_eq!(serial, serial_after_reclaim);
    // Ended (by the gateway's close, an error status; or already seen ending above, then None).
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match rx.message().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the superseded key's session stayed open 5 s after the reclaim"
    );

    // A new session of the old certificate: refused (at Hello until the gateway has read the revocation, at the TLS
    // handshake after).
    let e = raw_session(&p, old_cert.clone(), &old_key, &node.id)
        .await
        .expect_err("the superseded key opened a session");
    assert_ne!(e.code(), tonic::Code::Ok, "{e:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let e = loop {
        match tls_probe(&p, old_cert.clone(), &old_key).await {
            Err(e) => break e,
            Ok(()) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(()) => panic!("the superseded key still completes the TLS handshake after 10 s"),
        }
    };
    assert!(e.contains("CertificateRevoked"), "{e}");
    let e = raw_session(&p, old_cert, &old_key, &node.id)
        .await
        .expect_err("the superseded key opened a session");
    assert!(!e.message().contains("Welcome"), "{e:?}");

    // The node's current key works (positive control).
    let state = bcd::state::StateDir::open(&p.dir.path().join("reinstalled-again"))?;
    let (cert, key) = (
        state.certificate()?,
        std::fs::read_to_string(state.path("node.key"))?,
    );
    let (tx, mut rx) = raw_session(&p, cert, &key, &node.id).await?;
    tx.send(renewal_request(&rcgen::KeyPair::from_pem(&key)?))
        .await?;
    assert!(
        next_renewal(&mut rx, Duration::from_secs(5))
            .await?
            .is_some(),
        "the current key did not renew"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_two_nodes_report_is_bookable_once_and_a_condition_on_the_second() -> TestResult {
    let p = plane_with(fast()).await;
    let mut first = joined_node(&p, "holder", 2).await;
    let mut second = joined_node(&p, "copycat", 2).await;
    // The second machine reports the first one's GPUs (same UUIDs: a copied fixture, as a cloned or lying node would).
    std::fs::copy(&first.fixture, &second.fixture)?;
    spawn_run(&p, &mut first, "holder");
    let gpus = |id: String| {
        let p = &p;
        async move {
            bc_store::sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM devices WHERE node_id = $1",
            )
            .bind(id)
            .fetch_one(p.store.pool())
            .await
            .unwrap_or(0)
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while gpus(first.id.clone()).await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no GPU inventory from the holder"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    spawn_run(&p, &mut second, "copycat");
    wait_node(&p, &second.id, 30, "the conflict condition", |n| {
        n.conditions
            .to_string()
            .contains("is also reported by node")
    })
    .await;
    let (present, total): (i64, i64) =
        bc_store::sqlx::query_as("SELECT count(*) FILTER (WHERE present), count(*) FROM devices")
            .fetch_one(p.store.pool())
            .await?;
    assert_eq!((present, total), (2, 4), "each physical GPU is one device");
    let v = p
        .admin
        .call("nodes", "get", json!({"id": second.id}))
        .await?;
    let conditions = v["node"]["conditions"].to_string();
    assert!(
        conditions.contains(&format!("node {}", first.id)),
        "{conditions}"
    );
    let audits: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'gpu.conflict' AND subject = $1",
    )
    .bind(format!("node/{}", second.id))
    .fetch_one(p.store.pool())
    .await?;
    assert_eq!(audits, 2, "one audit event per conflicting GPU");
    Ok(())
}
