//! The certificates a control-plane process issues itself at start from the shared CA: the gateway role's serving
//! certificate and the tunnel relay's client certificate (30 days each). Both are re-issued while the process runs
//! ([`RENEW_EVERY`]), so a process that stays up for months never presents an expired one; each handshake takes the
//! current certificate (`bc_gateway::tls::Renewable`), open connections keep theirs.

use crate::ca::{Ca, CaError};
use bc_gateway::tls::Renewable;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use std::time::Duration;

/// How often the process's own certificates are re-issued (they live 30 days).
pub const RENEW_EVERY: Duration = Duration::from_secs(24 * 3600);

/// After a failed issue, the next try.
const RETRY: Duration = Duration::from_secs(60);

/// Which certificate.
#[derive(Debug, Clone)]
pub enum Identity {
    /// The gateway role's serving certificate: its id and host names.
    Gateway { id: String, hosts: Vec<String> },
    /// A control-plane client identity (the tunnel relay's): its id.
    Control { id: String },
}

/// One certificate the process presents, and how to issue it again.
#[derive(Debug, Clone)]
pub struct Renewal {
    pub identity: Identity,
    pub current: Arc<Renewable>,
}

type Issued = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

impl Identity {
    pub fn issue(&self, ca: &Ca) -> Result<Issued, CaError> {
        match self {
            Identity::Gateway { id, hosts } => ca.issue_gateway(id, hosts),
            Identity::Control { id } => ca.issue_control(id),
        }
    }

    fn what(&self) -> String {
        match self {
            Identity::Gateway { id, .. } => format!("gateway {id}'s serving certificate"),
            Identity::Control { id } => format!("control-plane client certificate {id}"),
        }
    }
}

/// Issues `identity` and wraps it for renewal.
pub fn issue(ca: &Ca, identity: Identity) -> Result<Renewal, crate::StartError> {
    let (chain, key) = identity.issue(ca)?;
    Ok(Renewal {
        current: Renewable::new(chain, key)?,
        identity,
    })
}

/// Re-issues every one of `renewals` each `every` until the plane stops.
pub async fn run(ca: Arc<Ca>, renewals: Vec<Renewal>, every: Duration, mut stop: bc_kernel::Stop) {
    if renewals.is_empty() {
        // A task of the plane runs until it stops (one that ends early reads as a role that stopped on its own).
        return stop.stopped().await;
    }
    let mut wait = every;
    loop {
        if stop.sleep(wait).await {
            return;
        }
        wait = every;
        for r in &renewals {
            let renewed = r
                .identity
                .issue(&ca)
                .map_err(|e| bc_error_chain::chain(&e))
                .and_then(|(chain, key)| {
                    r.current
                        .replace(chain, key)
                        .map_err(|e| bc_error_chain::chain(&e))
                });
            match renewed {
                Ok(()) => tracing::info!("renewed the {}", r.identity.what()),
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the {} failed; retrying in {} s", r.identity.what(), RETRY.as_secs());
                    wait = RETRY;
                }
            }
        }
    }
}
