//! The proxy-DHCP UDP server: receive, [`decode`], [`decide`], send. Every drop is counted and logged at debug.
//!
//! The caller binds the sockets ([`bind_udp`] sets SO_BROADCAST and SO_BINDTODEVICE) and owns the netboot table
//! through a `watch` channel, so table updates take effect on the next packet.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::decide::{Decision, Destination, IgnoreReason, ListenPort, ServerInfo, decide};
use super::rogue::{RogueServer, observe};
use super::table::{MacAddr, NetbootTable};
use super::wire::{decode, encode};

/// Largest datagram we read; DHCP messages fit in 1500 bytes, anything longer is truncated and rejected.
const MAX_PACKET: usize = 2048;
/// Distinct (MAC, reason) pairs remembered for the once-per-MAC info log before the memory is cleared.
const INFO_LOGGED: usize = 4096;

/// The already-bound sockets the server reads.
#[derive(Debug)]
pub struct DhcpSockets {
    /// UDP 67 (DHCP server port).
    pub dhcp: UdpSocket,
    /// UDP 4011 (PXE boot-server port).
    pub pxe: UdpSocket,
    /// Optional UDP 68 listener that sees other servers' replies, for [`RogueServer`] detection.
    pub watch: Option<UdpSocket>,
}

/// Addressing for replies. The defaults are the real ports; tests point them at loopback ports.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub info: ServerInfo,
    /// Where broadcast replies go: `255.255.255.255` on a real segment.
    pub broadcast: Ipv4Addr,
    /// The DHCP client port (68).
    pub client_port: u16,
    /// The DHCP server port relay agents listen on (67).
    pub relay_port: u16,
}

impl ServerConfig {
    pub fn new(info: ServerInfo) -> Self {
        ServerConfig {
            info,
            broadcast: Ipv4Addr::BROADCAST,
            client_port: 68,
            relay_port: 67,
        }
    }
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding UDP {addr} (device {device:?})")]
    Bind {
        addr: SocketAddrV4,
        device: Option<String>,
        #[source]
        source: io::Error,
    },
}

/// Binds a UDP socket for DHCP: SO_REUSEADDR, SO_BROADCAST, and SO_BINDTODEVICE when `device` is given (so
/// broadcasts leave through the boot interface and only its packets arrive). Must be called inside a tokio runtime.
pub fn bind_udp(addr: SocketAddrV4, device: Option<&str>) -> Result<UdpSocket, ServerError> {
    let err = |source| ServerError::Bind {
        addr,
        device: device.map(str::to_owned),
        source,
    };
    let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).map_err(err)?;
    socket.set_reuse_address(true).map_err(err)?;
    socket.set_broadcast(true).map_err(err)?;
    // Bursts of DISCOVERs (a rack powering on) must not overflow the default buffer.
    let _ = socket.set_recv_buffer_size(4 << 20);
    if let Some(dev) = device {
        socket.bind_device(Some(dev.as_bytes())).map_err(err)?;
    }
    socket.set_nonblocking(true).map_err(err)?;
    socket.bind(&SocketAddr::V4(addr).into()).map_err(err)?;
    UdpSocket::from_std(socket.into()).map_err(err)
}

/// What the server did, for metrics and tests.
#[derive(Debug, Default)]
pub struct DhcpCounters {
    received: AtomicU64,
    replied: AtomicU64,
    replied_4011: AtomicU64,
    decode_failed: AtomicU64,
    send_failed: AtomicU64,
    rogue_seen: AtomicU64,
    ignored: Mutex<BTreeMap<&'static str, u64>>,
    last_rogue: Mutex<Option<RogueServer>>,
    /// The last DHCP request of each client MAC since [`DhcpCounters::take_sightings`] (bounded).
    sightings: Mutex<HashMap<MacAddr, SystemTime>>,
}

/// Client MACs remembered between two [`DhcpCounters::take_sightings`]; more are not recorded until the next take.
pub const MAX_SIGHTINGS: usize = 4096;

/// A point-in-time copy of [`DhcpCounters`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CountersSnapshot {
    pub received: u64,
    /// Replies on both ports.
    pub replied: u64,
    /// Of `replied`, the ACKs on the boot-server port (4011).
    pub replied_4011: u64,
    pub decode_failed: u64,
    pub send_failed: u64,
    pub rogue_seen: u64,
    /// Ignored requests by [`super::IgnoreReason::kind`].
    pub ignored: BTreeMap<&'static str, u64>,
    pub last_rogue: Option<RogueServer>,
}

impl DhcpCounters {
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            received: self.received.load(Ordering::Relaxed),
            replied: self.replied.load(Ordering::Relaxed),
            replied_4011: self.replied_4011.load(Ordering::Relaxed),
            decode_failed: self.decode_failed.load(Ordering::Relaxed),
            send_failed: self.send_failed.load(Ordering::Relaxed),
            rogue_seen: self.rogue_seen.load(Ordering::Relaxed),
            ignored: self.ignored.lock().map(|m| m.clone()).unwrap_or_default(),
            last_rogue: self.last_rogue.lock().ok().and_then(|r| r.clone()),
        }
    }

    /// The last DHCP request seen from each client MAC since the previous call (any request on either port, PXE or
    /// not: "last DHCP seen" for a machine that never booted).
    pub fn take_sightings(&self) -> Vec<(MacAddr, SystemTime)> {
        self.sightings
            .lock()
            .map(|mut m| m.drain().collect())
            .unwrap_or_default()
    }

    fn sighted(&self, mac: MacAddr, at: SystemTime) {
        if let Ok(mut m) = self.sightings.lock()
            && (m.len() < MAX_SIGHTINGS || m.contains_key(&mac))
        {
            m.insert(mac, at);
        }
    }

    fn ignore(&self, kind: &'static str) {
        if let Ok(mut map) = self.ignored.lock() {
            *map.entry(kind).or_default() += 1;
        }
    }
}

