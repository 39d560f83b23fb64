//! Site agents against a real control plane (fresh PostgreSQL, mTLS on loopback): enrollment with `bcst_` site
//! tokens, the boot lease (one agent answers DHCP, a standby takes over when the holder dies) and the secret broker
//! (JWE to a per-request key, only for the agent's own site), and revocation of a site (refused at the handshake).

mod common;

use bc_proto::v1;
use bcd::site::{BootLeaseView, SiteAgent, SiteAgentOptions};
use bcd_site::dhcp::MacAddr;
use bcd_site::dhcp::dhcproto::v4::{Architecture, DhcpOption, Message, MessageType, Opcode};
use bcd_site::dhcp::dhcproto::{Encodable, Encoder};
use bcd_site::dhcp::server::{DhcpSockets, bind_udp};
use bcd_site::serve::{Bound, Netboot, SiteConfig, SiteCounters};
use common::{Plane, TestResult, plane};
use serde_json::json;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::watch;

const MAC: &str = "52:54:00:00:00:01";

async fn site_token(p: &Plane, site: &str, uses: i32) -> String {
    let v = p
        .admin
        .call("site-tokens", "create", json!({"site": site, "uses": uses}))
        .await
        .expect("create site token");
    v["token"].as_str().expect("token").to_string()
}

async fn enroll(
    p: &Plane,
    state: &str,
    token: &str,
) -> Result<bcd::join::JoinOutcome, bcd::join::JoinError> {
    bcd::join::enroll_site(
        &p.node_config(state),
        token,
        bcd::join::JoinOptions {
            attempts: 1,
            claims: v1::HardwareClaims {
                hostname: state.into(),
                ..Default::default()
            },
        },
    )
    .await
}

async fn uses_left(p: &Plane, token_id: &str) -> i32 {
    bc_store::sqlx::query_scalar("SELECT uses_left FROM site_tokens WHERE id = $1")
        .bind(token_id)
        .fetch_one(p.store.pool())
        .await
        .expect("uses_left")
}

fn token_id(token: &str) -> String {
    token
        .trim_start_matches("bcst_")
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The agent id the gateway derives from an agent's certificate.
fn agent_id(p: &Plane, state: &str) -> String {
    let s = bcd::state::StateDir::open(&p.dir.path().join(state)).expect("state");
    let cert = s.certificate().expect("cert");
    let point = bc_proto::envelope::cert_public_point(&cert).expect("point");
    bc_gateway::site::agent_id_of(&point)
}

fn tls_of(p: &Plane, state: &str) -> std::sync::Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject as _;
    let s = bcd::state::StateDir::open(&p.dir.path().join(state)).expect("state");
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(s.path("node.key")).expect("key");
    bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(s.trust_bundle().expect("bundle")),
        Some((vec![s.certificate().expect("cert")], key)),
    )
    .expect("tls")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enroll_with_a_site_token_retry_exhaust_revoke() -> TestResult {
    let p = plane().await;
    let token = site_token(&p, "rack-1", 2).await;
    assert!(token.starts_with("bcst_"));
    let id = token_id(&token);

    let a = enroll(&p, "site-a", &token).await?;
    assert_eq!(a.identity.node_id, "rack-1");
    assert_eq!(a.identity.spiffe_id, "spiffe://test.bc/site/rack-1");
    assert!(!a.replayed);
    let key = p.dir.path().join("site-a/node.key");
    assert_eq!(std::fs::metadata(&key)?.permissions().mode() & 0o777, 0o600);
    assert_eq!(uses_left(&p, &id).await, 1);

    // A retry with the same key (a crash after the server committed): same site, no use spent.
    let again = enroll(&p, "site-a", &token).await?;
    assert!(again.replayed);
    assert_eq!(uses_left(&p, &id).await, 1);

    let b = enroll(&p, "site-b", &token).await?;
    assert_eq!(b.identity.node_id, "rack-1");
    assert_eq!(uses_left(&p, &id).await, 0);
    assert_eq!(p.store.site_agent_count("rack-1").await?, 2);

    // A third key: no uses left.
    match enroll(&p, "site-c", &token).await {
        Err(bcd::join::JoinError::Refused { code, message }) => {
            assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
            assert!(message.contains("site-tokens create"), "{message}");
        }
        other => panic!("expected exhaustion, got {other:?}"),
    }
    // A revoked token.
    let t2 = site_token(&p, "rack-1", 5).await;
    p.admin
        .call("site-tokens", "revoke", json!({"id": token_id(&t2)}))
        .await?;
    match enroll(&p, "site-d", &t2).await {
        Err(bcd::join::JoinError::Refused { code, message }) => {
            assert_eq!(code, tonic::Code::PermissionDenied, "{message}");
            assert!(message.contains("revoked"), "{message}");
        }
        other => panic!("expected revoked, got {other:?}"),
    }
    // The token listing shows the site's tokens without secrets.
    let list = p
        .admin
        .call("site-tokens", "list", json!({"site": "rack-1"}))
        .await?;
    assert_eq!(list["tokens"].as_array().map(Vec::len), Some(2));
    assert!(!list.to_string().contains(&token[22..]));

    // A node identity is refused on the site services.
    let jt = p.token(json!({"pool": "default"})).await;
    common::join(&p, "node-1", &jt, common::claims("n1", 1)).await?;
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls_of(&p, "node-1")).await?;
    let e = v1::site_service_client::SiteServiceClient::new(ch)
        .boot_lease(v1::BootLeaseRequest {
            ttl_ms: 1000,
            release: false,
        })
        .await
        .expect_err("node refused");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("site identities only"), "{e:?}");
    Ok(())
}

