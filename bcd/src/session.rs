//! `bcd run`: the daemon's one dial-out HTTP/2 mTLS connection to the gateway, carrying the Session stream.
//!
//! Hello → Welcome (epoch, heartbeat interval); heartbeats; inventory sections on request, each with a content
//! hash, unchanged ones never resent; desired state applied and acknowledged by generation; commands run and their
//! results signed by the node key. Any failure ends the session and the daemon reconnects with exponential backoff,
//! full jitter and a cap. Nothing the gateway sends can panic the daemon: every message is checked.

use crate::config::Config;
use crate::gpu::GpuBackend;
use crate::state::{StateDir, StateError};
use bc_proto::channel::{self, Backoff, ServerTrust};
use bc_proto::envelope::EnvelopeSigner;
use bc_proto::v1;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject as _;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("this node has not joined yet (no identity in {dir}): run `bcd join` first")]
    NotJoined { dir: String },
    #[error("node state")]
    State(#[from] StateError),
    #[error(
        "the node certificate expired while the node was offline: rejoin with `bcd join` (a reclaim token keeps the \
         node id where the pool allows reclaim)"
    )]
    CertificateExpired,
    #[error("the control plane refused this node: {0}")]
    Refused(String),
}

/// Why one session ended.
#[derive(Debug, thiserror::Error)]
enum SessionEnd {
    #[error("connecting: {0}")]
    Connect(String),
    #[error("gateway: {0}")]
    Status(String),
    #[error("the gateway closed the session")]
    Closed,
    #[error("refused: {0}")]
    Refused(String),
    #[error("local: {0}")]
    Local(String),
}

