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
//! The cap of tunnels per principal counts across every API process: each open tunnel's row names the API process
//! relaying it (its worker id in the `api` role), the count and the row are written under a per-principal advisory
//! lock, and a sweeper ([`sweep`], in the `api` role, which also makes every API process a member of that role) closes
//! the rows of a process whose membership expired as `LOST`.
//!
//! Its migrations are 1200 to 1202; its state is a [`TunnelsState`] resource the composition provides.

pub mod api;
pub mod queries;
pub mod relay;
pub mod route;

use bc_kernel::{Migration, Module, Reconciler, StepCx, Tick};
use bc_store::Store;
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
    Migration {
        version: 1202,
        name: "tunnels: the API process relaying each open tunnel",
        sql: include_str!("migration_1202.sql"),
    },
];

/// The permission a tunnel needs on the node's scope (`pool/<pool>`).
pub const OPEN: &str = "compute:tunnels:open";

/// Limits of the module: `[tunnels]` in the control plane's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// A tunnel that moves no byte either way for this long is closed (`IDLE`). At least an hour by default.
    pub idle: Duration,
    /// Tunnels one principal holds open at once, through every API process together.
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
    /// This process's worker id (its membership of the `api` role): the open rows it relays name it.
    pub worker: String,
}

impl TunnelsState {
    pub fn new(
        store: Store,
        gateway: Option<LocalGateway>,
        peers: Option<bc_gateway::relay::Peers>,
        options: Options,
        worker: String,
    ) -> TunnelsState {
        TunnelsState {
            store,
            gateway,
            peers,
            options,
            worker,
        }
    }
}

/// How often the sweeper looks for the open rows of API processes that died.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The sweeper's step: closes the open rows whose API process's membership of the `api` role expired.
async fn sweep(cx: StepCx) -> Result<(), bc_store::StoreError> {
    let Some(state) = cx.resources.get::<TunnelsState>() else {
        return Ok(());
    };
    let closed = queries::close_orphans(&state.store).await?;
    if closed > 0 {
        tracing::warn!(
            closed,
            "closed the audit rows of tunnels whose API process stopped (LOST)"
        );
    }
    Ok(())
}

pub fn module() -> Module {
    let module = MIGRATIONS
        .iter()
        .fold(Module::new("tunnels"), |m, migration| {
            m.migration(*migration)
        })
        .route(route::route())
        .reconciler(
            Reconciler::new("tunnels-sweeper")
                .role("api")
                .shard_scoped()
                .tick(Tick::Every(SWEEP_EVERY))
                .step(sweep),
        );
    api::register(module)
}
