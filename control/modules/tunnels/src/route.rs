//! `GET /api/tunnels/{node}/{port}` with `Authorization: Bearer <api key>`, `Connection: upgrade` and
//! `Upgrade: bc-tunnel/1`: one tunnel connection to `port` on `node`. Checked in this order, each refusal a
//! `{code, message}` answer and an audit row, and nothing sent to the node before the last one passes:
//! the caller's key; the node; the grant `compute:tunnels:open` on `pool/<pool>`; the pool's port allowlist
//! (`tunnels.set-ports`); the caller's cap of open tunnels; the gateway (this process's, holding the node's
//! session). Then the gateway asks the node, and on the node's tunnel stream the answer is
//! `101 Switching Protocols` and the connection carries frames ([`crate::relay`]). The node's own refusals (its
//! allowlist, nothing listening) arrive as the first frame, a `close` with its code and reason.

use crate::queries::{self, Opening};
use crate::{OPEN, TunnelsState, relay};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bc_gateway::relay::{Peers, RelayError};
use bc_gateway::tunnel::{OpenError, Tunnels};
use bc_kernel::{ApiCode, ApiError, Route, RouterState};
use bc_proto::tunnel::UPGRADE;
use bc_store::gateways::NodeRoute;

pub(crate) fn route() -> Route {
    Route::new(
        "/api/tunnels/{node}/{port}",
        "GET",
        axum::routing::get(open),
    )
    .permission(OPEN)
    .doc(serde_json::json!({
        "operationId": "tunnels.open",
        "summary": "Open a tunnel to a port on a node",
        "description": "An HTTP/1.1 upgrade (`Connection: upgrade`, `Upgrade: bc-tunnel/1`): on `101 Switching \
            Protocols` the connection carries the tunnel's frames to `127.0.0.1:<port>` on the node \
            (`better-compute tunnel` speaks it). Checked in order, each refusal `{code, message}` and an audit \
            row: the key, the node, `compute:tunnels:open` on the node's `pool/<pool>`, the pool's port allowlist \
            (`tunnels.set-ports`), the caller's cap of open tunnels, the gateway holding the node's session.",
        "x-scope": "pool/<pool>",
        "parameters": [
            { "name": "node", "in": "path", "required": true, "description": "The node id.", "schema": { "type": "string" } },
            { "name": "port", "in": "path", "required": true, "description": "The TCP port on the node's loopback.", "schema": { "type": "integer", "minimum": 1, "maximum": 65535 } },
            { "name": "Upgrade", "in": "header", "required": true, "schema": { "type": "string", "const": UPGRADE } },
        ],
        "responses": {
            "101": { "description": "Switched: the connection is the tunnel." },
        },
    }))
}

async fn open(
    State(router): State<RouterState>,
    Path((node, port)): Path<(String, String)>,
    request: Request,
) -> Response {
    match accept(router, node, port, request).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn wants_upgrade(headers: &HeaderMap) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    has(header::CONNECTION, "upgrade") && has(header::UPGRADE, UPGRADE)
}

/// What a refusal before the node records as its outcome.
fn outcome_of(e: &ApiError) -> &'static str {
    match e.code() {
        ApiCode::AccessDenied => "ACCESS_DENIED",
        ApiCode::NotFound => "NOT_FOUND",
        ApiCode::FailedPrecondition => "LIMIT",
        ApiCode::Unavailable => "NOT_CONNECTED",
        _ => "UNAVAILABLE",
    }
}

