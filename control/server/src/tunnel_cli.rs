//! `better-compute tunnel <node> <port> [--listen 127.0.0.1:<local>]`, like `ssh -L`: it listens locally and
//! turns each accepted connection into one tunnel (`GET /api/tunnels/{node}/{port}` upgraded to
//! `bc-tunnel/1`, then length-prefixed `TunnelFrame`s, see bc-mod-tunnels). A refused or failed tunnel closes
//! only its own local connection and says why on stderr; the listener goes on. Also `better-compute tunnels
//! list|ports|set-ports`.

use crate::client::{ApiClient, ClientError};
use crate::output::{self, Format, Table};
use bc_core::api::tunnels::{GetPoolPorts, ListTunnels, PoolPorts};
use bc_mod_tunnels::api::{ListTunnelsMethod, PortsMethod, SetPortsMethod};
use bc_proto::tunnel as wire;
use bc_proto::v1;
use bc_proto::v1::tunnel_frame::Frame;
use clap::Subcommand;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The local side's marker for "the link broke while writing" (the reason arrives the other way).
const LINK: &str = "LINK";

/// Where the API is and who calls it.
#[derive(Debug, Clone)]
pub struct Api {
    pub url: String,
    pub key: String,
}

/// How one tunnel connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forwarded {
    /// Bytes from the local connection to the node's port, and back.
    pub to_node: u64,
    pub from_node: u64,
    /// None after a half-close each way; else the close's code name and reason.
    pub closed: Option<(String, String)>,
}

/// The HTTP client for tunnels: reqwest's default TCP_USER_TIMEOUT (30 s) would abort a tunnel whose reader on
/// the node's side is slower than that to take more bytes (a zero window is legitimate here, up to the idle limit);
/// keepalive probes still find a dead peer.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_user_timeout(None)
        .connect_timeout(crate::client::CONNECT_TIMEOUT)
        .build()
        .unwrap_or_default()
}

/// Opens one tunnel: the upgraded connection, or the API's refusal (`{code, message}`), within the CLI's call
/// timeout (the API's own wait for the node to dial is 10 s, plus a relay).
pub async fn connect(
    api: &Api,
    http: &reqwest::Client,
    node: &str,
    port: u16,
) -> Result<reqwest::Upgraded, ClientError> {
    connect_within(api, http, node, port, crate::client::CALL_TIMEOUT).await
}

/// [`connect`], given up after `deadline` ([`ClientError::Timeout`]). Before, an API that accepted the request and
/// never answered held the local connection waiting for ever.
async fn connect_within(
    api: &Api,
    http: &reqwest::Client,
    node: &str,
    port: u16,
    deadline: std::time::Duration,
) -> Result<reqwest::Upgraded, ClientError> {
    let url = format!(
        "{}/api/tunnels/{node}/{port}",
        api.url.trim_end_matches('/')
    );
    tokio::time::timeout(deadline, open(api, http, &url))
        .await
        .map_err(|_| ClientError::Timeout {
            url: url.clone(),
            after: deadline,
        })?
}

async fn open(
    api: &Api,
    http: &reqwest::Client,
    url: &str,
) -> Result<reqwest::Upgraded, ClientError> {
    let failed = |source| ClientError::Http {
        url: url.to_owned(),
        source,
    };
    let resp = http
        .get(url)
        .bearer_auth(&api.key)
        .header(reqwest::header::CONNECTION, "upgrade")
        .header(reqwest::header::UPGRADE, wire::UPGRADE)
        .send()
        .await
        .map_err(failed)?;
    if resp.status() == reqwest::StatusCode::SWITCHING_PROTOCOLS {
        return resp.upgrade().await.map_err(failed);
    }
    #[derive(serde::Deserialize)]
    struct ErrorBody {
        code: String,
        message: String,
    }
    let status = resp.status();
    let body: ErrorBody = resp.json().await.unwrap_or_else(|_| ErrorBody {
        code: "UNAVAILABLE".into(),
        message: format!("the API answered {status} without {{code, message}}"),
    });
    Err(ClientError::Api {
        code: body.code,
        message: body.message,
    })
}

/// Relays `local` through the tunnel `link` until both sides half-closed and the API ended the link, or either side
/// closed. A local connection that stops reading does not hold the tunnel past a close or the link's end that
/// comes right behind the blocked frame, nor past [`wire::IDLE_BACKSTOP`].
pub async fn forward<L, T>(local: L, link: T) -> Forwarded
where
    L: AsyncRead + AsyncWrite,
    T: AsyncRead + AsyncWrite,
{
    forward_within(local, link, wire::IDLE_BACKSTOP).await
}

