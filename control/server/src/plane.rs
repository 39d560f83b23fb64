//! The server's own API groups and role loops as the kernel's `server` module: every method of the former dispatch
//! registered with its permission and scope ([`ServerMethod`] types: JSON in, JSON out, until each group moves into
//! its module crate under `control/modules/`), and the role loops as reconcilers the kernel starts for the roles a
//! process runs (`controllers` and `scheduler`: statistics). The nodes' groups and controllers are the nodes
//! module's ([`bc_mod_nodes`]), the capacity groups and the placer bc-mod-capacity's, the sites' groups, the
//! artifact upload route and the site gateway service bc-mod-sites'.

use crate::api::{self, ApiState};
use crate::statistics;
use axum::Json;
use bc_kernel::{
    ApiMethod, Cx, Method, Module, ReconcileCx, Reconciler, Scope, Stop,
};
use bc_store::Store;
use bc_store::iam::Principal;
use serde_json::Value;
use std::time::Duration;
use tokio::sync::watch;

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
    CreateTenant = "tenants" / "create": "compute:tenants:create" on "tenant/<id>";
    CreatePrincipal = "principals" / "create": "compute:principals:create" on "tenant/<tenant>";
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
}

/// The `server` module: its methods, its upload route, the gateway services it serves and its role loops.
pub fn module(loops: Loops) -> Module {
    register_methods(Module::new("server")).reconciler(statistics_loop(loops.store.clone()))
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

fn statistics_loop(store: Store) -> Reconciler {
    Reconciler::new("statistics")
        .role("controllers")
        .role("scheduler")
        .run(move |cx: ReconcileCx| statistics::run(store.clone(), stop_watch(cx.stop)))
}
