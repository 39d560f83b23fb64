//! The connection to one BMC: TLS, authentication (a Redfish session with logout, or Basic when the BMC has no
//! session to give), the per-BMC concurrency limit, and the retry budget for "busy" answers (409, 429, 503 and
//! busy message ids) and for reads answered with a server error, with capped exponential backoff and jitter,
//! honouring `Retry-After`. Documents are decoded leniently ([`super::decode`]); collections are read to their last
//! page ([`super::listing`]), with `$expand` where the service advertises it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bc_backoff::{ExponentialBackoff, InvalidBackoff, Jitter};

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use super::credentials::Credentials;
use super::decode::{self, DecodeError, FieldWarning};
use super::error::RedfishError;
use super::listing::{Listed, Listing};
use super::models::{Collection, ErrorBody, Manager, Member, ServiceRoot};
use super::quirks::{self, BASE_BUSY_IDS, BmcIdentity, Quirks};
use super::tls::{TlsTrust, client_config};

/// How often and how patiently busy answers are retried.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts: u32,
    /// Delays between attempts; its cap also bounds a BMC's `Retry-After`.
    pub backoff: ExponentialBackoff,
}

/// Between attempts on a busy BMC: 0.5 s doubling to 10 s, equal jitter (50–100 % of each step).
pub const BMC_RETRY: ExponentialBackoff = ExponentialBackoff::new(
    Duration::from_millis(500),
    Duration::from_secs(10),
    Jitter::Fraction(0.5),
);

/// Attempts at most, within a [`RetryPolicy`]'s, for a read answered with a server error. A passing state clears
/// in that time (sushy's libvirt driver answers 500 while a domain stops: 0.25–0.5 s, then 0.5–1 s of waiting with
/// [`BMC_RETRY`]), and a resource that always fails costs no more. With the whole default budget (6 attempts, about
/// 15 s of waiting), an inspection of sushy's fake driver, which answers every `Storage` read 500, took 14.0 s (1.5 s
/// with this cap), and a fleet of 20 machines behind one emulator ran out of its inspection deadline.
pub const SERVER_ERROR_ATTEMPTS: u32 = 3;

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 6,
            backoff: BMC_RETRY,
        }
    }
}

impl RetryPolicy {
    /// `attempts` in all, [`BMC_RETRY`]'s jitter between `initial_delay` doubling to `max_delay`; refused (saying
    /// why) for a zero initial delay or a cap below it.
    pub fn new(
        attempts: u32,
        initial_delay: Duration,
        max_delay: Duration,
    ) -> Result<RetryPolicy, InvalidBackoff> {
        Ok(RetryPolicy {
            attempts,
            backoff: ExponentialBackoff::try_new(initial_delay, max_delay, BMC_RETRY.jitter())?,
        })
    }

    /// Delay before attempt `n + 1` (n ≥ 1); `unit` is a uniform random number in `[0, 1]`.
    pub fn delay(&self, n: u32, unit: f64) -> Duration {
        self.backoff.delay(n.saturating_sub(1), unit)
    }
}

/// Options for [`Bmc::connect`].
#[derive(Debug, Clone)]
pub struct BmcOptions {
    /// Certificate check for `https://` BMCs. Without one, an `https://` URL is refused.
    pub trust: Option<TlsTrust>,
    /// Per request.
    pub timeout: Duration,
    pub retry: RetryPolicy,
    /// Requests in flight to this BMC at once (BMCs fall over under parallel load). Share one [`Semaphore`]
    /// between several `Bmc`s of the same host with `limiter`.
    pub max_concurrent: usize,
    pub limiter: Option<Arc<Semaphore>>,
    /// Use Basic auth when no session can be opened (no SessionService, sessions exhausted).
    pub basic_fallback: bool,
    /// How long a one-time boot override may take to read back as set.
    pub boot_readback: Duration,
    /// How long a power change may take to show; `None` uses the vendor's value from the quirk table.
    pub power_apply_time: Option<Duration>,
    /// Between read-backs.
    pub poll_interval: Duration,
    /// Read collections with `$expand` when the service root advertises it (`ProtocolFeaturesSupported`).
    pub use_expand: bool,
}

