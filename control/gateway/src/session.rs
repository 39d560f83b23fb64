//! The Session stream: one per daemon, on the daemon's single HTTP/2 mTLS connection.
//!
//! The peer's certificate was verified against the control-plane CA at the handshake; here the SPIFFE ID must name
//! a node of our trust domain and equal `Hello.node_id`. Opening a session bumps the node's epoch in the store
//! (through [`SessionBackend`]); a newer session closes the older one, and every write carries its epoch so a stale
//! session's writes are refused by the store. Liveness stays in memory and reaches the store in one statement per
//! interval, whatever the number of sessions.

use crate::tls::Revocations;
use crate::{BoxFuture, STORE_DEADLINE, stored};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::v1;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt as _};
use tonic::{Request, Response, Status, Streaming};

/// A live session's identity for the store: writes are accepted only for the node's current epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRef {
    pub node_id: String,
    pub epoch: u64,
}

/// What the control plane answers to a Hello.
#[derive(Debug, Clone, Default)]
pub struct SessionGrant {
    pub epoch: u64,
    /// Inventory sections to request now (those whose stored hash differs from what the node says it sent).
    pub want_sections: Vec<String>,
}

/// Last-seen time of a session, for the batched liveness write.
#[derive(Debug, Clone)]
pub struct Seen {
    pub session: SessionRef,
    pub at_ms: i64,
}

/// The store side of sessions, implemented by the control plane.
pub trait SessionBackend: Send + Sync + 'static {
    /// Refuses unknown and revoked nodes, and a `public_key` (the uncompressed point the session's certificate
    /// certifies) other than the node's current key (one a reclaim superseded); bumps and returns the node's
    /// session epoch. The key is compared in the statement that bumps the epoch: no read of its own per connect.
    fn open(
        &self,
        node_id: &str,
        public_key: &[u8],
        hello: &v1::Hello,
    ) -> BoxFuture<'_, Result<SessionGrant, Status>>;
    fn inventory(
        &self,
        s: &SessionRef,
        section: v1::InventorySection,
    ) -> BoxFuture<'_, Result<(), Status>>;
    fn ack(&self, s: &SessionRef, ack: v1::DesiredStateAck) -> BoxFuture<'_, Result<(), Status>>;
    fn result(
        &self,
        s: &SessionRef,
        result: v1::CommandResult,
    ) -> BoxFuture<'_, Result<(), Status>>;
    /// The latest progress of a running command of this node (advisory; the backend keeps only the latest).
    fn progress(
        &self,
        s: &SessionRef,
        progress: v1::CommandProgress,
    ) -> BoxFuture<'_, Result<(), Status>>;
    /// Renewal by proof of possession: `csr_der` must be signed by the key the session's certificate certifies
    /// (`session_key`, the uncompressed public point the node proved in the TLS handshake).
    fn renew(
        &self,
        s: &SessionRef,
        csr_der: Vec<u8>,
        session_key: Vec<u8>,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>>;
    /// The session ended (only acts if `s` is still the node's current epoch), last heard from at `s.at_ms`.
    fn closed(&self, s: &Seen) -> BoxFuture<'_, ()>;
    /// One statement for all live sessions; returns node ids whose sessions must close (revoked, superseded by a
    /// session on another gateway, or closed by the control plane, which took the node offline).
    fn liveness(&self, seen: &[Seen]) -> BoxFuture<'_, Result<Vec<String>, Status>>;
    /// Messages waiting for these sessions (commands, new desired state): one statement per call.
    fn pending(
        &self,
        sessions: &[SessionRef],
    ) -> BoxFuture<'_, Result<Vec<(String, v1::GatewayMessage)>, Status>>;
    /// Identities and keys revoked since the watermark `since` (all of them when None), and the watermark for the
    /// next call. One statement.
    fn revoked_since(&self, since: Option<i64>) -> BoxFuture<'_, Result<RevokedSince, Status>>;
}

/// What [`SessionBackend::revoked_since`] read.
#[derive(Debug, Clone, Default)]
pub struct RevokedSince {
    pub identities: Vec<SpiffeId>,
    /// SHA-256 of the SubjectPublicKeyInfo of node keys a reclaim superseded: every certificate of such a key.
    pub keys: Vec<[u8; 32]>,
    pub watermark_ms: i64,
}

