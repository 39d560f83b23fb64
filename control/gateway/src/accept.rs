//! The accept path: accept(2) that never waits on the peers already connected and never spins when descriptors run
//! out, each TLS handshake in its own task, and every connection accounted in a [`ConnTable`] from accept to close
//! and closed when its policy ([`crate::conns`]) says so.
//!
//! A connection's TCP stream is wrapped ([`Tracked`]): closing it by policy wakes whatever holds it (the handshake
//! task, or hyper's HTTP/2 connection) with an error, and dropping it takes it out of the table. Until its first
//! request it reports whether the gateway waits for the peer (a read found nothing) or the peer for the gateway (it
//! was woken by new bytes). Requests are counted by a tower layer ([`CountRequests`]) keyed by the peer address
//! tonic records per connection, so a connection without a client certificate is known to be idle once its Join
//! has answered.

use crate::conns::{Admission, ConnId, ConnLimits, ConnStats, ConnTable};
use bc_proto::proxy_protocol::{self, Trusted};
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tonic::codegen::http;
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};

/// How many connections one failed accept(2) for want of descriptors closes, and how long it then waits: long
/// enough for the closed ones to be dropped, and a bounded rate when nothing could be closed.
const SHED_ON_EXHAUSTION: usize = 16;
const PAUSE_AFTER_SHEDDING: Duration = Duration::from_millis(5);
const PAUSE_WITH_NOTHING_TO_SHED: Duration = Duration::from_millis(50);
/// How often deadlines are checked, and how often a summary of what was closed is logged.
const SWEEP_EVERY: Duration = Duration::from_millis(100);
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// The connection table and how to close each connection in it. Cloning shares it.
#[derive(Clone)]
pub(crate) struct Gate {
    state: Arc<Mutex<GateState>>,
    limits: Arc<ConnLimits>,
}

struct GateState {
    table: ConnTable,
    signals: HashMap<ConnId, Arc<Signals>>,
    headers: HeaderReads,
}

/// Trusted balancers' connections whose PROXY header is being read (they are not in the table until it names the
/// client), and the headers refused since the last report.
#[derive(Default)]
struct HeaderReads {
    pending: usize,
    refused: u64,
    /// What the last refusal said (a misconfigured balancer repeats one reason on every connection).
    last_refusal: Option<String>,
    /// The reasons logged since the last report: each is logged the first time it is seen in a period.
    logged: Vec<String>,
}