impl Default for BmcOptions {
    fn default() -> Self {
        BmcOptions {
            trust: None,
            timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            max_concurrent: 2,
            limiter: None,
            basic_fallback: true,
            boot_readback: Duration::from_secs(5),
            power_apply_time: None,
            poll_interval: Duration::from_secs(1),
            use_expand: true,
        }
    }
}

#[derive(Debug, Clone)]
enum Auth {
    Session {
        token: String,
        location: Option<String>,
    },
    Basic,
    Closed,
}

/// A BMC's answer.
#[derive(Debug)]
pub(crate) struct Reply {
    pub status: StatusCode,
    pub etag: Option<String>,
    pub location: Option<String>,
    /// `X-Auth-Token` (session login).
    pub token: Option<String>,
    /// `Retry-After` in seconds (the HTTP-date form is ignored).
    pub retry_after: Option<Duration>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn error_body(&self) -> Option<ErrorBody> {
        serde_json::from_slice(&self.body).ok()
    }

    pub fn message(&self) -> Option<String> {
        self.error_body().and_then(|e| e.summary())
    }

    pub fn has_message_id(&self, ids: &[&str]) -> bool {
        self.error_body()
            .is_some_and(|e| e.message_ids().any(|m| ids.iter().any(|id| m.contains(id))))
    }
}

/// A connected BMC. Cheap to share behind an `Arc`; [`Bmc::close`] logs out (dropping it logs out in the
/// background when a tokio runtime is running).
#[derive(Debug)]
pub struct Bmc {
    base: String,
    http: reqwest::Client,
    creds: Credentials,
    auth: Mutex<Auth>,
    limiter: Arc<Semaphore>,
    pub(crate) opts: BmcOptions,
    root: ServiceRoot,
    identity: BmcIdentity,
    quirks: &'static Quirks,
    /// Why Basic auth is used, when a session was tried and failed.
    basic_reason: Option<String>,
    /// The `$expand` query for collections, when the service advertises one and it was not refused.
    expand: Option<&'static str>,
    expand_refused: AtomicBool,
    /// The identity mark that selected the quirks.
    recognised_by: Option<String>,
    /// HTTP requests sent (every attempt, logins and logouts included).
    requests: AtomicU64,
}

/// A decoded resource with its ETag and the properties that needed repair.
#[derive(Debug, Clone)]
pub struct Fetched<T> {
    pub value: T,
    pub etag: Option<String>,
    pub warnings: Vec<FieldWarning>,
    pub raw: Value,
}

/// The `$expand` form to use, from `ProtocolFeaturesSupported.ExpandQuery`: one level of the members, without the
/// `Links` section (`.`), or everything (`*`) where only that is offered.
fn expand_query(root: &ServiceRoot) -> Option<&'static str> {
    let q = root
        .protocol_features_supported
        .as_ref()?
        .expand_query
        .as_ref()?;
    let levels = q.levels == Some(true);
    match (q.no_links == Some(true), q.expand_all == Some(true), levels) {
        (true, _, true) => Some("$expand=.($levels=1)"),
        (true, _, false) => Some("$expand=."),
        (false, true, true) => Some("$expand=*($levels=1)"),
        (false, true, false) => Some("$expand=*"),
        _ => None,
    }
}

/// A login refusal that means "no session left to give" rather than "who are you".
fn out_of_sessions(reply: &Reply) -> bool {
    matches!(reply.status.as_u16(), 429 | 503)
        || reply.has_message_id(&["SessionLimitExceeded", "ServiceTemporarilyUnavailable"])
}

