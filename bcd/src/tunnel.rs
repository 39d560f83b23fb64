//! The node side of tunnels (DESIGN.md, "Tunnels"): on an `OpenTunnel` from the gateway, bcd checks the port
//! against its own allowlist (`[tunnels] allow` in bcd.toml; nothing is allowed by default), dials
//! 127.0.0.1:<port> within a deadline and opens one `TunnelService.Tunnel` stream on the session's connection for
//! that one tunnel connection. Bytes go both ways; a half-close on either side becomes a `half_close` frame and a
//! TCP write shutdown on the other. A refusal (port not allowed, dial refused, dial timeout) is answered on the
//! tunnel's own stream as `close` with a code and a reason, so it ends only that tunnel and never the session.
//!
//! The allowlist is the node's own word: a control plane that asks for another port is refused here whatever it
//! granted.

use bc_proto::tunnel::Written;
use bc_proto::tunnel::bytes::{BufMut as _, BytesMut};
use bc_proto::v1;
use bc_proto::v1::tunnel_frame::Frame;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};

/// The table of bcd.toml that configures tunnels.
pub const TABLE: &str = "tunnels";

/// Dial deadline when the gateway names none, and the bounds a named one is clamped to.
pub const DIAL_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
pub const DIAL_TIMEOUT_MIN: Duration = Duration::from_millis(100);
pub const DIAL_TIMEOUT_MAX: Duration = Duration::from_secs(30);

/// Largest `data` frame the node sends (the wire's limit, 64 KiB).
pub const MAX_FRAME: usize = 64 * 1024;

/// Tunnels one node serves at once; one more is refused (`close{ABORTED}`) without a dial. The gateway caps
/// its own count per node at the same number.
pub const MAX_OPEN: usize = bc_proto::tunnel::MAX_PER_NODE as usize;

/// The node's backstop for a tunnel that moves no byte either way, or whose gateway or local port stopped reading.
pub use bc_proto::tunnel::IDLE_BACKSTOP;

/// How long an ended tunnel waits for the gateway to end its stream, so that its last frames are not reset away.
const DRAIN: Duration = Duration::from_secs(10);

/// Frames queued toward the gateway per tunnel before the local reader waits (HTTP/2's window does the rest).
const OUTBOUND_QUEUE: usize = 8;

/// `[tunnels]` as written in bcd.toml.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunnelsWire {
    /// Local TCP ports an operator may reach through a tunnel, e.g. `[22, 8888]`.
    #[serde(default)]
    pub allow: Vec<i64>,
}

/// The ports this node lets tunnels reach. Empty (the default) refuses every tunnel.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Allowlist(BTreeSet<u16>);

impl TunnelsWire {
    /// Err names the first port out of 1..=65535.
    pub fn validate(self) -> Result<Allowlist, String> {
        let mut ports = BTreeSet::new();
        for p in self.allow {
            let port = u16::try_from(p)
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("{p} is not a TCP port (1 to 65535)"))?;
            ports.insert(port);
        }
        Ok(Allowlist(ports))
    }
}

impl Allowlist {
    pub fn new(ports: impl IntoIterator<Item = u16>) -> Allowlist {
        Allowlist(ports.into_iter().filter(|&p| p != 0).collect())
    }

    pub fn allows(&self, port: u16) -> bool {
        self.0.contains(&port)
    }

    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.0.iter().copied()
    }
}

/// Why a tunnel ended other than by a half-close each way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: v1::TunnelCloseCode,
    pub reason: String,
}

impl Refusal {
    fn new(code: v1::TunnelCloseCode, reason: impl Into<String>) -> Refusal {
        Refusal {
            code,
            reason: reason.into(),
        }
    }

    fn frame(&self) -> v1::TunnelFrame {
        frame(Frame::Close(v1::TunnelClose {
            code: self.code as i32,
            reason: self.reason.clone(),
        }))
    }
}

/// How one tunnel connection ended, with the bytes each way (for the node's log; the gateway keeps the audit row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Bytes read from the local port and sent to the gateway.
    pub up: u64,
    /// Bytes received from the gateway and written to the local port.
    pub down: u64,
    /// None when both sides half-closed and the streams ended.
    pub refusal: Option<Refusal>,
}