impl Gate {
    pub(crate) fn new(limits: ConnLimits) -> Gate {
        Gate {
            state: Arc::new(Mutex::new(GateState {
                table: ConnTable::default(),
                signals: HashMap::new(),
                headers: HeaderReads::default(),
            })),
            limits: Arc::new(limits),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Nothing panics while holding the lock; should something, the table is still the best account there is.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stats(&self) -> ConnStats {
        self.lock().table.stats(&self.limits)
    }

    /// Admits a new connection (closing those the policy sheds to make room), or None when it must be refused.
    fn admit(&self, peer: SocketAddr) -> Option<ConnHandle> {
        let mut st = self.lock();
        match st.table.admit(peer, Instant::now(), &self.limits) {
            Admission::Admitted { id, shed } => {
                st.close(&shed);
                let signals = Arc::new(Signals::default());
                st.signals.insert(id, signals.clone());
                Some(ConnHandle {
                    id,
                    gate: self.clone(),
                    signals,
                })
            }
            Admission::Refused => None,
        }
    }

    fn handshake_done(&self, id: ConnId, authenticated: bool) {
        self.lock()
            .table
            .handshake_done(id, authenticated, Instant::now());
    }

    fn waiting_on_peer(&self, id: ConnId) {
        self.lock().table.waiting_on_peer(id, Instant::now());
    }

    fn peer_ready(&self, id: ConnId) {
        self.lock().table.peer_ready(id);
    }

    fn request_started(&self, peer: SocketAddr) -> Option<RequestGuard> {
        let mut st = self.lock();
        let id = st.table.request_started(peer)?;
        if let Some(s) = st.signals.get(&id) {
            s.requested.store(true, Ordering::Release);
        }
        drop(st);
        Some(RequestGuard {
            id,
            gate: self.clone(),
        })
    }

    /// Closes connections past their deadlines; returns how many.
    fn sweep(&self) -> usize {
        let mut st = self.lock();
        let expired: Vec<ConnId> = st
            .table
            .expire(Instant::now(), &self.limits)
            .into_iter()
            .map(|(id, stage)| {
                tracing::debug!(conn = id, ?stage, "connection closed: deadline passed");
                id
            })
            .collect();
        st.close(&expired);
        expired.len()
    }

    /// A trusted balancer's connection starts its header; false when too many are being read already.
    fn header_started(&self) -> bool {
        let mut st = self.lock();
        if st.headers.pending >= self.limits.max_unauthenticated.max(1) {
            st.headers
                .refuse("too many PROXY headers being read at once".into());
            return false;
        }
        st.headers.pending += 1;
        true
    }

    /// Its header was read (`refused`: None) or refused, saying why.
    fn header_ended(&self, refused: Option<String>) {
        let mut st = self.lock();
        st.headers.pending = st.headers.pending.saturating_sub(1);
        if let Some(why) = refused {
            st.headers.refuse(why);
        }
    }

    /// The header refusals since the last call, and the last one's reason.
    fn take_header_refusals(&self) -> (u64, Option<String>) {
        let mut st = self.lock();
        let refused = std::mem::take(&mut st.headers.refused);
        st.headers.logged.clear();
        (refused, st.headers.last_refusal.take())
    }

    fn shed_for_descriptors(&self) -> usize {
        let mut st = self.lock();
        let shed = st.table.shed_for_descriptors(SHED_ON_EXHAUSTION);
        st.close(&shed);
        shed.len()
    }
}

impl HeaderReads {
    /// Counts a refusal. Each reason is logged at once the first time in a report period: it is usually a
    /// configuration mistake, repeated on every connection until fixed.
    fn refuse(&mut self, why: String) {
        if self.logged.len() < 16 && !self.logged.contains(&why) {
            tracing::warn!(reason = %why, "a trusted balancer's connection was refused");
            self.logged.push(why.clone());
        }
        self.refused += 1;
        self.last_refusal = Some(why);
    }
}

impl GateState {
    fn close(&mut self, ids: &[ConnId]) {
        for id in ids {
            if let Some(c) = self.signals.get(id) {
                c.close();
            }
        }
    }
}

// === impl Signals ===

/// What reaches a connection from outside the task that holds it: closing it (the next read or write fails, and
/// the task is woken to see it), and that a request has started (no more reports of who waits for whom).
#[derive(Default)]
struct Signals {
    closed: AtomicBool,
    waker: Mutex<Option<Waker>>,
    requested: AtomicBool,
}

impl Signals {
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let waker = self.waker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Whether the connection was closed; else registers the task to be woken when it is.
    fn poll_closed(&self, cx: &mut Context<'_>) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return true;
        }
        {
            let mut slot = self.waker.lock().unwrap_or_else(|p| p.into_inner());
            if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *slot = Some(cx.waker().clone());
            }
        }
        self.closed.load(Ordering::Acquire)
    }
}

/// A connection's place in the table; leaving it (the connection dropped) removes the entry.
struct ConnHandle {
    id: ConnId,
    gate: Gate,
    signals: Arc<Signals>,
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        st.table.remove(self.id);
        st.signals.remove(&self.id);
    }
}

// === impl Tracked ===

/// A TCP connection the gateway accounts for and may close.
pub(crate) struct Tracked {
    tcp: TcpStream,
    /// The peer as the gateway accounts it: the TCP peer, or the client a trusted balancer's PROXY header named.
    client: SocketAddr,
    conn: ConnHandle,
    /// Wakes the task when the peer's bytes arrive, telling the table first; with the waker made from it.
    peer: Arc<PeerWake>,
    peer_waker: Waker,
}