/// A message queued for a node's session. Boxed: a tokio channel allocates its first block of 32 slots with the
/// channel, so the slot's size is paid by every idle session (boxing saved 2.9 KiB of RSS per idle session in
/// `scripts/bench sessions`).
pub(crate) type Outbound = Result<Box<v1::GatewayMessage>, Status>;

pub(crate) struct Entry {
    pub(crate) epoch: u64,
    pub(crate) last_seen_ms: Arc<AtomicI64>,
    pub(crate) tx: mpsc::Sender<Outbound>,
    /// The status the session ends with, when something other than the node ends it.
    pub(crate) close: watch::Sender<Option<Status>>,
}

/// The sessions this gateway holds.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<HashMap<String, Entry>>>,
    opened: Arc<AtomicU64>,
    /// Store calls made by housekeeping: one statement each.
    liveness_writes: Arc<AtomicU64>,
    pending_pulls: Arc<AtomicU64>,
    /// Identities refused at the handshake (shared with the TLS verifier).
    revocations: Revocations,
    /// Reads of revocations made elsewhere (one statement each).
    revocation_reads: Arc<AtomicU64>,
    /// Wakes the pull of waiting messages before its tick (something was queued for a node).
    pending_poke: Arc<tokio::sync::Notify>,
}

/// Counters an operator (or a benchmark) reads through the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionStats {
    pub sessions: usize,
    pub opened: u64,
    /// Batched liveness writes (one statement each, whatever the number of sessions).
    pub liveness_writes: u64,
    /// Pulls of waiting commands and desired state (one statement each).
    pub pending_pulls: u64,
    /// Reads of revocations made elsewhere (one statement each).
    pub revocation_reads: u64,
    /// Identities in the handshake's revocation set.
    pub revoked: usize,
}

impl Registry {
    pub fn len(&self) -> usize {
        self.inner.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> SessionStats {
        SessionStats {
            sessions: self.len(),
            opened: self.opened(),
            liveness_writes: self.liveness_writes.load(Ordering::Relaxed),
            pending_pulls: self.pending_pulls.load(Ordering::Relaxed),
            revocation_reads: self.revocation_reads.load(Ordering::Relaxed),
            revoked: self.revocations.len(),
        }
    }

    /// Asks for a pull before the next tick when this gateway holds a session of any of `nodes` (the outbox
    /// sink's notification). Returns whether it held one.
    pub fn poke<'a>(&self, nodes: impl IntoIterator<Item = &'a str>) -> bool {
        let held = self
            .inner
            .lock()
            .map(|m| nodes.into_iter().any(|n| m.contains_key(n)))
            .unwrap_or(false);
        if held {
            self.pending_poke.notify_one();
        }
        held
    }

    /// Total sessions opened since start.
    pub fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    pub(crate) fn insert(&self, node_id: &str, entry: Entry) {
        if let Ok(mut m) = self.inner.lock()
            && let Some(old) = m.insert(node_id.to_string(), entry)
        {
            let _ = old.close.send(Some(Status::aborted(
                "superseded by a newer session of the same node",
            )));
        }
        self.opened.fetch_add(1, Ordering::Relaxed);
    }

    fn remove(&self, s: &SessionRef) {
        if let Ok(mut m) = self.inner.lock()
            && m.get(&s.node_id).is_some_and(|e| e.epoch == s.epoch)
        {
            m.remove(&s.node_id);
        }
    }

    /// When the gateway last heard from `node_id`'s session (milliseconds since the epoch); None without a session.
    pub fn last_seen_ms(&self, node_id: &str) -> Option<i64> {
        let m = self.inner.lock().ok()?;
        m.get(node_id)
            .map(|e| e.last_seen_ms.load(Ordering::Relaxed))
    }

    /// Whether this gateway holds `node_id`'s session of `epoch`.
    pub fn holds(&self, node_id: &str, epoch: u64) -> bool {
        self.inner
            .lock()
            .is_ok_and(|m| m.get(node_id).is_some_and(|e| e.epoch == epoch))
    }