/// Proxy DHCP of one agent on loopback (port 4011 semantics: replies go to the source).
struct Services {
    pxe: SocketAddr,
    http: SocketAddr,
    artifacts: std::path::PathBuf,
    task: tokio::task::JoinHandle<()>,
}

async fn services(dir: &Path, table: watch::Receiver<Netboot>) -> anyhow::Result<Services> {
    let (tftp_root, artifacts) = (dir.join("tftp"), dir.join("artifacts"));
    std::fs::create_dir_all(&tftp_root)?;
    std::fs::create_dir_all(&artifacts)?;
    // The default x64 UEFI loader, public: the services offer only loaders the TFTP root serves.
    let loader = tftp_root.join("snponly.efi");
    std::fs::write(&loader, b"x64 loader")?;
    std::fs::set_permissions(&loader, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    let text = format!(
        "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = {:?}\nartifacts = {:?}\nreport_interval_s = 0\n",
        tftp_root.display().to_string(),
        artifacts.display().to_string(),
    );
    let config = SiteConfig::from_toml(&text, Path::new("test-site.toml"))?;
    let any = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);
    let bound = Bound {
        dhcp: DhcpSockets {
            dhcp: bind_udp(any, None)?,
            pxe: bind_udp(any, None)?,
            watch: None,
        },
        tftp: UdpSocket::bind(any).await?,
        http: TcpListener::bind(any).await?,
    };
    let pxe = bound.dhcp.pxe.local_addr()?;
    let http = bound.http.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = bcd_site::serve::run(
            &config,
            bound,
            table,
            SiteCounters::default(),
            None,
            std::future::pending(),
        )
        .await;
    });
    Ok(Services {
        pxe,
        http,
        artifacts,
        task,
    })
}

/// Whether the proxy DHCP at `to` answers a PXE request for MAC.
async fn answers(to: SocketAddr) -> anyhow::Result<bool> {
    let mac: MacAddr = MAC.parse()?;
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(7)
        .set_chaddr(&mac.0);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(MessageType::Request));
    o.insert(DhcpOption::ClientSystemArchitecture(Architecture::from(7)));
    o.insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
    ));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf))?;
    let client = UdpSocket::bind("127.0.0.1:0").await?;
    client.send_to(&buf, to).await?;
    let mut rx = [0u8; 1500];
    Ok(
        tokio::time::timeout(Duration::from_millis(300), client.recv_from(&mut rx))
            .await
            .is_ok(),
    )
}

/// Polls until the proxy DHCP at `to` answers (`want` true) or stays silent (`want` false); the services pick
/// a table change up asynchronously, so one ask right after the agent's view changed may race it.
async fn settles(to: SocketAddr, want: bool) -> anyhow::Result<bool> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if answers(to).await? == want {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
    }
}

struct Agent {
    view: watch::Receiver<BootLeaseView>,
    services: Services,
    agent: std::sync::Arc<SiteAgent>,
    task: tokio::task::JoinHandle<()>,
}

async fn start_agent(p: &Plane, state: &str, ttl: Duration) -> anyhow::Result<Agent> {
    start_agent_capped(p, state, ttl, bcd::site::cache::DEFAULT_MAX_BYTES).await
}

async fn start_agent_capped(
    p: &Plane,
    state: &str,
    ttl: Duration,
    cache_max_bytes: u64,
) -> anyhow::Result<Agent> {
    let agent = std::sync::Arc::new(SiteAgent::new(
        p.node_config(state),
        SiteAgentOptions {
            lease_ttl: ttl,
            artifacts: Some(p.dir.path().join(state).join("artifacts")),
            artifact_fetches: 2,
            cache_max_bytes,
        },
    ));
    let view = agent.view();
    let (table_tx, table_rx) = watch::channel(Netboot::default());
    let services = services(&p.dir.path().join(state), table_rx).await?;
    let running = agent.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = running.run(table_tx, std::future::pending()).await {
            panic!("site agent failed: {e}");
        }
    });
    Ok(Agent {
        view,
        services,
        agent,
        task,
    })
}

async fn lease_row(p: &Plane, site: &str) -> (String, i64, bool) {
    bc_store::sqlx::query_as(
        "SELECT holder, fence, expires_at > now() FROM boot_leases WHERE site_id = $1",
    )
    .bind(site)
    .fetch_one(p.store.pool())
    .await
    .expect("lease row")
}