async fn accept(
    router: RouterState,
    node: String,
    port: String,
    mut request: Request,
) -> Result<Response, ApiError> {
    let caller = router.authenticate(request.headers()).await?;
    if !wants_upgrade(request.headers()) {
        return Err(ApiError::invalid(format!(
            "a tunnel is an upgraded connection (Connection: upgrade, Upgrade: {UPGRADE}); use `better-compute tunnel <node> <port>`"
        )));
    }
    let port: u16 = port
        .parse()
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| ApiError::invalid(format!("{port:?} is not a TCP port (1 to 65535)")))?;
    let state = router.resources().require::<TunnelsState>()?.clone();
    let row = state.store.node(&node).await?.ok_or_else(|| {
        ApiError::not_found(format!(
            "no node {node:?}; list nodes with `better-compute nodes list`"
        ))
    })?;
    let pool = row.pool_id.to_string();
    let opening = Opening {
        principal: &caller.id,
        node: &node,
        pool: &pool,
        port,
        gateway: None,
    };
    let refuse = |e: ApiError| async {
        queries::start(&state.store, &opening, outcome_of(&e), e.message()).await?;
        Err::<Response, ApiError>(e)
    };
    if !caller.allows(OPEN, &format!("pool/{pool}")) {
        return refuse(ApiError::denied(format!(
            "principal {} lacks {OPEN} on pool/{pool}; ask an administrator for that grant",
            caller.id
        )))
        .await;
    }
    let allowed = queries::pool_ports(&state.store, &pool).await?;
    if !allowed.contains(&port) {
        return refuse(ApiError::denied(format!(
            "port {port} is not in pool {pool}'s tunnel allowlist {allowed:?}; an administrator adds it with \
             `better-compute tunnels set-ports {pool} <ports>`"
        )))
        .await;
    }
    let route = state.store.node_route(&node).await?;
    let via = match choose(&state, &node, route) {
        Ok(via) => via,
        Err(e) => return refuse(e).await,
    };
    let opening = Opening {
        gateway: Some(via.gateway()),
        ..opening
    };
    let cap = state.options.per_principal;
    let id = match queries::start_open(&state.store, &opening, &state.worker, cap).await? {
        Ok(id) => id,
        Err(held) => {
            let e = ApiError::new(
                ApiCode::FailedPrecondition,
                format!(
                    "principal {} already holds {held} tunnels open (at most {cap}, through every API process); \
                     close one, then retry",
                    caller.id
                ),
            );
            queries::start(&state.store, &opening, outcome_of(&e), e.message()).await?;
            return Err(e);
        }
    };
    let on_upgrade = hyper::upgrade::on(&mut request);
    let tunnel = match via.open(&node, port).await {
        Ok(t) => t,
        Err((code, outcome, why)) => {
            queries::stop(&state.store, id, 0, 0, outcome, &why).await?;
            return Err(ApiError::new(code, why));
        }
    };
    let (store, idle) = (state.store.clone(), state.options.idle);
    let who = (caller.id.clone(), node, port);
    tokio::spawn(async move {
        run(on_upgrade, tunnel, store, id, idle, who).await;
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let h = response.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static(UPGRADE));
    Ok(response)
}

/// The gateway a tunnel goes through.
enum Via {
    /// This process's gateway role.
    Local { id: String, tunnels: Tunnels },
    /// Another gateway process, through its relay URL.
    Remote {
        id: String,
        url: String,
        peers: Peers,
    },
}

impl Via {
    fn gateway(&self) -> &str {
        match self {
            Via::Local { id, .. } | Via::Remote { id, .. } => id,
        }
    }

