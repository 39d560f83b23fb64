//! `bcd site run`'s agent: performs the boot lease's steps ([`super::lease`]) against the control plane and applies
//! its effects to the table the services serve. The I/O is behind [`Link`] ([`GatewayLink`] is the real one, over
//! the gateway's `SiteService`), so the driver runs on paused time in tests; the decisions are all the lease's.

use super::cache::ArtifactCache;
use super::lease::{
    BootLease, Effect, Event, LeaseAnswer, LeaseTimes, Refusal, StandByReason, Step,
};
use super::{SiteError, site_identity, tls_of};
use crate::config::Config;
use crate::state::{NodeIdentity, StateDir};
use bc_error_chain::chain;
use bc_proto::channel;
use bc_proto::v1;
use bcd_site::dhcp::MacAddr;
use bcd_site::http::DesiredBoot;
use bcd_site::serve::Netboot;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

type Client = v1::site_service_client::SiteServiceClient<tonic::transport::Channel>;

/// What the agent knows about the boot lease, for logs, status and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootLeaseView {
    /// True while this agent holds the lease and feeds the real table (its DHCP answers).
    pub serving: bool,
    pub fence: i64,
    pub holder: String,
    /// Machines in the table fed to the services (0 while standing by).
    pub machines: usize,
}

#[derive(Debug, Clone)]
pub struct SiteAgentOptions {
    /// Lease length asked for; the agent renews every third of it.
    pub lease_ttl: Duration,
    /// The artifact cache (`boot.artifacts`): artifacts the table references are fetched into it. `None`: machines
    /// referencing artifacts are left out of the table.
    pub artifacts: Option<std::path::PathBuf>,
    /// Artifact downloads at once.
    pub artifact_fetches: usize,
    /// Size cap of the artifact cache (`[cache] max_bytes`).
    pub cache_max_bytes: u64,
}

impl Default for SiteAgentOptions {
    fn default() -> Self {
        SiteAgentOptions {
            lease_ttl: Duration::from_secs(15),
            artifacts: None,
            artifact_fetches: 4,
            cache_max_bytes: super::cache::DEFAULT_MAX_BYTES,
        }
    }
}

/// Converts the control plane's table; entries that cannot be used are logged and left out.
pub fn netboot_table(r: &v1::NetbootResponse) -> Netboot {
    let mut machines = BTreeMap::new();
    for m in &r.machines {
        let Ok(mac) = m.mac.parse::<MacAddr>() else {
            tracing::warn!(mac = m.mac, "netboot entry with an unusable MAC left out");
            continue;
        };
        machines.insert(
            mac,
            DesiredBoot {
                kernel: m.kernel.clone(),
                initrd: (!m.initrd.is_empty()).then(|| m.initrd.clone()),
                cmdline: m.cmdline.clone(),
            },
        );
    }
    Netboot::from_machines(machines)
}

/// The table less the machines that reference artifacts (no cache to put them in).
fn without_artifacts(mut r: v1::NetbootResponse) -> v1::NetbootResponse {
    r.machines.retain(|m| {
        let keep = m.artifacts.is_empty();
        if !keep {
            tracing::warn!(
                mac = m.mac,
                "netboot entry references artifacts but this agent has no artifact cache: left out"
            );
        }
        keep
    });
    r
}

pub struct SiteAgent {
    config: Config,
    options: SiteAgentOptions,
    view: watch::Sender<BootLeaseView>,
    cache: Option<ArtifactCache>,
}

impl SiteAgent {
    pub fn new(config: Config, options: SiteAgentOptions) -> SiteAgent {
        let cache = options.artifacts.as_deref().map(|dir| {
            ArtifactCache::new(dir, options.artifact_fetches)
                .with_max_bytes(options.cache_max_bytes)
        });
        SiteAgent {
            config,
            options,
            view: watch::channel(BootLeaseView::default()).0,
            cache,
        }
    }