async fn wait_serving(a: &Agent, within: Duration) -> bool {
    let mut v = a.view.clone();
    tokio::time::timeout(within, v.wait_for(|v| v.serving && v.machines > 0))
        .await
        .is_ok_and(|r| r.is_ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_agent_serves_and_the_standby_takes_over_when_it_dies() -> TestResult {
    let p = plane().await;
    let token = site_token(&p, "rack-9", 2).await;
    enroll(&p, "agent-a", &token).await?;
    enroll(&p, "agent-b", &token).await?;
    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC.to_uppercase(), "site": "rack-9",
                   "boot": {"kernel": "ramdisk/vmlinuz", "initrd": "ramdisk/initrd", "cmdline": "console=ttyS0"}}),
        )
        .await?;
    let ttl = Duration::from_millis(1500);
    let a = start_agent(&p, "agent-a", ttl).await?;
    assert!(
        wait_serving(&a, Duration::from_secs(10)).await,
        "agent a never served"
    );
    let b = start_agent(&p, "agent-b", ttl).await?;
    // B stands by through several of its asks while A renews.
    tokio::time::sleep(ttl * 2).await;
    assert!(a.view.borrow().serving);
    assert!(!b.view.borrow().serving);
    let (holder, fence_a, valid) = lease_row(&p, "rack-9").await;
    assert_eq!(holder, agent_id(&p, "agent-a"));
    assert!(valid);
    assert!(
        settles(a.services.pxe, true).await?,
        "holder must answer DHCP"
    );
    assert!(
        !answers(b.services.pxe).await?,
        "standby must not answer DHCP"
    );

    // Kill the holder (no release: a crash). Its services go with it.
    let killed = Instant::now();
    a.task.abort();
    a.services.task.abort();
    assert!(
        wait_serving(&b, ttl * 3).await,
        "standby did not take over within 3 × TTL"
    );
    let takeover = killed.elapsed();
    let (holder, fence_b, valid) = lease_row(&p, "rack-9").await;
    assert_eq!(holder, agent_id(&p, "agent-b"));
    assert!(valid);
    assert!(fence_b > fence_a, "fence must increase on takeover");
    assert!(
        settles(b.services.pxe, true).await?,
        "new holder must answer DHCP"
    );
    // The lease had up to one TTL left when A died; B asks every TTL/3.
    assert!(
        takeover <= ttl + ttl / 3 + Duration::from_millis(700),
        "{takeover:?}"
    );
    println!(
        "takeover after holder death: {} ms (ttl {} ms)",
        takeover.as_millis(),
        ttl.as_millis()
    );

    // Clearing the machine's boot empties the served table.
    p.admin
        .call("machines", "set-boot", json!({"mac": MAC, "boot": null}))
        .await?;
    let mut v = b.view.clone();
    tokio::time::timeout(ttl * 2, v.wait_for(|v| v.machines == 0)).await??;
    assert!(settles(b.services.pxe, false).await?);
    b.task.abort();
    b.services.task.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_stops_answering_when_its_lease_is_taken() -> TestResult {
    let p = plane().await;
    let token = site_token(&p, "rack-7", 1).await;
    enroll(&p, "agent", &token).await?;
    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC, "site": "rack-7", "boot": {"kernel": "k"}}),
        )
        .await?;
    let ttl = Duration::from_millis(1500);
    let a = start_agent(&p, "agent", ttl).await?;
    assert!(wait_serving(&a, Duration::from_secs(10)).await);
    assert!(settles(a.services.pxe, true).await?);
    // Someone else holds the lease now (e.g. the agent was partitioned and a standby took over).
    bc_store::sqlx::query(
        "UPDATE boot_leases SET holder = 'other', fence = fence + 1, expires_at = now() + interval '1 minute'",
    )
    .execute(p.store.pool())
    .await?;
    let mut v = a.view.clone();
    tokio::time::timeout(ttl * 2, v.wait_for(|v| !v.serving)).await??;
    assert!(
        settles(a.services.pxe, false).await?,
        "must stop answering once the lease is lost"
    );
    a.task.abort();
    a.services.task.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_only_their_site_as_jwe_and_rest_encrypted() -> TestResult {
    let p = plane().await;
    let t1 = site_token(&p, "rack-1", 1).await;
    let t2 = site_token(&p, "rack-2", 1).await;
    enroll(&p, "site-1", &t1).await?;
    enroll(&p, "site-2", &t2).await?;
    let value = r#"{"username":"root","password":"hunter2-very-secret"}"#;
    p.admin
        .call(
            "secrets",
            "put",
            json!({"site": "rack-1", "name": "bmc/node-7", "value": value}),
        )
        .await?;

    // At rest: neither the secrets table nor the audit log holds the plaintext.
    let leaks: i64 = bc_store::sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM secrets WHERE position(convert_to('hunter2', 'UTF8') IN ciphertext) > 0 \
                 OR position(convert_to('hunter2', 'UTF8') IN nonce) > 0) \
              + (SELECT count(*) FROM audit_events WHERE detail::text LIKE '%hunter2%')",
    )
    .fetch_one(p.store.pool())
    .await?;
    assert_eq!(leaks, 0);
    let rows: i64 = bc_store::sqlx::query_scalar("SELECT count(*) FROM secrets")
        .fetch_one(p.store.pool())
        .await?;
    assert_eq!(rows, 1);
    let key = p.dir.path().join("control/secrets.key");
    assert_eq!(std::fs::metadata(&key)?.permissions().mode() & 0o777, 0o600);

    // Round trip to the secret's own site.
    let got = bcd::site::fetch_secret(&p.node_config("site-1"), "bmc/node-7").await?;
    assert_eq!(got.as_str(), value);
    let delivered: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'secret.delivered' \
         AND subject = 'site/rack-1/secret/bmc/node-7' AND actor = $1",
    )
    .bind(format!("site/rack-1/agent/{}", agent_id(&p, "site-1")))
    .fetch_one(p.store.pool())
    .await?;
    assert_eq!(delivered, 1);

    // Another site asking for the same name is refused.
    match bcd::site::fetch_secret(&p.node_config("site-2"), "bmc/node-7").await {
        Err(bcd::site::SecretFetchError::Refused { code, message, .. }) => {
            assert_eq!(code, tonic::Code::NotFound, "{message}");
            assert!(message.contains("rack-2"), "{message}");
        }
        other => panic!("expected refusal, got {other:?}"),
    }

    // The JWE as relayed: readable only with the request's key; tampering is detected.
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls_of(&p, "site-1")).await?;
    let req_key = jwt_simple::prelude::EcdhEsA256KWDecryptionKey::generate();
    let jwe = v1::secret_service_client::SecretServiceClient::new(ch.clone())
        .secret_request(v1::SecretRequestMessage {
            secret_ref: "bmc/node-7".into(),
            recipient_jwk: req_key.encryption_key().to_jwk(),
        })
        .await?
        .into_inner()
        .jwe;
    assert!(!jwe.contains("hunter2"));
    assert_eq!(jwe.split('.').count(), 5, "compact JWE");
    assert_eq!(
        bcd::site::open_secret(&req_key, &jwe, "bmc/node-7", "rack-1")?.as_str(),
        value
    );
    let other_key = jwt_simple::prelude::EcdhEsA256KWDecryptionKey::generate();
    assert!(matches!(
        bcd::site::open_secret(&other_key, &jwe, "bmc/node-7", "rack-1"),
        Err(bcd::site::SecretFetchError::Jwe(_))
    ));
    let mut parts: Vec<String> = jwe.split('.').map(str::to_string).collect();
    let ct = &mut parts[3];
    let flipped = if ct.starts_with('A') { "B" } else { "A" };
    ct.replace_range(0..1, flipped);
    let tampered = parts.join(".");
    assert!(matches!(
        bcd::site::open_secret(&req_key, &tampered, "bmc/node-7", "rack-1"),
        Err(bcd::site::SecretFetchError::Jwe(_))
    ));
    // A JWE for another site's agent does not pass as ours.
    assert!(matches!(
        bcd::site::open_secret(&req_key, &jwe, "bmc/node-7", "rack-2"),
        Err(bcd::site::SecretFetchError::Mismatch { .. })
    ));
    // A malformed key or name is refused with what to send.
    let e = v1::secret_service_client::SecretServiceClient::new(ch)
        .secret_request(v1::SecretRequestMessage {
            secret_ref: "bmc/node-7".into(),
            recipient_jwk: "{}".into(),
        })
        .await
        .expect_err("bad jwk");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("P-256"), "{e:?}");
    let e = p
        .admin
        .call(
            "secrets",
            "put",
            json!({"site": "rack-1", "name": "../x y", "value": "v"}),
        )
        .await
        .expect_err("bad name");
    assert!(e.to_string().contains("INVALID_ARGUMENT"), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_renews_its_site_certificate_and_keeps_serving() -> TestResult {
    let p = common::plane_with(common::Options {
        leaf_lifetime: Some(Duration::from_secs(8)),
        ..Default::default()
    })
    .await;
    let token = site_token(&p, "rack-5", 1).await;
    enroll(&p, "agent", &token).await?;
    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC, "site": "rack-5", "boot": {"kernel": "k"}}),
        )
        .await?;
    let state = bcd::state::StateDir::open(&p.dir.path().join("agent"))?;
    let first = state.certificate()?;
    let first_expiry = state
        .identity()?
        .map(|i| i.not_after_ms)
        .unwrap_or_default();

    // Proof of possession: a CSR from another key is refused.
    let other = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let csr = rcgen::CertificateParams::default().serialize_request(&other)?;
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls_of(&p, "agent")).await?;
    let e = v1::site_service_client::SiteServiceClient::new(ch)
        .renew(v1::RenewRequest {
            csr_der: csr.der().to_vec(),
        })
        .await
        .expect_err("foreign key refused");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    let ttl = Duration::from_millis(1500);
    let a = start_agent(&p, "agent", ttl).await?;
    assert!(wait_serving(&a, Duration::from_secs(10)).await);
    // Renewal at 50% ±10% of the 8 s lifetime; then past the first certificate's expiry it still holds the lease.
    let deadline = Instant::now() + Duration::from_secs(8);
    // node.json is written last: its new expiry means the renewal is stored.
    while state
        .identity()?
        .map(|i| i.not_after_ms)
        .unwrap_or_default()
        == first_expiry
    {
        assert!(Instant::now() < deadline, "no renewal within 8 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let renewed = state
        .identity()?
        .map(|i| i.not_after_ms)
        .unwrap_or_default();
    assert!(renewed > first_expiry);
    assert_ne!(state.certificate()?, first);
    let serial: String = bc_store::sqlx::query_scalar(
        "SELECT cert_serial FROM site_agents WHERE site_id = 'rack-5'",
    )
    .fetch_one(p.store.pool())
    .await?;
    let new_cert = state.certificate()?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&new_cert)?;
    assert_eq!(serial, hex::encode(parsed.raw_serial()));
    let now_ms = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(first_expiry - now_ms).unwrap_or(0) + 1500,
    ))
    .await;
    assert!(a.view.borrow().serving, "lost the lease across renewal");
    let (holder, _, valid) = lease_row(&p, "rack-5").await;
    assert_eq!(holder, agent_id(&p, "agent"));
    assert!(valid);
    assert!(settles(a.services.pxe, true).await?);
    a.task.abort();
    a.services.task.abort();
    Ok(())
}