/// Serves until `shutdown` completes. Receive errors are logged and retried; nothing a client sends stops it.
pub async fn run(
    sockets: DhcpSockets,
    table: watch::Receiver<NetbootTable>,
    config: ServerConfig,
    counters: Arc<DhcpCounters>,
    shutdown: impl Future<Output = ()>,
) {
    let config = Arc::new(config);
    let mut tasks = JoinSet::new();
    tasks.spawn(serve_port(
        sockets.dhcp,
        ListenPort::Dhcp,
        table.clone(),
        config.clone(),
        counters.clone(),
    ));
    tasks.spawn(serve_port(
        sockets.pxe,
        ListenPort::PxeBoot,
        table,
        config.clone(),
        counters.clone(),
    ));
    if let Some(watch) = sockets.watch {
        tasks.spawn(watch_for_rogues(watch, config, counters));
    }
    shutdown.await;
    tasks.shutdown().await;
    debug!("proxy DHCP stopped");
}

async fn serve_port(
    socket: UdpSocket,
    port: ListenPort,
    table: watch::Receiver<NetbootTable>,
    config: Arc<ServerConfig>,
    counters: Arc<DhcpCounters>,
) {
    let mut buf = vec![0u8; MAX_PACKET];
    let mut out = Vec::with_capacity(600);
    // Refusals an operator must hear of are logged at info once per MAC and reason (bounded), the rest at debug:
    // a PXE client that is not marked, and a marked one whose architecture no served loader boots.
    let mut logged: HashSet<(MacAddr, &'static str)> = HashSet::new();
    loop {
        let (len, src) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                warn!(?port, error = %bc_error_chain::InlineErrorChain::new(&e), "proxy DHCP receive failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        counters.received.fetch_add(1, Ordering::Relaxed);
        let request = match decode(&buf[..len]) {
            Ok(m) => m,
            Err(e) => {
                counters.decode_failed.fetch_add(1, Ordering::Relaxed);
                debug!(?port, %src, error = %bc_error_chain::InlineErrorChain::new(&e), "dropped undecodable packet");
                continue;
            }
        };
        if let Some(mac) = super::decide::client_mac(&request) {
            counters.sighted(mac, SystemTime::now());
        }
        let decision = {
            let table = table.borrow();
            decide(&request, port, &table, &config.info)
        };
        let reply = match decision {
            Decision::Reply(reply) => reply,
            Decision::Ignore { reason } => {
                counters.ignore(reason.kind());
                if let Some(mac) = worth_info(&reason) {
                    if logged.len() >= INFO_LOGGED {
                        logged.clear();
                    }
                    if logged.insert((mac, reason.kind())) {
                        match reason {
                            IgnoreReason::NotMarkedForNetboot { .. } => {
                                info!(?port, %mac, "PXE client not marked for netboot: not answered");
                            }
                            _ => {
                                info!(?port, %mac, %reason, "netboot client not answered: no loader for its architecture");
                            }
                        }
                    }
                }
                debug!(?port, %src, xid = request.xid(), %reason, "ignored");
                continue;
            }
        };
        if let Err(e) = encode(&reply.message, &mut out) {
            counters.send_failed.fetch_add(1, Ordering::Relaxed);
            warn!(mac = %reply.mac, error = %bc_error_chain::InlineErrorChain::new(&e), "could not encode reply");
            continue;
        }
        let dest: SocketAddr = match reply.destination {
            Destination::Broadcast => (config.broadcast, config.client_port).into(),
            Destination::Client(ip) => (ip, config.client_port).into(),
            Destination::Relay(ip) => (ip, config.relay_port).into(),
            Destination::Source => src,
        };
        match socket.send_to(&out, dest).await {
            Ok(_) => {
                counters.replied.fetch_add(1, Ordering::Relaxed);
                if port == ListenPort::PxeBoot {
                    counters.replied_4011.fetch_add(1, Ordering::Relaxed);
                }
                debug!(?port, mac = %reply.mac, %dest, bootfile = %reply.bootfile, "answered");
            }
            Err(e) => {
                counters.send_failed.fetch_add(1, Ordering::Relaxed);
                debug!(?port, mac = %reply.mac, %dest, error = %bc_error_chain::InlineErrorChain::new(&e), "send failed");
            }
        }
    }
}

/// The MAC to log at info for `reason`, when an operator must hear of it.
fn worth_info(reason: &IgnoreReason) -> Option<MacAddr> {
    match reason {
        IgnoreReason::NotMarkedForNetboot { mac }
        | IgnoreReason::NoArchitecture { mac }
        | IgnoreReason::UnsupportedArchitecture { mac, .. }
        | IgnoreReason::NoLoader { mac, .. } => Some(*mac),
        _ => None,
    }
}

async fn watch_for_rogues(
    socket: UdpSocket,
    config: Arc<ServerConfig>,
    counters: Arc<DhcpCounters>,
) {
    let mut buf = vec![0u8; MAX_PACKET];
    loop {
        let (len, src) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "client-port watch receive failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let SocketAddr::V4(src) = src else { continue };
        let Ok(msg) = decode(&buf[..len]) else {
            continue;
        };
        if let Some(rogue) = observe(&msg, *src.ip(), config.info.server_ip) {
            counters.rogue_seen.fetch_add(1, Ordering::Relaxed);
            warn!(server = %rogue.server_id, %rogue, "another server is answering PXE clients on this segment");
            if let Ok(mut last) = counters.last_rogue.lock() {
                *last = Some(rogue);
            }
        }
    }
}