pub(crate) fn frame(f: Frame) -> v1::TunnelFrame {
    v1::TunnelFrame { frame: Some(f) }
}

/// Checks the port and dials it: the connected socket, or the refusal to send as the tunnel's `close`.
pub async fn dial(allow: &Allowlist, open: &v1::OpenTunnel) -> Result<TcpStream, Refusal> {
    use v1::TunnelCloseCode as C;
    let port = u16::try_from(open.port).ok().filter(|&p| p != 0);
    let Some(port) = port.filter(|&p| allow.allows(p)) else {
        return Err(Refusal::new(
            C::PortNotAllowed,
            format!(
                "port {} is not in this node's tunnel allowlist; add it to [tunnels] allow in bcd.toml on the node",
                open.port
            ),
        ));
    };
    let deadline = match open.dial_timeout_ms {
        0 => DIAL_TIMEOUT_DEFAULT,
        ms => Duration::from_millis(u64::from(ms)).clamp(DIAL_TIMEOUT_MIN, DIAL_TIMEOUT_MAX),
    };
    match tokio::time::timeout(deadline, TcpStream::connect(("127.0.0.1", port))).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Err(Refusal::new(
            C::DialRefused,
            format!(
                "nothing listens on 127.0.0.1:{port} on the node; start the service, then retry"
            ),
        )),
        Ok(Err(e)) => Err(Refusal::new(
            C::IoError,
            format!("dialing 127.0.0.1:{port} on the node: {e}"),
        )),
        Err(_) => Err(Refusal::new(
            C::DialTimeout,
            format!(
                "127.0.0.1:{port} on the node did not accept within {} ms; check the service, then retry",
                deadline.as_millis()
            ),
        )),
    }
}

/// Like [`serve`], holding one of `slots` for the tunnel's life; with none left the tunnel is refused
/// (`close{ABORTED}`) before any dial.
pub async fn serve_limited<S, F, Fut>(
    slots: &std::sync::Arc<tokio::sync::Semaphore>,
    allow: &Allowlist,
    open: v1::OpenTunnel,
    open_stream: F,
) -> Outcome
where
    S: Stream<Item = Result<v1::TunnelFrame, tonic::Status>> + Unpin,
    F: FnOnce(mpsc::Receiver<v1::TunnelFrame>) -> Fut,
    Fut: std::future::Future<Output = Result<S, tonic::Status>>,
{
    let Ok(_permit) = slots.clone().try_acquire_owned() else {
        let r = Refusal::new(
            v1::TunnelCloseCode::Aborted,
            format!("this node already serves {MAX_OPEN} tunnels; close one, then retry"),
        );
        let (tx, rx) = mpsc::channel(2);
        let _ = tx
            .send(frame(Frame::Open(v1::TunnelOpen {
                tunnel_id: open.tunnel_id.clone(),
            })))
            .await;
        let _ = tx.send(r.frame()).await;
        drop(tx);
        if let Ok(mut inbound) = open_stream(rx).await {
            // Wait for the gateway to end the stream, so the close reaches it.
            let _ = tokio::time::timeout(Duration::from_secs(5), inbound.next()).await;
        }
        return Outcome {
            up: 0,
            down: 0,
            refusal: Some(r),
        };
    };
    serve(allow, open, open_stream).await
}

/// Serves one OpenTunnel end to end: dials, then calls `open_stream` with the node's outbound frames (`open`
/// first) and relays. `open_stream` is the `TunnelService.Tunnel` call in the daemon and a loopback pair in tests.
pub async fn serve<S, F, Fut>(allow: &Allowlist, open: v1::OpenTunnel, open_stream: F) -> Outcome
where
    S: Stream<Item = Result<v1::TunnelFrame, tonic::Status>> + Unpin,
    F: FnOnce(mpsc::Receiver<v1::TunnelFrame>) -> Fut,
    Fut: std::future::Future<Output = Result<S, tonic::Status>>,
{
    let dialed = dial(allow, &open).await;
    let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
    let first = frame(Frame::Open(v1::TunnelOpen {
        tunnel_id: open.tunnel_id.clone(),
    }));
    // Both fit the queue, so these never wait.
    let _ = tx.send(first).await;
    if let Err(r) = &dialed {
        let _ = tx.send(r.frame()).await;
    }
    let inbound = match open_stream(rx).await {
        Ok(s) => s,
        Err(status) => {
            return Outcome {
                up: 0,
                down: 0,
                refusal: Some(Refusal::new(
                    v1::TunnelCloseCode::Aborted,
                    format!("opening the tunnel stream: {}", status.message()),
                )),
            };
        }
    };
    match dialed {
        Ok(sock) => relay(sock, tx, inbound).await,
        Err(r) => {
            // Let the refusal reach the gateway before the call is dropped (see relay's end).
            drop(tx);
            let mut inbound = inbound;
            let _ = tokio::time::timeout(DRAIN, async {
                while let Some(Ok(_)) = inbound.next().await {}
            })
            .await;
            Outcome {
                up: 0,
                down: 0,
                refusal: Some(r),
            }
        }
    }
}

