//! The gateway's side of tunnels (DESIGN.md, "Tunnels"): [`Tunnels::open`] asks a node this gateway holds a
//! session of to dial one of its local ports, and `TunnelService.Tunnel` (served here, node identities only)
//! receives the stream the node opens for it.
//!
//! - `OpenTunnel` goes on the node's Session through its bounded outbound queue with `try_send`: a full queue
//!   refuses the tunnel (the session keeps its capacity, it never waits for a tunnel).
//! - Each open is pending until the node opens its stream, for the dial deadline plus a margin; past it the opener
//!   gets [`OpenError::DialTimeout`]. A stream whose first frame is not `open` naming a tunnel this gateway issued
//!   *to that node* and still pending is answered `close{PROTOCOL}` and dropped.
//! - Tunnels per node are capped (pending and open together); HTTP/2 windows are set explicitly by [`Windows`] so
//!   that the connection window covers every tunnel of a node at its full stream window plus the Session's share:
//!   a stalled tunnel reader fills only its own stream window and never the connection's.
//! - Bytes are counted per tunnel ([`Tunnel::bytes`]) and for the gateway ([`TunnelStats`]).

use crate::session::{Registry, SessionEnd, node_identity};
use bc_proto::v1;
use bc_proto::v1::tunnel_frame::Frame;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// Frames queued toward the node per tunnel (each at most 64 KiB): what the gateway holds beyond HTTP/2's window.
const TO_NODE_QUEUE: usize = 8;
/// How long a node's tunnel stream may take to send its first frame.
const FIRST_FRAME_DEADLINE: Duration = Duration::from_secs(10);

/// HTTP/2 flow-control windows, set on both ends (the gateway's server, bcd's channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// Per stream: one tunnel's bytes in flight. 8 MiB covers 1 Gbit/s × 50 ms (6.25 MB) with room.
    pub stream: u32,
    /// Per connection: every tunnel of a node at its full window, plus as much again for the Session and the rest.
    pub connection: u32,
}

impl Windows {
    /// Windows for `per_node` tunnels of `stream` bytes each (the connection window is capped at HTTP/2's 2^31-1).
    pub fn for_tunnels(stream: u32, per_node: usize) -> Windows {
        let connection = u64::from(stream) * (per_node as u64 + 1);
        Windows {
            stream,
            connection: connection.min(u64::from(i32::MAX as u32)) as u32,
        }
    }
}

/// Limits on tunnels at this gateway.
#[derive(Debug, Clone)]
pub struct TunnelLimits {
    /// Tunnels of one node, pending and open (beyond it, [`OpenError::NodeFull`]). bcd caps its own too.
    pub per_node: usize,
    /// Dial deadline sent to the node; the open waits this plus [`TunnelLimits::open_margin`].
    pub dial_timeout: Duration,
    pub open_margin: Duration,
    pub windows: Windows,
}

impl Default for TunnelLimits {
    fn default() -> TunnelLimits {
        TunnelLimits {
            per_node: bc_proto::tunnel::MAX_PER_NODE as usize,
            dial_timeout: Duration::from_secs(5),
            open_margin: Duration::from_secs(5),
            windows: Windows::for_tunnels(
                bc_proto::tunnel::STREAM_WINDOW,
                bc_proto::tunnel::MAX_PER_NODE as usize,
            ),
        }
    }
}

/// Why a tunnel could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("node {0} has no session on this gateway")]
    NotConnected(String),
    #[error("node {0}'s session queue is full; retry in a moment")]
    SessionBusy(String),
    #[error("node {node} already has {cap} tunnels through this gateway; close one, then retry")]
    NodeFull { node: String, cap: usize },
    #[error(
        "node {node} did not open tunnel {tunnel} within {ms} ms; check that bcd runs and is connected"
    )]
    DialTimeout {
        node: String,
        tunnel: String,
        ms: u128,
    },
    #[error("the gateway is shutting down")]
    Closed,
}

