//! `bcd site serve`: proxy DHCP, TFTP and boot HTTP in one process, fed by one netboot table.
//!
//! - [`config`]: `site.toml` (wire struct → validated [`SiteConfig`]).
//! - [`Netboot`]: MAC → desired boot. It reaches the services through a `tokio::sync::watch` channel, and whoever
//!   holds the sender is the table's source: the `[[machine]]` list of the config file (reloaded on SIGHUP by
//!   `bcd site serve`), or the control plane while the agent holds the site's boot lease (`bcd site run`, which
//!   sends an empty table when it does not). The services never know which.
//! - [`bind`] then [`run`]: bind every socket first (so a port in use fails before anything serves), then serve
//!   until shutdown, logging the counters every [`SiteConfig::report_interval`] and once at the end.

pub mod config;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;

use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::watch;
use tracing::{info, warn};

pub use config::{DEFAULT_CACHE_MAX_BYTES, SiteConfig, SiteConfigError, SiteConfigWire};

use crate::dhcp::server::{self as dhcp_server, DhcpCounters, DhcpSockets, ServerConfig, bind_udp};
use crate::dhcp::{BootFiles, MacAddr, NetbootRule, NetbootTable, ServerInfo};
use crate::http::{self, BootCatalog, BootHttp, DesiredBoot, HttpConfig};
use crate::tftp::root::ServeRoot;
use crate::tftp::server::{self as tftp_server, TftpCounters};

/// The netboot table: which machines may netboot and what each should boot. Both the proxy DHCP's view (who is
/// answered) and the HTTP server's (which script) derive from it, so they cannot disagree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Netboot {
    machines: BTreeMap<MacAddr, DesiredBoot>,
}

impl Netboot {
    pub fn from_machines(machines: BTreeMap<MacAddr, DesiredBoot>) -> Self {
        Netboot { machines }
    }

    pub fn insert(&mut self, mac: MacAddr, boot: DesiredBoot) -> Option<DesiredBoot> {
        self.machines.insert(mac, boot)
    }

    pub fn remove(&mut self, mac: &MacAddr) -> Option<DesiredBoot> {
        self.machines.remove(mac)
    }

    pub fn len(&self) -> usize {
        self.machines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.machines.is_empty()
    }

    /// The MACs in the table, in order.
    pub fn dhcp_table_macs(&self) -> impl Iterator<Item = MacAddr> + '_ {
        self.machines.keys().copied()
    }

    /// The proxy DHCP's view: every MAC with a desired boot is answered.
    pub fn dhcp_table(&self) -> NetbootTable {
        self.machines.keys().map(|m| NetbootRule::Mac(*m)).collect()
    }

    /// The boot HTTP server's view.
    pub fn catalog(&self) -> BootCatalog {
        self.machines.iter().map(|(m, b)| (*m, b.clone())).collect()
    }
}

