//! The site agent's BMC worker: it long-polls the control plane for the metal flow's BMC commands
//! (`SiteService.BmcCommands`, over the agent's own mTLS identity), carries each out against the machine's BMC
//! with credentials fetched from the broker for that command only (wiped when dropped), reads the effect back, and
//! reports the outcome signed by the agent's key (`BmcResult`). At most `per_address` commands run against one BMC
//! address at once (a machine: a BMC's only system, or one system of a BMC that serves several), `max_in_flight` in
//! all, and the commands against one BMC endpoint share its `bmc.max_concurrent` requests in flight; a command
//! already running is not started again when it is handed out again.
//!
//! Read-backs: `boot-once-pxe` must read back Target=Pxe (Enabled=Once, or Continuous on a BMC that keeps every
//! override, as sushy-tools' libvirt driver does: reported `persistent` so the flow restores the disk boot once the
//! ramdisk joined); an override that does not read back as Pxe fails, not retryable. `power boot` turns the
//! machine on, or force-restarts it when on, and must read back PowerState On. `boot-disk` must read back Hdd,
//! Continuous. The decision of what a result means is the control plane's planner's.

use super::{SiteError, site_identity, tls_of};
use crate::state::StateDir;
use bc_core::metal::{BmcOp, HardwareSummary, Outcome, Power};
use bc_proto::envelope::EnvelopeSigner;
use bc_proto::{channel, v1};
use bcd_site::redfish::{Bmc, BmcOptions, BootTarget, PowerAction, RedfishError};
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The payload type of a signed BMC outcome (the control plane's `bc_mod_metal::gateway::OUTCOME_PAYLOAD_TYPE`).
pub const OUTCOME_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.bmc-outcome+json";

#[derive(Debug, Clone)]
pub struct BmcWorkerOptions {
    /// Commands against one BMC address at once: a BMC's only system, or one system of a BMC that serves several
    /// (a chassis manager, an emulator), each address its own.
    pub per_address: usize,
    /// Commands in flight in all.
    pub max_in_flight: usize,
    /// How long one `BmcCommands` call waits for work.
    pub poll_wait: Duration,
    pub bmc: BmcOptions,
}

impl Default for BmcWorkerOptions {
    fn default() -> Self {
        BmcWorkerOptions {
            per_address: 1,
            max_in_flight: 32,
            poll_wait: Duration::from_secs(20),
            bmc: BmcOptions::default(),
        }
    }
}

/// The BMC worker of the site agent whose state directory is `state_dir`.
pub struct BmcWorker {
    state_dir: PathBuf,
    options: BmcWorkerOptions,
    limits: Mutex<HashMap<String, Arc<Semaphore>>>,
    /// The Redfish requests in flight to each BMC endpoint (`bmc.max_concurrent`), shared by every command against
    /// it: each command opens its own `Bmc`, whose permits were its own, so a BMC serving several systems saw one
    /// set per command running against it.
    endpoints: Mutex<HashMap<String, Arc<Semaphore>>>,
    running: Mutex<BTreeSet<String>>,
    in_flight: Arc<Semaphore>,
}

fn failed(reason: String, retryable: bool) -> Outcome {
    Outcome::Failed { reason, retryable }
}

/// Whether a Redfish error may pass on another attempt (the BMC was busy or unreachable) or will not.
fn retryable(e: &RedfishError) -> bool {
    !matches!(
        e,
        RedfishError::BootOverrideNotApplied { .. } | RedfishError::PowerNotApplied { .. }
    )
}

/// The system a BMC address names after its host (`https://bmc/redfish/v1/Systems/<id>`: one of several systems
/// behind one BMC or emulator), or `None` for a bare address (the BMC's only system).
/// The path keeps its leading `/`, as the BMC's `@odata.id` does.
pub fn system_of(address: &str) -> Option<&str> {
    let rest = address
        .strip_prefix("https://")
        .or_else(|| address.strip_prefix("http://"))?;
    let path = rest[rest.find('/')?..].trim_end_matches('/');
    (!path.is_empty()).then_some(path)
}

/// The BMC endpoint an address names (`https://bmc:8443` of `https://bmc:8443/redfish/v1/Systems/2`): what its
/// systems share. The host is compared without regard to case.
fn endpoint_of(address: &str) -> String {
    let scheme = address.find("://").map_or(0, |i| i + 3);
    let end = address[scheme..]
        .find('/')
        .map_or(address.len(), |i| scheme + i);
    address[..end].to_ascii_lowercase()
}

fn summary(inv: &bcd_site::redfish::Inventory, wanted: Option<&str>) -> HardwareSummary {
    let chosen = match wanted {
        None => inv.systems.first(),
        Some(w) => {
            let last = w.rsplit('/').next().unwrap_or(w);
            inv.systems.iter().find(|s| {
                s.path.trim_end_matches('/') == w.trim_end_matches('/')
                    || s.path.trim_end_matches('/').rsplit('/').next() == Some(last)
            })
        }
    };
    let Some(s) = chosen else {
        return HardwareSummary::default();
    };
    HardwareSummary {
        // A count of 0 is a BMC that does not say (sushy's fake driver), not a machine without CPUs.
        cpus: u32::try_from(s.cpu_count()).ok().filter(|n| *n > 0),
        memory_mib: Some(s.memory_mib()).filter(|n| *n > 0),
        gpus: u32::try_from(s.gpus().count()).ok(),
        disks: u32::try_from(s.drives.len()).ok().filter(|n| *n > 0),
        macs: s.macs().map(str::to_ascii_lowercase).collect(),
    }
}

impl BmcWorker {
    pub fn new(state_dir: PathBuf, options: BmcWorkerOptions) -> Arc<BmcWorker> {
        let in_flight = Arc::new(Semaphore::new(options.max_in_flight.max(1)));
        Arc::new(BmcWorker {
            state_dir,
            options,
            limits: Mutex::default(),
            endpoints: Mutex::default(),
            running: Mutex::default(),
            in_flight,
        })
    }

    fn limit(&self, address: &str) -> Arc<Semaphore> {
        let mut l = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        l.entry(address.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(self.options.per_address.max(1))))
            .clone()
    }

    /// The options for a `Bmc` of `address`: the worker's, with the in-flight permits of the address's endpoint
    /// (unless the options bring a limiter of their own).
    fn bmc_options(&self, address: &str) -> BmcOptions {
        let mut options = self.options.bmc.clone();
        if options.limiter.is_none() {
            let mut e = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
            let permits = options.max_concurrent.max(1);
            options.limiter = Some(
                e.entry(endpoint_of(address))
                    .or_insert_with(|| Arc::new(Semaphore::new(permits)))
                    .clone(),
            );
        }
        options
    }

    /// The slots a command holds while it runs: its address's first (`per_address`: BMCs fall over under parallel
    /// work), then one of the `max_in_flight`. In that order, so that commands queued behind a busy address hold
    /// none of the shared slots and commands for other BMCs go on.
    async fn slots(&self, address: &str) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        let own = self.limit(address).acquire_owned().await.ok()?;
        let shared = self.in_flight.clone().acquire_owned().await.ok()?;
        Some((own, shared))
    }

    /// Carries out one operation against the BMC at `address` and reads it back (the caller holds the BMC's slot).
    pub async fn execute(&self, address: &str, credentials_ref: &str, op: &BmcOp) -> Outcome {
        let creds =
            match super::secrets::fetch_bmc_credentials(&self.state_dir, credentials_ref).await {
                Ok(c) => c,
                Err(e) => return failed(bc_error_chain::chain(&e), true),
            };
        let bmc = match Bmc::connect(address, creds, self.bmc_options(address)).await {
            Ok(b) => b,
            Err(e) => {
                return failed(
                    format!("connecting to the BMC: {}", bc_error_chain::chain(&e)),
                    true,
                );
            }
        };
        let outcome = match run_op(&bmc, op, system_of(address)).await {
            Ok(o) => o,
            Err(e) => failed(bc_error_chain::chain(&e), retryable(&e)),
        };
        let _ = bmc.close().await;
        outcome
    }

    /// Runs until `shutdown`: polls for commands, runs each once at a time, reports each signed.
    pub async fn run(
        self: Arc<Self>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), SiteError> {
        tokio::pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let round = self.clone().round();
            let outcome = tokio::select! {
                r = round => r,
                () = &mut shutdown => return Ok(()),
            };
            let pause = match outcome {
                Ok(()) => {
                    failures = 0;
                    Duration::ZERO
                }
                Err(Round::Unimplemented) => {
                    tracing::info!(
                        "the control plane sends no BMC work (no metal module); asking again in 5 min"
                    );
                    Duration::from_secs(300)
                }
                Err(Round::Failed(why)) => {
                    failures = failures.saturating_add(1);
                    let d = Duration::from_millis(500u64.saturating_mul(1 << failures.min(6)))
                        .mul_f64(0.5 + rand::random::<f64>() / 2.0);
                    tracing::warn!(error = why, retry_in = ?d, "BMC command poll failed");
                    d
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = &mut shutdown => return Ok(()),
            }
        }
    }

    async fn round(self: Arc<Self>) -> Result<(), Round> {
        let state = StateDir::open(&self.state_dir).map_err(|e| Round::Failed(e.to_string()))?;
        let identity =
            site_identity(&state, &self.state_dir).map_err(|e| Round::Failed(e.to_string()))?;
        let tls = tls_of(&state).map_err(|e| Round::Failed(e.to_string()))?;
        let signer = std::fs::read_to_string(state.path("node.key"))
            .map_err(|e| e.to_string())
            .and_then(|pem| rcgen::KeyPair::from_pem(&pem).map_err(|e| e.to_string()))
            .and_then(|k| {
                EnvelopeSigner::new(&k.serialize_der(), identity.spiffe_id.clone())
                    .map_err(|e| e.to_string())
            })
            .map_err(Round::Failed)?;
        let signer = Arc::new(signer);
        let ch = channel::connect(&identity.gateway_url, tls)
            .await
            .map_err(|e| Round::Failed(bc_error_chain::chain(&e)))?;
        let mut client = v1::site_service_client::SiteServiceClient::new(ch);
        loop {
            let ask = v1::BmcCommandsRequest {
                wait_ms: u32::try_from(self.options.poll_wait.as_millis()).unwrap_or(u32::MAX),
                max: 16,
            };
            let answer = tokio::time::timeout(
                self.options.poll_wait + Duration::from_secs(10),
                client.bmc_commands(ask),
            )
            .await
            .map_err(|_| Round::Failed("BmcCommands did not answer in time".into()))?;
            let commands = match answer {
                Ok(r) => {
                    let r = r.into_inner();
                    // Deadlines are in the gateway's time: read them in this host's.
                    let offset =
                        crate::commands::clock_offset(r.clock_unix_ms, crate::session::now_ms())
                            .unwrap_or(0);
                    r.commands
                        .into_iter()
                        .map(|mut c| {
                            c.deadline_unix_ms =
                                crate::commands::local_deadline(c.deadline_unix_ms, offset);
                            c
                        })
                        .collect::<Vec<_>>()
                }
                Err(s) if s.code() == tonic::Code::Unimplemented => {
                    return Err(Round::Unimplemented);
                }
                Err(s) => return Err(Round::Failed(format!("BmcCommands: {}", s.message()))),
            };
            for c in commands {
                self.clone().start(c, client.clone(), signer.clone());
            }
        }
    }

    /// What command `c` came to at `now_ms` (the BMC's slot already held): one whose deadline has passed is not
    /// sent to the BMC at all (the control plane has given up on it and may have asked again: a late power-off
    /// must not land after the retry's power-on); one that runs past it is given up there.
    async fn outcome(&self, c: &v1::BmcCommand, now_ms: i64) -> Outcome {
        let late = now_ms.saturating_sub(c.deadline_unix_ms);
        // Every BMC command has a deadline; one without (0) is as late as can be.
        let left = crate::commands::time_left(c.deadline_unix_ms, now_ms).unwrap_or_default();
        let op = match serde_json::from_str::<BmcOp>(&c.op_json) {
            Err(e) => return failed(format!("unknown BMC operation {:?}: {e}", c.op_json), false),
            Ok(op) => op,
        };
        if left.is_zero() {
            return failed(
                format!(
                    "the command's deadline had passed {late} ms before it could be sent; not sent to the BMC"
                ),
                true,
            );
        }
        tracing::info!(
            command = c.id,
            mac = c.mac,
            bmc = c.bmc_address,
            ?op,
            "BMC command"
        );
        match tokio::time::timeout(left, self.execute(&c.bmc_address, &c.credentials_ref, &op))
            .await
        {
            Ok(o) => o,
            Err(_) => failed(
                "the command's deadline passed before the BMC finished".into(),
                true,
            ),
        }
    }

    fn start(
        self: Arc<Self>,
        c: v1::BmcCommand,
        mut client: v1::site_service_client::SiteServiceClient<tonic::transport::Channel>,
        signer: Arc<EnvelopeSigner>,
    ) {
        {
            let mut r = self.running.lock().unwrap_or_else(|p| p.into_inner());
            if !r.insert(c.id.clone()) {
                return;
            }
        }
        tokio::spawn(async move {
            let Some(_slots) = self.slots(&c.bmc_address).await else {
                return;
            };
            let outcome = self.outcome(&c, crate::session::now_ms()).await;
            tracing::info!(
                command = c.id,
                mac = c.mac,
                ?outcome,
                "BMC command finished"
            );
            let payload = serde_json::to_vec(&outcome).unwrap_or_default();
            match signer.sign(OUTCOME_PAYLOAD_TYPE, payload) {
                Ok(env) => {
                    for n in 0..3u32 {
                        let req = v1::BmcResultRequest {
                            id: c.id.clone(),
                            result: Some(env.clone()),
                        };
                        let sent = bc_proto::channel::answered_within(
                            "reporting a BMC result",
                            bc_proto::channel::CALL_DEADLINE,
                            client.bmc_result(req),
                        );
                        match sent.await {
                            Ok(_) => break,
                            Err(s) => {
                                tracing::warn!(
                                    command = c.id,
                                    error = s.message(),
                                    "reporting a BMC result failed"
                                );
                                tokio::time::sleep(Duration::from_secs(1 << n)).await;
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(command = c.id, error = %e, "signing a BMC result failed")
                }
            }
            self.running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&c.id);
        });
    }
}

enum Round {
    Unimplemented,
    Failed(String),
}

async fn power_state(bmc: &Bmc, path: &str) -> Result<String, RedfishError> {
    let (sys, _) = bmc
        .get::<bcd_site::redfish::models::ComputerSystem>(path)
        .await?;
    Ok(sys.power_state.unwrap_or_default())
}

/// One operation on system `wanted` (the BMC's only one when `None`), read back.
async fn run_op(bmc: &Bmc, op: &BmcOp, wanted: Option<&str>) -> Result<Outcome, RedfishError> {
    let path = bmc.system_path(wanted).await?;
    if let BmcOp::Inspect = op {
        return Ok(Outcome::Inspected(summary(
            &bmc.inventory_of(&path).await?,
            Some(path.as_str()),
        )));
    }
    match op {
        BmcOp::Inspect => unreachable!("handled above"),
        BmcOp::BootOncePxe => match bmc.boot_once(&path, BootTarget::Pxe).await {
            Ok(_) => Ok(Outcome::BootOnceSet { persistent: false }),
            // The override is set, as a persistent one: the flow restores the disk boot after the join.
            Err(RedfishError::BootOverrideNotApplied { observed, .. })
                if observed.target == "Pxe" && observed.enabled == "Continuous" =>
            {
                tracing::info!(
                    bmc = bmc.base_url(),
                    "the BMC keeps the PXE override as Continuous"
                );
                Ok(Outcome::BootOnceSet { persistent: true })
            }
            Err(e) => Err(e),
        },
        BmcOp::BootDisk => {
            bmc.restore_disk_boot(&path).await?;
            Ok(Outcome::Done)
        }
        BmcOp::Power { power: Power::Off } => {
            bmc.power(&path, PowerAction::Off).await?;
            Ok(Outcome::Done)
        }
        BmcOp::Power { power: Power::Boot } => {
            let on = power_state(bmc, &path).await?.eq_ignore_ascii_case("On");
            let action = if on {
                PowerAction::Reset
            } else {
                PowerAction::On
            };
            bmc.power(&path, action).await?;
            // A restart has no steady state of its own: read back On within the BMC's budget.
            let started = tokio::time::Instant::now();
            loop {
                let state = power_state(bmc, &path).await?;
                if state.eq_ignore_ascii_case("On") {
                    return Ok(Outcome::Done);
                }
                if started.elapsed() >= Duration::from_secs(30) {
                    return Ok(failed(
                        format!("power {action} accepted, but PowerState reads {state} after 30 s"),
                        false,
                    ));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{BmcWorker, BmcWorkerOptions, endpoint_of, system_of};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn the_systems_of_one_bmc_share_its_endpoint() {
        assert_eq!(
            endpoint_of("http://127.0.0.1:8000/redfish/v1/Systems/6b0f-01"),
            "http://127.0.0.1:8000"
        );
        assert_eq!(endpoint_of("https://BMC.example"), "https://bmc.example");
        assert_eq!(endpoint_of("https://bmc.example/"), "https://bmc.example");
        assert_eq!(
            endpoint_of("https://bmc:8443/redfish/v1/Systems/2"),
            "https://bmc:8443"
        );
    }

    /// Every command against one BMC endpoint shares its in-flight permits (`bmc.max_concurrent`): two systems of
    /// one chassis manager, or of one emulator, are two addresses but one BMC. Before, each command's `Bmc` had
    /// permits of its own. (That a shared limiter bounds the requests in flight is the Redfish client's test
    /// `redfish_quirks.rs::at_most_max_concurrent_requests_reach_one_bmc`.)
    #[test]
    fn commands_against_one_bmc_share_its_in_flight_permits() {
        let worker = BmcWorker::new("/nonexistent".into(), BmcWorkerOptions::default());
        let limiter = |address: &str| {
            worker
                .bmc_options(address)
                .limiter
                .expect("the worker gives every Bmc a limiter")
        };
        let a1 = limiter("http://127.0.0.1:8000/redfish/v1/Systems/1");
        let a2 = limiter("http://127.0.0.1:8000/redfish/v1/Systems/2");
        let b = limiter("http://127.0.0.1:8001/redfish/v1/Systems/1");
        assert!(
            Arc::ptr_eq(&a1, &a2),
            "two systems of one BMC share its permits"
        );
        assert!(!Arc::ptr_eq(&a1, &b), "another BMC has its own");
        assert_eq!(
            a1.available_permits(),
            BmcWorkerOptions::default().bmc.max_concurrent
        );
    }

    /// Before the order was the address's slot first, a command queued behind a busy address held a shared slot
    /// while it waited: with `max_in_flight` commands queued so, no other BMC got any.
    #[tokio::test]
    async fn commands_queued_behind_a_busy_address_hold_no_shared_slot() {
        let worker = BmcWorker::new(
            "/nonexistent".into(),
            BmcWorkerOptions {
                per_address: 1,
                max_in_flight: 2,
                ..BmcWorkerOptions::default()
            },
        );
        let running = worker
            .slots("https://a")
            .await
            .expect("the first command's slots");
        let queued = tokio::spawn({
            let worker = worker.clone();
            async move { worker.slots("https://a").await.map(drop) }
        });
        // Let the second command for `a` queue.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !queued.is_finished(),
            "a second command for a busy address waits"
        );
        let other = tokio::time::timeout(Duration::from_secs(5), worker.slots("https://b"))
            .await
            .expect("a command for another BMC is not held up by one queued behind a busy address");
        assert!(other.is_some());
        drop(running);
        tokio::time::timeout(Duration::from_secs(5), queued)
            .await
            .expect("the queued command runs once the first is done")
            .expect("join")
            .expect("its slots");
    }

    /// A command whose deadline passed before its turn came is not sent to the BMC: nothing connects to it.
    /// Before, the request was started (a zero timeout still polls its future once) and its outcome was whatever
    /// that first poll gave.
    #[tokio::test]
    async fn a_command_past_its_deadline_is_not_sent_to_the_bmc() {
        let bmc = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = format!("http://{}", bmc.local_addr().expect("addr"));
        // A state directory of its own: were the command run, fetching its secret opens (and creates) it.
        let state = tempfile::tempdir().expect("tempdir");
        let worker = BmcWorker::new(state.path().join("site"), BmcWorkerOptions::default());
        let c = bc_proto::v1::BmcCommand {
            id: "b-1".into(),
            mac: "52:54:00:00:00:01".into(),
            bmc_address: address,
            credentials_ref: "bmc-creds".into(),
            op_json: r#"{"op": "power", "power": "off"}"#.into(),
            deadline_unix_ms: 1_000,
        };
        match worker.outcome(&c, 3_500).await {
            bc_core::metal::Outcome::Failed { reason, retryable } => {
                assert!(retryable);
                assert_eq!(
                    reason,
                    "the command's deadline had passed 2500 ms before it could be sent; not sent to the BMC"
                );
            }
            other => panic!("{other:?}"),
        }
        let connected = tokio::time::timeout(Duration::from_millis(300), bmc.accept()).await;
        assert!(connected.is_err(), "something connected to the BMC");
    }

    #[test]
    fn an_address_may_name_one_system_of_several() {
        assert_eq!(system_of("http://127.0.0.1:8000"), None);
        assert_eq!(system_of("https://bmc.example/"), None);
        assert_eq!(
            system_of("http://127.0.0.1:8000/redfish/v1/Systems/6b0f-01"),
            Some("/redfish/v1/Systems/6b0f-01")
        );
        assert_eq!(system_of("ftp://x/y"), None);
        assert_eq!(
            system_of("https://bmc/redfish/v1/Systems/x/"),
            Some("/redfish/v1/Systems/x")
        );
    }
}
