//! The server's own API groups and role loops as the kernel's `server` module: every method of the former dispatch
//! registered with its permission and scope ([`ServerMethod`] types: JSON in, JSON out, until each group moves into
//! its module crate under `control/modules/`), and the role loops as reconcilers the
//! kernel starts for the roles a process runs (`controllers`: membership, expiry, outbox and lifecycle;
//! `scheduler`: the placer; `api`: admission's decided notices; every role: the notification pokes).

use crate::api::{self, ApiState};
use crate::lifecycle::LifecycleTiming;
use crate::{controllers, lifecycle, pokes, scheduler, statistics};
use axum::Json;
use bc_kernel::{
    ApiMethod, Cx, Method, Module, Notice, ROLES, ReconcileCx, Reconciler, Scope, Stop,
};
use bc_store::Store;
use bc_store::iam::Principal;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// A method of the server's former dispatch: its request and response are JSON values until its group moves into
/// a module crate with typed ones.
pub trait ServerMethod: ApiMethod<Request = Value, Response = Value> {}
impl<M: ApiMethod<Request = Value, Response = Value>> ServerMethod for M {}

macro_rules! server_methods {
    (@grant $permission:literal on $scope:literal) => { Some(($permission, $scope)) };
    (@grant) => { None };
    ($( $ty:ident = $group:literal / $method:literal $(: $permission:literal on $scope:literal)? ; )*) => {
        $( bc_kernel::api_method!(
            #[doc = concat!("`", $group, ".", $method, "`.")]
            pub $ty = $group / $method: Value => Value
        ); )*
        fn register_methods(module: Module) -> Module {
            module $( .method(server_method::<$ty>(server_methods!(@grant $($permission on $scope)?))) )*
        }
    };
}

server_methods! {
    CreateJoinToken = "join-tokens" / "create": "compute:join-tokens:create" on "pool/<pool>";
    ListJoinTokens = "join-tokens" / "list": "compute:join-tokens:list" on "pool/<pool>";
    RevokeJoinToken = "join-tokens" / "revoke": "compute:join-tokens:revoke" on "pool/<pool>";
    CreateReservation = "reservations" / "create": "compute:reservations:create" on "tenant/<tenant>";
    GetReservation = "reservations" / "get": "compute:reservations:get" on "tenant/<tenant>";
    ListReservations = "reservations" / "list": "compute:reservations:list" on "tenant/<tenant>";
    ReleaseReservation = "reservations" / "release": "compute:reservations:release" on "tenant/<tenant>";
    CreateTenant = "tenants" / "create": "compute:tenants:create" on "tenant/<id>";
    CreatePrincipal = "principals" / "create": "compute:principals:create" on "tenant/<tenant>";
    ListNodes = "nodes" / "list": "compute:nodes:list" on "pool/<pool>";
    GetNode = "nodes" / "get": "compute:nodes:get" on "pool/<pool>";
    DrainNode = "nodes" / "drain": "compute:nodes:drain" on "pool/<pool>";
    UndrainNode = "nodes" / "undrain": "compute:nodes:undrain" on "pool/<pool>";
    RevokeNode = "nodes" / "revoke": "compute:nodes:revoke" on "pool/<pool>";
    QueueCommand = "nodes" / "command": "compute:nodes:command" on "pool/<pool>";
    GetCommand = "commands" / "get": "compute:nodes:get" on "pool/<pool>";
    Stats = "system" / "stats";
    Info = "system" / "info";
}

/// A method of the former dispatch: `grant` is (permission, scope pattern), which its handler checks itself; none:
/// any authenticated caller.
fn server_method<M: ServerMethod>(grant: Option<(&'static str, &'static str)>) -> Method<M> {
    let method = match grant {
        Some((permission, scope)) => Method::<M>::new()
            .permission(permission)
            .scope(Scope::checked_by_handler(scope)),
        None => Method::<M>::new().any_caller(),
    };
    method.handler(|cx: Cx, body: Value| async move {
        let state = cx.get::<ApiState>()?.clone();
        let caller = cx.caller();
        let principal = Principal {
            id: caller.id.clone(),
            tenant_id: caller.tenant_id.clone(),
            name: String::new(),
            api_key_hash: String::new(),
            tenant_is_root: caller.tenant_is_root,
            grants: caller.grants.clone(),
        };
        let Json(answer) = api::call(&state, &principal, M::GROUP, M::METHOD, body).await?;
        Ok(answer)
    })
}