    /// Opens the tunnel; a refusal as (code, audit outcome, reason).
    async fn open(
        &self,
        node: &str,
        port: u16,
    ) -> Result<bc_gateway::tunnel::Tunnel, (ApiCode, &'static str, String)> {
        let e = match self {
            Via::Local { tunnels, .. } => match tunnels.open(node, port).await {
                Ok(t) => return Ok(t),
                Err(e) => e,
            },
            Via::Remote { peers, url, id } => match peers.open(url, node, port).await {
                Ok(t) => return Ok(t),
                Err(RelayError::Refused(e)) => e,
                Err(e) => {
                    return Err((
                        ApiCode::Unavailable,
                        "UNREACHABLE",
                        format!(
                            "the node's session is held by gateway {id}, which this process cannot reach: {e}"
                        ),
                    ));
                }
            },
        };
        let (code, outcome) = match &e {
            OpenError::NotConnected(_) => (ApiCode::Unavailable, "NOT_CONNECTED"),
            OpenError::SessionBusy(_) | OpenError::NodeFull { .. } => {
                (ApiCode::FailedPrecondition, "LIMIT")
            }
            OpenError::DialTimeout { .. } => (ApiCode::Unavailable, "DIAL_TIMEOUT"),
            OpenError::Closed => (ApiCode::Unavailable, "ABORTED"),
        };
        let why = match &e {
            OpenError::NotConnected(_) => format!(
                "{e} (gateway {}); the node may be reconnecting: retry, or check `better-compute nodes get {node}`",
                self.gateway()
            ),
            _ => e.to_string(),
        };
        Err((code, outcome, why))
    }
}

/// Where the node's session is held, from its session row: this process's gateway, another one's relay, or a
/// refusal saying why neither.
fn choose(state: &TunnelsState, node: &str, route: Option<NodeRoute>) -> Result<Via, ApiError> {
    let not_connected = |why: String| ApiError::unavailable(why);
    let Some(route) = route else {
        return Err(ApiError::not_found(format!("no node {node:?}")));
    };
    let gateway = match (&route.gateway_id, route.online) {
        (Some(g), true) => g.clone(),
        _ => {
            return Err(not_connected(format!(
                "node {node} has no session (it is offline); a tunnel needs the node connected: check \
                 `better-compute nodes get {node}`"
            )));
        }
    };
    if let Some(local) = state.gateway.as_ref().filter(|l| l.id == gateway) {
        return Ok(Via::Local {
            id: gateway,
            tunnels: local.tunnels.clone(),
        });
    }
    let Some(peers) = state.peers.clone() else {
        return Err(not_connected(format!(
            "node {node}'s session is held by gateway {gateway}, and this process reaches no other gateway"
        )));
    };
    let Some(url) = route.relay_url else {
        return Err(not_connected(format!(
            "node {node}'s session is held by gateway {gateway}, which published no relay address"
        )));
    };
    Ok(Via::Remote {
        id: gateway,
        url,
        peers,
    })
}

/// Relays one accepted tunnel once the operator's connection is upgraded, then records its end.
async fn run(
    on_upgrade: hyper::upgrade::OnUpgrade,
    tunnel: bc_gateway::tunnel::Tunnel,
    store: bc_store::Store,
    id: uuid::Uuid,
    idle: std::time::Duration,
    (principal, node, port): (String, String, u16),
) {
    use std::sync::atomic::Ordering::Relaxed;
    let tunnel_id = tunnel.id.clone();
    let bytes = tunnel.bytes();
    let (tx, mut rx) = (tunnel.tx, tunnel.rx);
    let ended = match on_upgrade.await {
        Ok(upgraded) => {
            let io = hyper_util::rt::TokioIo::new(upgraded);
            relay::relay(io, &tx, &mut rx, idle).await
        }
        Err(e) => relay::Ended {
            outcome: "ABORTED".into(),
            reason: format!("the operator's upgrade failed: {e}"),
        },
    };
    let (up, down) = (bytes.up.load(Relaxed), bytes.down.load(Relaxed));
    tracing::info!(
        tunnel = tunnel_id,
        principal,
        node,
        port,
        from_node = up,
        to_node = down,
        outcome = ended.outcome,
        reason = ended.reason,
        "tunnel ended"
    );
    if let Err(e) = queries::stop(&store, id, up, down, &ended.outcome, &ended.reason).await {
        tracing::warn!(error = %e, tunnel = tunnel_id, "recording the end of a tunnel failed");
    }
    // What the relay sent last (a half-close, a close) may still be queued toward the node: end our side, then let
    // the far side end its own before dropping the stream (dropping it first would reset it).
    drop(tx);
    rx.finish(relay::FINISH).await;
}