/// Counters of this gateway's tunnels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TunnelStats {
    /// OpenTunnel messages sent to nodes.
    pub opens_sent: u64,
    /// Tunnel streams nodes opened and this gateway matched.
    pub opened: u64,
    /// Tunnel streams refused (no pending open of that node).
    pub refused_streams: u64,
    pub open_now: u64,
    /// Data bytes from nodes, and to nodes.
    pub bytes_from_nodes: u64,
    pub bytes_to_nodes: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    opens_sent: AtomicU64,
    opened: AtomicU64,
    refused_streams: AtomicU64,
    open_now: AtomicU64,
    from_nodes: AtomicU64,
    to_nodes: AtomicU64,
}

/// The node's end of a matched tunnel, handed from the service to the opener.
struct NodeEnd {
    inbound: Streaming<v1::TunnelFrame>,
    outbound: mpsc::Sender<Result<v1::TunnelFrame, Status>>,
}

struct Pending {
    node_id: String,
    reply: oneshot::Sender<NodeEnd>,
}

#[derive(Default)]
struct State {
    pending: HashMap<String, Pending>,
    per_node: HashMap<String, usize>,
    next: u64,
}

/// This gateway's tunnels. Cloning shares them.
#[derive(Clone)]
pub struct Tunnels {
    registry: Registry,
    limits: Arc<TunnelLimits>,
    state: Arc<Mutex<State>>,
    counters: Arc<Counters>,
    /// Makes tunnel ids of different gateway processes differ (a node matches only its own pending ids anyway).
    prefix: String,
}

/// Counters as a snapshot.
pub(crate) fn snapshot(c: &Counters) -> TunnelStats {
    TunnelStats {
        opens_sent: c.opens_sent.load(Relaxed),
        opened: c.opened.load(Relaxed),
        refused_streams: c.refused_streams.load(Relaxed),
        open_now: c.open_now.load(Relaxed),
        bytes_from_nodes: c.from_nodes.load(Relaxed),
        bytes_to_nodes: c.to_nodes.load(Relaxed),
    }
}

impl Tunnels {
    pub fn new(registry: Registry, limits: TunnelLimits) -> Tunnels {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Tunnels {
            registry,
            limits: Arc::new(limits),
            state: Arc::default(),
            counters: Arc::default(),
            prefix: format!("{:x}", nonce ^ u64::from(std::process::id())),
        }
    }

    pub fn limits(&self) -> &TunnelLimits {
        &self.limits
    }

