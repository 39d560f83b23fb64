//! Boot HTTP: per-machine iPXE scripts, iPXE loaders for UEFI HTTP boot, and boot artifacts from the local cache.
//!
//! Routes (GET and HEAD only):
//! - `/boot/<mac>.ipxe`: the machine's desired boot from the [`BootCatalog`] rendered by [`render_script`]; the
//!   MAC may be upper or lower case, `:` or `-` separated. Unknown MACs get 404 with the reason.
//!   Targets may also come in absolute form (`http://host/ipxe/...`, RFC 9112 §3.2.2).
//! - `/ipxe/<loader>`: the loaders the proxy DHCP names for HTTP-boot clients, from the loader directory (usually
//!   the TFTP root).
//! - `/artifacts/<path>`: kernels, initramfs and images from the artifact cache the site fills.
//!
//! Files go out with `sendfile(2)` straight from the page cache (no copy through user space, no whole-file reads),
//! with `Content-Length`, `ETag`, `Last-Modified`, conditional requests (304 / 412, [`conditional`]), single
//! `Range` requests (206 / 416) and `If-Range`. What may be opened follows the TFTP rules
//! ([`crate::tftp::root::ServeRoot`]): relative names, no `..`, nothing a symlink leads outside the directory,
//! regular world-readable files only. Error bodies never echo the request's path.
//!
//! The HTTP/1.1 framing is this module's own (request heads are parsed by `httparse` and checked by [`request`]:
//! Host, target forms): a boot server needs GET/HEAD, keep-alive and pipelining, never request bodies, and a
//! generic stack (hyper/axum) cannot hand a socket to `sendfile`, which is what keeps up with nginx. Requests with
//! a body are refused (413) and the connection closed.
//! Start reading at [`run`]; [`conn`] holds the per-connection loop.

pub mod conditional;
mod conn;
mod ipxe;
pub mod range;
pub mod request;

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::dhcp::MacAddr;
use crate::tftp::root::ServeRoot;

pub use ipxe::{DesiredBoot, RenderError, render_script};

/// Desired boot per MAC, as the site learns it from the control plane. Handed to [`run`] through a `watch`
/// channel: a new catalog takes effect with the next request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootCatalog {
    machines: HashMap<MacAddr, DesiredBoot>,
}

impl BootCatalog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, mac: MacAddr, boot: DesiredBoot) -> Option<DesiredBoot> {
        self.machines.insert(mac, boot)
    }

    pub fn remove(&mut self, mac: &MacAddr) -> Option<DesiredBoot> {
        self.machines.remove(mac)
    }

    pub fn get(&self, mac: &MacAddr) -> Option<&DesiredBoot> {
        self.machines.get(mac)
    }

    pub fn len(&self) -> usize {
        self.machines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.machines.is_empty()
    }
}

impl FromIterator<(MacAddr, DesiredBoot)> for BootCatalog {
    fn from_iter<I: IntoIterator<Item = (MacAddr, DesiredBoot)>>(iter: I) -> Self {
        BootCatalog {
            machines: iter.into_iter().collect(),
        }
    }
}

/// Where files come from and how long clients may take.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Served under `/artifacts/`.
    pub artifacts: PathBuf,
    /// Served under `/ipxe/` (the TFTP root, which holds the same loaders).
    pub loaders: PathBuf,
    /// Connections served at once; further clients wait in the listen backlog.
    pub max_connections: usize,
    /// Time to receive a whole request head once its first byte arrived.
    pub header_timeout: Duration,
    /// Time a keep-alive connection may sit between requests.
    pub idle_timeout: Duration,
    /// Time a client may take to accept more bytes of a response before it is dropped.
    pub write_timeout: Duration,
    /// After shutdown, time given to responses in flight before they are cut.
    pub shutdown_grace: Duration,
}

