//! `bcd site`: the site agent (feature `site`). It wires bcd's link to the control plane to bcd-site's services
//! (proxy DHCP, TFTP, boot HTTP, Redfish), which know nothing of the session.
//!
//! The agent enrolls with `bcd site enroll <bcst_…>` (the same sealed-token path as `bcd join`; its identity is
//! `spiffe://<domain>/site/<site-id>`), keeps one mTLS connection to the gateway and, every third of the lease TTL,
//! asks for the site's boot lease. While it holds the lease it feeds the site's netboot table to the services; when
//! it does not, or when its lease runs out on its own clock without a renewal, it feeds an empty table, so its proxy
//! DHCP answers nobody. A standby agent of the same site takes over once the holder's lease has expired in the
//! store. Machines whose boot references control-plane artifacts are published only once the artifact cache holds
//! them, verified.
//!
//! - [`lease`]: the boot lease as a pure state machine (event, `now`, random number → effects and the next step);
//!   start reading here.
//! - [`agent`]: [`SiteAgent`], which performs the lease's steps against the gateway and applies its effects.
//! - [`cache`]: the artifact cache (bc-cas's content-addressed writer), with eviction planned in [`cache::evict`].
//! - [`secrets`]: secrets from the control plane's broker as JWE (BMC credentials).
//! - [`bmc`]: the BMC worker (the metal flow's Redfish commands); [`report`]: DHCP sightings and the boot URL.
//! - [`cli`]: the `bcd site` subcommands (serve, enroll, run, redfish).

pub mod agent;
pub mod bmc;
pub mod cache;
pub mod cli;
pub mod lease;
pub mod report;
pub mod secrets;

pub use agent::{BootLeaseView, SiteAgent, SiteAgentOptions, netboot_table};
pub use secrets::{
    BmcSecretError, SecretClaims, SecretFetchError, fetch_bmc_credentials, fetch_secret,
    fetch_secret_in, open_secret,
};

use crate::state::{StateDir, StateError};
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject as _;
use std::sync::Arc;

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
    #[error("the TLS configuration from {dir} (node.key, node.crt, bundle.pem)")]
    Tls {
        dir: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
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

/// The agent's mTLS client configuration: its certificate and key, the control plane's trust bundle.
fn tls_of(state: &StateDir) -> Result<Arc<rustls::ClientConfig>, SiteError> {
    let cert = state.certificate()?;
    let bundle = state.trust_bundle()?;
    let tls = |source: Box<dyn std::error::Error + Send + Sync>| SiteError::Tls {
        dir: state.dir().display().to_string(),
        source,
    };
    let key = PrivateKeyDer::from_pem_file(state.path("node.key")).map_err(|e| tls(e.into()))?;
    bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(bundle),
        Some((vec![cert], key)),
    )
    .map_err(|e| tls(e.into()))
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
