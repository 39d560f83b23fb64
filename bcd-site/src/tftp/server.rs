//! The read-only TFTP server: requests arrive on the listening socket; each accepted read runs as its own task
//! on its own ephemeral socket (the transfer ID of RFC 1350), bounded by a semaphore. Writes are refused.

use std::collections::VecDeque;
use std::fs::File;
use std::future::Future;
use std::io::{self, Read as _};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::UdpSocket;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout_at};
use tracing::{debug, info, warn};

use super::codec::{ErrorCode, Mode, Packet, Request, encode_data, encode_error};
use super::root::{RootError, ServeRoot};
use super::{Limits, Negotiated, negotiate};

/// Bytes read from the file at a time.
const READ_AHEAD: usize = 256 * 1024;

/// What the server did, for metrics and tests.
#[derive(Debug, Default)]
pub struct TftpCounters {
    pub started: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub refused: AtomicU64,
    pub malformed: AtomicU64,
}

/// Serves `root` read-only until `shutdown` completes; running transfers are then cancelled.
pub async fn run(
    socket: UdpSocket,
    root: &Path,
    limits: Limits,
    counters: Arc<TftpCounters>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RootError> {
    let root = ServeRoot::new(root)?;
    let local_ip = socket
        .local_addr()
        .map(|a| a.ip())
        .map_err(|source| RootError {
            path: root.path().to_owned(),
            source,
        })?;
    let slots = Arc::new(Semaphore::new(limits.max_transfers.max(1)));
    let limits = Arc::new(limits);
    let mut transfers = JoinSet::new();
    let mut buf = vec![0u8; 2048];
    let mut out = Vec::with_capacity(128);
    tokio::pin!(shutdown);
    info!(root = %root.path().display(), "TFTP serving");
    loop {
        let (len, peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(done) = transfers.join_next(), if !transfers.is_empty() => {
                if let Err(e) = done {
                    warn!(error = %e, "TFTP transfer task ended abnormally");
                }
                continue;
            }
            r = socket.recv_from(&mut buf) => match r {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %e, "TFTP receive failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let refusal = match Packet::decode(&buf[..len]) {
            Ok(Packet::Rrq(req)) if req.mode != Mode::Octet => {
                Some((ErrorCode::IllegalOperation, "only octet mode is served"))
            }
            Ok(Packet::Rrq(req)) => match slots.clone().try_acquire_owned() {
                Ok(permit) => {
                    counters.started.fetch_add(1, Ordering::Relaxed);
                    let (root, limits, counters) = (root.clone(), limits.clone(), counters.clone());
                    transfers.spawn(async move {
                        let _permit = permit;
                        let file = req.filename.clone();
                        match transfer(local_ip, peer, req, &root, &limits).await {
                            Ok(Outcome::Sent { bytes }) => {
                                counters.completed.fetch_add(1, Ordering::Relaxed);
                                debug!(%peer, %file, bytes, "TFTP transfer complete");
                            }
                            Ok(Outcome::Declined { code, message }) => {
                                counters.completed.fetch_add(1, Ordering::Relaxed);
                                debug!(%peer, %file, ?code, %message, "TFTP client ended after the OACK");
                            }
                            Ok(Outcome::Refused(r)) => {
                                counters.refused.fetch_add(1, Ordering::Relaxed);
                                debug!(%peer, code = ?r.0, reason = %r.1, "TFTP request refused");
                            }
                            Err(e) => {
                                counters.failed.fetch_add(1, Ordering::Relaxed);
                                debug!(%peer, %file, error = %e, "TFTP transfer failed");
                            }
                        }
                    });
                    None
                }
                Err(_) => Some((ErrorCode::NotDefined, "server busy, retry later")),
            },
            Ok(Packet::Wrq(_)) => Some((ErrorCode::AccessViolation, "read-only server")),
            Ok(other) => {
                counters.malformed.fetch_add(1, Ordering::Relaxed);
                debug!(%peer, packet = ?other, "TFTP packet without a transfer dropped");
                None
            }
            Err(e) => {
                counters.malformed.fetch_add(1, Ordering::Relaxed);
                debug!(%peer, error = %e, "malformed TFTP request");
                Some((ErrorCode::IllegalOperation, "malformed request"))
            }
        };
        if let Some((code, message)) = refusal {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            debug!(%peer, ?code, message, "TFTP request refused");
            encode_error(code, message, &mut out);
            let _ = socket.send_to(&out, peer).await;
        }
    }
    transfers.shutdown().await;
    debug!("TFTP stopped");
    Ok(())
}

enum Outcome {
    Sent {
        bytes: u64,
    },
    /// The client answered the OACK with an error (a `tsize` probe, or options it dislikes).
    Declined {
        code: ErrorCode,
        message: String,
    },
    Refused((ErrorCode, String)),
}

/// Why a transfer stopped early.
#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error("socket")]
    Io(#[from] io::Error),
    #[error("no answer after {retries} retransmissions")]
    TimedOut { retries: u32 },
    #[error("client sent error {code:?}: {message}")]
    ClientError { code: ErrorCode, message: String },
    #[error("file size changed while being served")]
    SizeChanged,
}

async fn transfer(
    local_ip: std::net::IpAddr,
    peer: SocketAddr,
    req: Request,
    root: &ServeRoot,
    limits: &Limits,
) -> Result<Outcome, TransferError> {
    let socket = UdpSocket::bind((local_ip, 0)).await?;
    socket.connect(peer).await?;
    let mut out = Vec::new();
    // Opening and the first read-ahead share one trip to the blocking pool: most loaders fit in it.
    let opened = {
        let (root, name) = (root.clone(), req.filename.clone());
        tokio::task::spawn_blocking(move || {
            let (file, size) = root.open(&name)?;
            Ok::<_, super::root::Refusal>(ChunkReader::start(file, size))
        })
        .await
        .map_err(io::Error::other)?
    };
    let (reader, size) = match opened {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            encode_error(ErrorCode::NotDefined, "server read error", &mut out);
            socket.send(&out).await?;
            return Err(TransferError::Io(e));
        }
        Err(refusal) => {
            encode_error(refusal.code, refusal.message, &mut out);
            socket.send(&out).await?;
            return Ok(Outcome::Refused((refusal.code, refusal.to_string())));
        }
    };
    let n = negotiate(&req.options, size, limits);
    let mut link = Link {
        socket,
        n,
        max_retries: limits.max_retries,
        buf: vec![0u8; 65536 + 4],
    };
    if !link.n.oack.is_empty() {
        Packet::Oack(link.n.oack.clone()).encode(&mut out);
        // Block 0 acknowledges the OACK. A client that only wanted `tsize` answers with error 8 instead.
        match link.send_until_acked(&[out.as_slice()], 0).await {
            Ok(_) => {}
            Err(TransferError::ClientError { code, message }) => {
                return Ok(Outcome::Declined { code, message });
            }
            Err(e) => return Err(e),
        }
    }
    match link.send_file(reader, size).await {
        Ok(bytes) => Ok(Outcome::Sent { bytes }),
        Err(e) => {
            // Our side failed (read error, file changed): tell the client rather than leave it waiting.
            if matches!(e, TransferError::Io(_) | TransferError::SizeChanged) {
                encode_error(ErrorCode::NotDefined, "server read error", &mut out);
                let _ = link.socket.send(&out).await;
            }
            Err(e)
        }
    }
}

/// One transfer's socket and negotiated parameters.
struct Link {
    socket: UdpSocket,
    n: Negotiated,
    max_retries: u32,
    buf: Vec<u8>,
}

impl Link {
    /// Sends the file in windows of `windowsize` blocks; an ACK for block k starts the next window at k+1
    /// (RFC 7440). Block numbers wrap after 65535 to 0, as tftp-hpa and curl expect.
    async fn send_file(&mut self, mut file: ChunkReader, size: u64) -> Result<u64, TransferError> {
        let blksize = self.n.blksize;
        let window = usize::from(self.n.windowsize);
        // Unacknowledged blocks: (absolute block number, encoded DATA packet).
        let mut pending: VecDeque<(u64, Vec<u8>)> = VecDeque::with_capacity(window);
        let mut next_block: u64 = 1;
        let mut read_done = false;
        let mut sent_bytes: u64 = 0;
        let mut chunk = vec![0u8; blksize];
        loop {
            while pending.len() < window && !read_done {
                let n = file.read_block(&mut chunk).await?;
                if n < blksize {
                    read_done = true;
                }
                sent_bytes += n as u64;
                let mut pkt = Vec::with_capacity(n + 4);
                encode_data(next_block as u16, &chunk[..n], &mut pkt);
                pending.push_back((next_block, pkt));
                next_block += 1;
            }
            let Some(&(first, _)) = pending.front() else {
                break;
            };
            let packets: Vec<&[u8]> = pending.iter().map(|(_, p)| p.as_slice()).collect();
            let acked = self.send_until_acked(&packets, first).await?;
            // Drop everything up to and including the acknowledged block.
            while pending.front().is_some_and(|(b, _)| *b <= acked) {
                pending.pop_front();
            }
            if read_done && pending.is_empty() {
                break;
            }
        }
        if sent_bytes != size {
            // The file changed while being served; the client got a consistent prefix but not the announced size.
            return Err(TransferError::SizeChanged);
        }
        Ok(sent_bytes)
    }

    /// Sends `packets` (blocks `first`, `first+1`, ... by absolute number) and waits for an ACK of any of them,
    /// retransmitting on timeout up to the retry cap. Stale and foreign packets are ignored without resending
    /// (no Sorcerer's Apprentice). Returns the absolute number of the highest block acknowledged.
    async fn send_until_acked(
        &mut self,
        packets: &[&[u8]],
        first: u64,
    ) -> Result<u64, TransferError> {
        let last = first + packets.len() as u64 - 1;
        let mut retries = 0;
        loop {
            for p in packets {
                self.socket.send(p).await?;
            }
            let deadline = Instant::now() + self.n.timeout;
            loop {
                let len = match timeout_at(deadline, self.socket.recv(&mut self.buf)).await {
                    Err(_) => break,
                    // ICMP port unreachable surfaces as ECONNREFUSED on a connected socket: the client left.
                    Ok(r) => r?,
                };
                match Packet::decode(&self.buf[..len]) {
                    Ok(Packet::Ack { block }) => {
                        // Map the 16-bit block number onto the window being sent.
                        if let Some(abs) = (first..=last).rev().find(|b| *b as u16 == block) {
                            return Ok(abs);
                        }
                        // With a window, an ACK of the block before it says the client saw a gap (RFC 7440):
                        // resend now. In lockstep such an ACK is a stale duplicate and is ignored.
                        if packets.len() > 1 && first > 0 && block == (first - 1) as u16 {
                            break;
                        }
                    }
                    Ok(Packet::Error { code, message }) => {
                        return Err(TransferError::ClientError { code, message });
                    }
                    _ => {}
                }
            }
            retries += 1;
            if retries > self.max_retries {
                return Err(TransferError::TimedOut {
                    retries: retries - 1,
                });
            }
        }
    }
}

/// Reads the file in [`READ_AHEAD`] chunks on the blocking pool and hands it out block by block: one pool trip
/// per chunk instead of one per block.
struct ChunkReader {
    file: Option<File>,
    chunk: Vec<u8>,
    pos: usize,
    eof: bool,
}

impl ChunkReader {
    /// Blocking: reads the first chunk. Returns the reader and the file size.
    fn start(file: File, size: u64) -> io::Result<(ChunkReader, u64)> {
        let mut r = ChunkReader {
            file: Some(file),
            chunk: Vec::new(),
            pos: 0,
            eof: false,
        };
        r.refill_blocking()?;
        Ok((r, size))
    }

    fn refill_blocking(&mut self) -> io::Result<()> {
        self.chunk.resize(READ_AHEAD, 0);
        self.pos = 0;
        let mut filled = 0;
        if let Some(file) = self.file.as_mut() {
            while filled < READ_AHEAD {
                let n = file.read(&mut self.chunk[filled..])?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
        }
        self.chunk.truncate(filled);
        self.eof = filled < READ_AHEAD;
        Ok(())
    }

    /// Fills `out` completely unless the file ends first; returns the bytes written.
    async fn read_block(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut filled = 0;
        while filled < out.len() {
            if self.pos < self.chunk.len() {
                let n = (self.chunk.len() - self.pos).min(out.len() - filled);
                out[filled..filled + n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
                self.pos += n;
                filled += n;
            } else if self.eof {
                break;
            } else {
                let mut taken = std::mem::replace(
                    self,
                    ChunkReader {
                        file: None,
                        chunk: Vec::new(),
                        pos: 0,
                        eof: true,
                    },
                );
                *self =
                    tokio::task::spawn_blocking(move || taken.refill_blocking().map(|()| taken))
                        .await
                        .map_err(io::Error::other)??;
            }
        }
        Ok(filled)
    }
}
