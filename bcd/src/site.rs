//! `bcd site run`: the site agent's link to the control plane (feature `site`).
//!
//! The agent enrolled with `bcd site enroll <bcst_…>` (the same sealed-token path as `bcd join`; its identity is
//! `spiffe://<domain>/site/<site-id>`). It keeps one mTLS connection to the gateway and, every third of the lease
//! TTL, asks for the site's boot lease ([`BootLeaseView`]). While it holds the lease it fetches the site's netboot
//! table and feeds it to `bcd site serve`'s table channel; when it does not, or when its lease runs out on its own
//! clock without a renewal (the control plane unreachable), it feeds an empty table, so its proxy DHCP answers
//! nobody. A standby agent of the same site takes over once the holder's lease has expired in the store.
//! Machines whose boot references control-plane artifacts are published only once
//! [`crate::artifact_cache::ArtifactCache`] holds them, verified.

use crate::artifact_cache::ArtifactCache;
use crate::config::Config;
use crate::state::{StateDir, StateError};
use bc_proto::channel::{self, Backoff, ServerTrust};
use bc_proto::v1;
use bcd_site::dhcp::MacAddr;
use bcd_site::http::DesiredBoot;
use bcd_site::serve::Netboot;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject as _;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use zeroize::Zeroizing;

#[derive(Debug, thiserror::Error)]
pub enum SiteError {
    #[error("site state")]
    State(#[from] StateError),
    #[error(
        "this site agent has not enrolled yet (no identity in {dir}): run `bcd site enroll <bcst_ token>` first"
    )]
    NotEnrolled { dir: String },
    #[error(
        "{spiffe_id} is not a site identity: this state directory belongs to a node, not a site agent"
    )]
    NotASite { spiffe_id: String },
    #[error(
        "the certificate of {spiffe_id} expired while the agent was not running: enroll again with a new site token \
         (`better-compute site-tokens create`, then `bcd site enroll`)"
    )]
    Expired { spiffe_id: String },
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error(
        "the gateway refused the certificate of {spiffe_id} at the TLS handshake: the site is revoked \
         (`better-compute sites revoke`); enroll this host into another site with a new site token"
    )]
    Revoked { spiffe_id: String },
}

impl SiteError {
    /// The process exit status for this error: [`crate::session::EXIT_REFUSED`] when the control plane refuses the
    /// site (a service manager should not restart the agent), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            SiteError::Revoked { .. } => crate::session::EXIT_REFUSED,
            _ => 1,
        }
    }
}

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
            cache_max_bytes: crate::artifact_cache::DEFAULT_MAX_BYTES,
        }
    }
}

/// A check of the gateway's answer that must not hold up the lease loop (its deadline stops DHCP): false when it
/// takes longer than `within`.
async fn bounded(within: Duration, check: impl Future<Output = bool>) -> bool {
    tokio::time::timeout(within, check).await.unwrap_or(false)
}