    /// The artifact cache's counters (`None` without a cache).
    pub fn artifact_counters(&self) -> Option<super::cache::CacheCounters> {
        self.cache.as_ref().map(ArtifactCache::counters)
    }

    /// Watches what the agent knows about the lease.
    pub fn view(&self) -> watch::Receiver<BootLeaseView> {
        self.view.subscribe()
    }

    /// Runs until `shutdown`: holds or stands by for the boot lease and feeds `table` accordingly. On shutdown it
    /// stops serving and releases the lease, so a standby takes over at its next ask instead of after the TTL.
    pub async fn run(
        &self,
        table: watch::Sender<Netboot>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), SiteError> {
        let state = StateDir::open(&self.config.state_dir)?;
        let identity = site_identity(&state, &self.config.state_dir)?;
        let tls = tls_of(&state)?;
        let renew_in = crate::session::renewal_delay(
            &state,
            &identity,
            crate::session::now_ms(),
            rand::random::<f64>(),
        );
        let times = LeaseTimes::new(self.options.lease_ttl);
        let mut link = GatewayLink {
            state,
            identity,
            tls,
            client: None,
            cache: self.cache.as_ref(),
            probe_timeout: times.rpc_timeout,
            version: String::new(),
            pushed: std::sync::Mutex::new(String::new()),
        };
        let out = Outputs {
            table: &table,
            view: &self.view,
        };
        drive(
            &mut link,
            out,
            times,
            renew_in,
            shutdown,
            rand::random::<f64>,
        )
        .await
    }
}

// === the driver ===

/// How a connection attempt ended.
#[derive(Debug)]
pub(crate) enum Connect {
    Connected,
    /// The gateway refused this agent's certificate as revoked.
    Revoked,
    Failed(String),
}

/// How a lease request ended.
#[derive(Debug)]
pub(crate) enum Asked {
    Answer(v1::BootLeaseResponse),
    Refused { code: tonic::Code, message: String },
    Revoked,
}

/// The agent's I/O toward the control plane. Each call is bounded by the driver (the lease's request timeout).
pub(crate) trait Link {
    /// The site's id and SPIFFE id, for logs and errors.
    fn site(&self) -> (&str, &str);
    fn connect(&mut self) -> impl Future<Output = Connect> + Send;
    /// Renews the site certificate; the next renewal is due in the `Ok` duration.
    fn renew(&mut self) -> impl Future<Output = Result<Duration, String>> + Send;
    fn ask(&mut self, ttl_ms: u32) -> impl Future<Output = Asked> + Send;
    /// The netboot table to serve (machines whose artifacts are not cached yet left out).
    fn table(&mut self) -> impl Future<Output = Result<Netboot, String>> + Send;
    fn release(&mut self, ttl_ms: u32) -> impl Future<Output = ()> + Send;
    fn disconnect(&mut self);
    /// Resolves when an artifact finished downloading (the agent asks again at once to publish its machines).
    fn poked(&self) -> impl Future<Output = ()> + Send;
}

/// Where the lease's effects go.
pub(crate) struct Outputs<'a> {
    pub table: &'a watch::Sender<Netboot>,
    pub view: &'a watch::Sender<BootLeaseView>,
}

impl Outputs<'_> {
    /// Serves `t` (the table just fetched).
    fn serve(&self, site_id: &str, t: Netboot, fence: i64, holder: String, first: bool) {
        let machines = t.len();
        if first {
            tracing::info!(site_id, fence, machines, "boot lease held: answering DHCP");
        }
        self.table.send_if_modified(|cur| {
            let changed = *cur != t;
            *cur = t;
            changed
        });
        self.view.send_replace(BootLeaseView {
            serving: true,
            fence,
            holder,
            machines,
        });
    }

    /// Serves nothing.
    fn stand_by(&self, site_id: &str, fence: i64, holder: String, why: Option<StandByReason>) {
        match &why {
            Some(StandByReason::RanOut) => tracing::warn!(
                site_id,
                "boot lease ran out without a renewal: no longer answering DHCP"
            ),
            Some(StandByReason::Lost { holder }) => {
                tracing::warn!(site_id, holder, "boot lease lost: no longer answering DHCP")
            }
            Some(StandByReason::Refused) => tracing::warn!(
                site_id,
                "the control plane refused this agent: no longer answering DHCP"
            ),
            None => {}
        }
        self.table.send_if_modified(|cur| {
            let changed = !cur.is_empty();
            *cur = Netboot::default();
            changed
        });
        self.view.send_replace(BootLeaseView {
            serving: false,
            fence,
            holder,
            machines: 0,
        });
    }
}