    pub fn stats(&self) -> TunnelStats {
        snapshot(&self.counters)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks `node_id` to dial its local `port` and waits for its tunnel stream. The node may still refuse (its
    /// allowlist, nothing listening): that arrives as the tunnel's first frame, a `close`.
    pub async fn open(&self, node_id: &str, port: u16) -> Result<Tunnel, OpenError> {
        let slot = self.reserve(node_id)?;
        let (reply, rx) = oneshot::channel();
        let tunnel_id = {
            let mut st = self.lock();
            st.next += 1;
            let id = format!("{}-{}", self.prefix, st.next);
            st.pending.insert(
                id.clone(),
                Pending {
                    node_id: node_id.to_string(),
                    reply,
                },
            );
            id
        };
        // Removes the pending entry however this call ends, a caller that gave up (dropped this future) included:
        // before, a cancelled open left its entry for good.
        let forget = Forget {
            tunnels: self,
            id: &tunnel_id,
        };
        let Some((tx, session)) = self.registry.session_of(node_id) else {
            return Err(OpenError::NotConnected(node_id.to_string()));
        };
        let msg = v1::GatewayMessage {
            msg: Some(v1::gateway_message::Msg::OpenTunnel(v1::OpenTunnel {
                tunnel_id: tunnel_id.clone(),
                port: u32::from(port),
                dial_timeout_ms: u32::try_from(self.limits.dial_timeout.as_millis())
                    .unwrap_or(u32::MAX),
            })),
        };
        if let Err(e) = tx.try_send(Ok(Box::new(msg))) {
            return Err(match e {
                mpsc::error::TrySendError::Full(_) => OpenError::SessionBusy(node_id.to_string()),
                mpsc::error::TrySendError::Closed(_) => {
                    OpenError::NotConnected(node_id.to_string())
                }
            });
        }
        self.counters.opens_sent.fetch_add(1, Relaxed);
        let wait = self.limits.dial_timeout + self.limits.open_margin;
        let end = match tokio::time::timeout(wait, rx).await {
            Ok(Ok(end)) => end,
            Ok(Err(_)) => return Err(OpenError::Closed),
            Err(_) => {
                return Err(OpenError::DialTimeout {
                    node: node_id.to_string(),
                    tunnel: tunnel_id.clone(),
                    ms: wait.as_millis(),
                });
            }
        };
        drop(forget);
        self.counters.opened.fetch_add(1, Relaxed);
        self.counters.open_now.fetch_add(1, Relaxed);
        let open = Arc::new(Open {
            counters: self.counters.clone(),
            _slot: Some(slot),
        });
        let bytes = Arc::<Bytes>::default();
        Ok(Tunnel {
            id: tunnel_id,
            node_id: node_id.to_string(),
            port,
            tx: TunnelTx {
                to_node: end.outbound,
                session: Some(session.clone()),
                bytes: bytes.clone(),
                open: open.clone(),
            },
            rx: TunnelRx {
                from_node: end.inbound,
                session: Some(session),
                bytes,
                open,
            },
        })
    }

    fn reserve(&self, node_id: &str) -> Result<Slot, OpenError> {
        let mut st = self.lock();
        let n = st.per_node.entry(node_id.to_string()).or_default();
        if *n >= self.limits.per_node {
            return Err(OpenError::NodeFull {
                node: node_id.to_string(),
                cap: self.limits.per_node,
            });
        }
        *n += 1;
        Ok(Slot {
            tunnels: self.clone(),
            node_id: node_id.to_string(),
        })
    }

    /// Tunnels of `node_id` pending or open at this gateway.
    pub fn of_node(&self, node_id: &str) -> usize {
        self.lock().per_node.get(node_id).copied().unwrap_or(0)
    }

    /// The pending open `tunnel_id`, if it was issued to `node_id` (else it stays pending for its own node).
    fn take(&self, tunnel_id: &str, node_id: &str) -> Option<Pending> {
        let mut st = self.lock();
        match st.pending.get(tunnel_id) {
            Some(p) if p.node_id == node_id => st.pending.remove(tunnel_id),
            _ => None,
        }
    }
}

/// A node's place in the per-node count; dropping it frees it.
struct Slot {
    tunnels: Tunnels,
    node_id: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.tunnels.lock();
        if let Some(n) = st.per_node.get_mut(&self.node_id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.per_node.remove(&self.node_id);
            }
        }
    }
}

/// Data bytes of one tunnel: from the node (`up`), to the node (`down`).
#[derive(Debug, Default)]
pub struct Bytes {
    pub up: AtomicU64,
    pub down: AtomicU64,
}

/// What both halves of a tunnel hold: its slot in the node's count at this gateway (none for a tunnel relayed
/// through another gateway) and the open count of its counters.
struct Open {
    counters: Arc<Counters>,
    _slot: Option<Slot>,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.counters.open_now.fetch_sub(1, Relaxed);
    }
}

/// One open tunnel connection to a node's port, in two halves that may run in separate tasks. Dropping both ends
/// the gateway's stream to the node (the node sees the stream end and closes its local connection).
pub struct Tunnel {
    pub id: String,
    pub node_id: String,
    pub port: u16,
    pub tx: TunnelTx,
    pub rx: TunnelRx,
}

impl Tunnel {
    /// Its byte counters (shared: they go on counting while the tunnel relays).
    pub fn bytes(&self) -> Arc<Bytes> {
        self.tx.bytes.clone()
    }

    /// A tunnel whose node end is a stream to another gateway (the relay's client side), counted in `counters`.
    pub(crate) fn relayed(
        id: String,
        node_id: String,
        port: u16,
        to_node: mpsc::Sender<Result<v1::TunnelFrame, Status>>,
        from_node: Streaming<v1::TunnelFrame>,
        counters: Arc<Counters>,
    ) -> Tunnel {
        counters.opened.fetch_add(1, Relaxed);
        counters.open_now.fetch_add(1, Relaxed);
        let open = Arc::new(Open {
            counters,
            _slot: None,
        });
        let bytes = Arc::<Bytes>::default();
        Tunnel {
            id,
            node_id,
            port,
            tx: TunnelTx {
                to_node,
                session: None,
                bytes: bytes.clone(),
                open: open.clone(),
            },
            rx: TunnelRx {
                from_node,
                // The gateway holding the node's session ends the relayed stream when the session ends.
                session: None,
                bytes,
                open,
            },
        }
    }
}