impl HttpConfig {
    pub fn new(artifacts: impl Into<PathBuf>, loaders: impl Into<PathBuf>) -> Self {
        HttpConfig {
            artifacts: artifacts.into(),
            loaders: loaders.into(),
            max_connections: 1024,
            header_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// A served directory that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("boot HTTP {what} directory {path}")]
pub struct DirError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Counters since start; read with [`HttpCounters::snapshot`].
#[derive(Debug, Default)]
pub struct HttpCounters {
    requests: AtomicU64,
    scripts: AtomicU64,
    files: AtomicU64,
    not_modified: AtomicU64,
    not_found: AtomicU64,
    refused: AtomicU64,
    bad_requests: AtomicU64,
    bytes_sent: AtomicU64,
    aborted: AtomicU64,
}

/// A copy of [`HttpCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HttpCountersSnapshot {
    pub requests: u64,
    /// iPXE scripts served.
    pub scripts: u64,
    /// File responses (200 or 206) started.
    pub files: u64,
    /// 304: the client's copy (If-None-Match / If-Modified-Since) is current.
    pub not_modified: u64,
    /// 404: unknown MAC, missing file, unknown route.
    pub not_found: u64,
    /// 403 / 412 / 416 / 405 / 413, requests with a target of neither form (400), and renders refused.
    pub refused: u64,
    /// Unparseable heads (400, a missing or repeated Host included / 431) and header timeouts.
    pub bad_requests: u64,
    /// File body bytes handed to the kernel.
    pub bytes_sent: u64,
    /// Responses cut short (client gone, write timeout, file shrank).
    pub aborted: u64,
}

impl HttpCounters {
    pub fn snapshot(&self) -> HttpCountersSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        HttpCountersSnapshot {
            requests: get(&self.requests),
            scripts: get(&self.scripts),
            files: get(&self.files),
            not_modified: get(&self.not_modified),
            not_found: get(&self.not_found),
            refused: get(&self.refused),
            bad_requests: get(&self.bad_requests),
            bytes_sent: get(&self.bytes_sent),
            aborted: get(&self.aborted),
        }
    }
}

/// The validated server: both directories exist. Build once, hand to [`run`].
#[derive(Debug, Clone)]
pub struct BootHttp {
    shared: Arc<conn::Shared>,
}

impl BootHttp {
    pub fn new(config: HttpConfig) -> Result<Self, DirError> {
        Self::with_counters(config, Arc::default())
    }

    /// Like [`BootHttp::new`], counting into `counters` (shared with the caller, e.g. for telemetry).
    pub fn with_counters(
        config: HttpConfig,
        counters: Arc<HttpCounters>,
    ) -> Result<Self, DirError> {
        let open = |what, path: &PathBuf| {
            ServeRoot::new(path).map_err(|e| DirError {
                what,
                path: e.path,
                source: e.source,
            })
        };
        let artifacts = open("artifacts", &config.artifacts)?;
        let loaders = open("loaders", &config.loaders)?;
        Ok(BootHttp {
            shared: Arc::new(conn::Shared {
                artifacts,
                loaders,
                config,
                counters,
            }),
        })
    }

    pub fn counters(&self) -> HttpCountersSnapshot {
        self.shared.counters.snapshot()
    }
}

/// Serves boot HTTP on an already-bound listener until `shutdown` completes, then lets responses in flight finish
/// for [`HttpConfig::shutdown_grace`] and cuts the rest.
pub async fn run(
    listener: TcpListener,
    http: BootHttp,
    catalog: watch::Receiver<BootCatalog>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let shared = http.shared;
    let limit = Arc::new(Semaphore::new(shared.config.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, catalog = catalog.borrow().len(), "boot HTTP serving");
    }
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            permit = limit.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let catalog = catalog.clone();
                let stop = stop_rx.clone();
                tasks.spawn(async move {
                    conn::serve(stream, peer, &shared, catalog, stop).await;
                    drop(permit);
                });
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(error = %e, "boot HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let _ = stop_tx.send(true);
    let grace = shared.config.shutdown_grace;
    let drained =
        tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        debug!(
            left = tasks.len(),
            "boot HTTP shutdown grace over: cutting responses"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    info!("boot HTTP stopped");
    Ok(())
}