/// The agent's mTLS client configuration: its certificate and key, the control plane's trust bundle.
fn tls_of(state: &StateDir) -> Result<Arc<rustls::ClientConfig>, SiteError> {
    let cert = state.certificate()?;
    let bundle = state.trust_bundle()?;
    let key = PrivateKeyDer::from_pem_file(state.path("node.key"))
        .map_err(|e| SiteError::Tls(e.to_string()))?;
    channel::client_config(ServerTrust::Bundle(bundle), Some((vec![cert], key)))
        .map_err(|e| SiteError::Tls(e.to_string()))
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
    pub fn artifact_counters(&self) -> Option<crate::artifact_cache::CacheCounters> {
        self.cache.as_ref().map(ArtifactCache::counters)
    }

    /// Watches what the agent knows about the lease.
    pub fn view(&self) -> watch::Receiver<BootLeaseView> {
        self.view.subscribe()
    }

    fn tls(&self, state: &StateDir) -> Result<Arc<rustls::ClientConfig>, SiteError> {
        tls_of(state)
    }

    /// Runs until `shutdown`: holds or stands by for the boot lease and feeds `table` accordingly. On shutdown it
    /// stops serving and releases the lease, so a standby takes over at its next ask instead of after the TTL.
    pub async fn run(
        &self,
        table: watch::Sender<Netboot>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), SiteError> {
        let state = StateDir::open(&self.config.state_dir)?;
        let mut identity = site_identity(&state, &self.config.state_dir)?;
        let mut tls = self.tls(&state)?;
        let mut renew_at = Instant::now()
            + crate::session::renewal_delay(
                &state,
                &identity,
                crate::session::now_ms(),
                rand::random::<f64>(),
            );
        let ttl = self.options.lease_ttl;
        let interval = ttl / 3;
        let rpc_timeout = interval.max(Duration::from_millis(200));
        let ttl_ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
        tokio::pin!(shutdown);
        let mut client: Option<
            v1::site_service_client::SiteServiceClient<tonic::transport::Channel>,
        > = None;
        let mut backoff = Backoff::new(Duration::from_millis(200), ttl);
        // While serving: when our lease ends on our own clock unless renewed first.
        let mut deadline: Option<Instant> = None;
        let mut wait = Duration::ZERO;
        loop {
            let sleep_until = match deadline {
                Some(d) => (Instant::now() + wait).min(d),
                None => Instant::now() + wait,
            };
            let fetched = async {
                match &self.cache {
                    Some(c) => c.done.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep_until(sleep_until) => {}
                // An artifact came in: ask again now, so its machines are published without waiting a round.
                _ = fetched => {}
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                tracing::warn!(
                    site_id = identity.node_id,
                    "boot lease ran out without a renewal: no longer answering DHCP"
                );
                self.stand_by(&table, None);
                deadline = None;
            }
            let c = match &mut client {
                Some(c) => c,
                None => {
                    match tokio::time::timeout(
                        rpc_timeout,
                        channel::connect(&identity.gateway_url, tls.clone()),
                    )
                    .await
                    {
                        Ok(Ok(ch)) => {
                            client.insert(v1::site_service_client::SiteServiceClient::new(ch))
                        }
                        Ok(Err(e))
                            if bounded(
                                rpc_timeout,
                                crate::session::connect_refused_as_revoked(
                                    &e,
                                    &identity.gateway_url,
                                    tls.clone(),
                                ),
                            )
                            .await =>
                        {
                            self.stand_by(&table, None);
                            return Err(SiteError::Revoked {
                                spiffe_id: identity.spiffe_id.clone(),
                            });
                        }
                        Ok(Err(e)) => {
                            wait = backoff.next_delay(rand::random::<f64>()).min(interval);
                            tracing::warn!(error = %crate::join::error_chain(&e), ?wait, "gateway unreachable");
                            continue;
                        }
                        Err(_) => {
                            wait = backoff.next_delay(rand::random::<f64>()).min(interval);
                            tracing::warn!(?wait, "connecting to the gateway timed out");
                            continue;
                        }
                    }
                }
            };
            if Instant::now() >= renew_at {
                renew_at = Instant::now() + interval;
                match self.renew(c, &state, &mut identity, rpc_timeout).await {
                    Ok(()) => {
                        tls = self.tls(&state)?;
                        renew_at = Instant::now()
                            + crate::session::renewal_delay(
                                &state,
                                &identity,
                                crate::session::now_ms(),
                                rand::random::<f64>(),
                            );
                        // Reconnect with the new certificate at once; the lease and table are unchanged.
                        client = None;
                        wait = Duration::ZERO;
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = e, "site certificate renewal failed; retrying")
                    }
                }
            }
            let sent = Instant::now();
            let asked = tokio::time::timeout(
                rpc_timeout,
                c.boot_lease(v1::BootLeaseRequest {
                    ttl_ms,
                    release: false,
                }),
            )
            .await;
            let lease = match asked {
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(s))
                    if bounded(
                        rpc_timeout,
                        crate::session::refused_as_revoked(&s, &identity.gateway_url, tls.clone()),
                    )
                    .await =>
                {
                    self.stand_by(&table, None);
                    return Err(SiteError::Revoked {
                        spiffe_id: identity.spiffe_id.clone(),
                    });
                }
                Ok(Err(s)) => {
                    tracing::warn!(code = ?s.code(), error = s.message(), "boot lease request refused");
                    if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown) {
                        client = None;
                    }
                    // Refused by the control plane (a revoked site, before the gateway's revocation set caught up):
                    // serve nothing, and reconnect so the next handshake says whether the site is revoked.
                    if s.code() == tonic::Code::PermissionDenied {
                        if deadline.take().is_some() {
                            tracing::warn!(
                                site_id = identity.node_id,
                                "the control plane refused this agent: no longer answering DHCP"
                            );
                        }
                        self.stand_by(&table, None);
                        client = None;
                    }
                    wait = backoff.next_delay(rand::random::<f64>()).min(interval);
                    continue;
                }
                Err(_) => {
                    tracing::warn!("boot lease request timed out; reconnecting");
                    client = None;
                    wait = interval;
                    continue;
                }
            };
            backoff.reset();
            wait = interval;
            if !lease.held {
                if deadline.is_some() {
                    tracing::warn!(
                        site_id = identity.node_id,
                        holder = lease.holder,
                        "boot lease lost: no longer answering DHCP"
                    );
                }
                deadline = None;
                self.stand_by(&table, Some(&lease));
                continue;
            }
            // Never trust a lease longer than the one asked for: the local deadline is what stops DHCP when the
            // control plane cannot be reached.
            let expires_in =
                Duration::from_millis(u64::try_from(lease.expires_in_ms).unwrap_or(0)).min(ttl);
            let was_serving = deadline.is_some();
            deadline = Some(sent + expires_in);
            match tokio::time::timeout(rpc_timeout, c.netboot(v1::NetbootRequest {})).await {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    let r = match &self.cache {
                        Some(cache) => cache.ready(&r, c),
                        None => without_artifacts(r),
                    };
                    let t = netboot_table(&r);
                    if !was_serving {
                        tracing::info!(
                            site_id = identity.node_id,
                            fence = lease.fence,
                            machines = t.len(),
                            "boot lease held: answering DHCP"
                        );
                    }
                    let machines = t.len();
                    table.send_if_modified(|cur| {
                        let changed = *cur != t;
                        *cur = t;
                        changed
                    });
                    self.view.send_replace(BootLeaseView {
                        serving: true,
                        fence: lease.fence,
                        holder: lease.holder,
                        machines,
                    });
                }
                // Keep the table we serve (if any) until the lease runs out; try again at the next round.
                Ok(Err(s)) => {
                    tracing::warn!(code = ?s.code(), error = s.message(), "netboot table request refused")
                }
                Err(_) => tracing::warn!("netboot table request timed out"),
            }
        }
        self.stand_by(&table, None);
        if let Some(c) = &mut client {
            let _ = tokio::time::timeout(
                rpc_timeout,
                c.boot_lease(v1::BootLeaseRequest {
                    ttl_ms,
                    release: true,
                }),
            )
            .await;
        }
        tracing::info!(
            site_id = identity.node_id,
            "site agent stopped; boot lease released"
        );
        Ok(())
    }

    /// Renews the site certificate by proof of possession and stores it (used from the next connection).
    async fn renew(
        &self,
        c: &mut v1::site_service_client::SiteServiceClient<tonic::transport::Channel>,
        state: &StateDir,
        identity: &mut crate::state::NodeIdentity,
        timeout: Duration,
    ) -> Result<(), String> {
        let req = crate::session::renewal_request(state)?;
        let r = tokio::time::timeout(timeout, c.renew(req))
            .await
            .map_err(|_| "renewal timed out".to_string())?
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        crate::session::store_renewal(state, identity, &r)?;
        tracing::info!(
            site_id = identity.node_id,
            not_after_ms = identity.not_after_ms,
            "site certificate renewed; used from the next connection"
        );
        Ok(())
    }

    /// Stops answering: an empty table for the services.
    fn stand_by(&self, table: &watch::Sender<Netboot>, lease: Option<&v1::BootLeaseResponse>) {
        table.send_if_modified(|cur| {
            let changed = !cur.is_empty();
            *cur = Netboot::default();
            changed
        });
        self.view.send_replace(BootLeaseView {
            serving: false,
            fence: lease.map(|l| l.fence).unwrap_or_default(),
            holder: lease.map(|l| l.holder.clone()).unwrap_or_default(),
            machines: 0,
        });
    }
}