    /// Closes a node's session with a reason (the node reconnects).
    pub fn close(&self, node_id: &str, reason: &str) {
        self.close_with(node_id, Status::aborted(reason));
    }

    /// Closes `s` if it is still the node's session here: a newer session of the node (it reconnected meanwhile)
    /// is left alone.
    fn close_session(&self, s: &SessionRef, reason: &str) {
        if let Ok(m) = self.inner.lock()
            && let Some(e) = m.get(&s.node_id)
            && e.epoch == s.epoch
        {
            let _ = e.close.send(Some(Status::aborted(reason)));
        }
    }

    fn close_with(&self, node_id: &str, status: Status) {
        if let Ok(m) = self.inner.lock()
            && let Some(e) = m.get(node_id)
        {
            let _ = e.close.send(Some(status));
        }
    }

    /// Closes every session (gateway shutdown).
    /// A session already told to close is left as it was told: a revoked node's PERMISSION_DENIED is not turned into
    /// ABORTED, and a stopping gateway, which calls this every 20 ms until its sessions are gone, does not make a new
    /// `Status` for each of them every round under the registry's lock, which the sessions take to leave (4.0–4.3 ms
    /// a round with 10,000 sessions, release build on an idle machine; 0.1 ms after the first round now).
    pub fn close_all(&self, reason: &str) {
        if let Ok(m) = self.inner.lock() {
            for e in m.values() {
                if e.close.borrow().is_none() {
                    let _ = e.close.send(Some(Status::aborted(reason)));
                }
            }
        }
    }

    /// Something was queued for a node (a command, new desired state): pull now rather than on the next tick.
    /// Pokes that arrive while a pull runs are merged into one more pull.
    pub fn poke_pending(&self) {
        self.pending_poke.notify_one();
    }

    /// The revocation set this gateway's TLS verifier consults.
    pub fn revocations(&self) -> Revocations {
        self.revocations.clone()
    }

    /// Refuses `ids` from the next handshake on and closes their live sessions with PERMISSION_DENIED (the node
    /// stops instead of reconnecting). Returns the identities that were not revoked before.
    pub fn revoke(&self, ids: impl IntoIterator<Item = SpiffeId>) -> Vec<SpiffeId> {
        let new = self.revocations.extend(ids);
        for id in &new {
            if id.role() == Role::Node {
                self.close_with(
                    id.id(),
                    Status::permission_denied(format!("{id} is revoked")),
                );
            }
        }
        if !new.is_empty() {
            tracing::info!(
                count = new.len(),
                total = self.revocations.len(),
                "identities revoked at the gateway"
            );
        }
        new
    }