/// [`forward`] with `backstop` for a write to a local connection that takes nothing.
async fn forward_within<L, T>(local: L, link: T, backstop: std::time::Duration) -> Forwarded
where
    L: AsyncRead + AsyncWrite,
    T: AsyncRead + AsyncWrite,
{
    let (mut lr, mut lw) = tokio::io::split(local);
    let (tr, mut tw) = tokio::io::split(link);
    let mut tr = wire::FrameReader::new(tr);
    let to_node = AtomicU64::new(0);
    let from_node = AtomicU64::new(0);
    let up = async {
        let mut buf = vec![0u8; wire::MAX_DATA];
        loop {
            let n = match lr.read(&mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    let reason = format!("reading the local connection: {e}");
                    let _ =
                        wire::write(&mut tw, &wire::close(v1::TunnelCloseCode::Aborted, &reason))
                            .await;
                    return Err(("ABORTED".to_string(), reason));
                }
            };
            let f = match n {
                0 => wire::frame(Frame::HalfClose(v1::TunnelHalfClose {})),
                n => wire::frame(Frame::Data(wire::bytes::Bytes::copy_from_slice(&buf[..n]))),
            };
            if let Err(e) = wire::write(&mut tw, &f).await {
                // The API closed the link: why comes (or came) as a `close` frame the other way.
                return Err((LINK.to_string(), format!("the tunnel link: {e}")));
            }
            if n == 0 {
                return Ok(());
            }
            to_node.fetch_add(n as u64, Relaxed);
        }
    };
    // After the node's half-close the link is still read: the API ends it once both sides half-closed, or sends
    // why the tunnel ended early (the node's session ended while the operator still wrote).
    let down = to_local(&mut tr, &mut lw, &from_node, backstop);
    tokio::pin!(up, down);
    let (mut up_done, mut down_done) = (false, false);
    let mut link_lost = None;
    let closed = loop {
        tokio::select! {
            r = &mut up, if !up_done => match r {
                Ok(()) => up_done = true,
                Err(e) if e.0 == LINK && !down_done => {
                    up_done = true;
                    link_lost = Some(("ABORTED".to_string(), e.1));
                }
                Err(e) => break Some(e),
            },
            r = &mut down, if !down_done => match r {
                Ok(()) => down_done = true,
                Err(e) => break Some(e),
            },
        }
        if up_done && down_done {
            break link_lost;
        }
    };
    Forwarded {
        to_node: to_node.load(Relaxed),
        from_node: from_node.load(Relaxed),
        closed,
    }
}

/// The API → local half of [`forward_within`]. Ok: the node half-closed and the API then ended the link.
async fn to_local<R, W>(
    tr: &mut wire::FrameReader<R>,
    lw: &mut W,
    from_node: &AtomicU64,
    backstop: std::time::Duration,
) -> Result<(), (String, String)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut half_closed = false;
    // A frame read while a write to the local connection was blocked, handled next.
    let mut held = None;
    loop {
        let next = match held.take() {
            Some(next) => next,
            None => tr.next().await,
        };
        let f = match next {
            Ok(Some(f)) => f,
            Ok(None) if half_closed => return Ok(()),
            Ok(None) => {
                return Err((
                    "ABORTED".to_string(),
                    "the API ended the tunnel before a half-close".to_string(),
                ));
            }
            Err(e) => return Err(("PROTOCOL".to_string(), e.to_string())),
        };
        match f.frame {
            Some(Frame::Data(_)) if half_closed => {
                return Err((
                    "PROTOCOL".into(),
                    "the API sent data after the node's half-close".into(),
                ));
            }
            Some(Frame::Data(d)) => {
                // The operator's program may stop reading and block this write. Meanwhile the link is read
                // one frame ahead (`FrameReader::next` is cancel-safe): a close or the link's end abandons
                // the write; the write has the backstop's deadline.
                let (written, read) = wire::write_reading_ahead(
                    lw,
                    &d,
                    tr.next(),
                    |n| !matches!(n, Ok(Some(f)) if wire::carries_on(f)),
                    backstop,
                )
                .await;
                held = read;
                match written {
                    wire::Written::Done(Ok(())) => {
                        from_node.fetch_add(d.len() as u64, Relaxed);
                    }
                    wire::Written::Done(Err(e)) => {
                        return Err((
                            "ABORTED".into(),
                            format!("writing the local connection: {e}"),
                        ));
                    }
                    wire::Written::Abandoned => {}
                    wire::Written::TimedOut => {
                        return Err((
                            bc_mod_tunnels::relay::code_name(v1::TunnelCloseCode::Idle),
                            format!(
                                "the local connection did not take {} bytes in {} s",
                                d.len(),
                                backstop.as_secs()
                            ),
                        ));
                    }
                }
            }
            Some(Frame::HalfClose(_)) if !half_closed => {
                let _ = lw.shutdown().await;
                half_closed = true;
            }
            Some(Frame::Close(c)) => {
                let code = v1::TunnelCloseCode::try_from(c.code)
                    .map(bc_mod_tunnels::relay::code_name)
                    .unwrap_or_else(|_| format!("code {}", c.code));
                return Err((code, c.reason));
            }
            _ => {
                return Err((
                    "PROTOCOL".into(),
                    "the API sent a frame other than data, half_close or close".into(),
                ));
            }
        }
    }
}

