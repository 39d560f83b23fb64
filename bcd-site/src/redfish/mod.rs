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
mod error;
mod inventory;
pub mod metrics;
pub mod models;
mod ops;
pub mod quirks;
pub mod tls;

pub use client::{Bmc, BmcOptions, RetryPolicy};
pub use credentials::{Credentials, CredentialsFormatError, SECRET_FORMAT};
pub use error::{ObservedBoot, RedfishError};
pub use inventory::{Inventory, SystemInventory};
pub use ops::{BootOverride, BootTarget, PowerAction, PowerOutcome};
pub use tls::TlsTrust;

/// `inspect`: connect, read the inventory, log out. `Display` the result for the operator.
pub async fn inspect(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
) -> Result<Inventory, RedfishError> {
    metrics::timed("inspect", async {
        let bmc = Bmc::connect(url, creds, opts).await?;
        let result = bmc.inventory().await;
        let _ = bmc.close().await;
        result
    })
    .await
}

/// `power`: connect, apply `action` to `system` (or the only system), log out.
pub async fn power(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
    system: Option<&str>,
    action: PowerAction,
) -> Result<PowerOutcome, RedfishError> {
    metrics::timed("power", async {
        let bmc = Bmc::connect(url, creds, opts).await?;
        let result = async {
            let path = bmc.system_path(system).await?;
            bmc.power(&path, action).await
        }
        .await;
        let _ = bmc.close().await;
        result
    })
    .await
}

/// `boot-once`: connect, set the one-time boot override of `system` (or the only system) and read it back, log out.
pub async fn boot_once(
    url: &str,
    creds: Credentials,
    opts: BmcOptions,
    system: Option<&str>,
    target: BootTarget,
) -> Result<BootOverride, RedfishError> {
    metrics::timed("boot_once", async {
        let bmc = Bmc::connect(url, creds, opts).await?;
        let result = async {
            let path = bmc.system_path(system).await?;
            bmc.boot_once(&path, target).await
        }
        .await;
        let _ = bmc.close().await;
        result
    })
    .await
}
