//! A delay line in user space for kernels without netem: two TUN devices, one in this network namespace and one
//! moved into another, joined by this process. Each packet read from one device is written to the other after it
//! has been serialised at the link's rate (a FIFO: a packet leaves when the one before it has, plus its own bits at
//! that rate) and then delayed by the one-way delay, the same model as `netem delay <d> rate <r> limit <n>` on each
//! end of a veth pair. Packets beyond `limit` waiting in one direction are dropped at the tail, as netem does.
//!
//! What it costs: two system calls per packet in this process, so the bench reports the devices' MTU with its
//! figures; at 1 Gbit/s and a 9,000-byte MTU that is about 14,000 packets a second one way.

use anyhow::{Context as _, bail};
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What one direction of the line did, read after the run.
#[derive(Default)]
pub struct Counters {
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    pub dropped: AtomicU64,
}

/// A running delay line; dropping it stops its threads and closes both devices (they are not persistent, so the
/// kernel deletes them with the last descriptor).
pub struct DelayLine {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// `a → b` and `b → a`.
    pub counters: [Arc<Counters>; 2],
}

/// The link's shape, the same in both directions.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// One way: half the round trip.
    pub delay: Duration,
    /// Bits per second.
    pub rate_bps: u64,
    /// Packets waiting in one direction before the tail is dropped.
    pub limit: usize,
}

/// Opens (creating) the TUN device `name` in this network namespace: IFF_TUN | IFF_NO_PI, so each read is one IP
/// packet and each write must be one.
pub fn open_tun(name: &str) -> anyhow::Result<File> {
    if name.len() >= libc::IFNAMSIZ {
        bail!(
            "interface name {name:?} is longer than {} bytes",
            libc::IFNAMSIZ - 1
        );
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .context("opening /dev/net/tun (the kernel's TUN driver; root is needed)")?;
    // struct ifreq: the name, then the flags (a short) in the union that follows it.
    let mut ifr = [0u8; 40];
    ifr[..name.len()].copy_from_slice(name.as_bytes());
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
    ifr[libc::IFNAMSIZ..libc::IFNAMSIZ + 2].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq (40 bytes on Linux) at the pointer, which is a live, writable
    // 40-byte buffer for the duration of the call; the descriptor is open.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, ifr.as_mut_ptr()) };
    if rc != 0 {
        bail!(
            "TUNSETIFF {name}: {} (is the TUN driver in this kernel?)",
            std::io::Error::last_os_error()
        );
    }
    Ok(file)
}

/// Waits up to `ms` for `file` to be readable; false on timeout.
fn readable(file: &File, ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd: file.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one pollfd, a live local; nfds is 1.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    rc > 0 && pfd.revents & libc::POLLIN != 0
}

impl DelayLine {
    /// Joins the open TUN devices `a` and `b` with `shape` in both directions.
    pub fn start(a: File, b: File, shape: Shape) -> anyhow::Result<DelayLine> {
        let (a, b) = (Arc::new(a), Arc::new(b));
        let stop = Arc::new(AtomicBool::new(false));
        let counters = [Arc::new(Counters::default()), Arc::new(Counters::default())];
        let mut threads = Vec::new();
        for (from, to, counters) in [
            (a.clone(), b.clone(), counters[0].clone()),
            (b, a, counters[1].clone()),
        ] {
            let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
            let waiting = Arc::new(AtomicUsize::new(0));
            let (stop_r, waiting_r, counters_r) = (stop.clone(), waiting.clone(), counters.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("delay-in".into())
                    .spawn(move || ingress(&from, &tx, shape, &stop_r, &waiting_r, &counters_r))?,
            );
            let stop_w = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("delay-out".into())
                    .spawn(move || egress(&to, &rx, &stop_w, &waiting))?,
            );
        }
        Ok(DelayLine {
            stop,
            threads,
            counters,
        })
    }
}

/// Reads packets and stamps each with the moment it is due on the other side.
fn ingress(
    from: &File,
    tx: &mpsc::Sender<(Instant, Vec<u8>)>,
    shape: Shape,
    stop: &AtomicBool,
    waiting: &AtomicUsize,
    counters: &Counters,
) {
    let mut leaves = Instant::now();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        if !readable(from, 100) {
            continue;
        }
        let n = match (&*from).read(&mut buf) {
            Ok(n) => n,
            Err(_) => return,
        };
        if waiting.load(Ordering::Relaxed) >= shape.limit {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let now = Instant::now();
        let bits = n as u128 * 8;
        let serialise =
            Duration::from_nanos((bits * 1_000_000_000 / shape.rate_bps as u128) as u64);
        leaves = leaves.max(now) + serialise;
        waiting.fetch_add(1, Ordering::Relaxed);
        counters.packets.fetch_add(1, Ordering::Relaxed);
        counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        if tx.send((leaves + shape.delay, buf[..n].to_vec())).is_err() {
            return;
        }
    }
}

/// Writes each packet when it is due (packets arrive in the order they are due).
fn egress(
    to: &File,
    rx: &mpsc::Receiver<(Instant, Vec<u8>)>,
    stop: &AtomicBool,
    waiting: &AtomicUsize,
) {
    while !stop.load(Ordering::Relaxed) {
        let (due, packet) = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(p) => p,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        waiting.fetch_sub(1, Ordering::Relaxed);
        // A packet the other side cannot take (its device down, a full queue) is lost, as on a wire.
        let _ = (&*to).write(&packet);
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