/// One local connection end to end: the tunnel, or the refusal, and how it ended.
pub async fn serve_one(
    api: &Api,
    http: &reqwest::Client,
    node: &str,
    port: u16,
    local: TcpStream,
) -> Result<Forwarded, ClientError> {
    let _ = local.set_nodelay(true);
    let link = connect(api, http, node, port).await?;
    Ok(forward(local, link).await)
}

/// Accepts local connections on `listener` forever, one tunnel each.
pub async fn listen(
    api: Api,
    node: String,
    port: u16,
    listener: TcpListener,
) -> anyhow::Result<()> {
    let http = http_client();
    loop {
        let (local, peer) = listener.accept().await?;
        let (api, http, node) = (api.clone(), http.clone(), node.clone());
        tokio::spawn(async move {
            match serve_one(&api, &http, &node, port, local).await {
                Ok(Forwarded {
                    closed: None,
                    to_node,
                    from_node,
                }) => {
                    tracing::debug!(%peer, to_node, from_node, "tunnel closed");
                }
                Ok(Forwarded {
                    closed: Some((code, reason)),
                    ..
                }) => {
                    eprintln!("tunnel to {node}:{port} for {peer}: {code}: {reason}");
                }
                Err(e) => eprintln!(
                    "tunnel to {node}:{port} for {peer}: {}",
                    bc_error_chain::chain(&e)
                ),
            }
        });
    }
}

/// `better-compute tunnel <node> <port> [--listen <addr>]`: binds (port 0 picks one) and prints the address.
pub async fn tunnel(
    api: Api,
    node: String,
    port: u16,
    listen_on: SocketAddr,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen_on)
        .await
        .map_err(|e| anyhow::anyhow!("listening on {listen_on}: {e}"))?;
    let local = listener.local_addr()?;
    println!("forwarding {local} -> {node}:{port} (one tunnel per connection; Ctrl-C stops)");
    tokio::select! {
        r = listen(api, node, port, listener) => r,
        _ = bc_proto::runtime::shutdown_signal() => Ok(()),
    }
}

#[derive(Subcommand)]
pub enum TunnelsCommand {
    /// The audit of tunnel connections, newest first (principal, node, port, start, stop, bytes, outcome).
    List {
        #[arg(long)]
        node: Option<String>,
        #[arg(long)]
        limit: Option<u32>,
    },
    /// A pool's tunnel port allowlist.
    Ports { pool: String },
    /// Replaces a pool's tunnel port allowlist (no ports refuses every tunnel to its nodes).
    SetPorts { pool: String, ports: Vec<u16> },
}

pub async fn tunnels(
    client: &ApiClient,
    out: Format,
    command: TunnelsCommand,
) -> anyhow::Result<()> {
    match command {
        TunnelsCommand::List { node, limit } => {
            let v = client
                .method::<ListTunnelsMethod>(&ListTunnels { node, limit })
                .await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&[
                    "NODE",
                    "PORT",
                    "PRINCIPAL",
                    "OUTCOME",
                    "STARTED",
                    "STOPPED",
                    "TO NODE",
                    "FROM NODE",
                ])
                .wide(&["ID", "POOL", "REASON"]);
                for r in &v.tunnels {
                    t.row(vec![
                        r.node.clone(),
                        r.port.to_string(),
                        r.principal.clone(),
                        r.outcome.clone(),
                        output::age(Some(r.started_at_ms), now),
                        output::age(r.stopped_at_ms, now),
                        r.bytes_to_node.to_string(),
                        r.bytes_from_node.to_string(),
                        r.id.clone(),
                        r.pool.clone(),
                        r.reason.clone(),
                    ]);
                }
                t
            })
        }
        TunnelsCommand::Ports { pool } => {
            let v = client.method::<PortsMethod>(&GetPoolPorts { pool }).await?;
            print_ports(out, &v)
        }
        TunnelsCommand::SetPorts { pool, ports } => {
            let v = client
                .method::<SetPortsMethod>(&PoolPorts { pool, ports })
                .await?;
            print_ports(out, &v)
        }
    }
}