// === impl secrets ===

/// What a secret JWE carries (the control plane's `secrets::SecretClaims`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct SecretClaims {
    pub name: String,
    pub value: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretFetchError {
    #[error("site state")]
    Site(#[from] SiteError),
    #[error("connecting to the gateway at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("the control plane refused secret {name:?} ({code:?}): {message}")]
    Refused {
        name: String,
        code: tonic::Code,
        message: String,
    },
    #[error(
        "the secret's JWE does not open with this request's key (tampered, or not meant for it): {0}"
    )]
    Jwe(String),
    #[error("the JWE carries secret {got:?} for {subject:?}, not {want:?} for this site")]
    Mismatch {
        want: String,
        got: String,
        subject: String,
    },
}

/// Opens a secret JWE with the request's ephemeral key and checks it is the secret asked for, for `site_id`. The
/// value comes back in a [`Zeroizing`] string: wiped when dropped.
pub fn open_secret(
    key: &jwt_simple::prelude::EcdhEsA256KWDecryptionKey,
    jwe: &str,
    name: &str,
    site_id: &str,
) -> Result<Zeroizing<String>, SecretFetchError> {
    let mut claims = key
        .decrypt_token::<SecretClaims>(jwe, None)
        .map_err(|e| SecretFetchError::Jwe(e.to_string()))?;
    let value = Zeroizing::new(std::mem::take(&mut claims.custom.value));
    let subject = claims.subject.clone().unwrap_or_default();
    if claims.custom.name != name || subject != site_id {
        return Err(SecretFetchError::Mismatch {
            want: name.to_string(),
            got: claims.custom.name,
            subject,
        });
    }
    Ok(value)
}

