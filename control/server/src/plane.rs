//! The server's own module `server`: the IAM methods it keeps (`tenants.create|list`, `principals.create|list`,
//! `audit.list`: see [`crate::iam_api`]), `system.stats|info` and `fleet.overview` (the fleet page's:
//! [`crate::fleet`]), typed with `bc_core::api::{iam, system}`, and the `statistics`
//! reconciler (`controllers` and `scheduler` roles). Every other group is a module crate's: the nodes' groups and
//! controllers [`bc_mod_nodes`]', reservations and the placer bc-mod-capacity's, the sites' groups, the artifact
//! upload route and the site gateway service bc-mod-sites'.

use crate::api::ApiState;
use crate::{iam_api, statistics};
use bc_core::api::audit::{AuditEvents, ListAudit};
use bc_core::api::iam::{
    CreatePrincipal, CreateTenant, ListPrincipals, ListTenants, PrincipalCreated, Principals,
    Tenant, Tenants,
};
use bc_core::api::system::{GatewayStats, Info, Nothing, Stats};
use bc_kernel::{ApiError, Cx, Method, Module, ReconcileCx, Reconciler, Scope, Stop};
use bc_store::Store;
use tokio::sync::watch;

bc_kernel::api_method!(
    /// `tenants.create`.
    pub CreateTenantMethod = "tenants" / "create": CreateTenant => Tenant
);
bc_kernel::api_method!(
    /// `principals.create`.
    pub CreatePrincipalMethod = "principals" / "create": CreatePrincipal => PrincipalCreated
);
bc_kernel::api_method!(
    /// `tenants.list`.
    pub ListTenantsMethod = "tenants" / "list": ListTenants => Tenants
);
bc_kernel::api_method!(
    /// `principals.list`.
    pub ListPrincipalsMethod = "principals" / "list": ListPrincipals => Principals
);
bc_kernel::api_method!(
    /// `audit.list`.
    pub ListAuditMethod = "audit" / "list": ListAudit => AuditEvents
);
bc_kernel::api_method!(
    /// `system.stats`.
    pub StatsMethod = "system" / "stats": Nothing => Stats
);
bc_kernel::api_method!(
    /// `system.info`.
    pub InfoMethod = "system" / "info": Nothing => Info
);

/// The `server` module: its methods and its role loop.
pub fn module(store: Store) -> Module {
    Module::new("server")
        .method(
            Method::<CreateTenantMethod>::new()
                .permission("compute:tenants:create")
                .scope_from_request("tenant/<id>", |r| format!("tenant/{}", r.id))
                .handler(iam_api::create_tenant),
        )
        .method(
            Method::<CreatePrincipalMethod>::new()
                .permission("compute:principals:create")
                .scope_from_request("tenant/<tenant>", |r| format!("tenant/{}", r.tenant))
                .handler(iam_api::create_principal),
        )
        .method(
            Method::<ListTenantsMethod>::new()
                .permission("compute:tenants:list")
                .scope(Scope::filtered("tenant/<id>"))
                .handler(iam_api::list_tenants),
        )
        .method(
            Method::<ListPrincipalsMethod>::new()
                .permission("compute:principals:list")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(iam_api::list_principals),
        )
        .method(
            Method::<ListAuditMethod>::new()
                .permission("compute:audit:list")
                .scope(Scope::fixed("audit"))
                .handler(iam_api::list_audit),
        )
        .method(Method::<StatsMethod>::new().any_caller().handler(stats))
        .method(Method::<InfoMethod>::new().any_caller().handler(info))
        .method(crate::fleet::method())
        .hot_tables(bc_store::statistics::HOT_TABLES)
        .reconciler(statistics_loop(store))
}

async fn stats(cx: Cx, _: Nothing) -> Result<Stats, ApiError> {
    let state = cx.get::<ApiState>()?;
    let gateway = state.sessions.as_ref().map(|r| {
        let s = r.stats();
        GatewayStats {
            sessions: s.sessions as u64,
            opened: s.opened,
            liveness_writes: s.liveness_writes,
            pending_pulls: s.pending_pulls,
            revocation_reads: s.revocation_reads,
            revoked: s.revoked as u64,
        }
    });
    Ok(Stats { gateway })
}

async fn info(cx: Cx, _: Nothing) -> Result<Info, ApiError> {
    let state = cx.get::<ApiState>()?;
    Ok(Info {
        trust_domain: state.ca.trust_domain().to_string(),
        ca_pin: state.ca.pin(),
        join_public_key: state.join_public_key.clone(),
        gateway_url: state.gateway_url.clone(),
        version: crate::version().to_string(),
    })
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
        .run(move |cx: ReconcileCx| {
            // Every module's hot tables (the plane collected them at start), this module's among them.
            let tables = cx
                .resources
                .get::<bc_kernel::HotTables>()
                .map(|t| t.0.clone())
                .unwrap_or_else(|| bc_store::statistics::HOT_TABLES.to_vec());
            statistics::run(store.clone(), tables, stop_watch(cx.stop))
        })
}