impl Tracked {
    fn new(tcp: TcpStream, client: SocketAddr, conn: ConnHandle) -> Tracked {
        let peer = Arc::new(PeerWake {
            id: conn.id,
            gate: conn.gate.clone(),
            waiting: AtomicBool::new(false),
            task: Mutex::new(None),
        });
        Tracked {
            tcp,
            client,
            conn,
            peer_waker: Waker::from(peer.clone()),
            peer,
        }
    }
}

/// The waker a connection's reads register before its first request: a wake means the peer's bytes arrived.
struct PeerWake {
    id: ConnId,
    gate: Gate,
    /// The table was told the gateway waits for the peer.
    waiting: AtomicBool,
    task: Mutex<Option<Waker>>,
}

impl PeerWake {
    fn ready(&self) {
        if self.waiting.swap(false, Ordering::AcqRel) {
            self.gate.peer_ready(self.id);
        }
    }
}

impl std::task::Wake for PeerWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready();
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(t) = task {
            t.wake();
        }
    }
}

fn closed_by_gateway() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "closed by the gateway (deadline passed or shed to make room)",
    )
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.signals.poll_closed(cx) {
            return Poll::Ready(Err(closed_by_gateway()));
        }
        if this.conn.signals.requested.load(Ordering::Acquire) {
            return Pin::new(&mut this.tcp).poll_read(cx, buf);
        }
        {
            let mut task = this.peer.task.lock().unwrap_or_else(|p| p.into_inner());
            if !task.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *task = Some(cx.waker().clone());
            }
        }
        let read =
            Pin::new(&mut this.tcp).poll_read(&mut Context::from_waker(&this.peer_waker), buf);
        match read {
            Poll::Pending => {
                if !this.peer.waiting.swap(true, Ordering::AcqRel) {
                    this.conn.gate.waiting_on_peer(this.conn.id);
                }
            }
            Poll::Ready(_) => this.peer.ready(),
        }
        read
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.signals.poll_closed(cx) {
            return Poll::Ready(Err(closed_by_gateway()));
        }
        Pin::new(&mut this.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.signals.poll_closed(cx) {
            return Poll::Ready(Err(closed_by_gateway()));
        }
        Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

impl Connected for Tracked {
    // The TCP stream's own type, so that tonic's `Request::peer_certs` and `remote_addr` find what they look for;
    // the remote address is the accounted peer (a balancer's forwarded client), as the request counting keys it.
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        TcpConnectInfo {
            local_addr: self.tcp.local_addr().ok(),
            remote_addr: Some(self.client),
        }
    }
}

pub(crate) type TlsConn = tokio_rustls::server::TlsStream<Tracked>;

// === the accept loop ===

fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// What the accept loop needs besides the listener.
pub(crate) struct AcceptConfig {
    pub(crate) acceptor: tokio_rustls::TlsAcceptor,
    /// What a resumed session passes after its handshake.
    pub(crate) tls: crate::tls::ServerTls,
    pub(crate) tx: tokio::sync::mpsc::Sender<io::Result<TlsConn>>,
    /// Bounds a handshake even if the policy's deadlines did not.
    pub(crate) handshake_ceiling: Duration,
    /// The balancers whose connections begin with a PROXY protocol header.
    pub(crate) proxies: Arc<Trusted>,
}