    fn snapshot(&self) -> Vec<Seen> {
        self.inner
            .lock()
            .map(|m| {
                m.iter()
                    .map(|(id, e)| Seen {
                        session: SessionRef {
                            node_id: id.clone(),
                            epoch: e.epoch,
                        },
                        at_ms: e.last_seen_ms.load(Ordering::Relaxed),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    pub(crate) fn sender(&self, node_id: &str) -> Option<mpsc::Sender<Outbound>> {
        self.inner
            .lock()
            .ok()
            .and_then(|m| m.get(node_id).map(|e| e.tx.clone()))
    }

    /// The node's current session: its queue, and a watch that changes or closes when that session ends (closed,
    /// superseded, revoked, or gone: its entry dropped).
    pub(crate) fn session_of(&self, node_id: &str) -> Option<(mpsc::Sender<Outbound>, SessionEnd)> {
        self.inner.lock().ok().and_then(|m| {
            m.get(node_id)
                .map(|e| (e.tx.clone(), SessionEnd(e.close.subscribe())))
        })
    }
}

/// Resolves when one session ends, whichever way: its close is asked for (a reason is set) or its registry entry is
/// dropped (the node ended it, it went silent, a newer session replaced it).
#[derive(Clone)]
pub(crate) struct SessionEnd(watch::Receiver<Option<Status>>);

impl SessionEnd {
    /// Waits for the end; at once if it has ended. Cancel-safe.
    pub(crate) async fn ended(&mut self) {
        if self.0.borrow().is_some() {
            return;
        }
        let _ = self.0.changed().await;
    }
}

/// Timing of sessions.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub trust_domain: String,
    pub heartbeat: Duration,
    /// How often liveness is written (one statement per interval).
    pub liveness_interval: Duration,
    /// How often waiting commands and desired state are pulled for live sessions when nothing pokes the gateway
    /// ([`Registry::poke_pending`]): the fallback for a lost notification.
    pub pending_interval: Duration,
    /// A session silent for this long is closed.
    pub idle_timeout: Duration,
    /// How often revocations made elsewhere (another control-plane process) are read into the handshake's set.
    /// Revocations through this process's API apply at once.
    pub revocation_interval: Duration,
}

impl SessionConfig {
    pub fn new(trust_domain: &str) -> SessionConfig {
        SessionConfig {
            trust_domain: trust_domain.to_string(),
            heartbeat: Duration::from_secs(15),
            liveness_interval: Duration::from_secs(5),
            pending_interval: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            revocation_interval: Duration::from_secs(10),
        }
    }
}

pub(crate) struct SessionSvc {
    pub backend: Arc<dyn SessionBackend>,
    pub registry: Registry,
    pub config: SessionConfig,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The node identity of a verified peer certificate, or why it is not one.
pub fn node_identity(
    certs: Option<&[rustls::pki_types::CertificateDer<'static>]>,
    trust_domain: &str,
) -> Result<SpiffeId, Status> {
    let leaf = certs
        .and_then(|c| c.first())
        .ok_or_else(|| Status::unauthenticated("Session needs a client certificate: join first"))?;
    let id = SpiffeId::from_cert_der(leaf)
        .map_err(|e| Status::unauthenticated(format!("client certificate: {e}")))?;
    if id.trust_domain() != trust_domain {
        return Err(Status::permission_denied(format!(
            "{id} is not of trust domain {trust_domain}"
        )));
    }
    if id.role() != Role::Node {
        return Err(Status::permission_denied(format!(
            "{id} is a {} identity; the node endpoint takes node identities only",
            id.role().as_str()
        )));
    }
    Ok(id)
}

type GatewayStream = Pin<Box<dyn Stream<Item = Result<v1::GatewayMessage, Status>> + Send>>;

#[tonic::async_trait]
impl v1::session_service_server::SessionService for SessionSvc {
    async fn session(
        &self,
        request: Request<Streaming<v1::NodeMessage>>,
    ) -> Result<Response<GatewayStream>, Status> {
        let peer = request.remote_addr();
        let certs = request.peer_certs();
        let id = node_identity(
            certs.as_deref().map(|v| v.as_slice()),
            &self.config.trust_domain,
        )
        .inspect_err(|s| {
            tracing::warn!(?peer, reason = s.message(), "session refused");
        })?;
        if self.registry.revocations.is_revoked(&id) {
            tracing::warn!(?peer, %id, "session refused: identity revoked");
            return Err(Status::permission_denied(format!("{id} is revoked")));
        }
        let session_key = certs
            .as_deref()
            .and_then(|c| c.first())
            .and_then(|leaf| bc_proto::envelope::cert_public_point(leaf).ok())
            .ok_or_else(|| {
                Status::unauthenticated("the client certificate's public key cannot be read")
            })?;
        let mut inbound = request.into_inner();
        let hello = match tokio::time::timeout(Duration::from_secs(10), inbound.message()).await {
            Ok(Ok(Some(v1::NodeMessage {
                msg: Some(v1::node_message::Msg::Hello(h)),
            }))) => h,
            Ok(Ok(_)) => {
                return Err(Status::invalid_argument(
                    "the first message of a session must be Hello",
                ));
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Status::deadline_exceeded("no Hello within 10 s")),
        };
        if hello.node_id != id.id() {
            tracing::warn!(?peer, %id, hello = hello.node_id, "session refused: SPIFFE ID differs from Hello.node_id");
            return Err(Status::permission_denied(format!(
                "certificate identity {id} does not match Hello.node_id {:?}",
                hello.node_id
            )));
        }
        // Last seen: when the Hello arrived. The open stores the database's own time, which is not earlier on one
        // clock, and the batched liveness only moves last-seen forward, so a session opened does not cost its row a
        // second write at the next liveness tick (50,000 of them in a reconnect storm of 50,000 nodes).
        let hello_at = now_ms();
        let grant = stored(
            "opening the session",
            self.backend.open(id.id(), &session_key, &hello),
        )
        .await
        .inspect_err(|s| {
            tracing::warn!(
                ?peer,
                node_id = id.id(),
                reason = s.message(),
                "session refused"
            );
        })?;
        let session = SessionRef {
            node_id: id.id().to_string(),
            epoch: grant.epoch,
        };
        let (tx, rx) = mpsc::channel(64);
        let (close_tx, close_rx) = watch::channel(None);
        let last_seen = Arc::new(AtomicI64::new(hello_at));
        self.registry.insert(
            &session.node_id,
            Entry {
                epoch: grant.epoch,
                last_seen_ms: last_seen.clone(),
                tx: tx.clone(),
                close: close_tx,
            },
        );
        tracing::info!(
            node_id = session.node_id,
            epoch = session.epoch,
            agent = hello.agent_version,
            "session opened"
        );
        let welcome = v1::GatewayMessage {
            msg: Some(v1::gateway_message::Msg::Welcome(v1::Welcome {
                session_epoch: grant.epoch,
                heartbeat_interval_ms: u32::try_from(self.config.heartbeat.as_millis())
                    .unwrap_or(u32::MAX),
                clock_unix_ms: now_ms(),
            })),
        };
        queue_within(&tx, Ok(Box::new(welcome)), self.config.idle_timeout).await;
        if !grant.want_sections.is_empty() {
            let req = v1::GatewayMessage {
                msg: Some(v1::gateway_message::Msg::InventoryRequest(
                    v1::InventoryRequest {
                        sections: grant.want_sections.clone(),
                    },
                )),
            };
            queue_within(&tx, Ok(Box::new(req)), self.config.idle_timeout).await;
        }
        tokio::spawn(drive(
            self.backend.clone(),
            self.registry.clone(),
            session,
            session_key,
            inbound,
            tx,
            close_rx,
            last_seen,
            self.config.idle_timeout,
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx).map(|m| m.map(|b| *b)),
        )))
    }
}

/// How long an ending session waits to queue its last status for a node that is not reading its stream.
const CLOSE_QUEUE_WITHIN: Duration = Duration::from_secs(5);

/// Queues `m` on a session's outbound stream, waiting at most `within` for room: false when the node made none (it
/// stopped reading, and its stream and this queue are full). A session's task never waits on its node without a
/// deadline: blocked there it would no longer see the idle timeout, a supersede or a revoke, and its task, queue
/// and stream would stay for good.
async fn queue_within(tx: &mpsc::Sender<Outbound>, m: Outbound, within: Duration) -> bool {
    matches!(tokio::time::timeout(within, tx.send(m)).await, Ok(Ok(())))
}

/// Reads one session's inbound messages until it ends, is superseded, is closed, or goes idle.
#[allow(clippy::too_many_arguments)]
async fn drive(
    backend: Arc<dyn SessionBackend>,
    registry: Registry,
    session: SessionRef,
    session_key: Vec<u8>,
    mut inbound: Streaming<v1::NodeMessage>,
    tx: mpsc::Sender<Outbound>,
    mut close: watch::Receiver<Option<Status>>,
    last_seen: Arc<AtomicI64>,
    idle: Duration,
) {
    use v1::node_message::Msg;
    let reason = loop {
        let next = tokio::select! {
            m = tokio::time::timeout(idle, inbound.message()) => m,
            _ = close.changed() => {
                let status = close.borrow().clone().unwrap_or_else(|| Status::aborted("closed"));
                let why = status.message().to_string();
                queue_within(&tx, Err(status), CLOSE_QUEUE_WITHIN).await;
                break why;
            }
        };
        let msg = match next {
            Err(_) => break format!("silent for {} s", idle.as_secs()),
            Ok(Err(e)) => break format!("stream error: {}", e.message()),
            Ok(Ok(None)) => break "node closed the stream".into(),
            Ok(Ok(Some(m))) => m,
        };
        last_seen.store(now_ms(), Ordering::Relaxed);
        // A report the node will not send again in this session: if the store cannot take it, the session ends
        // (below) so that the node sends it again in the next one.
        let must_land = matches!(
            msg.msg,
            Some(Msg::Inventory(_) | Msg::Ack(_) | Msg::Result(_))
        );
        let result = match msg.msg {
            Some(Msg::Renew(r)) => {
                let renewed = backend.renew(&session, r.csr_der, session_key.clone());
                match stored("renewing the certificate", renewed).await {
                    Ok(resp) => {
                        let m = v1::GatewayMessage {
                            msg: Some(v1::gateway_message::Msg::Renew(resp)),
                        };
                        if !queue_within(&tx, Ok(Box::new(m)), idle).await {
                            break format!("did not read its stream for {} s", idle.as_secs());
                        }
                    }
                    Err(s) => {
                        let reason = s.message();
                        tracing::warn!(node_id = session.node_id, reason, "renewal refused");
                    }
                }
                Ok(())
            }
            other => store_message(backend.as_ref(), &session, other).await,
        };
        if let Err(s) = result {
            if s.code() == tonic::Code::Aborted {
                // The store refused a write of a stale epoch: this session is superseded.
                queue_within(&tx, Err(s.clone()), CLOSE_QUEUE_WITHIN).await;
                break s.message().to_string();
            }
            if must_land && s.code() == tonic::Code::Unavailable {
                // Dropping it would leave its command `sent` (or its generation unacknowledged) for good: the
                // node counts it delivered. A new session replays it (results sent within the resend window,
                // commands of an older epoch delivered again, desired state and inventory sent at Hello).
                let why = format!(
                    "the control plane could not record this message ({}); reconnect and send it again",
                    s.message()
                );
                queue_within(
                    &tx,
                    Err(Status::unavailable(why.clone())),
                    CLOSE_QUEUE_WITHIN,
                )
                .await;
                break why;
            }
            tracing::info!(
                node_id = session.node_id,
                error = s.message(),
                "node message refused"
            );
        }
    };
    // Record the close before leaving the registry: a shutdown waits for the registry to empty.
    let ended = Seen {
        session: session.clone(),
        at_ms: last_seen.load(Ordering::Relaxed),
    };
    if tokio::time::timeout(STORE_DEADLINE, backend.closed(&ended))
        .await
        .is_err()
    {
        tracing::warn!(
            node_id = session.node_id,
            "the database did not record the session's close in time"
        );
    }
    registry.remove(&session);
    tracing::info!(
        node_id = session.node_id,
        epoch = session.epoch,
        reason,
        "session closed"
    );
}

/// Stores one message of a session other than a renewal (a heartbeat stores nothing here: liveness is batched).
async fn store_message(
    backend: &dyn SessionBackend,
    session: &SessionRef,
    msg: Option<v1::node_message::Msg>,
) -> Result<(), Status> {
    use v1::node_message::Msg;
    match msg {
        Some(Msg::Heartbeat(_)) => Ok(()),
        Some(Msg::Inventory(section)) => {
            stored("storing inventory", backend.inventory(session, section)).await
        }
        Some(Msg::Ack(ack)) => {
            stored("storing an acknowledgement", backend.ack(session, ack)).await
        }
        Some(Msg::Result(r)) => {
            stored("storing a command result", backend.result(session, r)).await
        }
        Some(Msg::Progress(p)) => stored("storing progress", backend.progress(session, p)).await,
        Some(Msg::Hello(_)) => Err(Status::invalid_argument(
            "Hello may only be the first message",
        )),
        Some(Msg::Renew(_)) => Err(Status::internal(
            "a renewal is answered by the session's task",
        )),
        None => Err(Status::invalid_argument("empty NodeMessage")),
    }
}

#[path = "session_housekeeping.rs"]
mod housekeeping;
#[cfg(test)]
use housekeeping::close_judged;
pub(crate) use housekeeping::{housekeeping, refresh_revocations};

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