/// A pool's allowlist: `POOL PORTS` (or the answer itself in JSON or YAML).
fn print_ports(out: Format, v: &PoolPorts) -> anyhow::Result<()> {
    output::print(out, v, || {
        let mut t = Table::new(&["POOL", "PORTS"]);
        let ports: Vec<String> = v.ports.iter().map(u16::to_string).collect();
        t.row(vec![v.pool.clone(), ports.join(",")]);
        t
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::DuplexStream;
    use tokio::task::JoinHandle;

    fn data(byte: u8) -> v1::TunnelFrame {
        wire::frame(Frame::Data(vec![byte; wire::MAX_DATA].into()))
    }

    /// `forward` between a local program that reads nothing yet (a 1 KiB pipe) and the API's end of the link,
    /// which sends one full data frame the pipe cannot take: the task, the program's end and the API's end.
    async fn blocked_write(
        backstop: Duration,
    ) -> (JoinHandle<Forwarded>, DuplexStream, DuplexStream) {
        let (local, program) = tokio::io::duplex(1024);
        let (link, mut api) = tokio::io::duplex(1 << 20);
        let task = tokio::spawn(forward_within(local, link, backstop));
        wire::write(&mut api, &data(1))
            .await
            .expect("the link takes a frame");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !task.is_finished(),
            "a write to a program that does not read blocks"
        );
        (task, program, api)
    }

    /// An API that takes the tunnel's request and never answers: the opening is given up at its deadline.
    #[tokio::test]
    async fn an_api_that_never_answers_the_opening_is_given_up() {
        bc_proto::install_crypto_provider();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let holder = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((tcp, _)) = listener.accept().await {
                held.push(tcp);
            }
        });
        let api = Api {
            url,
            key: "k".into(),
        };
        let began = std::time::Instant::now();
        let e = tokio::time::timeout(
            Duration::from_secs(20),
            connect_within(&api, &http_client(), "n1", 22, Duration::from_millis(500)),
        )
        .await
        .expect("given up at the deadline, not left waiting")
        .expect_err("nothing answers");
        assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        holder.abort();
    }

    async fn ended(task: JoinHandle<Forwarded>) -> Forwarded {
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the tunnel ends while its write is blocked")
            .expect("forward")
    }

    #[tokio::test]
    async fn a_close_while_the_local_program_does_not_read_ends_the_tunnel() {
        let (task, _program, mut api) = blocked_write(wire::IDLE_BACKSTOP).await;
        let close = wire::close(v1::TunnelCloseCode::Aborted, "the node's service closed");
        wire::write(&mut api, &close).await.expect("write");
        let out = ended(task).await;
        assert_eq!(
            out.closed,
            Some(("ABORTED".into(), "the node's service closed".into()))
        );
        assert_eq!(out.from_node, 0, "the abandoned write is not counted");
    }

    #[tokio::test]
    async fn the_link_ending_while_the_local_program_does_not_read_ends_the_tunnel() {
        let (task, _program, api) = blocked_write(wire::IDLE_BACKSTOP).await;
        drop(api);
        let out = ended(task).await;
        assert_eq!(
            out.closed,
            Some((
                "ABORTED".into(),
                "the API ended the tunnel before a half-close".into()
            ))
        );
    }

    #[tokio::test]
    async fn a_local_program_that_stops_reading_is_given_up_at_the_backstop() {
        let (task, _program, mut api) = blocked_write(Duration::from_secs(1)).await;
        // Held behind the blocked write, and no close comes.
        wire::write(&mut api, &data(2)).await.expect("write");
        let out = ended(task).await;
        assert_eq!(
            out.closed,
            Some((
                "IDLE".into(),
                format!(
                    "the local connection did not take {} bytes in 1 s",
                    wire::MAX_DATA
                )
            ))
        );
    }

    /// A frame read ahead while the write was blocked is written next, in order, once the program reads again.
    #[tokio::test]
    async fn a_slow_program_gets_every_frame_in_order() {
        let (task, mut program, mut api) = blocked_write(wire::IDLE_BACKSTOP).await;
        wire::write(&mut api, &data(2)).await.expect("write");
        wire::write(
            &mut api,
            &wire::frame(Frame::HalfClose(v1::TunnelHalfClose {})),
        )
        .await
        .expect("write");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut got = Vec::new();
        program.read_to_end(&mut got).await.expect("read");
        let mut want = vec![1u8; wire::MAX_DATA];
        want.extend(vec![2u8; wire::MAX_DATA]);
        assert!(got == want, "{} bytes, not both frames in order", got.len());
        // The program half-closes; the API ends the link once both sides did.
        program.shutdown().await.expect("shutdown");
        let mut link = wire::FrameReader::new(&mut api);
        let f = link.next().await.expect("read").expect("a frame");
        assert!(matches!(f.frame, Some(Frame::HalfClose(_))), "{f:?}");
        drop(link);
        drop(api);
        let out = ended(task).await;
        assert_eq!(out.closed, None);
        assert_eq!(out.from_node, 2 * wire::MAX_DATA as u64);
    }
}