/// Accepts until the task is aborted: every connection at once, its handshake in a task of its own, the
/// established ones handed to `tx`. Deadlines are enforced by [`sweep`]. A trusted balancer's connection is
/// accounted as the client its PROXY protocol header names, once the header is read ([`read_proxy_header`]).
pub(crate) async fn accept(listener: TcpListener, gate: Gate, config: AcceptConfig) {
    let config = Arc::new(config);
    let mut last_exhaustion_log: Option<Instant> = None;
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) if out_of_descriptors(&e) => {
                let shed = gate.shed_for_descriptors();
                if last_exhaustion_log.is_none_or(|t| t.elapsed() >= REPORT_EVERY) {
                    last_exhaustion_log = Some(Instant::now());
                    let s = gate.stats();
                    tracing::warn!(
                        error = %e,
                        shed,
                        open = s.open,
                        stalled = s.stalled,
                        "accept failed for want of descriptors: closing stalled connections (raise the \
                         descriptor limit, LimitNOFILE=, if this persists without a flood)"
                    );
                }
                tokio::time::sleep(if shed > 0 {
                    PAUSE_AFTER_SHEDDING
                } else {
                    PAUSE_WITH_NOTHING_TO_SHED
                })
                .await;
                continue;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::Interrupted
                ) =>
            {
                // The peer left before accept(2) returned: nothing to wait for.
                continue;
            }
            Err(e) => {
                // Anything else: a pause, never a spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(PAUSE_WITH_NOTHING_TO_SHED).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        if config.proxies.contains(peer.ip()) {
            // Bounded like unauthenticated connections: a header is one segment from a balancer that is trusted.
            if !gate.header_started() {
                tracing::debug!(%peer, "balancer connection refused: too many PROXY headers being read");
                continue;
            }
            tokio::spawn(from_balancer(tcp, peer, gate.clone(), config.clone()));
            continue;
        }
        let Some(conn) = gate.admit(peer) else {
            tracing::debug!(%peer, "connection refused: the gateway holds all it may, none can be shed");
            continue;
        };
        let stream = Tracked::new(tcp, peer, conn);
        let (gate, config) = (gate.clone(), config.clone());
        tokio::spawn(async move { handshake(stream, gate, &config).await });
    }
}

/// A trusted balancer's connection: its PROXY header read within the deadline, then admitted and handshaken as
/// the client the header names (the balancer itself for a LOCAL header).
async fn from_balancer(
    mut tcp: TcpStream,
    peer: SocketAddr,
    gate: Gate,
    config: Arc<AcceptConfig>,
) {
    let header = tokio::time::timeout(PROXY_HEADER_DEADLINE, read_proxy_header(&mut tcp)).await;
    let source = match header {
        Ok(Ok(Ok(source))) => Ok(source),
        Ok(Ok(Err(refused))) => Err(Some(refused.to_string())),
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "balancer connection ended before its PROXY header");
            Err(None)
        }
        Err(_) => Err(Some(format!(
            "no PROXY protocol header within {} s",
            PROXY_HEADER_DEADLINE.as_secs()
        ))),
    };
    gate.header_ended(source.as_ref().err().cloned().flatten());
    let Ok(source) = source else { return };
    let client = source.unwrap_or(peer);
    let Some(conn) = gate.admit(client) else {
        tracing::debug!(%client, %peer, "connection refused: the gateway holds all it may, none can be shed");
        return;
    };
    handshake(Tracked::new(tcp, client, conn), gate, &config).await;
}

/// How long a trusted balancer's connection may take to deliver its PROXY header (balancers write it with the
/// connection's first segment).
const PROXY_HEADER_DEADLINE: Duration = Duration::from_secs(5);