// === artifacts ===

/// Deterministic bytes that do not repeat at chunk boundaries.
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn put_artifact(p: &Plane, content: &[u8], name: &str) -> anyhow::Result<String> {
    let v = p.admin.put_artifact(content.to_vec(), Some(name)).await?;
    let reference = v["reference"].as_str().unwrap_or_default().to_string();
    anyhow::ensure!(
        reference.starts_with("sha256:") && reference.len() == 7 + 64,
        "bad answer {v}"
    );
    Ok(reference)
}

async fn wait_machines(a: &Agent, n: usize, within: Duration) -> bool {
    let mut v = a.view.clone();
    tokio::time::timeout(within, v.wait_for(|v| v.serving && v.machines == n))
        .await
        .is_ok_and(|r| r.is_ok())
}

/// Entries and temporary files in the cache directory other than `sha256/`.
fn partial_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != "sha256")
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_fill_the_site_cache_verified_and_boot_http_serves_them() -> TestResult {
    let p = plane().await;
    let token = site_token(&p, "rack-a", 1).await;
    enroll(&p, "agent-a", &token).await?;

    // Sizes that are not multiples of the 256 KiB chunk.
    let kernel = pseudo_random(3 * 1024 * 1024 + 123, 1);
    let initrd = pseudo_random(700_001, 2);
    let k_ref = put_artifact(&p, &kernel, "vmlinuz-test").await?;
    let i_ref = put_artifact(&p, &initrd, "initrd-test").await?;
    let k_sha = k_ref.trim_start_matches("sha256:").to_string();
    let i_sha = i_ref.trim_start_matches("sha256:").to_string();
    let listed = p.admin.call("artifacts", "list", json!({})).await?;
    assert_eq!(
        listed["artifacts"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );

    // A boot naming an artifact that was never put is refused up front.
    let missing = format!("sha256:{}", "0".repeat(64));
    let e = p
        .admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC, "site": "rack-a", "boot": {"kernel": missing}}),
        )
        .await
        .expect_err("unknown artifact refused");
    assert!(e.to_string().starts_with("NOT_FOUND"), "{e}");

    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC, "site": "rack-a",
                   "boot": {"kernel": k_ref, "initrd": i_ref, "cmdline": "console=ttyS0"}}),
        )
        .await?;
    let started = Instant::now();
    let a = start_agent(&p, "agent-a", Duration::from_millis(1500)).await?;
    assert!(
        wait_machines(&a, 1, Duration::from_secs(20)).await,
        "the machine was never published: {:?} {:?}",
        *a.view.borrow(),
        a.agent.artifact_counters()
    );
    println!(
        "artifacts: {} + {} bytes fetched, verified and published in {} ms",
        kernel.len(),
        initrd.len(),
        started.elapsed().as_millis()
    );
    // Published only once both are in the cache, whole.
    let cache = &a.services.artifacts;
    assert_eq!(std::fs::read(cache.join("sha256").join(&k_sha))?, kernel);
    assert_eq!(std::fs::read(cache.join("sha256").join(&i_sha))?, initrd);
    assert_eq!(partial_files(cache), Vec::<String>::new());
    assert!(settles(a.services.pxe, true).await?, "DHCP does not answer");

    // Boot HTTP: the script names the cache paths; the artifacts come with their length and Range.
    let http = reqwest::Client::new();
    let base = format!("http://{}", a.services.http);
    let script = http
        .get(format!("{base}/boot/{MAC}.ipxe"))
        .send()
        .await?
        .text()
        .await?;
    assert!(
        script.contains(&format!("kernel /artifacts/sha256/{k_sha} initrd={i_sha}")),
        "{script}"
    );
    let full = http
        .get(format!("{base}/artifacts/sha256/{k_sha}"))
        .send()
        .await?;
    assert_eq!(full.status(), 200);
    assert_eq!(full.content_length(), Some(kernel.len() as u64));
    assert_eq!(full.bytes().await?.as_ref(), kernel.as_slice());
    let part = http
        .get(format!("{base}/artifacts/sha256/{k_sha}"))
        .header("Range", "bytes=1000000-1000099")
        .send()
        .await?;
    assert_eq!(part.status(), 206);
    assert_eq!(
        part.headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok()),
        Some(format!("bytes 1000000-1000099/{}", kernel.len()).as_str())
    );
    assert_eq!(part.bytes().await?.as_ref(), &kernel[1_000_000..1_000_100]);
    let tail = http
        .get(format!("{base}/artifacts/sha256/{i_sha}"))
        .header("Range", "bytes=-10")
        .send()
        .await?;
    assert_eq!(tail.status(), 206);
    assert_eq!(tail.bytes().await?.as_ref(), &initrd[initrd.len() - 10..]);

    // Tampered at rest in the control plane: the stream no longer hashes to the reference. The agent refuses
    // it, keeps nothing, never publishes the machine, and retries until the content is right again.
    let other = pseudo_random(512 * 1024 + 7, 3);
    let o_ref = put_artifact(&p, &other, "tampered").await?;
    let o_sha = o_ref.trim_start_matches("sha256:").to_string();
    let stored = p.dir.path().join("control/artifacts/sha256").join(&o_sha);
    let mut bad = other.clone();
    bad[300_000] ^= 0x40;
    std::fs::write(&stored, &bad)?;
    const MAC2: &str = "52:54:00:00:00:02";
    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC2, "site": "rack-a", "boot": {"kernel": o_ref}}),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.agent.artifact_counters().map_or(0, |c| c.failed) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = a.agent.artifact_counters().unwrap_or_default();
    assert!(
        c.failed >= 2,
        "the tampered artifact was not refused (and retried): {c:?}"
    );
    assert_eq!(
        a.view.borrow().machines,
        1,
        "the machine with a tampered artifact was published"
    );
    assert!(
        !cache.join("sha256").join(&o_sha).exists(),
        "tampered content kept"
    );
    assert_eq!(
        partial_files(cache),
        Vec::<String>::new(),
        "partial download left behind"
    );
    // Truncated at rest: refused the same way.
    std::fs::write(&stored, &other[..1000])?;
    let before = a.agent.artifact_counters().unwrap_or_default().failed;
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.agent.artifact_counters().map_or(0, |c| c.failed) <= before && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        a.agent.artifact_counters().unwrap_or_default().failed > before,
        "truncation not refused"
    );
    assert_eq!(a.view.borrow().machines, 1);
    // Repaired: the next retry brings it in and the machine is published.
    std::fs::write(&stored, &other)?;
    assert!(
        wait_machines(&a, 2, Duration::from_secs(20)).await,
        "not published after the repair: {:?}",
        a.agent.artifact_counters()
    );
    assert_eq!(std::fs::read(cache.join("sha256").join(&o_sha))?, other);
    println!("artifacts: counters {:?}", a.agent.artifact_counters());

    // The RPC serves only artifacts the asking site references.
    let unreferenced = put_artifact(&p, b"not for this site", "other").await?;
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls_of(&p, "agent-a")).await?;
    let e = v1::site_service_client::SiteServiceClient::new(ch)
        .artifact(v1::ArtifactRequest {
            sha256: unreferenced.trim_start_matches("sha256:").to_string(),
        })
        .await
        .expect_err("unreferenced artifact refused");
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");

    a.task.abort();
    a.services.task.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifact_uploads_stream_from_disk_and_a_truncated_one_leaves_nothing() -> TestResult {
    let p = plane().await;
    let files = tempfile::tempdir()?;
    // Larger than any chunk on the way (reqwest's file reads, hyper's frames, the server's writes).
    let content = pseudo_random(5 * 1024 * 1024 + 17, 9);
    let path = files.path().join("image.raw");
    std::fs::write(&path, &content)?;
    let v = p.admin.put_artifact_file(&path, None).await?;
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&content));
    assert_eq!(
        v["reference"].as_str(),
        Some(format!("sha256:{sha}").as_str()),
        "{v}"
    );
    assert_eq!(v["artifact"]["name"].as_str(), Some(sha.as_str()), "{v}");
    let stored = p.dir.path().join("control/artifacts");
    assert_eq!(std::fs::read(stored.join("sha256").join(&sha))?, content);
    let e = p
        .admin
        .put_artifact_file(&files.path().join("missing"), None)
        .await
        .expect_err("missing file");
    assert!(e.to_string().contains("reading"), "{e}");

    // A body that breaks off before its Content-Length: nothing is stored, no temporary file stays.
    use tokio::io::AsyncWriteExt as _;
    let api = p.running.api_addr.ok_or("api addr")?;
    let mut conn = tokio::net::TcpStream::connect(api).await?;
    let head = format!(
        "PUT /api/artifacts HTTP/1.1\r\nHost: {api}\r\nAuthorization: Bearer {}\r\n\
         x-artifact-name: truncated\r\nContent-Length: {}\r\n\r\n",
        p.admin.key(),
        4 * 1024 * 1024
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(&content[..1024 * 1024 + 5]).await?;
    conn.flush().await?;
    let leftovers = || -> Vec<String> {
        std::fs::read_dir(&stored)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n != "sha256")
                    .collect()
            })
            .unwrap_or_default()
    };
    // The server writes what came to its temporary `.partial-*` file (bc-cas) while the body is still incomplete.
    let deadline = Instant::now() + Duration::from_secs(10);
    while leftovers().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let partial = leftovers();
    assert!(
        partial.iter().any(|n| n.starts_with(bc_cas::TEMP_PREFIX)),
        "no temporary file while the upload runs: {partial:?}"
    );
    drop(conn);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !leftovers().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        leftovers(),
        Vec::<String>::new(),
        "partial upload left behind"
    );
    assert_eq!(std::fs::read_dir(stored.join("sha256"))?.count(), 1);
    let listed = p.admin.call("artifacts", "list", json!({})).await?;
    assert_eq!(
        listed["artifacts"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_evicts_what_the_table_no_longer_references_when_over_its_cap() -> TestResult {
    let p = plane().await;
    let token = site_token(&p, "rack-e", 1).await;
    enroll(&p, "agent-e", &token).await?;
    const MIB: usize = 1024 * 1024;
    let (a, b, c) = (
        pseudo_random(MIB, 11),
        pseudo_random(MIB, 12),
        pseudo_random(MIB, 13),
    );
    let (a_ref, b_ref, c_ref) = (
        put_artifact(&p, &a, "a").await?,
        put_artifact(&p, &b, "b").await?,
        put_artifact(&p, &c, "c").await?,
    );
    let sha = |r: &str| r.trim_start_matches("sha256:").to_string();
    const MAC2: &str = "52:54:00:00:00:02";
    for (mac, k) in [(MAC, &a_ref), (MAC2, &b_ref)] {
        p.admin
            .call(
                "machines",
                "create",
                json!({"mac": mac, "site": "rack-e", "boot": {"kernel": k}}),
            )
            .await?;
    }
    // Room for two and a half artifacts.
    let agent = start_agent_capped(
        &p,
        "agent-e",
        Duration::from_millis(900),
        (5 * MIB / 2) as u64,
    )
    .await?;
    assert!(
        wait_machines(&agent, 2, Duration::from_secs(20)).await,
        "not published: {:?}",
        agent.agent.artifact_counters()
    );
    let cache = agent.services.artifacts.join("sha256");
    // An operator's own file beside the cache is not the cache's to evict.
    std::fs::write(agent.services.artifacts.join("own-kernel"), &c)?;

    // The first machine moves to C: A is no longer referenced, and A + B + C would pass the cap: A goes.
    p.admin
        .call(
            "machines",
            "set-boot",
            json!({"mac": MAC, "boot": {"kernel": c_ref}}),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while (cache.join(sha(&a_ref)).exists() || !cache.join(sha(&c_ref)).exists())
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!cache.join(sha(&a_ref)).exists(), "A was not evicted");
    assert_eq!(std::fs::read(cache.join(sha(&b_ref)))?, b);
    assert_eq!(std::fs::read(cache.join(sha(&c_ref)))?, c);
    assert!(agent.services.artifacts.join("own-kernel").exists());
    let counters = agent.agent.artifact_counters().unwrap_or_default();
    assert_eq!(
        (counters.evicted, counters.evicted_bytes),
        (1, MIB as u64),
        "{counters:?}"
    );
    assert!(wait_machines(&agent, 2, Duration::from_secs(20)).await);

    // The second machine moves to A, which has to be fetched again: B is no longer referenced and goes to make
    // room for the download; C, referenced, stays.
    p.admin
        .call(
            "machines",
            "set-boot",
            json!({"mac": MAC2, "boot": {"kernel": a_ref}}),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while (cache.join(sha(&b_ref)).exists() || !cache.join(sha(&a_ref)).exists())
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!cache.join(sha(&b_ref)).exists(), "B was not evicted");
    assert_eq!(std::fs::read(cache.join(sha(&a_ref)))?, a);
    assert!(
        cache.join(sha(&c_ref)).exists(),
        "a referenced artifact was evicted"
    );
    assert!(wait_machines(&agent, 2, Duration::from_secs(20)).await);
    agent.task.abort();
    agent.services.task.abort();
    Ok(())
}

/// A TLS handshake with a site agent's certificate, then the HTTP/2 preface and the gateway's first bytes: what
/// tells a completed handshake from one refused as revoked (TLS 1.3 delivers the alert after the client finishes).
async fn handshake(p: &Plane, state: &str) -> Result<(), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = p.running.gateway_addr.ok_or("no gateway address")?;
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let mut tls = tokio_rustls::TlsConnector::from(tls_of(p, state))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("{e:?}"))?;
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .map_err(|e| format!("{e:?}"))?;
    let mut buf = [0u8; 16];
    match tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf)).await {
        Ok(Ok(0)) => Err("closed".into()),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("{e:?}")),
        Err(_) => Err("no answer within 5 s".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_site_is_refused_at_the_handshake_and_by_the_broker() -> TestResult {
    let p = plane().await;
    let revokee = site_token(&p, "rack-r", 3).await;
    let other = site_token(&p, "rack-o", 1).await;
    enroll(&p, "rev-a", &revokee).await?;
    enroll(&p, "rev-b", &revokee).await?;
    enroll(&p, "other", &other).await?;
    let value = r#"{"username":"root","password":"pw"}"#;
    for site in ["rack-r", "rack-o"] {
        p.admin
            .call(
                "secrets",
                "put",
                json!({"site": site, "name": "bmc/1", "value": value}),
            )
            .await?;
    }
    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": MAC, "site": "rack-r", "boot": {"kernel": "ramdisk/vmlinuz"}}),
        )
        .await?;
    // Positive controls: the agent fetches its site's secret; a running agent holds the boot lease.
    let got = bcd::site::fetch_secret(&p.node_config("rev-a"), "bmc/1").await?;
    assert_eq!(got.as_str(), value);
    handshake(&p, "rev-a").await.map_err(anyhow::Error::msg)?;
    let agent = SiteAgent::new(
        p.node_config("rev-b"),
        SiteAgentOptions {
            lease_ttl: Duration::from_secs(3),
            ..Default::default()
        },
    );
    let view = agent.view();
    let (table_tx, _table_rx) = watch::channel(Netboot::default());
    let running = tokio::spawn(async move { agent.run(table_tx, std::future::pending()).await });
    let mut v = view.clone();
    tokio::time::timeout(Duration::from_secs(15), v.wait_for(|v| v.serving))
        .await
        .map_err(|_| anyhow::anyhow!("the agent did not take the boot lease in 15 s"))??;
    // A connection opened before the revocation.
    let ch = bc_proto::channel::connect(&p.running.gateway_url, tls_of(&p, "rev-a")).await?;
    let ask = |ch: tonic::transport::Channel| async move {
        v1::secret_service_client::SecretServiceClient::new(ch)
            .secret_request(v1::SecretRequestMessage {
                secret_ref: "bmc/1".into(),
                recipient_jwk: jwt_simple::prelude::EcdhEsA256KWDecryptionKey::generate()
                    .encryption_key()
                    .to_jwk(),
            })
            .await
    };
    ask(ch.clone()).await?;

    // Revoked by another control-plane process (straight in the store: this process's API never saw it).
    let done = p
        .store
        .revoke_site("rack-r", "test/other-process")
        .await?
        .ok_or_else(|| anyhow::anyhow!("rack-r not found"))?;
    assert!(done.newly && done.lease_released, "{done:?}");
    assert_eq!(done.tokens_revoked, 1, "the token had a use left");
    // Before the gateway's refresh, the services refuse the open connection's requests.
    let e = ask(ch)
        .await
        .expect_err("a revoked site's request was answered");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("rack-r is revoked"), "{e:?}");
    // Within the refresh interval (10 s), the handshake is refused.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(12);
    let refusal = loop {
        match handshake(&p, "rev-a").await {
            Err(e) => break e,
            Ok(()) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(()) => panic!("a revoked site still completes the handshake after 12 s"),
        }
    };
    assert!(refusal.contains("CertificateRevoked"), "{refusal}");
    // The secret broker is out of reach, and bcd says why.
    match bcd::site::fetch_secret(&p.node_config("rev-a"), "bmc/1").await {
        Err(bcd::site::SecretFetchError::Site(e @ bcd::site::SiteError::Revoked { .. })) => {
            assert_eq!(e.exit_code(), bcd::session::EXIT_REFUSED);
            assert!(e.to_string().contains("site is revoked"), "{e}");
        }
        other => panic!("expected a handshake refusal, got {other:?}"),
    }
    // The running agent (`bcd site run`) stops serving and ends with the refusal: exit status 4.
    let ended = tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .map_err(|_| anyhow::anyhow!("the agent still runs 20 s after the revocation"))??;
    match ended {
        Err(e @ bcd::site::SiteError::Revoked { .. }) => {
            assert_eq!(e.exit_code(), bcd::session::EXIT_REFUSED);
            assert!(
                e.to_string().contains("spiffe://test.bc/site/rack-r"),
                "{e}"
            );
        }
        other => panic!("expected the agent to stop as revoked, got {other:?}"),
    }
    assert!(!view.borrow().serving);
    // The last token use enrolls no agent.
    let e = enroll(&p, "rev-c", &revokee)
        .await
        .expect_err("a revoked site enrolled an agent");
    assert!(e.to_string().contains("revoked"), "{e}");

    // Through the API: idempotent.
    let again = p
        .admin
        .call("sites", "revoke", json!({"site": "rack-r"}))
        .await?;
    assert_eq!(again["already_revoked"], true, "{again}");

    // Another site is unaffected.
    handshake(&p, "other").await.map_err(anyhow::Error::msg)?;
    let got = bcd::site::fetch_secret(&p.node_config("other"), "bmc/1").await?;
    assert_eq!(got.as_str(), value);
    Ok(())
}
