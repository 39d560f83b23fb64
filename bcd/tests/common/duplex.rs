//! Bulk bytes both ways through a tunnel at once, hashed, with a local service whose reading never waits on its
//! writing.
//!
//! An echo service (read, then write what was read) stops reading while its write is blocked. On Linux since "tcp: do
//! not accept packets beyond window" (July 2025; this machine runs 6.18) that can stall a loopback connection until TCP
//! gives up when both directions carry bulk data: the echo's full receive queue drops an in-window segment for memory
//! (`PROTO_MEM`), each retransmission of it then ends beyond the window and is dropped whole, its ACK with it
//! (`TCP_INVALID_END_SEQUENCE`, counted as `TcpExtBeyondWindow`), so the echo's own data is never acknowledged, its
//! write never ends and its queue is never read, until `tcp_retries2` (about 15 minutes) resets the connection. Seen
//! 2026-12-07 between bcd and the test's echo in 1 of 18 runs of `bcd/tests/tunnel.rs` (the stop 54 note): the kernel's
//! and the echo's doing, not the relay's, and a test that stalls on it says nothing about bcd. The [`duplex`] service
//! sends its own bytes and hashes what it reads, each on its own task, as an interactive service (a shell over ssh, a
//! notebook) does. The [`echo`] service is kept for tunnels too small to fill a socket's queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A byte stream's SHA-256 and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hashed {
    pub sha256: [u8; 32],
    pub bytes: u64,
}

fn finish(h: ring::digest::Context, bytes: u64) -> Hashed {
    let mut sha256 = [0u8; 32];
    sha256.copy_from_slice(h.finish().as_ref());
    Hashed { sha256, bytes }
}

/// Writes `bytes` random bytes to `w` in pieces of 1 MiB, then shuts its write side down: what it wrote.
pub async fn send_random(mut w: impl AsyncWrite + Unpin, bytes: u64) -> std::io::Result<Hashed> {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        getrandom::fill(&mut buf[..n]).map_err(std::io::Error::other)?;
        h.update(&buf[..n]);
        w.write_all(&buf[..n]).await?;
        left -= n as u64;
    }
    w.shutdown().await?;
    Ok(finish(h, bytes))
}

/// Reads `r` to its end: what it read.
pub async fn read_hashed(mut r: impl AsyncRead + Unpin) -> std::io::Result<Hashed> {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok(finish(h, got));
        }
        h.update(&buf[..n]);
        got += n as u64;
    }
}

/// What the [`duplex`] service read from one connection and what it wrote to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub read: Hashed,
    pub wrote: Hashed,
}

/// A local service: on each connection it writes `bytes` random bytes and half-closes, and meanwhile reads to
/// the end, each on its own task; [`Duplex::served`] says what each connection carried.
pub struct Duplex {
    pub port: u16,
    served: mpsc::UnboundedReceiver<std::io::Result<Served>>,
}

pub async fn duplex(bytes: u64) -> Duplex {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind duplex");
    let port = l.local_addr().expect("addr").port();
    let (tx, served) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let (r, w) = s.into_split();
                let (read, wrote) = tokio::join!(
                    tokio::spawn(read_hashed(r)),
                    tokio::spawn(send_random(w, bytes))
                );
                let joined = |j: Result<std::io::Result<Hashed>, tokio::task::JoinError>| {
                    j.map_err(std::io::Error::other).and_then(|r| r)
                };
                let _ = tx.send(
                    joined(read).and_then(|read| joined(wrote).map(|wrote| Served { read, wrote })),
                );
            });
        }
    });
    Duplex { port, served }
}

impl Duplex {
    /// What the next connection that ended carried, within `deadline`.
    pub async fn served(&mut self, deadline: Duration) -> Result<Served, String> {
        match tokio::time::timeout(deadline, self.served.recv()).await {
            Ok(Some(Ok(s))) => Ok(s),
            Ok(Some(Err(e))) => Err(format!("the duplex service's connection failed: {e}")),
            Ok(None) => Err("the duplex service stopped".into()),
            Err(_) => Err(format!(
                "no connection to the duplex service ended within {deadline:?}"
            )),
        }
    }
}

/// The operator's side: connects to `addr`, sends `bytes` random bytes and reads to the end, at once: (what it
/// sent, what it received).
pub async fn exchange(addr: std::net::SocketAddr, bytes: u64) -> std::io::Result<(Hashed, Hashed)> {
    let s = TcpStream::connect(addr).await?;
    let _ = s.set_nodelay(true);
    let (r, w) = s.into_split();
    let (sent, got) = tokio::join!(send_random(w, bytes), read_hashed(r));
    Ok((sent?, got?))
}

/// A local service that echoes what it reads and half-closes after the peer's EOF; counts its connections.
pub struct Echo {
    pub port: u16,
    accepted: Arc<AtomicU64>,
}

impl Echo {
    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Relaxed)
    }
}

pub async fn echo() -> Echo {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind echo");
    let port = l.local_addr().expect("addr").port();
    let accepted = Arc::new(AtomicU64::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            count.fetch_add(1, Relaxed);
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    Echo { port, accepted }
}