/// Runs the lease: performs each step, feeds its outcome back, applies the effects; `unit` draws the backoff's
/// random numbers. The lease's deadline is kept while a step is in flight: when it comes, the agent stops serving
/// without waiting for the request to end.
pub(crate) async fn drive<L: Link>(
    link: &mut L,
    out: Outputs<'_>,
    times: LeaseTimes,
    renew_in: Duration,
    shutdown: impl Future<Output = ()>,
    mut unit: impl FnMut() -> f64,
) -> Result<(), SiteError> {
    tokio::pin!(shutdown);
    let site_id = link.site().0.to_string();
    let mut lease = BootLease::new(times, Instant::now(), renew_in);
    let mut plan = lease.start(Instant::now());
    let mut fetched: Option<Netboot> = None;
    loop {
        for effect in std::mem::take(&mut plan.effects) {
            match effect {
                Effect::Serve {
                    fence,
                    holder,
                    first,
                } => {
                    if let Some(t) = fetched.take() {
                        out.serve(&site_id, t, fence, holder, first);
                    }
                }
                Effect::StandBy { fence, holder, why } => {
                    out.stand_by(&site_id, fence, holder, why)
                }
                Effect::Disconnect => link.disconnect(),
            }
        }
        let event = match plan.step {
            Step::Wait { until } => {
                tokio::select! {
                    () = &mut shutdown => Event::Shutdown,
                    () = tokio::time::sleep_until(until) => Event::Woke,
                    // An artifact came in: ask again now, so its machines are published without waiting a round.
                    () = link.poked() => Event::Woke,
                }
            }
            Step::Release => {
                let _ = tokio::time::timeout(times.rpc_timeout, link.release(times.ttl_ms())).await;
                tracing::info!(site_id, "site agent stopped; boot lease released");
                return Ok(());
            }
            Step::Stop => {
                tracing::info!(site_id, "site agent stopped");
                return Ok(());
            }
            Step::ExitRevoked => {
                return Err(SiteError::Revoked {
                    spiffe_id: link.site().1.to_string(),
                });
            }
            step => {
                let work = perform(link, step, &times);
                tokio::pin!(work);
                loop {
                    let deadline = lease.serving_until();
                    tokio::select! {
                        (event, table) = &mut work => {
                            fetched = table;
                            break event;
                        }
                        () = sleep_until_some(deadline) => {
                            if let Some(Effect::StandBy { fence, holder, why }) = lease.expire(Instant::now()) {
                                out.stand_by(&site_id, fence, holder, why);
                            }
                        }
                    }
                }
            }
        };
        plan = lease.on(event, Instant::now(), unit());
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Performs one I/O step within the request timeout; a fetched table comes back beside the event.
async fn perform<L: Link>(
    link: &mut L,
    step: Step,
    times: &LeaseTimes,
) -> (Event, Option<Netboot>) {
    let within = times.rpc_timeout;
    let event = match step {
        Step::Connect => match tokio::time::timeout(within, link.connect()).await {
            Ok(Connect::Connected) => Event::Connected,
            Ok(Connect::Revoked) => Event::Revoked,
            Ok(Connect::Failed(error)) => {
                tracing::warn!(error, "gateway unreachable");
                Event::ConnectFailed
            }
            Err(_) => {
                tracing::warn!("connecting to the gateway timed out");
                Event::ConnectFailed
            }
        },
        Step::Renew => match tokio::time::timeout(within, link.renew()).await {
            Ok(Ok(next_in)) => Event::Renewed { next_in },
            Ok(Err(error)) => {
                tracing::warn!(error, "site certificate renewal failed; retrying");
                Event::RenewFailed
            }
            Err(_) => {
                tracing::warn!("site certificate renewal timed out; retrying");
                Event::RenewFailed
            }
        },
        Step::Ask => {
            let sent = Instant::now();
            match tokio::time::timeout(within, link.ask(times.ttl_ms())).await {
                Ok(Asked::Answer(r)) => Event::Answer(LeaseAnswer {
                    held: r.held,
                    fence: r.fence,
                    holder: r.holder,
                    expires_in: Duration::from_millis(u64::try_from(r.expires_in_ms).unwrap_or(0)),
                    sent,
                }),
                Ok(Asked::Refused { code, message }) => {
                    tracing::warn!(?code, error = message, "boot lease request refused");
                    Event::Refused(Refusal::of(code))
                }
                Ok(Asked::Revoked) => Event::Revoked,
                Err(_) => {
                    tracing::warn!("boot lease request timed out; reconnecting");
                    Event::TimedOut
                }
            }
        }
        Step::FetchTable => match tokio::time::timeout(within, link.table()).await {
            Ok(Ok(t)) => return (Event::Table { fetched: true }, Some(t)),
            // The table served (if any) stays until the lease runs out; the next round tries again.
            Ok(Err(error)) => {
                tracing::warn!(error, "netboot table request refused");
                Event::Table { fetched: false }
            }
            Err(_) => {
                tracing::warn!("netboot table request timed out");
                Event::Table { fetched: false }
            }
        },
        Step::Wait { .. } | Step::Release | Step::Stop | Step::ExitRevoked => Event::Woke,
    };
    (event, None)
}

// === the gateway link ===

/// How long one push poll of the netboot table waits (the control plane caps it at 25 s).
const PUSH_WAIT: Duration = Duration::from_secs(25);

/// The real [`Link`]: one mTLS connection to the gateway's `SiteService`, with the agent's state directory for
/// renewals and the artifact cache for the table.
struct GatewayLink<'a> {
    state: StateDir,
    identity: NodeIdentity,
    tls: Arc<rustls::ClientConfig>,
    client: Option<Client>,
    cache: Option<&'a ArtifactCache>,
    /// Bound of the extra handshake that tells a revocation from a network failure.
    probe_timeout: Duration,
    /// The version of the table last fetched.
    version: String,
    /// The last version the control plane pushed while the agent waited: each one wakes it once.
    pushed: std::sync::Mutex<String>,
}

impl GatewayLink<'_> {
    /// Resolves when the control plane pushes a netboot table other than the one fetched last (a long poll of
    /// `Netboot` with its version; each new version once). A control plane that does not version its tables, or
    /// a failed call, leaves the lease's rounds to fetch it.
    async fn pushed(&self) {
        let Some(mut client) = self.client.clone() else {
            return std::future::pending().await;
        };
        let mut known = self.version.clone();
        if let Ok(p) = self.pushed.lock()
            && !p.is_empty()
            && *p != known
        {
            known.clone_from(&p);
        }
        let wait_ms = u32::try_from(PUSH_WAIT.as_millis()).unwrap_or(u32::MAX);
        loop {
            let asked = client
                .netboot(v1::NetbootRequest {
                    known_version: known.clone(),
                    wait_ms,
                })
                .await;
            match asked {
                Ok(r) if r.get_ref().version.is_empty() => return std::future::pending().await,
                Ok(r) if r.get_ref().version != known => {
                    let version = r.into_inner().version;
                    tracing::debug!(version, "netboot table pushed");
                    if let Ok(mut p) = self.pushed.lock() {
                        *p = version;
                    }
                    return;
                }
                Ok(_) => {}
                Err(s) => {
                    tracing::debug!(code = ?s.code(), error = s.message(), "netboot push: falling back to the lease's rounds");
                    return std::future::pending().await;
                }
            }
        }
    }

    fn client(&mut self) -> Result<&mut Client, String> {
        self.client
            .as_mut()
            .ok_or_else(|| "not connected to the gateway".to_string())
    }

    /// Whether a failed call means the gateway refuses this certificate as revoked (bounded: its answer must not
    /// hold up the lease, whose deadline stops DHCP).
    async fn revoked(&self, s: &tonic::Status) -> bool {
        let probe =
            crate::session::refused_as_revoked(s, &self.identity.gateway_url, self.tls.clone());
        tokio::time::timeout(self.probe_timeout, probe)
            .await
            .unwrap_or(false)
    }
}

