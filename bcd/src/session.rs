//! `bcd run`: the daemon's one dial-out HTTP/2 mTLS connection to the gateway, carrying the Session stream.
//!
//! Hello → Welcome (epoch, heartbeat interval); heartbeats; inventory sections on request, each with a content
//! hash, unchanged ones never resent; desired state applied and acknowledged by generation; commands run as their own
//! tasks (see [`crate::commands`]: a long command never holds up the session), their progress sent rate-limited and
//! their results signed by the node key (the daemon's own kinds, and those of a [`CommandHook`] the embedding program
//! adds: the ramdisk's agent mode). Any failure ends the session and the daemon reconnects with exponential backoff,
//! full jitter and a cap. Nothing the gateway sends can panic the daemon: every message is checked.

use crate::config::Config;
use crate::gpu::GpuBackend;
use crate::state::{StateDir, StateError};
use bc_error_chain::chain;
use bc_proto::channel::{self, Backoff, ExponentialBackoff, Jitter, ServerTrust};
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
        "the node certificate expired {ago_min} min ago while the node was offline, and no join token was given: \
         create one with `better-compute join-tokens create --pool {pool} --reclaim`, then run \
         `bcd join --token-file <file>` (or start `bcd run` with BCD_JOIN_TOKEN or --token-file); where pool {pool} \
         allows reclaim the node keeps its id {node_id}"
    )]
    NeedsToken {
        node_id: String,
        pool: String,
        ago_min: i64,
    },
    #[error("the node certificate expired and rejoining with the given token failed")]
    Rejoin(#[source] crate::join::JoinError),
    #[error("the control plane refused this node: {0}")]
    Refused(String),
}

/// Exit status of `bcd run` when the node needs a join token (certificate expired, or not joined): a service
/// manager should not restart it until an operator acts.
pub const EXIT_NEEDS_TOKEN: i32 = 3;
/// Exit status of `bcd run` when the control plane refuses the node (revoked, unknown).
pub const EXIT_REFUSED: i32 = 4;

impl RunError {
    /// The process exit status for this error (1 for errors a restart may cure).
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::NotJoined { .. } | RunError::NeedsToken { .. } | RunError::Rejoin(_) => {
                EXIT_NEEDS_TOKEN
            }
            RunError::Refused(_) => EXIT_REFUSED,
            RunError::State(_) => 1,
        }
    }
}

/// Why one session ended.
#[derive(Debug, thiserror::Error)]
enum SessionEnd {
    #[error("connecting: {0}")]
    Connect(String),
    #[error("gateway: {0}")]
    Status(String),
    #[error("the session's stream ended")]
    Closed,
    #[error("refused: {0}")]
    Refused(String),
    #[error("local: {0}")]
    Local(String),
}

/// How long the session waits for the gateway to take one message. A gateway that stops reading this session (its
/// handler stuck, the stream's window full) while its connection answers HTTP/2 pings would otherwise hold the
/// session for ever; past this the node ends it and reconnects, perhaps to another gateway behind the balancer.
const SEND_DEADLINE: Duration = Duration::from_secs(60);

/// The session's outbound queue; every send waits at most [`SEND_DEADLINE`].
struct Outbound {
    tx: mpsc::Sender<v1::NodeMessage>,
}

impl Outbound {
    fn new(tx: mpsc::Sender<v1::NodeMessage>) -> Outbound {
        Outbound { tx }
    }

    /// Queues `m`; Err when the stream ended or the gateway took nothing for the deadline (then said in the log).
    async fn send(&self, m: v1::NodeMessage) -> Result<(), ()> {
        match tokio::time::timeout(SEND_DEADLINE, self.tx.send(m)).await {
            Ok(sent) => sent.map_err(|_| ()),
            Err(_) => {
                tracing::warn!(
                    "the gateway took no message from this node for {} s: ending the session to reconnect",
                    SEND_DEADLINE.as_secs()
                );
                Err(())
            }
        }
    }

    /// The queue itself (its capacity shows what the transport has taken).
    fn queue(&self) -> &mpsc::Sender<v1::NodeMessage> {
        &self.tx
    }
}

pub use crate::commands::{
    CommandHook, CommandOutput, ERROR_PAYLOAD_TYPE, ProgressLimiter, ProgressReporter,
};