/// The sending half of a [`Tunnel`].
pub struct TunnelTx {
    to_node: mpsc::Sender<Result<v1::TunnelFrame, Status>>,
    /// As [`TunnelRx`]'s: nothing more is sent to a node whose session has ended.
    session: Option<SessionEnd>,
    bytes: Arc<Bytes>,
    open: Arc<Open>,
}

impl TunnelTx {
    /// Sends a frame to the node; waits while its queue is full (HTTP/2's window). Err: the node's stream is gone,
    /// or the session the tunnel was opened through has ended.
    pub async fn send(&self, f: v1::TunnelFrame) -> Result<(), Status> {
        let n = match &f.frame {
            Some(Frame::Data(d)) => d.len() as u64,
            _ => 0,
        };
        let sent = match &self.session {
            // Biased: a session that has ended wins over a queue with room, and a full queue the node no longer
            // reads does not hold the send past the session's end.
            Some(end) => {
                let mut end = end.clone();
                tokio::select! {
                    biased;
                    () = end.ended() => return Err(Status::aborted(SESSION_ENDED)),
                    r = self.to_node.send(Ok(f)) => r,
                }
            }
            None => self.to_node.send(Ok(f)).await,
        };
        sent.map_err(|_| Status::unavailable("the node's tunnel stream ended"))?;
        self.bytes.down.fetch_add(n, Relaxed);
        self.open.counters.to_nodes.fetch_add(n, Relaxed);
        Ok(())
    }
}

/// The receiving half of a [`Tunnel`]. Once the relay is done with a tunnel, drop its [`TunnelTx`] first and then
/// [`TunnelRx::finish`] it: dropping the receiving half of a stream whose far end has not ended yet resets the stream
/// (HTTP/2 RST_STREAM), which discards frames the sending half still had queued (the last bytes, a half-close).
pub struct TunnelRx {
    from_node: Streaming<v1::TunnelFrame>,
    /// The end of the node's session the tunnel was opened through (None: relayed from another gateway, which
    /// watches it). The tunnel ends with that session whatever the node does with its stream, so a revoked or
    /// superseded node keeps none open: a read waiting here ends `ABORTED`, and so does the next send once the
    /// node has half-closed and nothing reads.
    session: Option<SessionEnd>,
    bytes: Arc<Bytes>,
    open: Arc<Open>,
}

impl TunnelRx {
    /// The next frame from the node; None when its stream ended; `ABORTED` once the node's session has ended.
    pub async fn recv(&mut self) -> Option<Result<v1::TunnelFrame, Status>> {
        let TunnelRx {
            from_node, session, ..
        } = self;
        let next = match session {
            Some(end) => tokio::select! {
                m = from_node.message() => m,
                () = end.ended() => return Some(Err(Status::aborted(SESSION_ENDED))),
            },
            None => from_node.message().await,
        };
        let f = next.transpose()?;
        if let Ok(v1::TunnelFrame {
            frame: Some(Frame::Data(d)),
        }) = &f
        {
            self.bytes.up.fetch_add(d.len() as u64, Relaxed);
            self.open
                .counters
                .from_nodes
                .fetch_add(d.len() as u64, Relaxed);
        }
        Some(f)
    }

    /// Reads (and drops) what still arrives until the far end ends its stream, for at most `within`; then drops the
    /// stream. Frames the tunnel's sending half had queued reach the far end meanwhile.
    pub async fn finish(mut self, within: Duration) {
        let _ = tokio::time::timeout(within, async {
            while let Some(Ok(_)) = self.from_node.message().await.transpose() {}
        })
        .await;
    }
}

/// Why a tunnel ended when the session it was opened through did.
pub const SESSION_ENDED: &str = "the node's session ended, and its tunnels with it";