/// Reads a PROXY protocol v2 header off `tcp` and not a byte more: Ok(Ok(source)) with the client it names (None:
/// the balancer's own connection, e.g. a health check), Ok(Err) when it is not an acceptable header.
async fn read_proxy_header(
    tcp: &mut TcpStream,
) -> io::Result<Result<Option<SocketAddr>, proxy_protocol::HeaderError>> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; proxy_protocol::MAX_HEADER];
    let mut have = 0;
    loop {
        match proxy_protocol::parse(&buf[..have]) {
            Ok(proxy_protocol::Parsed::Incomplete { need }) => {
                tcp.read_exact(&mut buf[have..need]).await?;
                have = need;
            }
            Ok(proxy_protocol::Parsed::Header { source, .. }) => return Ok(Ok(source)),
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// One connection's TLS handshake, bounded by the ceiling; an established connection goes to the server.
async fn handshake(stream: Tracked, gate: Gate, config: &AcceptConfig) {
    let (id, peer) = (stream.conn.id, stream.client);
    match tokio::time::timeout(config.handshake_ceiling, config.acceptor.accept(stream)).await {
        Ok(Ok(tls)) => {
            if let Err(why) = config.tls.admit(tls.get_ref().1, crate::session::now_ms()) {
                tracing::info!(
                    %peer,
                    reason = why,
                    "resumed TLS session closed before any request: the client certificate its ticket holds no longer passes"
                );
                return;
            }
            let authenticated = tls.get_ref().1.peer_certificates().is_some();
            gate.handshake_done(id, authenticated);
            let _ = config.tx.send(Ok(tls)).await;
        }
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionAborted => {
            tracing::debug!(%peer, error = %e, "TLS handshake ended");
        }
        Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            tracing::debug!(%peer, "peer closed the connection during the TLS handshake");
        }
        Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake refused"),
        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
    }
}

/// Closes connections past their deadlines every SWEEP_EVERY, and logs what the policy closed every REPORT_EVERY
/// when it closed anything.
pub(crate) async fn sweep(gate: Gate) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reported = gate.stats().counters;
    let mut last_report = Instant::now();
    loop {
        tick.tick().await;
        gate.sweep();
        if last_report.elapsed() < REPORT_EVERY {
            continue;
        }
        last_report = Instant::now();
        let s = gate.stats();
        let c = s.counters;
        let closed = (c.expired - reported.expired)
            + (c.shed_full - reported.shed_full)
            + (c.shed_source_full - reported.shed_source_full)
            + (c.shed_descriptors - reported.shed_descriptors);
        let refused = c.refused - reported.refused;
        let (headers_refused, last_header_refusal) = gate.take_header_refusals();
        if headers_refused > 0 {
            tracing::warn!(
                refused = headers_refused,
                last_reason = last_header_refusal.as_deref().unwrap_or(""),
                "trusted balancers' connections refused for their PROXY protocol header in the last {} s",
                REPORT_EVERY.as_secs()
            );
        }
        if closed + refused > 0 {
            tracing::warn!(
                expired = c.expired - reported.expired,
                shed_at_cap = c.shed_full - reported.shed_full,
                shed_per_source = c.shed_source_full - reported.shed_source_full,
                shed_for_descriptors = c.shed_descriptors - reported.shed_descriptors,
                refused,
                open = s.open,
                stalled = s.stalled,
                busy = s.busy,
                pressure = format!("{:.2}", s.pressure),
                "gateway closed stalled or unauthenticated connections in the last {} s",
                REPORT_EVERY.as_secs()
            );
        }
        reported = c;
    }
}

// === counting requests ===

/// Marks a connection's request in flight until its response ends.
struct RequestGuard {
    id: ConnId,
    gate: Gate,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.gate
            .lock()
            .table
            .request_ended(self.id, Instant::now());
    }
}

/// The tower layer that counts each connection's requests in flight.
#[derive(Clone)]
pub(crate) struct CountRequests {
    pub(crate) gate: Gate,
}

impl<S> tower::Layer<S> for CountRequests {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            gate: self.gate.clone(),
        }
    }
}

#[derive(Clone)]
pub(crate) struct Counted<S> {
    inner: S,
    gate: Gate,
}

impl<S, B, R> tower::Service<http::Request<B>> for Counted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<CountedBody<R>>;
    type Error = S::Error;
    type Future = crate::BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let guard = request
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.get_ref().remote_addr)
            .and_then(|peer| self.gate.request_started(peer));
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| CountedBody { body, guard }))
        })
    }
}

/// A response body that ends its request's count when it ends (or is dropped: the stream was reset).
pub(crate) struct CountedBody<B> {
    body: B,
    guard: Option<RequestGuard>,
}

impl<B> http_body::Body for CountedBody<B>
where
    B: http_body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if matches!(frame, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.guard = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
