//! The module's methods: `tunnels.list` (the audit, each row shown where the caller holds
//! `compute:tunnels:list` on its pool), `tunnels.set-ports` and `tunnels.ports` (a pool's allowlist, under
//! `compute:tunnels:configure` and `compute:tunnels:list` on `pool/<pool>`).

use crate::{TunnelsState, queries};
use bc_core::api::tunnels::{GetPoolPorts, ListTunnels, MAX_LIST, PoolPorts, TunnelList};
use bc_kernel::{ApiError, Cx, Method, Module, Scope};

bc_kernel::api_method!(
    /// `tunnels.list`.
    pub ListTunnelsMethod = "tunnels" / "list": ListTunnels => TunnelList
);
bc_kernel::api_method!(
    /// `tunnels.set-ports`.
    pub SetPortsMethod = "tunnels" / "set-ports": PoolPorts => PoolPorts
);
bc_kernel::api_method!(
    /// `tunnels.ports`.
    pub PortsMethod = "tunnels" / "ports": GetPoolPorts => PoolPorts
);

pub(crate) fn register(module: Module) -> Module {
    module
        .method(
            Method::<ListTunnelsMethod>::new()
                .permission("compute:tunnels:list")
                .scope(Scope::filtered("pool/<pool>"))
                .handler(list),
        )
        .method(
            Method::<SetPortsMethod>::new()
                .permission("compute:tunnels:configure")
                .scope_from_request("pool/<pool>", |r| format!("pool/{}", r.pool))
                .handler(set_ports),
        )
        .method(
            Method::<PortsMethod>::new()
                .permission("compute:tunnels:list")
                .scope_from_request("pool/<pool>", |r| format!("pool/{}", r.pool))
                .handler(ports),
        )
}

async fn list(cx: Cx, r: ListTunnels) -> Result<TunnelList, ApiError> {
    let state = cx.get::<TunnelsState>()?;
    let limit = r.limit.unwrap_or(MAX_LIST).clamp(1, MAX_LIST);
    let rows = queries::list(&state.store, r.node.as_deref(), limit).await?;
    Ok(TunnelList {
        tunnels: rows
            .into_iter()
            .filter(|t| cx.allows(&format!("pool/{}", t.pool)))
            .collect(),
    })
}

async fn set_ports(cx: Cx, mut r: PoolPorts) -> Result<PoolPorts, ApiError> {
    let state = cx.get::<TunnelsState>()?;
    if r.ports.contains(&0) {
        return Err(ApiError::invalid(
            "port 0 is not a TCP port; list ports from 1 to 65535",
        ));
    }
    r.ports.sort_unstable();
    r.ports.dedup();
    if !queries::set_pool_ports(&state.store, &r.pool, &r.ports).await? {
        return Err(ApiError::not_found(format!(
            "no pool {:?}; list pools with `better-compute pools list`",
            r.pool
        )));
    }
    Ok(r)
}

async fn ports(cx: Cx, r: GetPoolPorts) -> Result<PoolPorts, ApiError> {
    let state = cx.get::<TunnelsState>()?;
    let ports = queries::pool_ports(&state.store, &r.pool).await?;
    Ok(PoolPorts {
        pool: r.pool,
        ports,
    })
}