impl Link for GatewayLink<'_> {
    fn site(&self) -> (&str, &str) {
        (&self.identity.node_id, &self.identity.spiffe_id)
    }

    async fn connect(&mut self) -> Connect {
        let url = self.identity.gateway_url.clone();
        match channel::connect(&url, self.tls.clone()).await {
            Ok(ch) => {
                self.client = Some(Client::new(ch));
                Connect::Connected
            }
            Err(e) => {
                let probe = crate::session::connect_refused_as_revoked(&e, &url, self.tls.clone());
                if tokio::time::timeout(self.probe_timeout, probe)
                    .await
                    .unwrap_or(false)
                {
                    Connect::Revoked
                } else {
                    Connect::Failed(chain(&e))
                }
            }
        }
    }

    async fn renew(&mut self) -> Result<Duration, String> {
        let req = crate::session::renewal_request(&self.state)?;
        let r = self
            .client()?
            .renew(req)
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        crate::session::store_renewal(&self.state, &mut self.identity, &r)?;
        self.tls = tls_of(&self.state).map_err(|e| {
            format!(
                "renewed, but the new certificate does not load: {}",
                chain(&e)
            )
        })?;
        tracing::info!(
            site_id = self.identity.node_id,
            not_after_ms = self.identity.not_after_ms,
            "site certificate renewed; used from the next connection"
        );
        let next = crate::session::renewal_delay(
            &self.state,
            &self.identity,
            crate::session::now_ms(),
            rand::random::<f64>(),
        );
        Ok(next)
    }

    async fn ask(&mut self, ttl_ms: u32) -> Asked {
        let Some(c) = self.client.as_mut() else {
            return Asked::Refused {
                code: tonic::Code::Unavailable,
                message: "not connected to the gateway".into(),
            };
        };
        let asked = c
            .boot_lease(v1::BootLeaseRequest {
                ttl_ms,
                release: false,
            })
            .await;
        match asked {
            Ok(r) => Asked::Answer(r.into_inner()),
            Err(s) if self.revoked(&s).await => Asked::Revoked,
            Err(s) => Asked::Refused {
                code: s.code(),
                message: s.message().to_string(),
            },
        }
    }

    async fn table(&mut self) -> Result<Netboot, String> {
        let cache = self.cache;
        let c = self.client()?;
        let r = c
            .netboot(v1::NetbootRequest::default())
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        let version = r.version.clone();
        let r = match cache {
            Some(cache) => cache.ready(&r, c),
            None => without_artifacts(r),
        };
        self.version = version;
        Ok(netboot_table(&r))
    }

    async fn release(&mut self, ttl_ms: u32) {
        if let Some(c) = self.client.as_mut() {
            let _ = c
                .boot_lease(v1::BootLeaseRequest {
                    ttl_ms,
                    release: true,
                })
                .await;
        }
    }

    fn disconnect(&mut self) {
        self.client = None;
    }

    async fn poked(&self) {
        let cached = async {
            match self.cache {
                Some(c) => c.done.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = cached => {}
            () = self.pushed() => {}
        }
    }
}

#[cfg(test)]
mod tests;
