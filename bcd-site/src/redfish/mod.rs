//! Redfish client for driving BMCs: service root, systems, managers and chassis; sessions with logout (Basic
//! when the BMC has none to give); ETag/If-Match on PATCH; power actions with the reset types the BMC allows;
//! one-time boot override to PXE or UEFI HTTP, read back after setting; hardware inventory; a per-BMC concurrency
//! limit and a retry budget for busy answers; and a vendor quirk table (Dell iDRAC, HPE iLO, Supermicro, AMI).
//!
//! The client never trusts an accepted request: power changes and boot overrides are read back, and one the BMC
//! accepted but did not apply is an error naming what was read. Start at [`Bmc::connect`], then
//! [`Bmc::power`], [`Bmc::boot_once`] and [`Bmc::inventory`]; [`inspect`], [`power`] and [`boot_once`] are the
//! one-call forms behind `bcd site redfish <url> inspect|power|boot-once`. HTTP goes through reqwest on rustls
//! with the ring provider ([`tls`]: pinned BMC certificate or a site CA).

mod client;
mod credentials;
pub mod decode;
mod error;
mod inventory;
pub mod listing;
pub mod metrics;
pub mod models;
mod ops;
pub mod quirks;
mod summary;
pub mod tls;

pub use client::{BMC_RETRY, Bmc, BmcOptions, Fetched, RetryPolicy, SERVER_ERROR_ATTEMPTS};
pub use credentials::{Credentials, CredentialsFormatError, SECRET_FORMAT};
pub use error::{ObservedBoot, RedfishError};
pub use inventory::{Gpu, Inventory, OtherInterface, SystemInventory, valid_mac};
pub use ops::{BootOverride, BootTarget, PowerAction, PowerOutcome};
pub use tls::TlsTrust;

/// What one call does once connected.
#[derive(Debug, Clone, Copy)]
pub enum Operation {
    Inspect,
    Power(PowerAction),
    BootOnce(BootTarget),
}

/// How one call ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    Inventory(Box<Inventory>),
    Power(PowerOutcome),
    Boot(BootOverride),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Inventory(inv) => write!(f, "{inv}"),
            Outcome::Power(p) => writeln!(f, "{p}"),
            Outcome::Boot(b) => writeln!(f, "{b}"),
        }
    }
}

/// How long a login already under way may finish after an interrupt, so that its session can be logged out.
const LOGIN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects, carries out `op` on `system` (or the only system), logs out. When `shutdown` completes first (SIGINT,
/// SIGTERM), the operation is dropped, the session is logged out all the same and the result is
/// [`RedfishError::Interrupted`]; a login under way gets [`LOGIN_GRACE`] to finish so its session can be closed.
pub async fn run(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
    system: Option<&str>,
    op: Operation,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Outcome, RedfishError> {
    let name = match op {
        Operation::Inspect => "inspect",
        Operation::Power(_) => "power",
        Operation::BootOnce(_) => "boot_once",
    };
    metrics::timed(name, run_counted(url, creds, opts, system, op, shutdown)).await
}

async fn run_counted(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
    system: Option<&str>,
    op: Operation,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Outcome, RedfishError> {
    tokio::pin!(shutdown);
    let connect = Bmc::connect(url, creds, opts);
    tokio::pin!(connect);
    let bmc = tokio::select! {
        r = &mut connect => r?,
        () = &mut shutdown => {
            if let Ok(Ok(bmc)) = tokio::time::timeout(LOGIN_GRACE, connect).await {
                let _ = bmc.close().await;
            }
            return Err(RedfishError::Interrupted { state: "while connecting; no session left open".into() });
        }
    };
    let work = async {
        match op {
            Operation::Inspect => bmc
                .inventory()
                .await
                .map(|i| Outcome::Inventory(Box::new(i))),
            Operation::Power(action) => {
                let path = bmc.system_path(system).await?;
                bmc.power(&path, action).await.map(Outcome::Power)
            }
            Operation::BootOnce(target) => {
                let path = bmc.system_path(system).await?;
                bmc.boot_once(&path, target).await.map(Outcome::Boot)
            }
        }
    };
    let result = tokio::select! {
        r = work => r,
        () = &mut shutdown => Err(RedfishError::Interrupted {
            state: format!("session {}", match bmc.auth_kind() { "session" => "logged out", _ => "not used (Basic auth)" }),
        }),
    };
    let _ = bmc.close().await;
    result
}

/// `inspect`: connect, read the inventory, log out. `Display` the result for the operator.
pub async fn inspect(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
) -> Result<Inventory, RedfishError> {
    match run(
        url,
        creds,
        opts,
        None,
        Operation::Inspect,
        std::future::pending(),
    )
    .await?
    {
        Outcome::Inventory(inv) => Ok(*inv),
        _ => unreachable!("inspect returns an inventory"),
    }
}

/// `power`: connect, apply `action` to `system` (or the only system), log out.
pub async fn power(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
    system: Option<&str>,
    action: PowerAction,
) -> Result<PowerOutcome, RedfishError> {
    match run(
        url,
        creds,
        opts,
        system,
        Operation::Power(action),
        std::future::pending(),
    )
    .await?
    {
        Outcome::Power(p) => Ok(p),
        _ => unreachable!("power returns a power outcome"),
    }
}

/// `boot-once`: connect, set the one-time boot override of `system` (or the only system) and read it back, log out.
pub async fn boot_once(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
    system: Option<&str>,
    target: BootTarget,
) -> Result<BootOverride, RedfishError> {
    match run(
        url,
        creds,
        opts,
        system,
        Operation::BootOnce(target),
        std::future::pending(),
    )
    .await?
    {
        Outcome::Boot(b) => Ok(b),
        _ => unreachable!("boot-once returns a boot override"),
    }
}
