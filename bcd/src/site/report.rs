//! The site agent's report to the control plane (`SiteService.Report`): the last DHCP request its proxy DHCP saw
//! from each MAC on the boot segment (so the metal flow can say "never joined: k PXE attempts, last DHCP seen at
//! …" and mean it), the boot HTTP base URL machines on the segment reach it at, and the artifacts its cache holds
//! (deploy images are streamed from its cache there, once it holds them). Sightings wait in a bounded map until a report is accepted, so a gateway that
//! is away loses none of the latest ones.

use super::{site_identity, tls_of};
use crate::state::StateDir;
use bc_proto::{channel, v1};
use bcd_site::dhcp::MacAddr;
use bcd_site::dhcp::server::{DhcpCounters, MAX_SIGHTINGS};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

type Client = v1::site_service_client::SiteServiceClient<tonic::transport::Channel>;

/// How often the agent reports: sightings as they come, the boot URL at least every [`REFRESH`].
pub const EVERY: Duration = Duration::from_secs(3);
const REFRESH: Duration = Duration::from_secs(60);
/// A control plane without the metal module answers UNIMPLEMENTED: asked again this much later.
const UNIMPLEMENTED_PAUSE: Duration = Duration::from_secs(300);

pub struct Reporter {
    pub state_dir: PathBuf,
    /// `http://<boot.server_ip>:<boot.http_port>`.
    pub boot_url: String,
    pub dhcp: Arc<DhcpCounters>,
    pub every: Duration,
    /// The artifact cache's folder: the digests verified in it are reported (`sha256/<hex>` files).
    pub cache_dir: Option<PathBuf>,
}

/// The verified artifacts in the cache folder `dir` (`sha256/<64 hex>` files), sorted, at most [`MAX_SIGHTINGS`].
pub fn cached(dir: &std::path::Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir.join("sha256")) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| n.len() == 64 && n.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .collect();
    out.sort();
    out.truncate(MAX_SIGHTINGS);
    out
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Folds new sightings into `pending` (the later time wins), never past [`MAX_SIGHTINGS`] MACs.
pub fn fold(pending: &mut HashMap<MacAddr, SystemTime>, new: Vec<(MacAddr, SystemTime)>) {
    for (mac, at) in new {
        if let Some(t) = pending.get_mut(&mac) {
            *t = (*t).max(at);
        } else if pending.len() < MAX_SIGHTINGS {
            pending.insert(mac, at);
        }
    }
}

impl Reporter {
    async fn connect(&self) -> Result<Client, String> {
        let state = StateDir::open(&self.state_dir).map_err(|e| e.to_string())?;
        let identity = site_identity(&state, &self.state_dir).map_err(|e| e.to_string())?;
        let tls = tls_of(&state).map_err(|e| e.to_string())?;
        let ch = channel::connect(&identity.gateway_url, tls)
            .await
            .map_err(|e| bc_error_chain::chain(&e))?;
        Ok(Client::new(ch))
    }

    /// Reports until `shutdown`.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut pending: HashMap<MacAddr, SystemTime> = HashMap::new();
        let mut client: Option<Client> = None;
        let mut last_sent: Option<tokio::time::Instant> = None;
        let mut sent_cached: Option<Vec<String>> = None;
        let mut pause = Duration::ZERO;
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(self.every.max(pause)) => {}
            }
            pause = Duration::ZERO;
            fold(&mut pending, self.dhcp.take_sightings());
            let cached_now = self.cache_dir.as_deref().map(cached).unwrap_or_default();
            let due = last_sent.is_none_or(|t| t.elapsed() >= REFRESH)
                || sent_cached.as_ref() != Some(&cached_now);
            if pending.is_empty() && !due {
                continue;
            }
            let c = match client.take() {
                Some(c) => c,
                None => match self.connect().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = e, "site report: no connection to the gateway");
                        continue;
                    }
                },
            };
            let mut c = c;
            let req = v1::SiteReport {
                boot_url: self.boot_url.clone(),
                dhcp: pending
                    .iter()
                    .map(|(mac, at)| v1::DhcpSighting {
                        mac: mac.to_string(),
                        at_unix_ms: unix_ms(*at),
                    })
                    .collect(),
                cached: cached_now.clone(),
            };
            let sent = req.dhcp.len();
            match tokio::time::timeout(Duration::from_secs(10), c.report(req)).await {
                Ok(Ok(_)) => {
                    tracing::debug!(sightings = sent, "site report accepted");
                    pending.clear();
                    last_sent = Some(tokio::time::Instant::now());
                    sent_cached = Some(cached_now);
                    client = Some(c);
                }
                Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                    tracing::info!(
                        "the control plane takes no site reports (no metal module); asking again in 5 min"
                    );
                    pending.clear();
                    pause = UNIMPLEMENTED_PAUSE;
                    client = Some(c);
                }
                Ok(Err(s)) => {
                    tracing::warn!(code = ?s.code(), error = s.message(), "site report refused");
                }
                Err(_) => tracing::warn!("site report: no answer within 10 s"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sightings_keep_the_latest_time_and_a_bound() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let a: MacAddr = "52:54:00:00:00:01".parse().expect("mac");
        let mut pending = HashMap::new();
        fold(&mut pending, vec![(a, t0 + Duration::from_secs(5))]);
        fold(&mut pending, vec![(a, t0)]);
        assert_eq!(pending[&a], t0 + Duration::from_secs(5), "the later wins");
        let many = (0..MAX_SIGHTINGS as u32 + 10)
            .map(|i| {
                let b = i.to_be_bytes();
                (MacAddr([2, 0, b[0], b[1], b[2], b[3]]), t0)
            })
            .collect();
        fold(&mut pending, many);
        assert_eq!(pending.len(), MAX_SIGHTINGS);
        assert_eq!(unix_ms(t0), 1_000_000);
    }

    #[test]
    fn only_verified_digests_in_the_cache_are_reported() {
        let t = tempfile::tempdir().expect("tempdir");
        let sha = t.path().join("sha256");
        std::fs::create_dir_all(&sha).expect("dir");
        let hex = "ab".repeat(32);
        std::fs::write(sha.join(&hex), b"x").expect("artifact");
        std::fs::write(sha.join(".partial-x"), b"x").expect("partial");
        std::fs::write(sha.join("AB".repeat(32)), b"x").expect("upper case");
        assert_eq!(cached(t.path()), vec![hex]);
        assert!(cached(&t.path().join("none")).is_empty());
    }
}