/// `TunnelService` as the gateway serves it.
pub(crate) struct TunnelSvc {
    pub tunnels: Tunnels,
    pub trust_domain: String,
}

type FrameStream = Pin<Box<dyn Stream<Item = Result<v1::TunnelFrame, Status>> + Send>>;

fn refuse(reason: String) -> Response<FrameStream> {
    let f = bc_proto::tunnel::close(v1::TunnelCloseCode::Protocol, reason);
    Response::new(Box::pin(tokio_stream::once(Ok(f))))
}

#[tonic::async_trait]
impl v1::tunnel_service_server::TunnelService for TunnelSvc {
    async fn tunnel(
        &self,
        request: Request<Streaming<v1::TunnelFrame>>,
    ) -> Result<Response<FrameStream>, Status> {
        let certs = request.peer_certs();
        let id = node_identity(certs.as_deref().map(|v| v.as_slice()), &self.trust_domain)?;
        if self.tunnels.registry.revocations().is_revoked(&id) {
            return Err(Status::permission_denied(format!("{id} is revoked")));
        }
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(FIRST_FRAME_DEADLINE, inbound.message()).await;
        let tunnel_id = match first {
            Ok(Ok(Some(v1::TunnelFrame {
                frame: Some(Frame::Open(o)),
            }))) => o.tunnel_id,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                self.tunnels.counters.refused_streams.fetch_add(1, Relaxed);
                return Ok(refuse(format!(
                    "no first frame within {} s: a tunnel stream starts with open{{tunnel_id}}",
                    FIRST_FRAME_DEADLINE.as_secs()
                )));
            }
            Ok(Ok(_)) => {
                self.tunnels.counters.refused_streams.fetch_add(1, Relaxed);
                return Ok(refuse(
                    "the first frame of a tunnel stream must be open{tunnel_id}".into(),
                ));
            }
        };
        let Some(pending) = self.tunnels.take(&tunnel_id, id.id()) else {
            self.tunnels.counters.refused_streams.fetch_add(1, Relaxed);
            tracing::warn!(
                node_id = id.id(),
                tunnel = tunnel_id,
                "tunnel stream refused: not pending for this node"
            );
            return Ok(refuse(format!(
                "tunnel {tunnel_id:?} is not pending for {id} at this gateway (expired, or issued to another node)"
            )));
        };
        let (outbound, rx) = mpsc::channel(TO_NODE_QUEUE);
        let end = NodeEnd { inbound, outbound };
        if pending.reply.send(end).is_err() {
            // The opener gave up (its deadline passed) just now.
            return Ok(Response::new(Box::pin(tokio_stream::once(Ok(
                bc_proto::tunnel::close(
                    v1::TunnelCloseCode::Aborted,
                    "the operator's side went away",
                ),
            )))));
        }
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Removes an open's pending entry when dropped (a no-op once the node's stream took it).
struct Forget<'a> {
    tunnels: &'a Tunnels,
    id: &'a str,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.tunnels.lock().pending.remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_window_covers_every_tunnel_of_a_node() {
        let w = Windows::for_tunnels(8 << 20, 128);
        assert_eq!(w.connection, 129 * (8 << 20));
        let capped = Windows::for_tunnels(64 << 20, 1024);
        assert_eq!(capped.connection, i32::MAX as u32);
    }

    #[tokio::test]
    async fn an_open_to_a_node_without_a_session_sends_nothing_and_frees_its_slot() {
        let t = Tunnels::new(Registry::default(), TunnelLimits::default());
        let e = t.open("n1", 22).await.err();
        assert_eq!(e, Some(OpenError::NotConnected("n1".into())));
        assert_eq!(t.of_node("n1"), 0);
        assert_eq!(t.stats().opens_sent, 0);
        assert!(t.lock().pending.is_empty());
    }

    /// A registry holding a session of `node` whose outbound queue holds `capacity` messages.
    fn with_session(
        node: &str,
        capacity: usize,
    ) -> (Registry, mpsc::Receiver<crate::session::Outbound>) {
        let registry = Registry::default();
        let (tx, rx) = mpsc::channel(capacity);
        let (close, _) = tokio::sync::watch::channel(None);
        registry.insert(
            node,
            crate::session::Entry {
                epoch: 1,
                last_seen_ms: Arc::default(),
                tx,
                close,
            },
        );
        (registry, rx)
    }

    fn limits(per_node: usize, wait_ms: u64) -> TunnelLimits {
        TunnelLimits {
            per_node,
            dial_timeout: Duration::from_millis(wait_ms / 2),
            open_margin: Duration::from_millis(wait_ms / 2),
            ..TunnelLimits::default()
        }
    }

    #[tokio::test]
    async fn a_full_session_queue_refuses_the_tunnel_at_once_and_keeps_its_messages() {
        let (registry, mut rx) = with_session("n1", 1);
        let t = Tunnels::new(registry.clone(), limits(4, 60_000));
        let heartbeat_like = v1::GatewayMessage { msg: None };
        registry
            .sender("n1")
            .expect("session")
            .try_send(Ok(Box::new(heartbeat_like)))
            .expect("fits");
        let started = std::time::Instant::now();
        let e = t.open("n1", 22).await.err();
        assert_eq!(e, Some(OpenError::SessionBusy("n1".into())));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "it waited for the queue"
        );
        assert_eq!((t.stats().opens_sent, t.of_node("n1")), (0, 0));
        assert!(t.lock().pending.is_empty());
        // What the session had queued is still there, and nothing else.
        assert!(matches!(
            rx.try_recv().map(|m| m.map(|b| *b)),
            Ok(Ok(v1::GatewayMessage { msg: None }))
        ));
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_node_that_never_opens_its_stream_times_out_and_a_node_is_capped() {
        let (registry, mut rx) = with_session("n1", 8);
        let t = Tunnels::new(registry, limits(1, 200));
        let first = tokio::spawn({
            let t = t.clone();
            async move { t.open("n1", 8888).await.err() }
        });
        // The OpenTunnel went on the session with its port and dial deadline.
        let sent = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .map(|m| m.map(|m| m.map(|b| *b)));
        let Ok(Some(Ok(v1::GatewayMessage {
            msg: Some(v1::gateway_message::Msg::OpenTunnel(open)),
        }))) = sent
        else {
            panic!("no OpenTunnel on the session: {sent:?}");
        };
        assert_eq!((open.port, open.dial_timeout_ms), (8888, 100));
        // While it is pending, the node's cap (1 here) refuses another without sending it.
        assert_eq!(
            t.open("n1", 22).await.err(),
            Some(OpenError::NodeFull {
                node: "n1".into(),
                cap: 1
            })
        );
        let e = first.await.expect("task");
        assert!(matches!(e, Some(OpenError::DialTimeout { .. })), "{e:?}");
        assert_eq!((t.stats().opens_sent, t.of_node("n1")), (1, 0));
        assert!(t.lock().pending.is_empty());
    }

    /// A caller that gives up on an open (its HTTP client hung up, so the future is dropped) leaves no pending
    /// entry and no slot behind. Before, the entry stayed until the gateway restarted.
    #[tokio::test]
    async fn an_open_given_up_by_its_caller_leaves_nothing_pending() {
        let (registry, mut rx) = with_session("n1", 8);
        let t = Tunnels::new(registry, limits(1, 60_000));
        let gave_up = tokio::time::timeout(Duration::from_millis(200), t.open("n1", 22)).await;
        assert!(gave_up.is_err(), "the node never answers");
        assert!(rx.try_recv().is_ok(), "the OpenTunnel went out");
        assert!(t.lock().pending.is_empty(), "the entry is gone");
        assert_eq!(t.of_node("n1"), 0, "and the slot");
    }

    #[test]
    fn a_pending_open_is_taken_only_by_its_own_node() {
        let t = Tunnels::new(Registry::default(), TunnelLimits::default());
        let (reply, _rx) = oneshot::channel();
        t.lock().pending.insert(
            "x-1".into(),
            Pending {
                node_id: "n1".into(),
                reply,
            },
        );
        assert!(t.take("x-1", "n2").is_none());
        assert!(t.take("x-1", "n1").is_some());
        assert!(t.take("x-1", "n1").is_none());
    }
}