/// The rustls error inside a failed request, when the TLS handshake was refused (a wrong pin, an unknown CA):
/// repeating the request cannot help, and "no answer" would mislead the operator.
fn tls_refusal(e: &reqwest::Error) -> Option<String> {
    let mut stack: Vec<&(dyn std::error::Error + 'static)> = vec![e];
    while let Some(c) = stack.pop() {
        if let Some(tls) = c.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
        {
            stack.push(inner);
        }
        if let Some(next) = c.source() {
            stack.push(next);
        }
    }
    None
}

fn normalize_base(url: &str) -> Result<String, RedfishError> {
    let err = |why| RedfishError::Url {
        url: url.to_owned(),
        why,
    };
    let trimmed = url.trim().trim_end_matches('/');
    let rest = trimmed
        .strip_prefix("https://")
        .or_else(|| trimmed.strip_prefix("http://"))
        .ok_or_else(|| err("expected http:// or https://"))?;
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || host.contains('@') {
        return Err(err(
            "expected a host (credentials do not belong in the URL)",
        ));
    }
    let scheme_len = trimmed.len() - rest.len();
    Ok(trimmed[..scheme_len + host.len()].to_owned())
}

impl Bmc {
    /// Connects: reads the service root, opens a session (or falls back to Basic), identifies the vendor.
    pub async fn connect(
        url: &str,
        creds: Credentials,
        opts: BmcOptions,
    ) -> Result<Bmc, RedfishError> {
        let base = normalize_base(url)?;
        let mut builder = reqwest::Client::builder()
            .timeout(opts.timeout)
            .connect_timeout(opts.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(opts.max_concurrent.max(1))
            // Redfish needs no redirects, and reqwest would carry X-Auth-Token (and a login's body) to another host.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("bcd-site/", env!("CARGO_PKG_VERSION")));
        match &opts.trust {
            Some(trust) => {
                let config = client_config(trust).map_err(|why| RedfishError::Tls {
                    url: base.clone(),
                    why,
                })?;
                builder = builder.tls_backend_preconfigured(config);
            }
            None if base.starts_with("https://") => {
                return Err(RedfishError::Tls {
                    url: base,
                    why: "an https BMC needs a pinned certificate or a CA (BmcOptions::trust)"
                        .into(),
                });
            }
            None => {
                // Plain http: reqwest still wants a TLS backend; give it one on the same provider.
                let config = client_config(&TlsTrust::Roots(Vec::new())).map_err(|why| {
                    RedfishError::Tls {
                        url: base.clone(),
                        why,
                    }
                })?;
                builder = builder.tls_backend_preconfigured(config);
            }
        }
        let http = builder.build().map_err(|source| RedfishError::Client {
            url: base.clone(),
            source,
        })?;
        let limiter = opts
            .limiter
            .clone()
            .unwrap_or_else(|| Arc::new(Semaphore::new(opts.max_concurrent.max(1))));
        let mut bmc = Bmc {
            base,
            http,
            creds,
            auth: Mutex::new(Auth::Basic),
            limiter,
            opts,
            root: ServiceRoot::default(),
            identity: BmcIdentity::default(),
            quirks: &quirks::GENERIC,
            basic_reason: None,
            expand: None,
            expand_refused: AtomicBool::new(false),
            recognised_by: None,
            requests: AtomicU64::new(0),
        };
        // The service root is readable without authentication (DSP0266); Basic is sent anyway, which BMCs ignore.
        let (root, _) = bmc.get::<ServiceRoot>("/redfish/v1").await?;
        if bmc.opts.use_expand {
            bmc.expand = expand_query(&root);
        }
        bmc.root = root;
        bmc.login().await?;
        bmc.identify().await;
        info!(bmc = %bmc.base, vendor = bmc.quirks.name, auth = bmc.auth_kind(), "BMC connected");
        Ok(bmc)
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub fn service_root(&self) -> &ServiceRoot {
        &self.root
    }

    pub fn quirks(&self) -> &'static Quirks {
        self.quirks
    }

    pub fn identity(&self) -> &BmcIdentity {
        &self.identity
    }

    /// `session`, `basic` or `closed`.
    pub fn auth_kind(&self) -> &'static str {
        match &*self.auth.lock().unwrap_or_else(|p| p.into_inner()) {
            Auth::Session { .. } => "session",
            Auth::Basic => "basic",
            Auth::Closed => "closed",
        }
    }

    /// Why Basic is in use when a session was tried first.
    pub fn basic_reason(&self) -> Option<&str> {
        self.basic_reason.as_deref()
    }

    /// HTTP requests sent to the BMC so far (every attempt, login and logout included).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// The `$expand` query used for collections, if any.
    pub fn expand(&self) -> Option<&'static str> {
        self.expand
            .filter(|_| !self.expand_refused.load(Ordering::Relaxed))
    }

    fn sessions_path(&self) -> Option<String> {
        if let Some(link) = &self.root.links.sessions {
            return Some(link.odata_id.clone());
        }
        self.root
            .session_service
            .as_ref()
            .map(|s| format!("{}/Sessions", s.odata_id.trim_end_matches('/')))
    }

    async fn login(&mut self) -> Result<(), RedfishError> {
        let Some(path) = self.sessions_path() else {
            self.basic_reason = Some("the BMC has no SessionService".into());
            return self.use_basic(None).await;
        };
        let body = json!({"UserName": self.creds.username, "Password": self.creds.password});
        let reply = self
            .send_raw(Method::POST, &path, Some(&body), None, false)
            .await?;
        let url = self.url(&path);
        match reply.status.as_u16() {
            200 | 201 => {
                let token = reply.token.clone();
                let Some(token) = token else {
                    self.basic_reason = Some("session created without X-Auth-Token".into());
                    return self.use_basic(Some(&reply)).await;
                };
                let location = reply.location.clone().or_else(|| {
                    serde_json::from_slice::<Value>(&reply.body)
                        .ok()
                        .and_then(|v| {
                            v.get("@odata.id")
                                .and_then(Value::as_str)
                                .map(str::to_owned)
                        })
                });
                *self.auth.lock().unwrap_or_else(|p| p.into_inner()) =
                    Auth::Session { token, location };
                Ok(())
            }
            401 | 403 => Err(RedfishError::AuthRejected {
                url,
                status: reply.status.as_u16(),
                message: reply.message(),
            }),
            status => {
                self.basic_reason = Some(format!(
                    "session login answered HTTP {status}{}",
                    reply
                        .message()
                        .map(|m| format!(": {m}"))
                        .unwrap_or_default()
                ));
                self.use_basic(Some(&reply)).await
            }
        }
    }

    /// Switches to Basic after checking that the BMC takes it.
    async fn use_basic(&mut self, failed_login: Option<&Reply>) -> Result<(), RedfishError> {
        let url = self.url(self.sessions_path().as_deref().unwrap_or("/redfish/v1"));
        let (status, message) =
            failed_login.map_or((0, None), |r| (r.status.as_u16(), r.message()));
        if !self.opts.basic_fallback {
            return Err(RedfishError::NoSession {
                url,
                status,
                message,
                basic: "is disabled".into(),
            });
        }
        *self.auth.lock().unwrap_or_else(|p| p.into_inner()) = Auth::Basic;
        let probe = self
            .root
            .systems
            .as_ref()
            .map_or("/redfish/v1/Systems".to_owned(), |l| l.odata_id.clone());
        let reply = self
            .send_raw(Method::GET, &probe, None, None, false)
            .await?;
        match reply.status.as_u16() {
            // Out of sessions, and Basic refused too: both said.
            401 | 403 if failed_login.is_some_and(out_of_sessions) => {
                Err(RedfishError::NoSession {
                    url,
                    status,
                    message,
                    basic: format!("was rejected too (HTTP {})", reply.status.as_u16()),
                })
            }
            // The login failed for another reason (a 400 or 500 for a wrong password, a read-only service) and
            // Basic with the same credentials is refused: the credentials are what is wrong.
            401 | 403 if failed_login.is_some() => Err(RedfishError::AuthRejected {
                url,
                status: reply.status.as_u16(),
                message: Some(format!(
                    "the session login answered HTTP {status}{}, and Basic auth with the same credentials HTTP {}",
                    message.map(|m| format!(" ({m})")).unwrap_or_default(),
                    reply.status.as_u16()
                )),
            }),
            401 | 403 => Err(RedfishError::AuthRejected {
                url: self.url(&probe),
                status: reply.status.as_u16(),
                message: reply.message(),
            }),
            _ => {
                if let Some(reason) = &self.basic_reason {
                    warn!(bmc = %self.base, reason = %reason, "using Basic auth");
                }
                Ok(())
            }
        }
    }

    /// Best-effort identification for the quirk table from every mark the BMC leaves: the service root's `Vendor`,
    /// `Product`, `Oem` keys and UUID (BMCs older than `Vendor` write their own MAC there), and the first manager's
    /// `Manufacturer`, `Model` and `Oem` keys. Never fails the connection.
    async fn identify(&mut self) {
        let mut marks: Vec<(&'static str, String)> = Vec::new();
        marks.extend(self.root.vendor.clone().map(|v| ("Vendor", v)));
        marks.extend(self.root.product.clone().map(|v| ("Product", v)));
        if let Some(Value::Object(oem)) = &self.root.oem {
            marks.extend(oem.keys().map(|k| ("Oem key", k.clone())));
        }
        marks.extend(self.root.uuid.clone().map(|u| ("UUID", u)));
        if let Some(managers) = self.root.managers.clone()
            && let Ok((collection, _)) = self.get::<Collection>(&managers.odata_id).await
            && let Some(first) = collection.members.first()
            && let Ok((manager, _)) = self.get::<Manager>(&first.odata_id).await
        {
            marks.extend(manager.manufacturer.map(|v| ("Manager Manufacturer", v)));
            marks.extend(manager.model.map(|v| ("Manager Model", v)));
            if let Some(Value::Object(oem)) = &manager.oem {
                marks.extend(oem.keys().map(|k| ("Manager Oem key", k.clone())));
            }
        }
        self.identity = BmcIdentity::from_marks(marks);
        let (q, mark) = quirks::recognise(&self.identity);
        self.quirks = q;
        self.recognised_by = mark;
    }

    /// The vendor as the BMC states it (`Vendor`), else as recognised and by which mark, else `not stated`.
    pub fn vendor_line(&self) -> String {
        match (&self.root.vendor, &self.recognised_by) {
            (Some(v), _) if !v.trim().is_empty() => v.clone(),
            (_, Some(mark)) => format!("{} (no Vendor; recognised by {mark})", self.quirks.vendor),
            _ => "not stated".into(),
        }
    }

    /// Where a request for `path` goes: [`Bmc::url`], refused when the BMC handed us an absolute link to another
    /// scheme, host or port (`@odata.id`, `nextLink`, a session's `Location`): requests carry the credentials or
    /// the session token, which go to the BMC's own address only.
    fn request_url(&self, path: &str) -> Result<String, RedfishError> {
        let url = self.url(path);
        if !(path.starts_with("http://") || path.starts_with("https://")) {
            return Ok(url);
        }
        let origin = |u: &str| {
            reqwest::Url::parse(u).ok().map(|u| {
                (
                    u.scheme().to_owned(),
                    u.host_str().map(str::to_owned),
                    u.port_or_known_default(),
                )
            })
        };
        match (origin(&url), origin(&self.base)) {
            (Some(link), Some(own)) if link == own => Ok(url),
            _ => Err(RedfishError::Foreign {
                url,
                base: self.base.clone(),
            }),
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        if path.starts_with("http://") || path.starts_with("https://") {
            path.to_owned()
        } else if path.starts_with('/') {
            format!("{}{path}", self.base)
        } else {
            format!("{}/{path}", self.base)
        }
    }

    /// One request, no retries. `authed` false sends no credentials (login itself).
    async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        if_match: Option<&str>,
        authed: bool,
    ) -> Result<Reply, RedfishError> {
        let url = self.request_url(path)?;
        let mut req = self
            .http
            .request(method.clone(), &url)
            .header("Accept", "application/json");
        if authed || method == Method::GET {
            let auth = self.auth.lock().unwrap_or_else(|p| p.into_inner()).clone();
            req = match auth {
                Auth::Session { token, .. } => req.header("X-Auth-Token", token),
                Auth::Basic => req.basic_auth(&self.creds.username, Some(&self.creds.password)),
                Auth::Closed => req,
            };
        }
        if let Some(etag) = if_match {
            req = req.header("If-Match", etag);
        }
        if let Some(body) = body {
            req = req.json(body);
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        let resp = req
            .send()
            .await
            .map_err(|source| match tls_refusal(&source) {
                Some(why) => RedfishError::Tls {
                    url: url.clone(),
                    why: format!("handshake refused: {why}"),
                },
                None => RedfishError::Transport {
                    method: method.to_string(),
                    url: url.clone(),
                    source,
                },
            })?;
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let status = resp.status();
        let etag = header("etag");
        let location = header("location");
        let token = header("x-auth-token");
        let retry_after = header("retry-after");
        let body = resp
            .bytes()
            .await
            .map_err(|source| RedfishError::Transport {
                method: method.to_string(),
                url,
                source,
            })?;
        Ok(Reply {
            status,
            etag,
            location,
            token,
            retry_after: retry_after
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs),
            body: body.to_vec(),
        })
    }

    /// A request with the retry budget for busy answers and one re-login on an expired session. Non-2xx answers
    /// that are not busy come back as they are; `success_ids` are message ids that end the retries (a 409 that
    /// means "already in that state"). Each attempt holds one of the BMC's in-flight permits while it is sent; the
    /// wait before the next attempt holds none, so one resource's retries do not stall every other request to
    /// the same BMC.
    pub(crate) async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        if_match: Option<&str>,
        success_ids: &[&str],
    ) -> Result<Reply, RedfishError> {
        let policy = self.opts.retry;
        let mut relogged = false;
        let mut attempt = 1;
        loop {
            let permit = self.limiter.acquire().await;
            let reply = match self
                .send_raw(method.clone(), path, body, if_match, true)
                .await
            {
                Ok(reply) => reply,
                // A GET that got no answer is safe to repeat; an action is not (it may have been applied).
                Err(e @ RedfishError::Transport { .. })
                    if method == Method::GET && attempt < policy.attempts =>
                {
                    drop(permit);
                    debug!(error = %bc_error_chain::InlineErrorChain::new(&e), attempt, "retrying GET");
                    tokio::time::sleep(policy.delay(attempt, rand::random())).await;
                    attempt += 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let status = reply.status.as_u16();
            if status == 401
                && !relogged
                && matches!(
                    &*self.auth.lock().unwrap_or_else(|p| p.into_inner()),
                    Auth::Session { .. }
                )
            {
                relogged = true;
                self.relogin().await?;
                continue;
            }
            let busy = !reply.has_message_id(success_ids)
                && (matches!(status, 409 | 429 | 503)
                    || (status >= 400
                        && (reply.has_message_id(BASE_BUSY_IDS)
                            || reply.has_message_id(self.quirks.busy_message_ids))));
            // A read answered with a server error is repeated, up to SERVER_ERROR_ATTEMPTS within the same budget:
            // it is safe to repeat, and a BMC's 500 on a read is often a passing state (sushy's libvirt driver
            // answers 500 when the domain stops between two of its libvirt calls; Ironic's sushy retries server
            // errors on GETs as well). 501 is an answer, not a state. When those attempts are spent the answer comes
            // back as it is. An action answered 500 is never repeated: it may have been applied.
            let failed_read = !busy && method == Method::GET && status >= 500 && status != 501;
            if !busy && !failed_read {
                return Ok(reply);
            }
            if failed_read && attempt >= policy.attempts.min(SERVER_ERROR_ATTEMPTS) {
                return Ok(reply);
            }
            if attempt >= policy.attempts {
                return Err(RedfishError::Busy {
                    method: method.to_string(),
                    url: self.url(path),
                    attempts: attempt,
                    status,
                    message: reply.message(),
                });
            }
            let delay = reply.retry_after.map_or_else(
                || policy.delay(attempt, rand::random()),
                |d| d.min(policy.backoff.cap()),
            );
            debug!(bmc = %self.base, path, status, attempt, ?delay, busy, "retrying");
            drop(permit);
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    async fn relogin(&self) -> Result<(), RedfishError> {
        let Some(path) = self.sessions_path() else {
            return Ok(());
        };
        let body = json!({"UserName": self.creds.username, "Password": self.creds.password});
        let reply = self
            .send_raw(Method::POST, &path, Some(&body), None, false)
            .await?;
        match (reply.status.as_u16(), reply.token.clone()) {
            (200 | 201, Some(token)) => {
                *self.auth.lock().unwrap_or_else(|p| p.into_inner()) = Auth::Session {
                    token,
                    location: reply.location.clone(),
                };
                Ok(())
            }
            (status, _) => Err(RedfishError::AuthRejected {
                url: self.url(&path),
                status,
                message: reply.message(),
            }),
        }
    }

    /// GET and decode leniently; also returns the ETag (header, else `@odata.etag`). Repaired properties are
    /// logged; [`Bmc::fetch`] returns them.
    pub async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<(T, Option<String>), RedfishError> {
        let f = self.fetch::<T>(path).await?;
        for w in &f.warnings {
            warn!(bmc = %self.base, path, warning = %w, "odd property in a BMC document");
        }
        Ok((f.value, f.etag))
    }

    /// GET and decode leniently, with the repairs the document needed.
    pub async fn fetch<T: DeserializeOwned>(&self, path: &str) -> Result<Fetched<T>, RedfishError> {
        let reply = self.send(Method::GET, path, None, None, &[]).await?;
        let reply = self.expect_ok(Method::GET, path, reply)?;
        let d = decode::decode::<T>(&reply.body).map_err(|e| self.decode_error::<T>(path, e))?;
        let etag = reply.etag.clone().or_else(|| {
            d.raw
                .get("@odata.etag")
                .and_then(Value::as_str)
                .map(str::to_owned)
        });
        Ok(Fetched {
            value: d.value,
            etag,
            warnings: d.warnings,
            raw: d.raw,
        })
    }

    pub(crate) fn decode_error<T>(&self, path: &str, e: DecodeError) -> RedfishError {
        match e {
            DecodeError::ErrorBody(message) => RedfishError::ErrorBody {
                url: self.url(path),
                message,
            },
            source => RedfishError::Decode {
                url: self.url(path),
                what: std::any::type_name::<T>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("resource"),
                source,
            },
        }
    }

    /// Every member of a collection, all pages (`Members@odata.nextLink`), with `$expand` where the service offers
    /// it. Fails only when the first page cannot be read; a later page that fails leaves the list incomplete
    /// (`Listed::complete`), with a warning.
    pub async fn list(&self, collection: &str) -> Result<Listed, RedfishError> {
        let mut listing = Listing::new(collection);
        let first = match self.expand() {
            Some(q) => {
                let sep = if collection.contains('?') { '&' } else { '?' };
                let expanded = format!("{collection}{sep}{q}");
                match self.fetch::<Collection>(&expanded).await {
                    Ok(page) => Some((expanded, page)),
                    // A service that advertises $expand but refuses it: read without, from now on.
                    Err(e)
                        if e.status()
                            .is_some_and(|s| (400..500).contains(&s) || s == 501) =>
                    {
                        warn!(bmc = %self.base, collection, error = %bc_error_chain::InlineErrorChain::new(&e), "$expand refused; reading collections without it");
                        self.expand_refused.store(true, Ordering::Relaxed);
                        None
                    }
                    Err(e) => return Err(e),
                }
            }
            None => None,
        };
        let (mut page_path, mut page) = match first {
            Some(p) => p,
            None => (
                collection.to_owned(),
                self.fetch::<Collection>(collection).await?,
            ),
        };
        while let Some(next) = listing.page(&page_path, page.value, &page.warnings) {
            match self.fetch::<Collection>(&next).await {
                Ok(p) => {
                    page_path = next;
                    page = p;
                }
                Err(e) => {
                    listing.failed(&next, &e.to_string());
                    break;
                }
            }
        }
        Ok(listing.into_listed())
    }

    /// One member: the inlined body when `$expand` gave it, else a GET.
    pub async fn member<T: DeserializeOwned>(
        &self,
        m: &Member,
    ) -> Result<Fetched<T>, RedfishError> {
        if m.is_expanded() {
            let mut body = m.body.clone();
            body.insert("@odata.id".into(), Value::String(m.odata_id.clone()));
            let d = decode::decode_value::<T>(Value::Object(body))
                .map_err(|e| self.decode_error::<T>(&m.odata_id, e))?;
            let etag = d
                .raw
                .get("@odata.etag")
                .and_then(Value::as_str)
                .map(str::to_owned);
            return Ok(Fetched {
                value: d.value,
                etag,
                warnings: d.warnings,
                raw: d.raw,
            });
        }
        self.fetch::<T>(&m.odata_id).await
    }

    /// Turns a non-2xx reply into the operator-facing error.
    pub(crate) fn expect_ok(
        &self,
        method: Method,
        path: &str,
        reply: Reply,
    ) -> Result<Reply, RedfishError> {
        if reply.status.is_success() {
            return Ok(reply);
        }
        let status = reply.status.as_u16();
        if status == 404 {
            return Err(RedfishError::NotFound {
                url: self.url(path),
                what: path.to_owned(),
            });
        }
        Err(RedfishError::Status {
            method: method.to_string(),
            url: self.url(path),
            status,
            message: reply.message(),
        })
    }

    /// Logs out (DELETE of the session). Idempotent; Basic has nothing to close.
    pub async fn close(&self) -> Result<(), RedfishError> {
        let auth = std::mem::replace(
            &mut *self.auth.lock().unwrap_or_else(|p| p.into_inner()),
            Auth::Closed,
        );
        let Auth::Session {
            token,
            location: Some(location),
        } = auth
        else {
            return Ok(());
        };
        let url = self.request_url(&location)?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        let resp = self
            .http
            .delete(&url)
            .header("X-Auth-Token", token)
            .send()
            .await
            .map_err(|source| RedfishError::Transport {
                method: "DELETE".into(),
                url: url.clone(),
                source,
            })?;
        let status = resp.status().as_u16();
        if resp.status().is_success() || status == 404 {
            debug!(bmc = %self.base, "session closed");
            Ok(())
        } else {
            Err(RedfishError::Status {
                method: "DELETE".into(),
                url,
                status,
                message: None,
            })
        }
    }
}

impl Drop for Bmc {
    fn drop(&mut self) {
        let auth = std::mem::replace(
            &mut *self.auth.lock().unwrap_or_else(|p| p.into_inner()),
            Auth::Closed,
        );
        let Auth::Session {
            token,
            location: Some(location),
        } = auth
        else {
            return;
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            warn!(bmc = %self.base, "BMC session left open: dropped outside a tokio runtime (call close())");
            return;
        };
        let (http, url) = (self.http.clone(), self.url(&location));
        handle.spawn(async move {
            if let Err(e) = http.delete(&url).header("X-Auth-Token", token).send().await {
                debug!(url, error = %bc_error_chain::InlineErrorChain::new(&e), "logout on drop failed");
            }
        });
    }
}