/// The site identity of a state directory: enrolled, a site (not a node) and not expired.
fn site_identity(
    state: &StateDir,
    dir: &std::path::Path,
) -> Result<crate::state::NodeIdentity, SiteError> {
    let identity = state.identity()?.ok_or_else(|| SiteError::NotEnrolled {
        dir: dir.display().to_string(),
    })?;
    let is_site = identity
        .spiffe_id
        .parse::<bc_proto::spiffe::SpiffeId>()
        .is_ok_and(|id| id.role() == bc_proto::spiffe::Role::Site);
    if !is_site {
        return Err(SiteError::NotASite {
            spiffe_id: identity.spiffe_id,
        });
    }
    if identity.not_after_ms <= crate::session::now_ms() {
        return Err(SiteError::Expired {
            spiffe_id: identity.spiffe_id,
        });
    }
    Ok(identity)
}

/// Asks the control plane for secret `name` of this agent's site, with a fresh P-256 key used for this request
/// only; the answer is a JWE to that key, which the gateway relaying it cannot open.
pub async fn fetch_secret(
    config: &Config,
    name: &str,
) -> Result<Zeroizing<String>, SecretFetchError> {
    fetch_secret_in(&config.state_dir, name).await
}

/// [`fetch_secret`] with the identity of the site agent whose state directory is `state_dir` (the gateway is the
/// one it enrolled with).
pub async fn fetch_secret_in(
    state_dir: &std::path::Path,
    name: &str,
) -> Result<Zeroizing<String>, SecretFetchError> {
    let state = StateDir::open(state_dir).map_err(SiteError::from)?;
    let identity = site_identity(&state, state_dir)?;
    let tls = tls_of(&state)?;
    let revoked = || {
        SecretFetchError::Site(SiteError::Revoked {
            spiffe_id: identity.spiffe_id.clone(),
        })
    };
    let ch = match channel::connect(&identity.gateway_url, tls.clone()).await {
        Ok(ch) => ch,
        Err(e) if crate::session::revoked_at_handshake(&e) => return Err(revoked()),
        Err(e) => {
            return Err(SecretFetchError::Connect {
                url: identity.gateway_url.clone(),
                message: crate::join::error_chain(&e),
            });
        }
    };
    let key = jwt_simple::prelude::EcdhEsA256KWDecryptionKey::generate();
    let response = match v1::secret_service_client::SecretServiceClient::new(ch)
        .secret_request(v1::SecretRequestMessage {
            secret_ref: name.to_string(),
            recipient_jwk: key.encryption_key().to_jwk(),
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) if crate::session::refused_as_revoked(&s, &identity.gateway_url, tls).await => {
            return Err(revoked());
        }
        Err(s) => {
            return Err(SecretFetchError::Refused {
                name: name.to_string(),
                code: s.code(),
                message: s.message().to_string(),
            });
        }
    };
    open_secret(&key, &response.jwe, name, &identity.node_id)
}

/// Why BMC credentials could not be had from the broker.
#[derive(Debug, thiserror::Error)]
pub enum BmcSecretError {
    #[error("fetching BMC secret {name:?}")]
    Fetch {
        name: String,
        #[source]
        source: SecretFetchError,
    },
    #[error(
        "secret {name:?} of site {site} {why}: BMC credentials are stored as {format} \
         (`better-compute secrets put {name} --site {site}`, value in BC_SECRET_VALUE)",
        format = bcd_site::redfish::SECRET_FORMAT
    )]
    Format {
        name: String,
        site: String,
        why: bcd_site::redfish::CredentialsFormatError,
    },
}

/// BMC credentials from the control plane's secret broker: secret `name` of the site whose agent state is
/// `state_dir`, in the format of [`bcd_site::redfish::Credentials::from_secret_json`]. Neither the secret nor the
/// password is logged or kept: the JSON is wiped once parsed, the password when the credentials are dropped.
pub async fn fetch_bmc_credentials(
    state_dir: &std::path::Path,
    name: &str,
) -> Result<bcd_site::redfish::Credentials, BmcSecretError> {
    let fetch = |source| BmcSecretError::Fetch {
        name: name.to_string(),
        source,
    };
    let value = fetch_secret_in(state_dir, name).await.map_err(fetch)?;
    bcd_site::redfish::Credentials::from_secret_json(&value).map_err(|why| {
        let site = StateDir::open(state_dir)
            .ok()
            .and_then(|s| s.identity().ok().flatten())
            .map_or_else(|| "<site>".to_string(), |i| i.node_id);
        BmcSecretError::Format {
            name: name.to_string(),
            site,
            why,
        }
    })
}