/// Starting the site services failed; each variant names what could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("proxy DHCP")]
    Dhcp(#[from] dhcp_server::ServerError),
    #[error("binding {what} on {addr}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("{field} {path}: not a usable directory")]
    Dir {
        field: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("boot HTTP")]
    Http(#[from] http::DirError),
    #[error("TFTP")]
    Tftp(#[from] crate::tftp::root::RootError),
}

/// Every socket `serve` needs, bound. Tests build this themselves on loopback.
#[derive(Debug)]
pub struct Bound {
    pub dhcp: DhcpSockets,
    pub tftp: UdpSocket,
    pub http: TcpListener,
}

/// Binds DHCP (port 67 and 4011 on `interface`, plus 255.255.255.255:68 to watch for rogue servers when asked),
/// TFTP and HTTP (on `server_ip`). A rogue watch that cannot bind (a DHCP client holds 68 exclusively) is reported
/// and left out.
pub async fn bind(config: &SiteConfig) -> Result<Bound, ServeError> {
    let any = Ipv4Addr::UNSPECIFIED;
    let dev = Some(config.interface.as_str());
    let dhcp = bind_udp(SocketAddrV4::new(any, config.dhcp_port), dev)?;
    let pxe = bind_udp(SocketAddrV4::new(any, config.pxe_port), dev)?;
    // The watch binds the broadcast address, not the wildcard: it sees the broadcast offers PXE servers send to
    // clients without an address, and never takes a unicast reply meant for a DHCP client running on this host.
    let watch = if config.watch_rogues {
        match bind_udp(SocketAddrV4::new(Ipv4Addr::BROADCAST, 68), dev) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(error = %e, "not watching for other PXE servers");
                None
            }
        }
    } else {
        None
    };
    let tftp_addr = SocketAddr::from((config.server_ip, config.tftp_port));
    let tftp = UdpSocket::bind(tftp_addr)
        .await
        .map_err(|source| ServeError::Bind {
            what: "TFTP",
            addr: tftp_addr,
            source,
        })?;
    let http_addr = SocketAddr::from((config.server_ip, config.http_port));
    let http = TcpListener::bind(http_addr)
        .await
        .map_err(|source| ServeError::Bind {
            what: "boot HTTP",
            addr: http_addr,
            source,
        })?;
    Ok(Bound {
        dhcp: DhcpSockets { dhcp, pxe, watch },
        tftp,
        http,
    })
}

/// Counters of the three services, shared with the caller (tests, telemetry).
#[derive(Debug, Default, Clone)]
pub struct SiteCounters {
    pub dhcp: Arc<DhcpCounters>,
    pub tftp: Arc<TftpCounters>,
    pub http: Arc<http::HttpCounters>,
}

/// Serves until `shutdown` completes, then stops all three services and logs the final counters.
///
/// `netboot` is the table channel (see the module docs); `dhcp_replies` overrides where broadcast replies go
/// (tests on loopback), `None` on a real segment.
pub async fn run(
    config: &SiteConfig,
    bound: Bound,
    netboot: watch::Receiver<Netboot>,
    counters: SiteCounters,
    dhcp_replies: Option<ServerConfig>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    // Fail before serving anything when a directory is unusable, naming the config field.
    let root = |field, dir: &std::path::Path| {
        ServeRoot::new(dir).map_err(|e| ServeError::Dir {
            field,
            path: e.path,
            source: e.source,
        })
    };
    let tftp_root = root("boot.tftp_root", &config.tftp_root)?;
    root("boot.artifacts", &config.artifacts)?;
    let http = BootHttp::with_counters(
        HttpConfig::new(&config.artifacts, &config.tftp_root),
        counters.http.clone(),
    )?;
    let loaders = served_loaders(&config.loaders, &tftp_root);

    let (table_tx, table_rx) = watch::channel(netboot.borrow().dhcp_table());
    let (catalog_tx, catalog_rx) = watch::channel(netboot.borrow().catalog());
    let dhcp_config = dhcp_replies.unwrap_or_else(|| {
        ServerConfig::new(ServerInfo {
            server_ip: config.server_ip,
            http_port: config.http_port,
            files: loaders,
            offer: config.offer,
        })
    });
    info!(
        interface = %config.interface,
        server_ip = %config.server_ip,
        machines = netboot.borrow().len(),
        dhcp = ?bound.dhcp.dhcp.local_addr().ok(),
        pxe = ?bound.dhcp.pxe.local_addr().ok(),
        tftp = ?bound.tftp.local_addr().ok(),
        http = ?bound.http.local_addr().ok(),
        rogue_watch = bound.dhcp.watch.is_some(),
        "bcd site serving"
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let dhcp_task = tokio::spawn(dhcp_server::run(
        bound.dhcp,
        table_rx,
        dhcp_config,
        counters.dhcp.clone(),
        stopped(stop_rx.clone()),
    ));
    let tftp_root = config.tftp_root.clone();
    let tftp_limits = config.tftp.clone();
    let tftp_counters = counters.tftp.clone();
    let tftp_stop = stopped(stop_rx.clone());
    let tftp_socket = bound.tftp;
    let tftp_task = tokio::spawn(async move {
        tftp_server::run(
            tftp_socket,
            &tftp_root,
            tftp_limits,
            tftp_counters,
            tftp_stop,
        )
        .await
    });
    let http_task = tokio::spawn(http::run(
        bound.http,
        http.clone(),
        catalog_rx,
        stopped(stop_rx.clone()),
    ));

    let report = || report(&counters, &http);
    let mut ticker = config.report_interval.map(|every| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let mut netboot = netboot;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            changed = netboot.changed() => {
                if changed.is_err() {
                    // The source is gone: keep serving the last table until shutdown.
                    warn!("netboot table source closed; serving the last table");
                    (&mut shutdown).await;
                    break;
                }
                let table = netboot.borrow_and_update().clone();
                info!(machines = table.len(), "netboot table updated");
                let _ = table_tx.send(table.dhcp_table());
                let _ = catalog_tx.send(table.catalog());
            }
            _ = async { match ticker.as_mut() { Some(t) => { t.tick().await; } None => std::future::pending().await } } => {
                report();
            }
        }
    }
    let _ = stop_tx.send(true);
    let _ = dhcp_task.await;
    let tftp_result = tftp_task.await;
    let _ = http_task.await;
    report();
    info!("bcd site stopped");
    match tftp_result {
        Ok(r) => r.map_err(ServeError::Tftp),
        Err(_) => Ok(()),
    }
}

