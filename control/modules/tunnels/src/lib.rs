//! bc-mod-tunnels: the control plane's tunnels module (DESIGN.md, "Tunnels"). An operator's
//! `better-compute tunnel <node> <port>` opens one `GET /api/tunnels/{node}/{port}` per local connection, with
//! its bearer API key and `Upgrade: bc-tunnel/1`; [`route`] authorizes it (the grant `compute:tunnels:open` on
//! the node's scope `pool/<pool>`, then the pool's port allowlist, both before the node is asked: a refusal sends
//! nothing to the node), asks the gateway that holds the node's session to open the tunnel, answers
//! `101 Switching Protocols` and [`relay`]s length-prefixed `TunnelFrame`s between the upgraded connection and
//! the node's tunnel stream. Every connection, refused ones too, leaves one audit row ([`queries`]) readable
//! with `tunnels.list`.
//!
//! The relay reaches the gateway of this process (the api and gateway roles together). A node whose session is
//! held by another gateway process is refused with UNAVAILABLE naming that gateway: the relay between processes
//! over internal mTLS is not built yet.
//!
//! Its migration is 1200; its state is a [`TunnelsState`] resource the composition provides.

pub mod api;
pub mod queries;
pub mod relay;
pub mod route;

use bc_kernel::{Migration, Module};
use bc_store::Store;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The module's schema.
pub const MIGRATION: Migration = Migration {
    version: 1200,
    name: "tunnels: pool port allowlists and the audit of tunnel connections",
    sql: include_str!("migration.sql"),
};

/// The permission a tunnel needs on the node's scope (`pool/<pool>`).
pub const OPEN: &str = "compute:tunnels:open";

/// Limits of the module (per API process).
#[derive(Debug, Clone)]
pub struct Options {
    /// A tunnel that moves no byte either way for this long is closed (`IDLE`). At least an hour by default.
    pub idle: Duration,
    /// Tunnels one principal holds open at once through this process.
    pub per_principal: usize,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            idle: Duration::from_secs(3600),
            per_principal: 256,
        }
    }
}

/// What the module's handlers share (a kernel resource: `builder.resource(TunnelsState::new(..))`).
#[derive(Clone)]
pub struct TunnelsState {
    pub store: Store,
    /// The tunnels of this process's gateway role, when it runs one.
    pub gateway: Option<bc_gateway::tunnel::Tunnels>,
    pub options: Options,
    principals: Arc<Mutex<HashMap<String, usize>>>,
}

impl TunnelsState {
    pub fn new(
        store: Store,
        gateway: Option<bc_gateway::tunnel::Tunnels>,
        options: Options,
    ) -> TunnelsState {
        TunnelsState {
            store,
            gateway,
            options,
            principals: Arc::default(),
        }
    }

    /// One more tunnel for `principal`, or None at its cap.
    pub(crate) fn hold(&self, principal: &str) -> Option<PrincipalSlot> {
        let mut m = self.principals.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(principal.to_string()).or_default();
        if *n >= self.options.per_principal {
            return None;
        }
        *n += 1;
        Some(PrincipalSlot {
            state: self.clone(),
            principal: principal.to_string(),
        })
    }

    /// Tunnels `principal` holds open through this process.
    pub fn held_by(&self, principal: &str) -> usize {
        let m = self.principals.lock().unwrap_or_else(|p| p.into_inner());
        m.get(principal).copied().unwrap_or(0)
    }
}

/// A principal's place in its count; dropping it frees it.
pub(crate) struct PrincipalSlot {
    state: TunnelsState,
    principal: String,
}

impl Drop for PrincipalSlot {
    fn drop(&mut self) {
        let mut m = self
            .state
            .principals
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.principal);
            }
        }
    }
}

/// The `tunnels` module: its migration, its methods and the tunnel route.
pub fn module() -> Module {
    let module = Module::new("tunnels")
        .migration(MIGRATION)
        .route(route::route());
    api::register(module)
}
