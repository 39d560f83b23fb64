//! The control plane's nodes module: joining (join tokens and JoinService), sessions (the gateway's backend),
//! the node verbs and commands, and the controllers that act on nodes (membership of the `controllers` role with
//! reservation expiry and the outbox sink; the lifecycle controller's acceptance checks).
//!
//! [`module`] declares it to the kernel: the methods of `join-tokens`, `nodes` and `commands` ([`methods`], typed
//! with [`bc_core::api::nodes`]), its reconcilers in the `controllers` role and the `gateway` role's outbox poke,
//! and the gateway services it serves (`join`, `session`: built by the binary that wires the gateway, from
//! [`join::JoinService`] and [`session::ControlSessions`]).

pub mod api;
pub mod commands;
pub mod controllers;
mod grouped;
pub mod join;
pub mod lifecycle;
pub mod methods;
pub mod session;

use bc_ca::Ca;
use bc_kernel::{Module, Notice, ReconcileCx, Reconciler, StartCx, Tick};
use bc_store::Store;
use std::sync::Arc;

/// What the module needs from the binary that composes it.
#[derive(Clone)]
pub struct Config {
    pub ca: Arc<Ca>,
    /// The sessions of this process's gateway role, when it runs one (revoking a node closes its session here).
    pub sessions: Option<bc_gateway::session::Registry>,
    pub lifecycle: lifecycle::LifecycleTiming,
}

/// The module's state, a kernel resource its handlers and reconcilers read.
#[derive(Clone)]
pub struct Nodes {
    pub store: Store,
    pub ca: Arc<Ca>,
    pub sessions: Option<bc_gateway::session::Registry>,
    pub lifecycle: lifecycle::LifecycleTiming,
}

/// The `nodes` module.
pub fn module(config: Config) -> Module {
    let lifecycle_tick = config.lifecycle.tick;
    let module = Module::new("nodes")
        .gateway_service("join")
        .gateway_service("session")
        .on_start(move |cx: StartCx| {
            let config = config.clone();
            async move {
                let store = cx.get::<Store>()?.clone();
                cx.provide(Nodes {
                    store,
                    ca: config.ca,
                    sessions: config.sessions,
                    lifecycle: config.lifecycle,
                });
                Ok(())
            }
        });
    methods::register(module)
        .reconciler(
            Reconciler::new("controllers")
                .role(controllers::ROLE)
                .shard_scoped()
                .tick(Tick::QuarterLease)
                .poked_by(controllers::OUTBOX_WRITTEN)
                .run(controllers::run),
        )
        .reconciler(
            Reconciler::new("lifecycle")
                .role(controllers::ROLE)
                .shard_scoped()
                .tick(Tick::Every(lifecycle_tick))
                .poked_by(bc_store::pokes::LIFECYCLE)
                .run(lifecycle::run),
        )
        .reconciler(
            Reconciler::new("session-outbox")
                .role("gateway")
                .poked_by(bc_store::pokes::OUTBOX)
                .run(outbox_pokes),
        )
}

/// Wakes the gateway's pull of waiting messages on `bc_outbox` (the sessions also pull on their own interval, so
/// a lost notification costs latency only; after a reconnect every session is woken once).
async fn outbox_pokes(mut cx: ReconcileCx) {
    let sessions = cx.resources.get::<Nodes>().and_then(|n| n.sessions.clone());
    loop {
        tokio::select! {
            n = cx.pokes.recv() => match n {
                Some(Notice::Message { .. } | Notice::Resync) => {
                    if let Some(s) = &sessions {
                        s.poke_pending();
                    }
                }
                None => break,
            },
            _ = cx.stop.stopped() => return,
        }
    }
    cx.stop.stopped().await;
}

/// The wall clock in ms since the epoch: read here, at the edge, and passed into the decisions and queries.
pub fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .unwrap_or(i64::MAX)
}