/// The configured loaders that `root` serves (by the rules TFTP and `/ipxe/` serve them under). A loader that is
/// absent would be offered to clients that then fail to fetch it, so it is left out, with a warning naming the
/// architectures it boots; their clients are then ignored with [`crate::dhcp::IgnoreReason::NoLoader`]. Checked
/// once, at start: a loader put in place later is offered after a restart. Blocking (metadata only).
pub fn served_loaders(configured: &BootFiles, root: &ServeRoot) -> BootFiles {
    let mut offered = configured.clone();
    offered.retain(|loader, file| match root.resolve(file) {
        Ok(_) => true,
        Err(refusal) => {
            warn!(
                clients = loader.clients(),
                field = %format_args!("boot.loaders.{}", loader.key()),
                file,
                root = %root.path().display(),
                reason = %refusal,
                "loader not served from the TFTP root: its clients are not offered a boot (put the file there, \
                 or name another in the field, and restart)"
            );
            false
        }
    });
    offered
}

/// One log line per service with its counters; a line naming the last rogue server while any were seen.
fn report(counters: &SiteCounters, http: &BootHttp) {
    let d = counters.dhcp.snapshot();
    let ignored: Vec<String> = d.ignored.iter().map(|(k, v)| format!("{k}={v}")).collect();
    info!(
        received = d.received,
        replied = d.replied,
        replied_4011 = d.replied_4011,
        decode_failed = d.decode_failed,
        send_failed = d.send_failed,
        rogue_seen = d.rogue_seen,
        ignored = %ignored.join(","),
        "proxy DHCP counters"
    );
    if let Some(rogue) = &d.last_rogue {
        warn!(seen = d.rogue_seen, last = %rogue, "other PXE servers answer on the boot segment");
    }
    let t = &counters.tftp;
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    info!(
        started = get(&t.started),
        completed = get(&t.completed),
        failed = get(&t.failed),
        refused = get(&t.refused),
        malformed = get(&t.malformed),
        acks_spun = get(&t.acks_spun),
        acks_slept = get(&t.acks_slept),
        "TFTP counters"
    );
    let h = http.counters();
    info!(
        requests = h.requests,
        scripts = h.scripts,
        files = h.files,
        not_modified = h.not_modified,
        not_found = h.not_found,
        refused = h.refused,
        bad_requests = h.bad_requests,
        bytes_sent = h.bytes_sent,
        aborted = h.aborted,
        "boot HTTP counters"
    );
}
