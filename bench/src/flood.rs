//! Hostile connections against the gateway, held open: the load of `scripts/bench gateway-flood` and of the
//! gateway's flood regression tests (control/server/tests/gateway_flood.rs). Every connection comes from a source
//! address of the caller's choosing (the whole 127/8 is loopback), and one the gateway closes is opened again
//! ([`Reopen`]), so the pressure stays. Re-opening is paced: the attack modelled is holding connections (handshake
//! slots, descriptors), not a flood of TLS handshakes at line rate, which costs the attacker as much CPU as the
//! gateway and is bounded by rate limits in front of it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// What a hostile connection does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Connects and never sends a byte: the TLS handshake never finishes.
    Tcp,
    /// Finishes the TLS handshake (no client certificate) and never sends the HTTP/2 preface.
    Tls,
    /// Sends the preface and SETTINGS, acknowledges SETTINGS and answers PING (so keepalive never closes it), and
    /// never opens a stream: never a Join, never a Hello.
    H2,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Tls => "tls",
            Kind::H2 => "h2",
        }
    }
}

/// `n` source addresses from 127.0.0.2 up (127.0.0.2 … 127.0.0.251, then 127.0.1.2 …).
pub fn loopback_sources(n: usize) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|i| Ipv4Addr::new(127, 0, (i / 250) as u8, (2 + i % 250) as u8))
        .collect()
}

#[derive(Default)]
struct Counters {
    held: AtomicUsize,
    attempts: AtomicUsize,
    closed_by_gateway: AtomicUsize,
    connect_failures: AtomicUsize,
}

/// How a flood opens again the connections the gateway closed: each after `after`, and at most `per_second` of them
/// a second across the flood.
#[derive(Debug, Clone, Copy)]
pub struct Reopen {
    pub after: Duration,
    pub per_second: f64,
}

/// A flood in progress.
pub struct Flood {
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    tasks: tokio::task::JoinSet<()>,
}

impl Flood {
    /// `n` connections of `kind` to `gateway`, `per_source` from each of `sources` in turn, all opened at once; one
    /// the gateway closes is opened again as `reopen` says. `tls` is a client config with ALPN h2 that trusts the
    /// gateway.
    pub fn start(
        kind: Kind,
        n: usize,
        per_source: usize,
        sources: &[Ipv4Addr],
        gateway: SocketAddr,
        tls: Arc<rustls::ClientConfig>,
        reopen: Reopen,
    ) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        // Opened 256 at a time: a burst of SYNs past the listen backlog would only measure the kernel.
        let opening = Arc::new(tokio::sync::Semaphore::new(256));
        let pacer = Arc::new(std::sync::Mutex::new(tokio::time::Instant::now()));
        let interval = Duration::from_secs_f64(1.0 / reopen.per_second.max(0.001));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..n {
            let source = sources[(i / per_source.max(1)) % sources.len().max(1)];
            let (stop, counters, tls, opening, pacer) = (
                stop.clone(),
                counters.clone(),
                tls.clone(),
                opening.clone(),
                pacer.clone(),
            );
            tasks.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let opened = {
                        let Ok(_slot) = opening.acquire().await else {
                            return;
                        };
                        tokio::time::timeout(
                            Duration::from_secs(5),
                            open(kind, source, gateway, tls.clone()),
                        )
                        .await
                    };
                    counters.attempts.fetch_add(1, Ordering::Relaxed);
                    match opened {
                        Ok(Ok(conn)) => {
                            counters.held.fetch_add(1, Ordering::Relaxed);
                            conn.hold().await;
                            counters.held.fetch_sub(1, Ordering::Relaxed);
                            counters.closed_by_gateway.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            counters.connect_failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    tokio::time::sleep(reopen.after).await;
                    let slot = {
                        let Ok(mut next) = pacer.lock() else {
                            return;
                        };
                        let slot = (*next).max(tokio::time::Instant::now());
                        *next = slot + interval;
                        slot
                    };
                    tokio::time::sleep_until(slot).await;
                }
            });
        }
        Flood {
            stop,
            counters,
            tasks,
        }
    }

    /// Connections open now (past their own TLS handshake for `tls` and `h2`).
    pub fn held(&self) -> usize {
        self.counters.held.load(Ordering::Relaxed)
    }

    /// Connections the gateway closed so far.
    pub fn closed_by_gateway(&self) -> usize {
        self.counters.closed_by_gateway.load(Ordering::Relaxed)
    }

    /// Attempts that failed to open (refused, reset, no answer within 5 s).
    pub fn connect_failures(&self) -> usize {
        self.counters.connect_failures.load(Ordering::Relaxed)
    }

    /// Waits until every connection was tried once (or `limit` has passed); returns how many are held then.
    pub async fn wait_opened(&self, n: usize, limit: Duration) -> usize {
        let t = Instant::now();
        while self.counters.attempts.load(Ordering::Relaxed) < n && t.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.held()
    }

    /// Closes every connection of the flood.
    pub async fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }
}

enum Hostile {
    Tcp(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
    H2(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

async fn open(
    kind: Kind,
    source: Ipv4Addr,
    gateway: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
) -> anyhow::Result<Hostile> {
    let tcp = bc_proto::channel::tcp_from(IpAddr::V4(source), gateway).await?;
    if kind == Kind::Tcp {
        return Ok(Hostile::Tcp(tcp));
    }
    let name = ServerName::try_from(gateway.ip().to_string())?;
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?;
    if kind == Kind::Tls {
        return Ok(Hostile::Tls(Box::new(stream)));
    }
    // The client connection preface (RFC 9113 §3.4): the magic, then an empty SETTINGS frame.
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await?;
    stream.flush().await?;
    Ok(Hostile::H2(Box::new(stream)))
}

impl Hostile {
    /// Holds the connection until the gateway closes it.
    async fn hold(self) {
        let mut buf = [0u8; 4096];
        match self {
            Hostile::Tcp(mut s) => while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {},
            Hostile::Tls(mut s) => while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {},
            Hostile::H2(mut s) => {
                let _ = answer_h2(&mut s).await;
            }
        }
    }
}

/// Reads HTTP/2 frames, acknowledging SETTINGS and answering PING, and never opens a stream. Returns when the
/// connection ends.
async fn answer_h2(
    s: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
) -> std::io::Result<()> {
    loop {
        let mut header = [0u8; 9];
        s.read_exact(&mut header).await?;
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let (kind, flags) = (header[3], header[4]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await?;
        match (kind, flags & 1) {
            (4, 0) => s.write_all(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00").await?,
            (6, 0) => {
                let mut pong = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                pong.extend_from_slice(&payload);
                s.write_all(&pong).await?;
            }
            _ => {}
        }
        s.flush().await?;
    }
}