/// Relays bytes between `sock` and the tunnel stream until both sides half-closed, or either side fails or
/// closes. A local failure or a protocol error is sent to the gateway as `close`; a `close` from the gateway ends
/// the tunnel without an answer, also while a write to a local port that stopped reading is blocked. No wait is
/// longer than [`IDLE_BACKSTOP`].
pub async fn relay<S>(sock: TcpStream, tx: mpsc::Sender<v1::TunnelFrame>, inbound: S) -> Outcome
where
    S: Stream<Item = Result<v1::TunnelFrame, tonic::Status>> + Unpin,
{
    relay_within(sock, tx, inbound, IDLE_BACKSTOP).await
}

/// [`relay`] with `backstop` for every wait on a peer that moves nothing ([`IDLE_BACKSTOP`] in the daemon).
async fn relay_within<S>(
    sock: TcpStream,
    tx: mpsc::Sender<v1::TunnelFrame>,
    inbound: S,
    backstop: Duration,
) -> Outcome
where
    S: Stream<Item = Result<v1::TunnelFrame, tonic::Status>> + Unpin,
{
    use std::sync::atomic::Ordering::Relaxed;
    use v1::TunnelCloseCode as C;
    let (mut rd, mut wr) = sock.into_split();
    let up_bytes = std::sync::atomic::AtomicU64::new(0);
    let down_bytes = std::sync::atomic::AtomicU64::new(0);
    let up_tx = tx.clone();
    // Local port → gateway. Err(Some(r)) is a refusal to send; Err(None) means the gateway went away.
    let up = async {
        // Each read becomes one frame's data as it is (no copy); the memory is reused once the frame was sent.
        let mut buf = BytesMut::new();
        loop {
            buf.reserve(MAX_FRAME);
            let n = rd
                .read_buf(&mut (&mut buf).limit(MAX_FRAME))
                .await
                .map_err(|e| {
                    Some(Refusal::new(
                        C::IoError,
                        format!("reading the local port: {e}"),
                    ))
                })?;
            let f = match n {
                0 => frame(Frame::HalfClose(v1::TunnelHalfClose {})),
                _ => frame(Frame::Data(buf.split().freeze())),
            };
            match tokio::time::timeout(backstop, up_tx.send(f)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(None),
                Err(_) => {
                    return Err(Some(Refusal::new(
                        C::Idle,
                        format!("the gateway read nothing for {} s", backstop.as_secs()),
                    )));
                }
            }
            if n == 0 {
                return Ok::<(), Option<Refusal>>(());
            }
            up_bytes.fetch_add(n as u64, Relaxed);
        }
    };
    // Gateway → local port. Err(Some(r)): r is sent back when it is the node's refusal (`send` true).
    let mut inbound = inbound;
    let down = async {
        // A frame read while a write to the local port was blocked, handled next.
        let mut held = None;
        loop {
            let next = match held.take() {
                Some(next) => next,
                None => match tokio::time::timeout(backstop, inbound.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        return Err((
                            Refusal::new(
                                C::Idle,
                                format!("nothing from the gateway for {} s", backstop.as_secs()),
                            ),
                            true,
                        ));
                    }
                },
            };
            let f = match next {
                None => {
                    return Err((
                        Refusal::new(
                            C::Aborted,
                            "the gateway ended the stream before a half-close",
                        ),
                        false,
                    ));
                }
                Some(Err(s)) => {
                    return Err((
                        Refusal::new(C::Aborted, format!("tunnel stream: {}", s.message())),
                        false,
                    ));
                }
                Some(Ok(f)) => f,
            };
            match f.frame {
                Some(Frame::Data(d)) => {
                    // A local service that stopped reading blocks this write. Meanwhile the gateway's stream is
                    // still read, one frame ahead: a close or the stream's end abandons the write (the tunnel
                    // ends, its slot is freed), and the write has the backstop's deadline.
                    let (written, read) = bc_proto::tunnel::write_reading_ahead(
                        &mut wr,
                        &d,
                        inbound.next(),
                        |n| !matches!(n, Some(Ok(f)) if bc_proto::tunnel::carries_on(f)),
                        backstop,
                    )
                    .await;
                    held = read;
                    match written {
                        Written::Done(r) => {
                            r.map_err(|e| {
                                (
                                    Refusal::new(
                                        C::IoError,
                                        format!("writing the local port: {e}"),
                                    ),
                                    true,
                                )
                            })?;
                            down_bytes.fetch_add(d.len() as u64, Relaxed);
                        }
                        Written::Abandoned => {}
                        Written::TimedOut => {
                            return Err((
                                Refusal::new(
                                    C::Idle,
                                    format!(
                                        "the local port did not take {} bytes in {} s",
                                        d.len(),
                                        backstop.as_secs()
                                    ),
                                ),
                                true,
                            ));
                        }
                    }
                }
                Some(Frame::HalfClose(_)) => {
                    let _ = wr.shutdown().await;
                    return Ok::<(), (Refusal, bool)>(());
                }
                Some(Frame::Close(c)) => {
                    let code = C::try_from(c.code).unwrap_or(C::Unspecified);
                    return Err((Refusal::new(code, c.reason), false));
                }
                Some(Frame::Open(_)) | None => {
                    return Err((
                        Refusal::new(
                            C::Protocol,
                            "the gateway sent a frame other than data, half_close or close",
                        ),
                        true,
                    ));
                }
            }
        }
    };
    // The last close and the drain below wait on the gateway too: never longer than DRAIN (or a test's backstop).
    let drain = DRAIN.min(backstop);
    let refusal = {
        tokio::pin!(up, down);
        let (mut up_done, mut down_done) = (false, false);
        loop {
            tokio::select! {
                r = &mut up, if !up_done => match r {
                    Ok(()) => up_done = true,
                    Err(Some(r)) => {
                        // The queue may be full of frames a gateway that stopped reading never took.
                        let _ = tokio::time::timeout(drain, tx.send(r.frame())).await;
                        break Some(r);
                    }
                    Err(None) => break Some(Refusal::new(C::Aborted, "the gateway stopped reading the tunnel")),
                },
                r = &mut down, if !down_done => match r {
                    Ok(()) => down_done = true,
                    Err((r, send)) => {
                        if send {
                            let _ = tokio::time::timeout(drain, tx.send(r.frame())).await;
                        }
                        break Some(r);
                    }
                },
            }
            if up_done && down_done {
                break None;
            }
        }
    };
    // What this side sent may still be queued: end the outbound stream and wait for the gateway to end its own
    // before dropping the call (dropping it first resets the stream, discarding the queued frames).
    drop(tx);
    let _ = tokio::time::timeout(drain, async {
        while let Some(Ok(_)) = inbound.next().await {}
    })
    .await;
    Outcome {
        up: up_bytes.load(Relaxed),
        down: down_bytes.load(Relaxed),
        refusal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use tokio_stream::wrappers::ReceiverStream;

    type Inbound = ReceiverStream<Result<v1::TunnelFrame, tonic::Status>>;

    /// The gateway's end of one tunnel in a test: what the node sent, and where to send it frames.
    struct Gateway {
        from_node: mpsc::Receiver<v1::TunnelFrame>,
        to_node: mpsc::Sender<Result<v1::TunnelFrame, tonic::Status>>,
    }

    /// Runs `serve` for `open` with a loopback gateway; the gateway end comes back once the node opened its stream.
    async fn start(
        allow: Allowlist,
        open: v1::OpenTunnel,
    ) -> (Gateway, tokio::task::JoinHandle<Outcome>) {
        let (gw_tx, gw_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            serve(&allow, open, |from_node| async move {
                let (to_node, rx) = mpsc::channel(8);
                let _ = gw_tx.send(Gateway { from_node, to_node });
                Ok::<Inbound, tonic::Status>(ReceiverStream::new(rx))
            })
            .await
        });
        let gw = tokio::time::timeout(Duration::from_secs(10), gw_rx)
            .await
            .expect("the node opens its tunnel stream within 10 s")
            .expect("serve hands over the gateway end");
        (gw, task)
    }

    fn open(id: &str, port: u16) -> v1::OpenTunnel {
        v1::OpenTunnel {
            tunnel_id: id.into(),
            port: u32::from(port),
            dial_timeout_ms: 2_000,
        }
    }

    async fn next(gw: &mut Gateway) -> Option<Frame> {
        tokio::time::timeout(Duration::from_secs(10), gw.from_node.recv())
            .await
            .expect("a frame or the end within 10 s")
            .map(|f| f.frame.expect("every frame names its kind"))
    }

    /// A local service that reads until EOF, then answers with the SHA-256 of everything it read and closes: it
    /// answers only after the tunnel's half-close reached it, and its answer must still come back.
    async fn hash_after_eof() -> (u16, tokio::task::JoinHandle<usize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            let mut all = Vec::new();
            s.read_to_end(&mut all).await.expect("read to EOF");
            use sha2::Digest;
            let h = sha2::Sha256::digest(&all);
            s.write_all(&h).await.expect("answer");
            s.shutdown().await.expect("shutdown");
            all.len()
        });
        (port, task)
    }

    /// The close an operator's leaving sends through the gateway.
    fn operator_close() -> Frame {
        Frame::Close(v1::TunnelClose {
            code: v1::TunnelCloseCode::Aborted as i32,
            reason: "operator left".into(),
        })
    }

    async fn send(gw: &Gateway, f: Frame) {
        gw.to_node.send(Ok(frame(f))).await.expect("node reads");
    }

    #[tokio::test]
    async fn bytes_go_both_ways_and_a_half_close_reaches_the_local_port_before_its_answer_comes_back()
     {
        let (port, service) = hash_after_eof().await;
        let (mut gw, task) = start(Allowlist::new([port]), open("t1", port)).await;
        assert_eq!(
            next(&mut gw).await,
            Some(Frame::Open(v1::TunnelOpen {
                tunnel_id: "t1".into()
            }))
        );
        let payload: Vec<u8> = (0..3_000_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for chunk in payload.chunks(50_000) {
            send(&gw, Frame::Data(chunk.to_vec().into())).await;
        }
        send(&gw, Frame::HalfClose(v1::TunnelHalfClose {})).await;
        let mut answer = Vec::new();
        loop {
            match next(&mut gw).await {
                Some(Frame::Data(d)) => answer.extend_from_slice(&d),
                Some(Frame::HalfClose(_)) => break,
                other => panic!("expected data or half_close, got {other:?}"),
            }
        }
        use sha2::Digest;
        assert_eq!(answer, sha2::Sha256::digest(&payload).to_vec());
        assert_eq!(service.await.expect("service"), payload.len());
        let out = task.await.expect("serve");
        assert_eq!(
            out,
            Outcome {
                up: 32,
                down: payload.len() as u64,
                refusal: None
            }
        );
        assert_eq!(
            next(&mut gw).await,
            None,
            "the node ends its stream after both half-closes"
        );
    }

    #[tokio::test]
    async fn a_port_outside_the_allowlist_is_refused_without_a_dial() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let (mut gw, task) = start(
            Allowlist::new([port.wrapping_add(1).max(1)]),
            open("t2", port),
        )
        .await;
        assert!(matches!(next(&mut gw).await, Some(Frame::Open(_))));
        match next(&mut gw).await {
            Some(Frame::Close(c)) => {
                assert_eq!(c.code, v1::TunnelCloseCode::PortNotAllowed as i32);
                assert!(c.reason.contains("[tunnels] allow"), "{}", c.reason);
            }
            other => panic!("expected close, got {other:?}"),
        }
        assert_eq!(next(&mut gw).await, None);
        let out = task.await.expect("serve");
        assert_eq!(
            out.refusal.map(|r| r.code),
            Some(v1::TunnelCloseCode::PortNotAllowed)
        );
        let accepted = tokio::time::timeout(Duration::from_millis(200), l.accept()).await;
        assert!(accepted.is_err(), "nothing dialed the port");
        let empty = start(Allowlist::default(), open("t3", 22)).await;
        let mut gw = empty.0;
        assert!(matches!(next(&mut gw).await, Some(Frame::Open(_))));
        assert!(
            matches!(next(&mut gw).await, Some(Frame::Close(c)) if c.code == v1::TunnelCloseCode::PortNotAllowed as i32)
        );
    }

    #[tokio::test]
    async fn a_refused_dial_closes_only_its_tunnel_beside_a_working_one() {
        let dead = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let dead_port = dead.local_addr().expect("addr").port();
        drop(dead);
        let (port, service) = hash_after_eof().await;
        let allow = Allowlist::new([port, dead_port]);
        let (mut good, good_task) = start(allow.clone(), open("good", port)).await;
        let (mut bad, bad_task) = start(allow, open("bad", dead_port)).await;
        assert!(matches!(next(&mut bad).await, Some(Frame::Open(_))));
        match next(&mut bad).await {
            Some(Frame::Close(c)) => {
                assert_eq!(
                    c.code,
                    v1::TunnelCloseCode::DialRefused as i32,
                    "{}",
                    c.reason
                );
                assert!(c.reason.contains(&dead_port.to_string()), "{}", c.reason);
            }
            other => panic!("expected close, got {other:?}"),
        }
        assert_eq!(
            bad_task.await.expect("serve").refusal.map(|r| r.code),
            Some(v1::TunnelCloseCode::DialRefused)
        );
        assert!(matches!(next(&mut good).await, Some(Frame::Open(_))));
        send(&good, Frame::Data(b"still here".to_vec().into())).await;
        send(&good, Frame::HalfClose(v1::TunnelHalfClose {})).await;
        assert!(matches!(next(&mut good).await, Some(Frame::Data(d)) if d.len() == 32));
        assert!(matches!(next(&mut good).await, Some(Frame::HalfClose(_))));
        assert_eq!(service.await.expect("service"), 10);
        assert_eq!(good_task.await.expect("serve").refusal, None);
    }

    #[tokio::test]
    async fn a_close_from_the_gateway_ends_the_tunnel_and_the_local_connection() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let (mut gw, task) = start(Allowlist::new([port]), open("t4", port)).await;
        let (mut local, _) = l.accept().await.expect("accept");
        assert!(matches!(next(&mut gw).await, Some(Frame::Open(_))));
        send(&gw, operator_close()).await;
        let out = task.await.expect("serve");
        assert_eq!(
            out.refusal.map(|r| r.reason),
            Some("operator left".to_string())
        );
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), local.read(&mut buf))
            .await
            .expect("the local side sees the end within 5 s")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }

    /// A local service that accepts and never reads, and a gateway end that sends one frame larger than both
    /// sockets' buffers can take, so the node's write to the local port blocks: the relay's task, the local
    /// service (held open) and the gateway end.
    async fn blocked_write(
        backstop: Duration,
    ) -> (tokio::task::JoinHandle<Outcome>, TcpStream, Gateway) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let (node_side, accepted) = tokio::join!(TcpStream::connect(addr), l.accept());
        let node_side = node_side.expect("connect");
        let (local, _) = accepted.expect("accept");
        let (tx, from_node) = mpsc::channel(8);
        let (to_node, rx) = mpsc::channel(8);
        let task = tokio::spawn(relay_within(
            node_side,
            tx,
            ReceiverStream::new(rx),
            backstop,
        ));
        let gw = Gateway { from_node, to_node };
        send(&gw, Frame::Data(vec![7u8; 64 << 20].into())).await;
        (task, local, gw)
    }

    #[tokio::test]
    async fn a_close_while_the_local_port_does_not_read_ends_the_tunnel() {
        let (task, _local, gw) = blocked_write(IDLE_BACKSTOP).await;
        // The write is blocked (64 MiB, no reader); the close comes behind it.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !task.is_finished(),
            "the write to a port that does not read blocks"
        );
        send(&gw, operator_close()).await;
        drop(gw.to_node);
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("a close ends the tunnel while its write is blocked")
            .expect("relay");
        assert_eq!(
            out.refusal.map(|r| (r.code, r.reason)),
            Some((v1::TunnelCloseCode::Aborted, "operator left".to_string()))
        );
        assert_eq!(out.down, 0, "the abandoned write is not counted");
    }

    #[tokio::test]
    async fn a_local_port_that_stops_reading_is_given_up_at_the_backstop() {
        let (task, _local, gw) = blocked_write(Duration::from_secs(1)).await;
        let Gateway {
            mut from_node,
            to_node,
        } = gw;
        // The gateway is told why, and then ends its stream, as the gateway does on a close.
        let sent = tokio::time::timeout(Duration::from_secs(10), from_node.recv())
            .await
            .expect("the blocked write is given up at the backstop")
            .and_then(|f| f.frame);
        let Some(Frame::Close(c)) = sent else {
            panic!("a close, not {sent:?}");
        };
        assert_eq!(c.code, v1::TunnelCloseCode::Idle as i32);
        assert!(
            c.reason.contains("did not take 67108864 bytes in 1 s"),
            "{}",
            c.reason
        );
        drop(to_node);
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the relay ends once the gateway ended its stream")
            .expect("relay");
        assert_eq!(out.refusal.map(|r| r.code), Some(v1::TunnelCloseCode::Idle));
    }

    /// A gateway that stops reading the tunnel (its queue full of the local port's data) and never ends its
    /// stream: the relay gives up at the backstop, tries its close within the drain, and ends. Before, the close
    /// waited for room in that full queue with no deadline, and the tunnel held its slot for good.
    #[tokio::test]
    async fn a_gateway_that_stops_reading_is_given_up_at_the_backstop() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let (node_side, accepted) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (mut local, _) = accepted.expect("accept");
        let (tx, from_node) = mpsc::channel(8);
        let (to_node, rx) = mpsc::channel::<Result<v1::TunnelFrame, tonic::Status>>(8);
        let task = tokio::spawn(relay_within(
            node_side.expect("connect"),
            tx,
            ReceiverStream::new(rx),
            Duration::from_secs(1),
        ));
        // The local service sends until the relay stops taking its bytes; nobody reads `from_node`.
        let writer = tokio::spawn(async move {
            let chunk = vec![1u8; 1 << 20];
            while local.write_all(&chunk).await.is_ok() {}
        });
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the relay ends within its backstop and drain")
            .expect("relay");
        let r = out.refusal.expect("a refusal");
        assert_eq!(r.code, v1::TunnelCloseCode::Idle);
        // Whichever backstop fires first: the gateway reads nothing, and sends nothing either.
        assert!(
            r.reason.contains("the gateway read nothing for 1 s")
                || r.reason.contains("nothing from the gateway for 1 s"),
            "{}",
            r.reason
        );
        drop((from_node, to_node));
        writer.abort();
    }

    #[tokio::test]
    async fn an_open_frame_from_the_gateway_is_a_protocol_error_sent_back() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let (mut gw, task) = start(Allowlist::new([port]), open("t5", port)).await;
        assert!(matches!(next(&mut gw).await, Some(Frame::Open(_))));
        send(
            &gw,
            Frame::Open(v1::TunnelOpen {
                tunnel_id: "x".into(),
            }),
        )
        .await;
        assert!(
            matches!(next(&mut gw).await, Some(Frame::Close(c)) if c.code == v1::TunnelCloseCode::Protocol as i32)
        );
        assert_eq!(
            task.await.expect("serve").refusal.map(|r| r.code),
            Some(v1::TunnelCloseCode::Protocol)
        );
    }

    #[test]
    fn the_dial_deadline_is_clamped_and_ports_are_checked() {
        assert!(TunnelsWire { allow: vec![0] }.validate().is_err());
        assert!(TunnelsWire { allow: vec![-1] }.validate().is_err());
        assert!(
            TunnelsWire {
                allow: vec![65_536]
            }
            .validate()
            .is_err()
        );
        let a = TunnelsWire {
            allow: vec![22, 22, 65_535],
        }
        .validate()
        .expect("valid");
        assert_eq!(a.ports().collect::<Vec<_>>(), vec![22, 65_535]);
    }
}