/// What the role loops of this process need.
#[derive(Clone)]
pub struct Loops {
    pub store: Store,
    pub worker: String,
    pub lease: Duration,
    pub lifecycle: LifecycleTiming,
    pub capacity_reload: Duration,
    /// The gateway's sessions, when this process runs the gateway role (woken on `bc_outbox`).
    pub gateway: Option<bc_gateway::session::Registry>,
    /// Wakes the lifecycle controller, when this process runs the controllers role (on `bc_lifecycle`).
    pub lifecycle_poke: Option<Arc<Notify>>,
    /// The control plane's own metrics (the placer records placement latency).
    pub metrics: crate::telemetry::ControlMetrics,
}

/// The `server` module: its methods, its upload route, the gateway services it serves and its role loops.
pub fn module(loops: Loops) -> Module {
    let module = Module::new("server")
        .gateway_service("join")
        .gateway_service("session");
    let module = register_methods(module)
        .reconciler(controllers_loop(loops.clone()))
        .reconciler(scheduler_loop(loops.clone()))
        .reconciler(statistics_loop(loops.store.clone()))
        .reconciler(admission_decisions());
    let mut pokes = Reconciler::new("pokes");
    for role in ROLES {
        pokes = pokes.role(role);
    }
    module.reconciler(pokes.run(move |cx: ReconcileCx| {
        let l = loops.clone();
        pokes::run(l.store, l.gateway, l.lifecycle_poke, stop_watch(cx.stop))
    }))
}

/// The kernel's stop signal as the watch channel the role loops take.
pub(crate) fn stop_watch(mut stop: Stop) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(stop.is_stopped());
    tokio::spawn(async move {
        stop.stopped().await;
        let _ = tx.send(true);
    });
    rx
}

fn controllers_loop(loops: Loops) -> Reconciler {
    Reconciler::new("controllers")
        .role("controllers")
        .run(move |cx: ReconcileCx| {
            let l = loops.clone();
            async move {
                let stop = stop_watch(cx.stop);
                let (shards_tx, shards_rx) = watch::channel(Vec::new());
                let poke = l.lifecycle_poke.clone().unwrap_or_default();
                tracing::info!(
                    worker = l.worker,
                    "controllers role: lifecycle, expiry and outbox sink running"
                );
                tokio::join!(
                    controllers::run(
                        l.store.clone(),
                        l.worker.clone(),
                        l.lease,
                        shards_tx,
                        stop.clone()
                    ),
                    lifecycle::run(l.store, l.lifecycle, shards_rx, poke, stop),
                );
            }
        })
}

fn scheduler_loop(loops: Loops) -> Reconciler {
    Reconciler::new("placer")
        .role("scheduler")
        .run(move |cx: ReconcileCx| {
            let l = loops.clone();
            tracing::info!(worker = l.worker, "scheduler role: placer running");
            scheduler::run(
                l.store,
                l.worker,
                l.lease,
                l.capacity_reload,
                l.metrics,
                stop_watch(cx.stop),
            )
        })
}

fn statistics_loop(store: Store) -> Reconciler {
    Reconciler::new("statistics")
        .role("controllers")
        .role("scheduler")
        .run(move |cx: ReconcileCx| statistics::run(store.clone(), stop_watch(cx.stop)))
}

/// Hands admission's waiting API calls the placer's decisions (`bc_reservation_decided`).
fn admission_decisions() -> Reconciler {
    Reconciler::new("admission-decisions")
        .role("api")
        .poked_by(bc_store::reservations::DECIDED_CHANNEL)
        .run(|mut cx: ReconcileCx| async move {
            let decisions = cx
                .resources
                .get::<ApiState>()
                .and_then(|s| Some((s.store.clone(), s.decisions.clone()?)));
            loop {
                tokio::select! {
                    n = cx.pokes.recv() => match (n, &decisions) {
                        (Some(Notice::Message { payload, .. }), Some((store, d))) => d.decided(store, &payload).await,
                        (Some(_), _) => {}
                        // The listener ended: the process is stopping.
                        (None, _) => break,
                    },
                    _ = cx.stop.stopped() => return,
                }
            }
            cx.stop.stopped().await;
        })
}