/// What the daemon remembers across sessions (in memory).
pub struct Daemon {
    pub config: Config,
    pub gpu: Option<Arc<dyn GpuBackend>>,
    /// A join token to rejoin with (by reclaim) if the certificate expired while the node was offline.
    pub rejoin_token: Option<String>,
    /// Extra command kinds (the ramdisk's; `instance.console` in a `bcd run` with a VMM).
    pub hook: Option<Arc<dyn CommandHook>>,
    /// The VPS instances this node runs (`[vmm]` in bcd.toml); `None` refuses a desired state that lists some.
    pub instances: Option<Arc<dyn crate::vmm::InstanceHost>>,
    /// At most one progress message per running command per this interval (1 s).
    pub progress_interval: Duration,
    /// Hashes of inventory sections sent in this process's earlier sessions.
    known: HashMap<String, [u8; 32]>,
    /// The gateway asked for the `instances` section by name: from then on it is pushed when it changes.
    instances_asked: bool,
    /// The TLS configuration of the last session and the hash of the certificate and trust bundle it was built
    /// from: kept while they are the same, so a reconnect resumes with the session tickets it holds (a ticket is
    /// bound to the configuration that received it) instead of a full handshake.
    tls: Option<([u8; 32], Arc<rustls::ClientConfig>)>,
    boot_id: String,
    /// Running and recently finished commands, and the outbox their results wait in between sessions.
    commands: crate::commands::Commands,
    /// The desired state this daemon could not apply, retried with backoff until it applies or a newer one comes.
    retry: Option<DesiredRetry>,
    /// Tunnels served at once ([`crate::tunnel::MAX_OPEN`]).
    tunnel_slots: Arc<tokio::sync::Semaphore>,
    /// The gateway's clock minus this node's, from the last Welcome: command deadlines are in the gateway's time.
    clock_offset_ms: i64,
}

/// An offset from the gateway's clock beyond which the node warns that its own clock is wrong.
const CLOCK_WARN_MS: u64 = 5_000;

/// First and longest wait between attempts to apply a desired state that failed (full jitter in between).
pub const DESIRED_RETRY_BASE: Duration = Duration::from_secs(1);
pub const DESIRED_RETRY_CAP: Duration = Duration::from_secs(30);
const DESIRED_RETRY: ExponentialBackoff =
    ExponentialBackoff::new(DESIRED_RETRY_BASE, DESIRED_RETRY_CAP, Jitter::Fraction(1.0));

/// A desired state that failed to apply (a read-only CDI directory, a GPU missing for a booking): the daemon tries
/// again with backoff, telling the gateway only when the reason changes and when it finally applies.
struct DesiredRetry {
    desired: v1::DesiredState,
    /// The reason last acknowledged.
    reason: String,
    backoff: Backoff,
    due: tokio::time::Instant,
}

