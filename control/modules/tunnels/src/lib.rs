//! bc-mod-tunnels: the control plane's tunnels module (DESIGN.md, "Tunnels"). An operator's
//! `better-compute tunnel <node> <port>` opens one `GET /api/tunnels/{node}/{port}` per local connection, with
//! its bearer API key and `Upgrade: bc-tunnel/1`; [`route`] authorizes it (the grant `compute:tunnels:open` on
//! the node's scope `pool/<pool>`, then the pool's port allowlist, both before the node is asked: a refusal sends
//! nothing to the node), asks the gateway that holds the node's session to open the tunnel, answers
//! `101 Switching Protocols` and [`relay`]s length-prefixed `TunnelFrame`s between the upgraded connection and
//! the node's tunnel stream. Every connection, refused ones too, leaves one audit row ([`queries`]) readable
//! with `tunnels.list`.
//!
//! The session row names the gateway that holds the node's session: when it is this process's gateway role the
//! tunnel is opened there; otherwise through that gateway's relay URL (published in the store) over internal mTLS,
//! as a control-plane identity ([`bc_gateway::relay::Peers`]). Either way the relay here sees the same
//! [`bc_gateway::tunnel::Tunnel`].
//!
//! Its migrations are 1200 and 1201; its state is a [`TunnelsState`] resource the composition provides.

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
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1200,
        name: "tunnels: pool port allowlists and the audit of tunnel connections",
        sql: include_str!("migration.sql"),
    },
    Migration {
        version: 1201,
        name: "tunnels: the gateway each tunnel connection went through",
        sql: include_str!("migration_1201.sql"),
    },
];

/// The permission a tunnel needs on the node's scope (`pool/<pool>`).
pub const OPEN: &str = "compute:tunnels:open";

/// Limits of the module (per API process): `[tunnels]` in the control plane's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// This process's gateway role, as the relay sees it.
#[derive(Clone)]
pub struct LocalGateway {
    /// Its id (`spiffe://<domain>/gateway/<id>`), as session rows name it.
    pub id: String,
    pub tunnels: bc_gateway::tunnel::Tunnels,
}

/// What the module's handlers share (a kernel resource: `builder.resource(TunnelsState::new(..))`).
#[derive(Clone)]
pub struct TunnelsState {
    pub store: Store,
    /// This process's gateway role, when it runs one.
    pub gateway: Option<LocalGateway>,
    /// The other gateways, reached over internal mTLS (None: only this process's gateway is reached).
    pub peers: Option<bc_gateway::relay::Peers>,
    pub options: Options,
    principals: Arc<Mutex<HashMap<String, usize>>>,
}

impl TunnelsState {
    pub fn new(
        store: Store,
        gateway: Option<LocalGateway>,
        peers: Option<bc_gateway::relay::Peers>,
        options: Options,
    ) -> TunnelsState {
        TunnelsState {
            store,
            gateway,
            peers,
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
    let module = MIGRATIONS
        .iter()
        .fold(Module::new("tunnels"), |m, migration| {
            m.migration(*migration)
        })
        .route(route::route());
    api::register(module)
}