/// What the daemon remembers across sessions (in memory).
pub struct Daemon {
    pub config: Config,
    pub gpu: Option<Arc<dyn GpuBackend>>,
    /// Hashes of inventory sections sent in this process's earlier sessions.
    known: HashMap<String, [u8; 32]>,
    boot_id: String,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Daemon {
    pub fn new(config: Config, gpu: Option<Arc<dyn GpuBackend>>) -> Daemon {
        let boot_id =
            std::fs::read_to_string(config.hardware_root.join("proc/sys/kernel/random/boot_id"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
        Daemon {
            config,
            gpu,
            known: HashMap::new(),
            boot_id,
        }
    }

    /// Runs sessions until `shutdown` resolves or the node can no longer connect without an operator.
    pub async fn run(
        &mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), RunError> {
        tokio::pin!(shutdown);
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            let started = tokio::time::Instant::now();
            let end = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                end = self.session_once() => end,
            };
            match end {
                SessionEnd::Refused(m) => return Err(RunError::Refused(m)),
                SessionEnd::Local(m) if m == "not joined" => {
                    return Err(RunError::NotJoined {
                        dir: self.config.state_dir.display().to_string(),
                    });
                }
                SessionEnd::Local(m) if m == "certificate expired" => {
                    return Err(RunError::CertificateExpired);
                }
                other => {
                    // A session that lasted a while was healthy: start the backoff again.
                    if started.elapsed() > Duration::from_secs(60) {
                        backoff.reset();
                    }
                    let wait = backoff.next_delay(rand::random::<f64>());
                    tracing::warn!(reason = %other, ?wait, "session ended; reconnecting");
                    tokio::select! {
                        _ = &mut shutdown => return Ok(()),
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    fn tls(&self, state: &StateDir) -> Result<Arc<rustls::ClientConfig>, SessionEnd> {
        let local = |e: &dyn std::fmt::Display| SessionEnd::Local(e.to_string());
        let cert = state.certificate().map_err(|e| local(&e))?;
        let bundle = state.trust_bundle().map_err(|e| local(&e))?;
        let key = PrivateKeyDer::from_pem_file(state.path("node.key")).map_err(|e| local(&e))?;
        channel::client_config(ServerTrust::Bundle(bundle), Some((vec![cert], key)))
            .map_err(|e| local(&e))
    }

    async fn session_once(&mut self) -> SessionEnd {
        let state = match StateDir::open(&self.config.state_dir) {
            Ok(s) => s,
            Err(e) => return SessionEnd::Local(e.to_string()),
        };
        let identity = match state.identity() {
            Ok(Some(i)) => i,
            Ok(None) => return SessionEnd::Local("not joined".into()),
            Err(e) => return SessionEnd::Local(e.to_string()),
        };
        if identity.not_after_ms <= now_ms() {
            return SessionEnd::Local("certificate expired".into());
        }
        let tls = match self.tls(&state) {
            Ok(t) => t,
            Err(e) => return e,
        };
        let signer = match std::fs::read_to_string(state.path("node.key"))
            .map_err(|e| e.to_string())
            .and_then(|pem| rcgen::KeyPair::from_pem(&pem).map_err(|e| e.to_string()))
            .and_then(|k| {
                EnvelopeSigner::new(&k.serialize_der(), identity.spiffe_id.clone())
                    .map_err(|e| e.to_string())
            }) {
            Ok(s) => s,
            Err(e) => return SessionEnd::Local(e),
        };
        let ch = match channel::connect(&identity.gateway_url, tls).await {
            Ok(c) => c,
            Err(e) => return SessionEnd::Connect(crate::join::error_chain(&e)),
        };
        let (tx, rx) = mpsc::channel::<v1::NodeMessage>(64);
        let hello = v1::Hello {
            node_id: identity.node_id.clone(),
            agent_version: bc_proto::AGENT_VERSION.to_string(),
            boot_id: self.boot_id.clone(),
            clock_unix_ms: now_ms(),
            known_inventory: self
                .known
                .iter()
                .map(|(name, hash)| v1::InventoryHash {
                    name: name.clone(),
                    hash: hash.to_vec(),
                })
                .collect(),
        };
        if tx
            .send(msg(v1::node_message::Msg::Hello(hello)))
            .await
            .is_err()
        {
            return SessionEnd::Local("outbound queue closed".into());
        }
        let mut client = v1::session_service_client::SessionServiceClient::new(ch);
        let mut inbound = match client
            .session(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => return end_of(s),
        };
        let mut heartbeat = tokio::time::interval(Duration::from_secs(15));
        heartbeat.reset();
        let mut seq = 0u64;
        let mut identity = identity;
        let expiry =
            Duration::from_millis(u64::try_from(identity.not_after_ms - now_ms()).unwrap_or(0));
        let expires = tokio::time::sleep(expiry);
        tokio::pin!(expires);
        let renew = tokio::time::sleep(renewal_delay(&state, &identity));
        tokio::pin!(renew);
        loop {
            tokio::select! {
                _ = heartbeat.tick() => {
                    seq += 1;
                    if tx.send(msg(v1::node_message::Msg::Heartbeat(v1::Heartbeat { seq }))).await.is_err() {
                        return SessionEnd::Closed;
                    }
                }
                _ = &mut expires => return SessionEnd::Local("certificate expired".into()),
                _ = &mut renew => {
                    match renewal_request(&state) {
                        Ok(r) => {
                            tracing::info!("renewing the node certificate");
                            if tx.send(msg(v1::node_message::Msg::Renew(r))).await.is_err() {
                                return SessionEnd::Closed;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot build a renewal request"),
                    }
                    // If no answer comes, ask again after a tenth of what is left (at least 1 s, at most 5 min).
                    let left = u64::try_from(identity.not_after_ms - now_ms()).unwrap_or(0);
                    renew.as_mut().reset(tokio::time::Instant::now() + Duration::from_millis((left / 10).clamp(1_000, 300_000)));
                }
                next = inbound.message() => {
                    let m = match next {
                        Ok(Some(m)) => m,
                        Ok(None) => return SessionEnd::Closed,
                        Err(s) => return end_of(s),
                    };
                    let Some(m) = m.msg else {
                        tracing::debug!("empty GatewayMessage ignored");
                        continue;
                    };
                    if let v1::gateway_message::Msg::Renew(r) = &m {
                        match store_renewal(&state, &mut identity, r) {
                            Ok(()) => {
                                tracing::info!(not_after_ms = identity.not_after_ms, "certificate renewed; used from the next connection");
                                expires.as_mut().reset(tokio::time::Instant::now() + Duration::from_millis(u64::try_from(identity.not_after_ms - now_ms()).unwrap_or(0)));
                                renew.as_mut().reset(tokio::time::Instant::now() + renewal_delay(&state, &identity));
                            }
                            Err(e) => tracing::warn!(error = %e, "renewal answer refused"),
                        }
                        continue;
                    }
                    if let Some(every) = self.handle(m, &tx, &state, &signer).await {
                        heartbeat = tokio::time::interval(every);
                        heartbeat.reset();
                    }
                }
            }
        }
    }

    /// Handles one gateway message; returns a new heartbeat interval when the gateway set one.
    async fn handle(
        &mut self,
        m: v1::gateway_message::Msg,
        tx: &mpsc::Sender<v1::NodeMessage>,
        state: &StateDir,
        signer: &EnvelopeSigner,
    ) -> Option<Duration> {
        use v1::gateway_message::Msg;
        match m {
            Msg::Welcome(w) => {
                tracing::info!(epoch = w.session_epoch, "session open");
                let ms = u64::from(w.heartbeat_interval_ms).clamp(1_000, 300_000);
                return Some(Duration::from_millis(ms));
            }
            Msg::InventoryRequest(r) => {
                for section in self.sections(&r.sections) {
                    self.known.insert(section.name.clone(), section.hash);
                    let out = v1::InventorySection {
                        name: section.name,
                        hash: section.hash.to_vec(),
                        payload: section.payload,
                    };
                    if tx
                        .send(msg(v1::node_message::Msg::Inventory(out)))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
            Msg::DesiredState(d) => {
                let (outcome, message) = match self.apply_desired(state, &d) {
                    Ok(()) => ("applied", String::new()),
                    Err(e) => ("failed", e),
                };
                tracing::info!(generation = d.generation, outcome, "desired state");
                let ack = v1::DesiredStateAck {
                    generation: d.generation,
                    outcome: outcome.into(),
                    message,
                };
                let _ = tx.send(msg(v1::node_message::Msg::Ack(ack))).await;
            }
            Msg::Command(c) => {
                let envelope = self.command(&c, signer).await;
                match envelope {
                    Ok(env) => {
                        let r = v1::CommandResult {
                            id: c.id,
                            envelope: Some(env),
                        };
                        let _ = tx.send(msg(v1::node_message::Msg::Result(r))).await;
                    }
                    Err(e) => {
                        tracing::warn!(command = c.id, error = %e, "command failed to produce a result")
                    }
                }
            }
            Msg::Renew(_) => tracing::debug!("renewal response ignored"),
            Msg::OpenTunnel(t) => tracing::info!(
                tunnel = t.tunnel_id,
                "tunnels are not available in this version"
            ),
        }
        None
    }

    async fn command(
        &self,
        c: &v1::Command,
        signer: &EnvelopeSigner,
    ) -> Result<v1::SignedEnvelope, String> {
        match c.kind.as_str() {
            crate::diag::KIND => {
                // The control plane's policy (expected GPU count and any thresholds it sets); a malformed policy
                // is reported in a signed error rather than run with guessed thresholds.
                let policy = match crate::diag::DiagPolicy::from_json(&c.args) {
                    Ok(p) => p,
                    Err(e) => {
                        let payload =
                            serde_json::json!({"error": format!("diag.nvml arguments: {e}")});
                        return signer
                            .sign(
                                "application/vnd.bettercompute.error+json",
                                payload.to_string().into_bytes(),
                            )
                            .map_err(|e| e.to_string());
                    }
                };
                let gpu = self.gpu.clone();
                let report = tokio::task::spawn_blocking(move || {
                    let backend: &dyn GpuBackend = match &gpu {
                        Some(b) => b.as_ref(),
                        None => &crate::gpu::NoGpus,
                    };
                    crate::diag::run(backend, &policy)
                })
                .await
                .map_err(|e| e.to_string())?;
                crate::diag::sign(&report, signer).map_err(|e| e.to_string())
            }
            other => {
                let payload =
                    serde_json::json!({"error": format!("unknown command kind {other:?}")});
                signer
                    .sign(
                        "application/vnd.bettercompute.error+json",
                        payload.to_string().into_bytes(),
                    )
                    .map_err(|e| e.to_string())
            }
        }
    }

    fn sections(&self, names: &[String]) -> Vec<crate::inventory::Section> {
        crate::inventory::collect_sections(&self.config.hardware_root, self.gpu.as_deref(), names)
    }
}

/// When to renew the stored certificate: 50% ±10% of its life, counted from when the node received it (the
/// certificate's NotBefore is backdated), else from its NotBefore.
pub(crate) fn renewal_delay(state: &StateDir, identity: &crate::state::NodeIdentity) -> Duration {
    let start = if identity.issued_at_ms > 0 {
        identity.issued_at_ms
    } else {
        state
            .certificate()
            .ok()
            .and_then(|c| channel::cert_validity_ms(&c))
            .map(|(nb, _)| nb)
            .unwrap_or_else(now_ms)
    };
    channel::renewal_delay(
        start,
        identity.not_after_ms,
        now_ms(),
        rand::random::<f64>(),
    )
}

/// A CSR from the node's own key: renewal proves possession of the key the current certificate certifies.
pub(crate) fn renewal_request(state: &StateDir) -> Result<v1::RenewRequest, String> {
    let key = state.load_or_create_key().map_err(|e| e.to_string())?;
    let mut params = rcgen::CertificateParams::default();
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, "bcd node");
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key).map_err(|e| e.to_string())?;
    Ok(v1::RenewRequest {
        csr_der: csr.der().to_vec(),
    })
}

/// Checks a renewed certificate (same identity, our key, later expiry) and stores it.
pub(crate) fn store_renewal(
    state: &StateDir,
    identity: &mut crate::state::NodeIdentity,
    r: &v1::RenewResponse,
) -> Result<(), String> {
    let id = bc_proto::spiffe::SpiffeId::from_cert_der(&r.cert_der).map_err(|e| e.to_string())?;
    if id.to_string() != identity.spiffe_id {
        return Err(format!(
            "renewed certificate names {id}, not {}",
            identity.spiffe_id
        ));
    }
    let key = state.load_or_create_key().map_err(|e| e.to_string())?;
    let point = bc_proto::envelope::cert_public_point(&r.cert_der).map_err(|e| e.to_string())?;
    if point != key.public_key_raw() {
        return Err("renewed certificate does not certify this node's key".into());
    }
    if r.not_after_unix_ms <= identity.not_after_ms {
        return Err("renewed certificate does not outlive the current one".into());
    }
    let bundle = if r.trust_bundle_der.is_empty() {
        state
            .trust_bundle()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|c| c.to_vec())
            .collect()
    } else {
        r.trust_bundle_der.clone()
    };
    identity.not_after_ms = r.not_after_unix_ms;
    identity.issued_at_ms = now_ms();
    state
        .store_join(&r.cert_der, &bundle, identity)
        .map_err(|e| e.to_string())
}

fn msg(m: v1::node_message::Msg) -> v1::NodeMessage {
    v1::NodeMessage { msg: Some(m) }
}

/// Permission errors mean an operator must act (revoked, unknown); the rest are worth a reconnect.
fn end_of(s: tonic::Status) -> SessionEnd {
    match s.code() {
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
            SessionEnd::Refused(s.message().to_string())
        }
        _ => SessionEnd::Status(format!("{:?}: {}", s.code(), s.message())),
    }
}

impl Daemon {
    /// Applies desired state: the bookings become the node's CDI spec (exactly the booked GPUs), then the document
    /// is recorded. A booking naming a GPU this node does not have fails the generation with that reason.
    fn apply_desired(&self, state: &StateDir, d: &v1::DesiredState) -> Result<(), String> {
        let spec: serde_json::Value =
            serde_json::from_slice(&d.spec).map_err(|e| format!("spec is not JSON: {e}"))?;
        let bookings = crate::cdi::bookings(&spec).map_err(|e| e.to_string())?;
        let local: Vec<crate::cdi::LocalGpu> = match &self.gpu {
            Some(g) => g
                .gpus()
                .map_err(|e| format!("listing GPUs for the bookings: {e}"))?
                .into_iter()
                .map(|g| crate::cdi::LocalGpu {
                    minor: crate::cdi::minor_from_procfs(&self.config.hardware_root, &g.pci_bus_id),
                    uuid: g.uuid,
                })
                .collect(),
            None => Vec::new(),
        };
        let cdi = crate::cdi::render(&bookings, &local).map_err(|e| e.to_string())?;
        crate::cdi::apply(&self.config.cdi_dir, cdi.as_ref()).map_err(|e| {
            format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            )
        })?;
        let doc = serde_json::json!({"generation": d.generation, "spec": spec});
        state
            .write_file("desired.json", doc.to_string().as_bytes(), 0o600)
            .map_err(|e| e.to_string())
    }
}