pub(crate) fn now_ms() -> i64 {
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
            rejoin_token: None,
            hook: None,
            instances: None,
            progress_interval: Duration::from_secs(1),
            known: HashMap::new(),
            instances_asked: false,
            tls: None,
            boot_id,
            commands: crate::commands::Commands::new(),
            retry: None,
            tunnel_slots: Arc::new(tokio::sync::Semaphore::new(crate::tunnel::MAX_OPEN)),
            clock_offset_ms: 0,
        }
    }

    /// Runs sessions until `shutdown` resolves or the node can no longer connect without an operator.
    pub async fn run(
        &mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), RunError> {
        tokio::pin!(shutdown);
        let mut backoff = channel::RECONNECT.start();
        loop {
            let started = tokio::time::Instant::now();
            let end = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                end = self.session_once() => end,
            };
            self.commands.session_ended();
            match end {
                SessionEnd::Refused(m) => return Err(RunError::Refused(m)),
                SessionEnd::Local(m) if m == "not joined" => {
                    return Err(RunError::NotJoined {
                        dir: self.config.state_dir.display().to_string(),
                    });
                }
                SessionEnd::Local(m) if m == "certificate expired" => match self.rejoin().await {
                    Ok(()) => backoff.reset(),
                    Err(RunError::Rejoin(crate::join::JoinError::Unreachable { last, .. })) => {
                        let wait = backoff.next_delay(rand::random::<f64>());
                        tracing::warn!(error = %last, ?wait, "rejoin: gateway unreachable; trying again");
                        tokio::select! {
                            _ = &mut shutdown => return Ok(()),
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                    Err(e) => return Err(e),
                },
                other => {
                    // A session that lasted a while was healthy: start the backoff again.
                    if started.elapsed() > Duration::from_secs(60) {
                        backoff.reset();
                    }
                    let wait = backoff.next_delay(rand::random::<f64>());
                    tracing::warn!(reason = %other, ?wait, "session ended; reconnecting");
                    bc_proto::runtime::service::status(&format!("reconnecting: {other}"));
                    tokio::select! {
                        _ = &mut shutdown => return Ok(()),
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// The certificate expired while the node was offline: rejoin by reclaim with the configured token (same node
    /// id where the token and pool allow reclaim), or stop saying a token is needed.
    async fn rejoin(&mut self) -> Result<(), RunError> {
        let state = StateDir::open(&self.config.state_dir)?;
        let identity = state.identity()?.ok_or_else(|| RunError::NotJoined {
            dir: self.config.state_dir.display().to_string(),
        })?;
        let Some(token) = self.rejoin_token.clone() else {
            return Err(RunError::NeedsToken {
                ago_min: (now_ms() - identity.not_after_ms) / 60_000,
                node_id: identity.node_id,
                pool: identity.pool,
            });
        };
        tracing::warn!(
            node_id = identity.node_id,
            "the node certificate expired while offline; rejoining with the join token"
        );
        // The same claims as at join, so the hardware key matches the node to reclaim (sysfs reads and a GPU query:
        // brief, and this path is rare).
        let claims =
            crate::hardware::collect(&self.config.hardware_root, self.gpu.as_deref(), None);
        let opts = crate::join::JoinOptions {
            attempts: 4,
            claims,
        };
        let out = crate::join::join(&self.config, &token, opts)
            .await
            .map_err(RunError::Rejoin)?;
        if out.identity.node_id == identity.node_id {
            tracing::info!(
                node_id = out.identity.node_id,
                reclaimed = out.reclaimed,
                "rejoined: same node, new key and certificate"
            );
        } else {
            tracing::warn!(
                old = identity.node_id,
                new = out.identity.node_id,
                "rejoined as a NEW node: the token or pool does not allow reclaim, or the hardware changed"
            );
        }
        // Inventory hashes were for the old node's sessions; send everything again.
        self.known.clear();
        self.instances_asked = false;
        Ok(())
    }

    fn tls(&mut self, state: &StateDir) -> Result<Arc<rustls::ClientConfig>, SessionEnd> {
        let local = |e: &(dyn std::error::Error + 'static)| SessionEnd::Local(chain(e));
        let cert = state.certificate().map_err(|e| local(&e))?;
        let bundle = state.trust_bundle().map_err(|e| local(&e))?;
        let mut built_from = cert.to_vec();
        for ca in &bundle {
            built_from.extend_from_slice(ca);
        }
        let built_from = bc_proto::sha256(&built_from);
        if let Some((from, tls)) = &self.tls
            && *from == built_from
        {
            return Ok(tls.clone());
        }
        let key = PrivateKeyDer::from_pem_file(state.path("node.key")).map_err(|e| local(&e))?;
        let tls = channel::client_config(ServerTrust::Bundle(bundle), Some((vec![cert], key)))
            .map_err(|e| local(&e))?;
        self.tls = Some((built_from, tls.clone()));
        Ok(tls)
    }

    async fn session_once(&mut self) -> SessionEnd {
        let state = match StateDir::open(&self.config.state_dir) {
            Ok(s) => s,
            Err(e) => return SessionEnd::Local(chain(&e)),
        };
        if let Err(e) = state.finish_rejoin() {
            return SessionEnd::Local(chain(&e));
        }
        let identity = match state.identity() {
            Ok(Some(i)) => i,
            Ok(None) => return SessionEnd::Local("not joined".into()),
            Err(e) => return SessionEnd::Local(chain(&e)),
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
            Ok(s) => Arc::new(s),
            Err(e) => return SessionEnd::Local(e),
        };
        let tls_again = tls.clone();
        // A resumed handshake carries no certificate to refuse: the gateway checks the one the ticket holds after the
        // handshake and closes the connection if it is revoked, so a connection closed after a resumed handshake is
        // probed with a full one (below) before it counts as a network failure.
        let resumed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ch = match channel::connect_observed(
            &identity.gateway_url,
            tls,
            None,
            Some(resumed.clone()),
        )
        .await
        {
            Ok(c) => c,
            Err(e) if revoked_at_handshake(&e) => {
                return SessionEnd::Refused(REVOKED_AT_HANDSHAKE.into());
            }
            Err(_)
                if resumed.load(std::sync::atomic::Ordering::Relaxed)
                    && revoked_probe(&identity.gateway_url, tls_again.clone()).await =>
            {
                return SessionEnd::Refused(REVOKED_AT_HANDSHAKE.into());
            }
            Err(e) => return SessionEnd::Connect(chain(&e)),
        };
        let (tx, rx) = mpsc::channel::<v1::NodeMessage>(64);
        let tx = Outbound::new(tx);
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
        // This session's tunnels: each its own task, held here so that the session's end ends them too (a revoked
        // or superseded session must not keep serving tunnels on a connection that happens to stay up).
        let mut tunnels = SessionTunnels {
            ch: ch.clone(),
            tasks: tokio::task::JoinSet::new(),
        };
        let mut client = v1::session_service_client::SessionServiceClient::new(ch);
        let opened = channel::answered_within(
            "opening the session",
            channel::CALL_DEADLINE,
            client.session(tokio_stream::wrappers::ReceiverStream::new(rx)),
        );
        let mut inbound = match opened.await {
            Ok(r) => r.into_inner(),
            // With TLS 1.3 a refused client certificate surfaces as a closed connection at the first call; one more
            // handshake, read by hand, tells a revocation (stop) from a network failure (reconnect).
            Err(s) if is_transport(&s) && revoked_probe(&identity.gateway_url, tls_again).await => {
                return SessionEnd::Refused(REVOKED_AT_HANDSHAKE.into());
            }
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
        let renew = tokio::time::sleep(renewal_delay(
            &state,
            &identity,
            now_ms(),
            rand::random::<f64>(),
        ));
        tokio::pin!(renew);
        // Results of commands that finished while no session was open go out first; from here on command tasks'
        // messages are forwarded as they come.
        let outbox = self.commands.outbox();
        let mut outbox = outbox.lock().await;
        let mut instance_changes = self.instances.as_ref().map(|h| h.subscribe());
        loop {
            let retry_due = self.retry.as_ref().map(|r| r.due);
            tokio::select! {
                _ = tokio::time::sleep_until(retry_due.unwrap_or_else(tokio::time::Instant::now)), if retry_due.is_some() => {
                    if self.retry_desired(&tx, &state).await.is_err() {
                        return SessionEnd::Closed;
                    }
                }
                Some(out) = outbox.recv() => {
                    let (m, result_id) = match out {
                        crate::commands::Outgoing::Result(r) => {
                            self.commands.sent(&r);
                            let id = r.id.clone();
                            (v1::node_message::Msg::Result(r), Some(id))
                        }
                        crate::commands::Outgoing::Progress(p) => (v1::node_message::Msg::Progress(p), None),
                    };
                    if tx.send(msg(m)).await.is_err() {
                        return SessionEnd::Closed;
                    }
                    if let (Some(id), Some(hook)) = (result_id, &self.hook) {
                        // Delivered once the transport took it from the queue (HTTP/2 framed it), not merely queued.
                        let (tx, hook) = (tx.queue().clone(), hook.clone());
                        tokio::spawn(async move {
                            let drained = tokio::time::Instant::now() + Duration::from_secs(5);
                            while tx.capacity() < tx.max_capacity() && tokio::time::Instant::now() < drained && !tx.is_closed() {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            if !tx.is_closed() {
                                hook.delivered(&id);
                            }
                        });
                    }
                }
                changed = instances_changed(&mut instance_changes) => {
                    if !changed {
                        instance_changes = None;
                    } else if self.push_instances(&tx).await.is_err() {
                        return SessionEnd::Closed;
                    }
                }
                Some(_) = tunnels.tasks.join_next(), if !tunnels.tasks.is_empty() => {}
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
                                renew.as_mut().reset(tokio::time::Instant::now() + renewal_delay(&state, &identity, now_ms(), rand::random::<f64>()));
                            }
                            Err(e) => tracing::warn!(error = %e, "renewal answer refused"),
                        }
                        continue;
                    }
                    if let Some(every) = self.handle(m, &tx, &state, &signer, &mut tunnels).await {
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
        tx: &Outbound,
        state: &StateDir,
        signer: &Arc<EnvelopeSigner>,
        tunnels: &mut SessionTunnels,
    ) -> Option<Duration> {
        use v1::gateway_message::Msg;
        match m {
            Msg::Welcome(w) => {
                tracing::info!(epoch = w.session_epoch, "session open");
                bc_proto::runtime::service::status(&format!(
                    "session open (epoch {})",
                    w.session_epoch
                ));
                if let Some(offset) = crate::commands::clock_offset(w.clock_unix_ms, now_ms()) {
                    self.clock_offset_ms = offset;
                    if self.clock_offset_ms.unsigned_abs() > CLOCK_WARN_MS {
                        tracing::warn!(
                            offset_ms = self.clock_offset_ms,
                            "this node's clock differs from the gateway's by more than 5 s; command deadlines are \
                             read in the gateway's time, but fix the clock (NTP) for logs and certificates"
                        );
                    }
                }
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
                // Instance status goes only to a gateway that asks for it by name (an older one refuses unknown
                // sections); from then on it is pushed whenever it changes.
                if r.sections.iter().any(|s| s == crate::vmm::SECTION) && self.instances.is_some() {
                    self.instances_asked = true;
                    self.known.remove(crate::vmm::SECTION);
                    let _ = self.push_instances(tx).await;
                }
            }
            Msg::DesiredState(d) => {
                // A newer generation (or the same one again, on a new session) replaces any retry.
                self.retry = None;
                match self.apply_desired(state, &d) {
                    Ok(()) => {
                        tracing::info!(generation = d.generation, "desired state applied");
                        let _ = ack(tx, d.generation, None).await;
                    }
                    Err(reason) => {
                        let mut backoff = DESIRED_RETRY.start();
                        let wait = backoff.next_delay(rand::random::<f64>());
                        tracing::warn!(generation = d.generation, %reason, ?wait, "desired state failed; retrying");
                        let _ = ack(tx, d.generation, Some(&reason)).await;
                        self.retry = Some(DesiredRetry {
                            desired: d,
                            reason,
                            backoff,
                            due: tokio::time::Instant::now() + wait,
                        });
                    }
                }
            }
            Msg::Command(mut c) => {
                c.deadline_unix_ms =
                    crate::commands::local_deadline(c.deadline_unix_ms, self.clock_offset_ms);
                let ctx = crate::commands::CommandContext {
                    gpu: self.gpu.clone(),
                    hook: self.hook.clone(),
                    signer: signer.clone(),
                    progress_interval: self.progress_interval,
                };
                self.commands.start(c, ctx);
            }
            Msg::Renew(_) => tracing::debug!("renewal response ignored"),
            Msg::OpenTunnel(t) => {
                // Each tunnel is its own task and its own HTTP/2 stream: a slow one never holds up this loop.
                let allow = self.config.tunnels.clone();
                let ch = tunnels.ch.clone();
                let slots = self.tunnel_slots.clone();
                tunnels.tasks.spawn(async move {
                    let id = t.tunnel_id.clone();
                    let port = t.port;
                    let out = crate::tunnel::serve_limited(&slots, &allow, t, |rx| async move {
                        let mut client = v1::tunnel_service_client::TunnelServiceClient::new(ch);
                        client
                            .tunnel(tokio_stream::wrappers::ReceiverStream::new(rx))
                            .await
                            .map(|r| r.into_inner())
                    })
                    .await;
                    match out.refusal {
                        None => tracing::info!(
                            tunnel = id,
                            port,
                            up = out.up,
                            down = out.down,
                            "tunnel closed"
                        ),
                        Some(r) => {
                            tracing::info!(tunnel = id, port, up = out.up, down = out.down, code = ?r.code, reason = r.reason, "tunnel ended")
                        }
                    }
                });
            }
        }
        None
    }

    /// Tries the failed desired state again: acknowledges `applied` once it applies, a failure only when its
    /// reason changed, and otherwise waits longer (backoff with full jitter, capped at [`DESIRED_RETRY_CAP`]). Err
    /// when the session's outbound queue is closed.
    async fn retry_desired(&mut self, tx: &Outbound, state: &StateDir) -> Result<(), ()> {
        let Some(mut r) = self.retry.take() else {
            return Ok(());
        };
        match self.apply_desired(state, &r.desired) {
            Ok(()) => {
                tracing::info!(
                    generation = r.desired.generation,
                    "desired state applied on retry"
                );
                ack(tx, r.desired.generation, None).await
            }
            Err(reason) => {
                let wait = r.backoff.next_delay(rand::random::<f64>());
                tracing::warn!(generation = r.desired.generation, %reason, ?wait, "desired state still fails");
                let sent = if reason != r.reason {
                    ack(tx, r.desired.generation, Some(&reason)).await
                } else {
                    Ok(())
                };
                r.reason = reason;
                r.due = tokio::time::Instant::now() + wait;
                self.retry = Some(r);
                sent
            }
        }
    }

    /// Sends the `instances` section when the gateway has asked for it before and it changed since it was sent.
    /// Err when the session's outbound queue is closed.
    async fn push_instances(&mut self, tx: &Outbound) -> Result<(), ()> {
        let Some(host) = &self.instances else {
            return Ok(());
        };
        let section = crate::inventory::Section::new(crate::vmm::SECTION, &host.section());
        if !self.instances_asked || self.known.get(crate::vmm::SECTION) == Some(&section.hash) {
            return Ok(());
        }
        self.known.insert(section.name.clone(), section.hash);
        let out = v1::InventorySection {
            name: section.name,
            hash: section.hash.to_vec(),
            payload: section.payload,
        };
        tx.send(msg(v1::node_message::Msg::Inventory(out)))
            .await
            .map_err(|_| ())
    }

    fn sections(&self, names: &[String]) -> Vec<crate::inventory::Section> {
        crate::inventory::collect_sections(&self.config.hardware_root, self.gpu.as_deref(), names)
    }
}

/// When to renew the stored certificate: 50% ±10% of its life (`unit` in [0, 1) picks the point), counted from
/// when the node received it (the certificate's NotBefore is backdated), else from its NotBefore.
pub(crate) fn renewal_delay(
    state: &StateDir,
    identity: &crate::state::NodeIdentity,
    now_ms: i64,
    unit: f64,
) -> Duration {
    let start = if identity.issued_at_ms > 0 {
        identity.issued_at_ms
    } else {
        state
            .certificate()
            .ok()
            .and_then(|c| channel::cert_validity_ms(&c))
            .map(|(nb, _)| nb)
            .unwrap_or(now_ms)
    };
    channel::renewal_delay(start, identity.not_after_ms, now_ms, unit)
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

/// Waits for the instance status to change; false once it never can (no VMM, or its supervisor is gone).
async fn instances_changed(rx: &mut Option<tokio::sync::watch::Receiver<u64>>) -> bool {
    match rx {
        Some(rx) => rx.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Acknowledges desired generation `generation`: applied, or failed for `reason`.
async fn ack(tx: &Outbound, generation: u64, reason: Option<&str>) -> Result<(), ()> {
    let ack = v1::DesiredStateAck {
        generation,
        outcome: if reason.is_some() {
            "failed"
        } else {
            "applied"
        }
        .into(),
        message: reason.unwrap_or_default().to_string(),
    };
    tx.send(msg(v1::node_message::Msg::Ack(ack)))
        .await
        .map_err(|_| ())
}

/// A session's tunnels: the connection they open their streams on, and their tasks (aborted when the session ends
/// and this is dropped).
struct SessionTunnels {
    ch: tonic::transport::Channel,
    tasks: tokio::task::JoinSet<()>,
}

fn msg(m: v1::node_message::Msg) -> v1::NodeMessage {
    v1::NodeMessage { msg: Some(m) }
}

/// Permission errors mean an operator must act (revoked, unknown); the rest are worth a reconnect. A certificate
/// the gateway refused at the TLS handshake as revoked shows up (TLS 1.3) as a transport error of the first call.
fn end_of(s: tonic::Status) -> SessionEnd {
    match s.code() {
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
            SessionEnd::Refused(s.message().to_string())
        }
        _ if revoked_at_handshake(&s) => SessionEnd::Refused(
            "the gateway refused this node's certificate at the TLS handshake: the node is revoked"
                .into(),
        ),
        _ => SessionEnd::Status(format!("{:?}: {}", s.code(), chain(&s))),
    }
}

const REVOKED_AT_HANDSHAKE: &str =
    "the gateway refused this node's certificate at the TLS handshake: the node is revoked";

/// A failure of the transport rather than an answer of the gateway.
fn is_transport(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Cancelled | tonic::Code::Unavailable | tonic::Code::Unknown
    )
}

/// Whether the failure `s` of the first call on a fresh connection is the gateway refusing this certificate at the
/// TLS handshake as revoked (TLS 1.3 reports a refused client certificate only after the handshake, so the call
/// fails as a transport error; one more handshake, read by hand, tells a revocation from a network failure).
/// Used by the site agent (feature `site`).
#[cfg_attr(not(feature = "site"), allow(dead_code))]
pub(crate) async fn refused_as_revoked(
    s: &tonic::Status,
    url: &str,
    tls: Arc<rustls::ClientConfig>,
) -> bool {
    revoked_at_handshake(s) || (is_transport(s) && revoked_probe(url, tls).await)
}

/// Whether a failed connection attempt (`e`) was the gateway refusing this certificate at the TLS handshake as
/// revoked: the alert in the error's chain, or else in the answer to one more handshake read by hand.
#[cfg_attr(not(feature = "site"), allow(dead_code))]
pub(crate) fn connect_refused_as_revoked<'a>(
    e: &(dyn std::error::Error + 'static),
    url: &'a str,
    tls: Arc<rustls::ClientConfig>,
) -> impl Future<Output = bool> + Send + 'a {
    let alert = revoked_at_handshake(e);
    async move { alert || revoked_probe(url, tls).await }
}

/// Whether a fresh TLS connection to the gateway is answered with the `certificate_revoked` alert: the handshake,
/// the HTTP/2 preface, then the first bytes the gateway sends (its SETTINGS, or the alert). Bounded by 10 s. Never
/// resumed: a resumed handshake carries no certificate to refuse (the gateway closes a resumed connection whose
/// certificate is revoked without an alert), so the probe is a full one.
async fn revoked_probe(url: &str, tls: Arc<rustls::ClientConfig>) -> bool {
    let mut full = (*tls).clone();
    full.resumption = rustls::client::Resumption::disabled();
    let tls = Arc::new(full);
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok((host, port)) = channel::parse_gateway_url(url) else {
        return false;
    };
    let Ok(name) = rustls::pki_types::ServerName::try_from(host.clone()) else {
        return false;
    };
    let probe = async move {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
        let mut stream = tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await?;
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await?;
        let mut buf = [0u8; 16];
        stream.read(&mut buf).await.map(|_| ())
    };
    match tokio::time::timeout(Duration::from_secs(10), probe).await {
        Ok(Err(e)) => revoked_at_handshake(&e),
        _ => false,
    }
}

/// Whether an error's chain holds the TLS alert `certificate_revoked`.
pub(crate) fn revoked_at_handshake(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(tls) = c.downcast_ref::<rustls::Error>() {
            return matches!(
                tls,
                rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRevoked)
            );
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(tls) = inner.downcast_ref::<rustls::Error>()
        {
            return matches!(
                tls,
                rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRevoked)
            );
        }
        cur = c.source();
    }
    false
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
        let instances = crate::vmm::spec::parse(&spec).map_err(|e| e.to_string())?;
        crate::cdi::apply(&self.config.cdi_dir, cdi.as_ref()).map_err(|e| chain(&e))?;
        self.apply_instances(d.generation, instances)?;
        let doc = serde_json::json!({"generation": d.generation, "spec": spec});
        state
            .write_file("desired.json", doc.to_string().as_bytes(), 0o600)
            .map_err(|e| e.to_string())
    }
}

impl Daemon {
    /// Hands the desired instances to the VMM (VM work happens afterwards and shows in the `instances` section).
    fn apply_instances(
        &self,
        generation: u64,
        instances: Vec<crate::vmm::InstanceSpec>,
    ) -> Result<(), String> {
        let Some(host) = &self.instances else {
            if instances.is_empty() {
                return Ok(());
            }
            return Err(format!(
                "the desired state lists {} instance(s) but this node runs no VMM: add a [vmm] table to bcd.toml \
                 (docs/instances.md) or place instances on a vps-host pool's nodes",
                instances.len()
            ));
        };
        let gpus: Vec<crate::vmm::LocalGpu> =
            match (&self.gpu, instances.iter().any(|i| !i.gpus.is_empty())) {
                (Some(g), true) => g
                    .gpus()
                    .map_err(|e| format!("listing GPUs for the instances: {e}"))?
                    .into_iter()
                    .map(|g| crate::vmm::LocalGpu {
                        uuid: g.uuid,
                        pci_bus_id: g.pci_bus_id,
                    })
                    .collect(),
                _ => Vec::new(),
            };
        host.apply(generation, instances, &gpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::NodeIdentity;

    const DAY_MS: i64 = 24 * 3600 * 1000;

    /// A gateway that takes nothing (the queue full, nothing reading it) fails the session's next send at the
    /// deadline, so the loop ends the session and reconnects; before, the send waited for ever and with it every
    /// heartbeat, renewal and acknowledgement. A queue with room is unaffected.
    #[tokio::test(start_paused = true)]
    async fn a_gateway_that_takes_nothing_fails_the_send_at_the_deadline() {
        let (tx, mut rx) = mpsc::channel(1);
        let out = Outbound::new(tx);
        let beat = |seq| msg(v1::node_message::Msg::Heartbeat(v1::Heartbeat { seq }));
        assert_eq!(out.send(beat(1)).await, Ok(()), "room for one");
        let t = tokio::time::Instant::now();
        assert_eq!(out.send(beat(2)).await, Err(()), "nothing taken");
        assert_eq!(t.elapsed(), SEND_DEADLINE);
        assert!(rx.recv().await.is_some());
        assert_eq!(
            out.send(beat(3)).await,
            Ok(()),
            "room again once the gateway reads"
        );
    }

    fn identity(issued_at_ms: i64, life_ms: i64) -> NodeIdentity {
        NodeIdentity {
            node_id: "n".into(),
            spiffe_id: "spiffe://test.bc/node/n".into(),
            pool: "default".into(),
            gateway_url: "https://127.0.0.1:1".into(),
            not_after_ms: issued_at_ms + life_ms,
            issued_at_ms,
        }
    }

    /// Under paused time: the renewal timer the session arms fires at 50% ±10% of the certificate's life (the
    /// spread covers the whole band), and what it sends is a CSR from the node's own key.
    #[tokio::test(start_paused = true)]
    async fn renewal_fires_at_half_life_give_or_take_a_tenth_with_a_csr_from_the_node_key()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let state = StateDir::open(dir.path())?;
        let key = state.load_or_create_key()?;
        let issued = 1_800_000_000_000;
        let id = identity(issued, DAY_MS);
        let (mut earliest, mut latest) = (f64::MAX, 0f64);
        for i in 0..200 {
            let unit = f64::from(i) / 200.0;
            let start = tokio::time::Instant::now();
            tokio::time::sleep(renewal_delay(&state, &id, issued, unit)).await;
            let fraction = start.elapsed().as_millis() as f64 / DAY_MS as f64;
            assert!(
                (0.4..=0.6).contains(&fraction),
                "renewal at {fraction} of the life"
            );
            earliest = earliest.min(fraction);
            latest = latest.max(fraction);
        }
        assert!(
            earliest < 0.41 && latest > 0.59,
            "spread {earliest}..{latest}"
        );
        // Received 10 h ago with a 24 h life: due in 2–4.4 h, never in the past.
        let late = renewal_delay(&state, &id, issued + 10 * 3600 * 1000, 0.5);
        assert_eq!(late, Duration::from_secs(2 * 3600));
        assert_eq!(
            renewal_delay(&state, &id, issued + DAY_MS, 0.5),
            Duration::ZERO,
            "overdue renews at once"
        );
        let request = renewal_request(&state)?;
        let csr = rcgen::CertificateSigningRequestParams::from_der(
            &rustls::pki_types::CertificateSigningRequestDer::from(request.csr_der),
        )?;
        assert_eq!(
            rcgen::PublicKeyData::der_bytes(&csr.public_key),
            key.public_key_raw(),
            "the renewal CSR must be signed by (and certify) the node key"
        );
        Ok(())
    }

    #[test]
    fn a_revoked_alert_anywhere_in_the_chain_is_recognised() {
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRevoked);
        let io = std::io::Error::other(alert);
        assert!(revoked_at_handshake(&io));
        let other = std::io::Error::other(rustls::Error::AlertReceived(
            rustls::AlertDescription::HandshakeFailure,
        ));
        assert!(!revoked_at_handshake(&other));
        assert!(!revoked_at_handshake(&std::io::Error::other(
            "CertificateRevoked"
        )));
    }
}
