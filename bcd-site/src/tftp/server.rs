//! The read-only TFTP server: requests arrive on the listening socket; each accepted read runs as its own task
//! on its own ephemeral socket (the transfer ID of RFC 1350), bounded by a semaphore. Writes are refused.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::future::Future;
use std::io::{self, Read as _};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::cache::FileCache;
use super::codec::{ErrorCode, Mode, Packet, Request, encode_data, encode_error};
use super::root::{Refusal, RootError, ServeRoot, not_found};
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
    /// ACKs of completed transfers caught while awaiting them awake ([`Limits::ack_spin`]).
    pub acks_spun: AtomicU64,
    /// ACKs of completed transfers awaited asleep on the reactor.
    pub acks_slept: AtomicU64,
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
    let cache = Arc::new(FileCache::new(
        limits.cache_max_file,
        limits.cache_max_total,
    ));
    let active = Arc::new(AtomicUsize::new(0));
    let clients = PerClient::default();
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
                    warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "TFTP transfer task ended abnormally");
                }
                continue;
            }
            r = socket.recv_from(&mut buf) => match r {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "TFTP receive failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let refusal = match Packet::decode(&buf[..len]) {
            Ok(Packet::Rrq(req)) if req.mode != Mode::Octet => {
                Some((ErrorCode::IllegalOperation, "only octet mode is served"))
            }
            Ok(Packet::Rrq(req)) => match (
                clients.take(peer.ip(), limits.max_per_client),
                slots.clone().try_acquire_owned(),
            ) {
                (None, _) => Some((
                    ErrorCode::NotDefined,
                    "too many transfers from this address at once, retry when one ends",
                )),
                (Some(client), Ok(permit)) => {
                    counters.started.fetch_add(1, Ordering::Relaxed);
                    let (root, limits, counters) = (root.clone(), limits.clone(), counters.clone());
                    let (cache, active) = (cache.clone(), active.clone());
                    transfers.spawn(async move {
                        let (_permit, _client) = (permit, client);
                        let file = req.filename.clone();
                        let _running = Running::start(&active);
                        let began = Instant::now();
                        match transfer(local_ip, peer, req, &root, &cache, &limits, &active).await {
                            Ok(Outcome::Sent { bytes, waits }) => {
                                counters.completed.fetch_add(1, Ordering::Relaxed);
                                counters.acks_spun.fetch_add(u64::from(waits.spun), Ordering::Relaxed);
                                counters.acks_slept.fetch_add(u64::from(waits.slept), Ordering::Relaxed);
                                debug!(
                                    %peer, %file, bytes,
                                    us = began.elapsed().as_micros() as u64,
                                    acks_spun = waits.spun, acks_slept = waits.slept,
                                    spins_missed = waits.missed, contended = waits.contended,
                                    resent = waits.resent,
                                    ack_wait_us = waits.ack_wait_us / u64::from((waits.spun + waits.slept).max(1)),
                                    "TFTP transfer complete"
                                );
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
                                debug!(%peer, %file, error = %bc_error_chain::InlineErrorChain::new(&e), "TFTP transfer failed");
                            }
                        }
                    });
                    None
                }
                (Some(_), Err(_)) => Some((ErrorCode::NotDefined, "server busy, retry later")),
            },
            Ok(Packet::Wrq(_)) => Some((ErrorCode::AccessViolation, "read-only server")),
            Ok(other) => {
                counters.malformed.fetch_add(1, Ordering::Relaxed);
                debug!(%peer, packet = ?other, "TFTP packet without a transfer dropped");
                None
            }
            Err(e) => {
                counters.malformed.fetch_add(1, Ordering::Relaxed);
                debug!(%peer, error = %bc_error_chain::InlineErrorChain::new(&e), "malformed TFTP request");
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

/// Transfers running per client address.
#[derive(Default, Clone)]
struct PerClient(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One of a client's transfers, counted until dropped.
struct ClientSlot {
    clients: PerClient,
    ip: IpAddr,
}

impl PerClient {
    /// A slot for `ip`, or `None` when it already runs `max` transfers.
    fn take(&self, ip: IpAddr, max: usize) -> Option<ClientSlot> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= max.max(1) {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            clients: self.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut map = self.clients.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// Counts a transfer as running until dropped (also when its task is cancelled).
struct Running(Arc<AtomicUsize>);

impl Running {
    fn start(active: &Arc<AtomicUsize>) -> Self {
        active.fetch_add(1, Ordering::Relaxed);
        Running(active.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

enum Outcome {
    Sent {
        bytes: u64,
        waits: Waits,
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
    #[error("transfer ran longer than {0:?} (tftp.max_transfer_s)")]
    TooLong(Duration),
}

async fn transfer(
    local_ip: std::net::IpAddr,
    peer: SocketAddr,
    req: Request,
    root: &ServeRoot,
    cache: &Arc<FileCache>,
    limits: &Limits,
    active: &Arc<AtomicUsize>,
) -> Result<Outcome, TransferError> {
    let socket = UdpSocket::bind((local_ip, 0)).await?;
    socket.connect(peer).await?;
    let mut out = Vec::new();
    let opened = open(root, cache, &req.filename).await;
    let (source, size) = match opened {
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
    let timer = Box::pin(tokio::time::sleep(n.timeout));
    let mut link = Link {
        socket,
        n,
        max_retries: limits.max_retries,
        buf: vec![0u8; MAX_CLIENT_PACKET],
        timer,
        spin: Spin::new(limits.ack_spin),
        active: active.clone(),
        waits: Waits::default(),
    };
    let longest = limits.max_transfer_time;
    let sent = tokio::time::timeout(longest, async {
        if !link.n.oack.is_empty() {
            Packet::Oack(link.n.oack.clone()).encode(&mut out);
            // Block 0 acknowledges the OACK. A client that only wanted `tsize` answers with error 8 instead.
            let oack = VecDeque::from([(0, std::mem::take(&mut out))]);
            match link.send_until_acked(&oack).await {
                Ok(_) => {}
                Err(TransferError::ClientError { code, message }) => {
                    return Ok(Outcome::Declined { code, message });
                }
                Err(e) => return Err(e),
            }
        }
        let bytes = link.send_file(source, size).await?;
        Ok(Outcome::Sent {
            bytes,
            waits: link.waits,
        })
    })
    .await
    .unwrap_or(Err(TransferError::TooLong(longest)));
    if let Err(e) = &sent {
        // Our side failed or gave up (read error, file changed, too long): tell the client rather than leave it
        // waiting.
        let message = match e {
            TransferError::Io(_) | TransferError::SizeChanged => Some("server read error"),
            TransferError::TooLong(_) => Some("transfer ran longer than the server allows"),
            TransferError::TimedOut { .. } | TransferError::ClientError { .. } => None,
        };
        if let Some(message) = message {
            encode_error(ErrorCode::NotDefined, message, &mut out);
            let _ = link.socket.send(&out).await;
        }
    }
    sent
}

/// Largest packet read from a client (ACKs and ERRORs; a longer error message is cut and the packet dropped).
const MAX_CLIENT_PACKET: usize = 2048;

/// Resolves the request and finds its contents: a cached loader is served from memory with no read at all (the
/// name is resolved inline: metadata only). Otherwise one trip to the blocking pool opens the file and reads it
/// whole when the cache admits it, else its first chunk.
async fn open(
    root: &ServeRoot,
    cache: &Arc<FileCache>,
    name: &str,
) -> Result<io::Result<(Source, u64)>, Refusal> {
    let (path, meta) = root.resolve(name)?;
    if let Some(data) = cache.get(&path, &meta) {
        let size = data.len() as u64;
        return Ok(Ok((Source::Memory { data, pos: 0 }, size)));
    }
    let (cache, name) = (cache.clone(), name.to_owned());
    let read = tokio::task::spawn_blocking(move || {
        let mut file = File::open(&path).map_err(|e| not_found(&name, e))?;
        // Metadata of the open file: the version the cache entry will claim.
        let meta = file.metadata().map_err(|e| not_found(&name, e))?;
        if cache.admits(&meta) {
            let mut data = Vec::with_capacity(meta.len() as usize);
            if let Err(e) = file.read_to_end(&mut data) {
                return Ok(Err(e));
            }
            let data: Arc<[u8]> = Arc::from(data);
            cache.put(path, &meta, data.clone());
            let size = data.len() as u64;
            Ok(Ok((Source::Memory { data, pos: 0 }, size)))
        } else {
            Ok(ChunkReader::start(file, meta.len()).map(|(r, size)| (Source::Chunked(r), size)))
        }
    })
    .await;
    match read {
        Ok(r) => r,
        Err(e) => Ok(Err(io::Error::other(e))),
    }
}

/// Where a transfer's bytes come from.
enum Source {
    /// The whole file, shared with the cache.
    Memory { data: Arc<[u8]>, pos: usize },
    /// Read ahead in chunks (files the cache does not take).
    Chunked(ChunkReader),
}

impl Source {
    /// Encodes the next DATA packet (at most `blksize` bytes of payload) into `pkt`; returns the payload length.
    async fn next_packet(
        &mut self,
        block: u16,
        blksize: usize,
        pkt: &mut Vec<u8>,
    ) -> io::Result<usize> {
        match self {
            Source::Memory { data, pos } => {
                let n = (data.len() - *pos).min(blksize);
                encode_data(block, &data[*pos..*pos + n], pkt);
                *pos += n;
                Ok(n)
            }
            Source::Chunked(reader) => {
                encode_data(block, &[], pkt);
                pkt.resize(4 + blksize, 0);
                let n = reader.read_block(&mut pkt[4..]).await?;
                pkt.truncate(4 + n);
                Ok(n)
            }
        }
    }
}

/// One transfer's socket and negotiated parameters.
struct Link {
    socket: UdpSocket,
    n: Negotiated,
    max_retries: u32,
    buf: Vec<u8>,
    /// Retransmission timer; its deadline trails the real one (see [`Link::send_until_acked`]).
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Whether and how long to await ACKs awake.
    spin: Spin,
    /// Transfers running now (this one included).
    active: Arc<AtomicUsize>,
    waits: Waits,
}

/// How a transfer's ACKs arrived, for the debug log.
#[derive(Debug, Default, Clone, Copy)]
struct Waits {
    /// ACKs caught while spinning.
    spun: u32,
    /// ACKs waited for on the reactor.
    slept: u32,
    /// Spins that ended without an ACK.
    missed: u32,
    /// Windows sent again (timeout or a gap the client reported).
    resent: u32,
    /// Spins cut short because a yield ran some other task.
    contended: u32,
    /// Sum of the waits for ACKs, in microseconds (divided by the ACKs: the client's mean answer time).
    ack_wait_us: u64,
}

impl Link {
    /// Sends the file in windows of `windowsize` blocks; an ACK for block k starts the next window at k+1
    /// (RFC 7440). Block numbers wrap after 65535 to 0, as tftp-hpa and curl expect. Packet buffers are reused.
    async fn send_file(&mut self, mut source: Source, size: u64) -> Result<u64, TransferError> {
        let blksize = self.n.blksize;
        let window = usize::from(self.n.windowsize);
        // Unacknowledged blocks: (absolute block number, encoded DATA packet).
        let mut pending: VecDeque<(u64, Vec<u8>)> = VecDeque::with_capacity(window);
        let mut spare: Vec<Vec<u8>> = Vec::with_capacity(window);
        let mut next_block: u64 = 1;
        let mut read_done = false;
        let mut sent_bytes: u64 = 0;
        loop {
            while pending.len() < window && !read_done {
                let mut pkt = spare
                    .pop()
                    .unwrap_or_else(|| Vec::with_capacity(blksize + 4));
                let n = source
                    .next_packet(next_block as u16, blksize, &mut pkt)
                    .await?;
                if n < blksize {
                    read_done = true;
                }
                sent_bytes += n as u64;
                pending.push_back((next_block, pkt));
                next_block += 1;
            }
            if pending.is_empty() {
                break;
            }
            let acked = self.send_until_acked(&pending).await?;
            // Drop everything up to and including the acknowledged block.
            while pending.front().is_some_and(|(b, _)| *b <= acked) {
                if let Some((_, pkt)) = pending.pop_front() {
                    spare.push(pkt);
                }
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

    /// Sends `packets` (by absolute block number, consecutive) and waits for an ACK of any of them, retransmitting
    /// on timeout up to the retry cap. Stale and foreign packets are ignored without resending (no Sorcerer's
    /// Apprentice). Returns the absolute number of the highest block acknowledged.
    async fn send_until_acked(
        &mut self,
        packets: &VecDeque<(u64, Vec<u8>)>,
    ) -> Result<u64, TransferError> {
        let (Some(&(first, _)), Some(&(last, _))) = (packets.front(), packets.back()) else {
            return Ok(0);
        };
        let mut retries = 0;
        loop {
            for (_, p) in packets {
                self.socket.send(p).await?;
            }
            let sent = Instant::now();
            // The timer is not re-armed per block (that costs a timer-wheel insert and removal for every ACK):
            // it fires at its old deadline, and only then is the real one (last send + timeout) checked.
            let deadline = sent + self.n.timeout;
            let mut spin = self.spin.budget(self.active.load(Ordering::Relaxed));
            loop {
                // Lockstep clients answer within tens of microseconds on a LAN: wait for the ACK awake for a moment
                // rather than sleep and pay a wake-up (on a VM, an idle vCPU's wake-up) for every block.
                if !spin.is_zero() {
                    let (r, contended) = spin_recv(&self.socket, &mut self.buf, spin);
                    spin = Duration::ZERO;
                    if contended {
                        self.spin.contended();
                        self.waits.contended += 1;
                    }
                    match r {
                        Some(r) => {
                            self.waits.spun += 1;
                            let len = r?;
                            match self.on_packet(len, first, last, packets.len()) {
                                Verdict::Acked(abs) => return Ok(self.acked(abs, sent)),
                                Verdict::Resend => break,
                                Verdict::Failed(e) => return Err(e),
                                Verdict::Ignore => continue,
                            }
                        }
                        None => self.waits.missed += 1,
                    }
                }
                let received = tokio::select! {
                    biased;
                    r = self.socket.recv(&mut self.buf) => Some(r),
                    () = &mut self.timer => None,
                };
                let len = match received {
                    // ICMP port unreachable surfaces as ECONNREFUSED on a connected socket: the client left.
                    Some(r) => {
                        self.waits.slept += 1;
                        r?
                    }
                    None if Instant::now() < deadline => {
                        self.timer.as_mut().reset(deadline);
                        continue;
                    }
                    None => {
                        // Expired: the next wait gets a fresh timeout from the retransmission.
                        self.timer.as_mut().reset(Instant::now() + self.n.timeout);
                        break;
                    }
                };
                match self.on_packet(len, first, last, packets.len()) {
                    Verdict::Acked(abs) => return Ok(self.acked(abs, sent)),
                    Verdict::Resend => break,
                    Verdict::Failed(e) => return Err(e),
                    Verdict::Ignore => {}
                }
            }
            retries += 1;
            self.waits.resent += 1;
            if retries > self.max_retries {
                return Err(TransferError::TimedOut {
                    retries: retries - 1,
                });
            }
        }
    }
}

impl Link {
    /// Notes an ACK of block `abs` that came `sent.elapsed()` after the window went out; returns `abs`.
    fn acked(&mut self, abs: u64, sent: Instant) -> u64 {
        let waited = sent.elapsed();
        self.waits.ack_wait_us += waited.as_micros() as u64;
        self.spin.answered(waited);
        abs
    }

    /// What a packet from the client means for the window `first..=last` (absolute block numbers).
    fn on_packet(&self, len: usize, first: u64, last: u64, window: usize) -> Verdict {
        match Packet::decode(&self.buf[..len]) {
            Ok(Packet::Ack { block }) => {
                // Map the 16-bit block number onto the window being sent.
                if let Some(abs) = (first..=last).rev().find(|b| *b as u16 == block) {
                    return Verdict::Acked(abs);
                }
                // With a window, an ACK of the block before it says the client saw a gap (RFC 7440): resend now.
                // In lockstep such an ACK is a stale duplicate and is ignored.
                if window > 1 && first > 0 && block == (first - 1) as u16 {
                    return Verdict::Resend;
                }
                Verdict::Ignore
            }
            Ok(Packet::Error { code, message }) => {
                Verdict::Failed(TransferError::ClientError { code, message })
            }
            _ => Verdict::Ignore,
        }
    }
}

enum Verdict {
    Acked(u64),
    Resend,
    Failed(TransferError),
    Ignore,
}

/// When a transfer awaits its ACKs awake, and for how long.
///
/// Lockstep clients answer within tens of microseconds on a LAN; waiting awake for that saves a sleep and a
/// wake-up (on a VM, an idle vCPU's wake-up) per block. Two things make it a loss, and each pauses it:
/// - A client slower than the budget: spinning only burns CPU. The client's answer time is smoothed over every
///   ACK, spun or slept for ([`Spin::answered`]); while it exceeds the budget the transfer sleeps, and a client
///   that speeds up is spun for again.
/// - A contended CPU: a `sched_yield` while a CPU-bound task is runnable hands it the CPU until the next
///   scheduler tick (up to 4 ms at 250 Hz), while a sleeping server would be woken ahead of it when the ACK lands.
///   That was this server's transfer-time tail (and, with a busy process beside it, its p99 went from 15 to 180
///   ms). A yield that kept the thread off the CPU longer than [`YIELD_LONG`] pauses spinning for
///   [`PAUSE_FIRST`] blocks, doubling on each further one up to [`PAUSE_MAX`]; a spin that catches its ACK
///   without one halves it again.
#[derive(Debug)]
struct Spin {
    budget: Duration,
    /// The client's smoothed answer time.
    answer: Duration,
    /// Waits left before spinning again after contention.
    paused: u32,
    /// The next pause.
    pause: u32,
}

/// Transfers running at once above which none spins (spinning tasks would delay each other's packets).
const SPIN_MAX_ACTIVE: usize = 2;
/// A `sched_yield` that kept this thread off the CPU longer than this ran some other task, not just a client
/// answering (tens of microseconds).
const YIELD_LONG: Duration = Duration::from_micros(200);
const PAUSE_FIRST: u32 = 8;
const PAUSE_MAX: u32 = 1024;

impl Spin {
    fn new(budget: Duration) -> Self {
        Spin {
            budget,
            answer: Duration::ZERO,
            paused: 0,
            pause: PAUSE_FIRST,
        }
    }

    /// How long to await the next ACK awake, with `active` transfers running (this one included); zero: sleep.
    fn budget(&mut self, active: usize) -> Duration {
        if self.paused > 0 {
            self.paused -= 1;
            return Duration::ZERO;
        }
        if self.answer > self.budget || active > SPIN_MAX_ACTIVE {
            return Duration::ZERO;
        }
        self.budget
    }

    /// An ACK came `waited` after the window went out.
    fn answered(&mut self, waited: Duration) {
        // Exponentially weighted, 1/4 per sample: one late ACK pauses spinning for a few blocks, a client that is
        // slow every time stops it within two.
        self.answer = (self.answer * 3 + waited) / 4;
        if waited <= self.budget {
            self.pause = (self.pause / 2).max(PAUSE_FIRST);
        }
    }

    /// A yield ran another task.
    fn contended(&mut self) {
        self.paused = self.pause;
        self.pause = (self.pause * 2).min(PAUSE_MAX);
    }
}

/// Tries to receive for up to `budget`, yielding the CPU between tries (a client woken on this CPU gets to run).
/// The first of the result is `None` when nothing arrived within the budget; the second says a yield kept this
/// thread off the CPU longer than [`YIELD_LONG`], after which it looks once more and stops. Reads the socket
/// directly: tokio's `try_recv` trusts readiness cached from the last poll of the reactor and would not see a
/// datagram that arrived since.
fn spin_recv(
    socket: &UdpSocket,
    buf: &mut [u8],
    budget: Duration,
) -> (Option<io::Result<usize>>, bool) {
    use std::io::Read as _;
    let sock = socket2::SockRef::from(socket);
    let until = std::time::Instant::now() + budget;
    let mut contended = false;
    loop {
        match (&*sock).read(buf) {
            Ok(n) => return (Some(Ok(n)), contended),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (Some(Err(e)), contended),
        }
        let now = std::time::Instant::now();
        if contended || now >= until {
            return (None, contended);
        }
        std::thread::yield_now();
        contended = now.elapsed() > YIELD_LONG;
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

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn spin_follows_the_client_and_backs_off_under_contention() {
        let mut s = Spin::new(100 * US);
        assert_eq!(s.budget(1), 100 * US);
        assert_eq!(s.budget(SPIN_MAX_ACTIVE + 1), Duration::ZERO, "busy server");
        // A slow client: sleep while its answer time exceeds the budget, spin again once it is fast.
        s.answered(2000 * US);
        assert_eq!(s.budget(1), Duration::ZERO);
        let mut fast = 0;
        while s.budget(1).is_zero() {
            s.answered(20 * US);
            fast += 1;
            assert!(fast < 20, "never spins again");
        }
        assert!(fast >= 5, "recovered after {fast}");
        // Contention: pauses of 8, 16, 32 … waits, capped; a clean ACK halves the next one.
        for pause in [8, 16, 32, 64] {
            s.contended();
            for _ in 0..pause {
                assert_eq!(s.budget(1), Duration::ZERO);
            }
            assert_eq!(s.budget(1), 100 * US);
        }
        for _ in 0..20 {
            s.contended();
        }
        assert_eq!(s.pause, PAUSE_MAX);
        s.paused = 0;
        s.answered(10 * US);
        assert_eq!(s.pause, PAUSE_MAX / 2);
        for _ in 0..20 {
            s.answered(10 * US);
        }
        assert_eq!(s.pause, PAUSE_FIRST);
    }
}
