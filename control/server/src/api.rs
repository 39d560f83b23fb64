//! The HTTP API: `POST /api/compute/{group}/{method}` with a JSON body and a bearer API key. Errors are
//! `{code, message}` with stable codes (INVALID_ARGUMENT, ACCESS_DENIED, NOT_FOUND, CONFLICT, UNAVAILABLE).

use crate::ca::Ca;
use axum::Json;

use bc_core::iam::allows;
use bc_core::join::Expectations;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::iam::Principal;
use bc_store::join_tokens::NewJoinToken;
use bc_store::reservations::NodeStateChange;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

#[derive(Clone)]
pub struct ApiState {
    pub store: Store,
    pub ca: Arc<Ca>,
    pub join_public_key: String,
    pub gateway_url: String,
    /// The sessions of this process's gateway role, when it runs one.
    pub sessions: Option<bc_gateway::session::Registry>,
    /// API calls waiting for the placer (None: this process does not admit reservations).
    pub decisions: Option<Arc<crate::admission::Decisions>>,
    /// Admission's tx 1, group-committed.
    pub admitter: Option<crate::admission::Admitter>,
    pub principals: Arc<PrincipalCache>,
}

/// Authenticated principals by API key id, kept [`PRINCIPAL_TTL`]: the hot path (and admission's pure checks)
/// need no database read. A disabled key or changed grant takes effect within the TTL.
#[derive(Default)]
pub struct PrincipalCache {
    entries: std::sync::Mutex<std::collections::HashMap<String, (Principal, std::time::Instant)>>,
}

pub const PRINCIPAL_TTL: std::time::Duration = std::time::Duration::from_secs(5);

impl PrincipalCache {
    fn get(&self, key_id: &str) -> Option<Principal> {
        let m = self.entries.lock().ok()?;
        let (p, at) = m.get(key_id)?;
        (at.elapsed() < PRINCIPAL_TTL).then(|| p.clone())
    }

    fn put(&self, key_id: &str, p: &Principal) {
        if let Ok(mut m) = self.entries.lock() {
            if m.len() > 100_000 {
                m.retain(|_, (_, at)| at.elapsed() < PRINCIPAL_TTL);
            }
            m.insert(key_id.to_string(), (p.clone(), std::time::Instant::now()));
        }
    }
}

pub use bc_kernel::router::BODY_DEADLINE;
pub use bc_kernel::{ApiCode, ApiError, MAX_BODY, check_strings, read_body};

/// The principal a bearer API key (as sent) names, or UNAUTHENTICATED saying why.
pub(crate) async fn authenticate_key(
    store: &Store,
    cache: &PrincipalCache,
    key: &str,
) -> Result<Principal, ApiError> {
    let unauth = |m: &str| ApiError::new(ApiCode::Unauthenticated, m.to_string());
    let key = Token::parse(TokenKind::ApiKey, key)
        .map_err(|e| unauth(&format!("malformed API key: {e}")))?;
    let principal = match cache.get(key.id()) {
        Some(p) => p,
        None => {
            let p = store
                .principal_by_api_key(key.id())
                .await?
                .ok_or_else(|| unauth("unknown API key"))?;
            cache.put(key.id(), &p);
            p
        }
    };
    if !key.secret().matches_hash(&principal.api_key_hash) {
        return Err(unauth("API key secret does not match"));
    }
    Ok(principal)
}

pub(crate) fn require(p: &Principal, permission: &str, scope: &str) -> Result<(), ApiError> {
    if allows(&p.grants, permission, scope) {
        Ok(())
    } else {
        Err(ApiError::denied(format!(
            "principal {} lacks {permission} on {scope}; ask an administrator for that grant",
            p.id
        )))
    }
}

pub(crate) fn parse<T: for<'de> Deserialize<'de>>(body: Value) -> Result<T, ApiError> {
    serde_json::from_value(body).map_err(|e| ApiError::invalid(format!("request body: {e}")))
}

/// Answers `group.method` for `principal` (already authenticated; each handler checks its own grant). The kernel
/// calls it for the groups the server registers ([`crate::plane`]) until each moves into its module crate.
pub(crate) async fn call(
    state: &ApiState,
    principal: &Principal,
    group: &str,
    method: &str,
    body: Value,
) -> Result<Json<Value>, ApiError> {
    match (group, method) {
        ("join-tokens", "create") => create_join_token(state, principal, parse(body)?).await,
        ("join-tokens", "list") => list_join_tokens(state, principal, parse(body)?).await,
        ("join-tokens", "revoke") => revoke_join_token(state, principal, parse(body)?).await,
        ("reservations", "create") => crate::admission::create(state, principal, body)
            .await
            .map(Json),
        ("reservations", "get") => crate::admission::get(state, principal, parse(body)?)
            .await
            .map(Json),
        ("reservations", "list") => crate::admission::list(state, principal, parse(body)?)
            .await
            .map(Json),
        ("reservations", "release") => crate::admission::release(state, principal, parse(body)?)
            .await
            .map(Json),
        ("tenants", "create") => crate::admission::create_tenant(state, principal, parse(body)?)
            .await
            .map(Json),
        ("principals", "create") => {
            crate::admission::create_principal(state, principal, parse(body)?)
                .await
                .map(Json)
        }
        ("nodes", "list") => list_nodes(state, principal).await,
        ("nodes", "get") => get_node(state, principal, parse(body)?).await,
        ("nodes", "drain") => set_node_state(state, principal, parse(body)?, NodeVerb::Drain).await,
        ("nodes", "undrain") => {
            set_node_state(state, principal, parse(body)?, NodeVerb::Undrain).await
        }
        ("nodes", "revoke") => {
            set_node_state(state, principal, parse(body)?, NodeVerb::Revoke).await
        }
        ("nodes", "command") => crate::commands_api::queue(state, principal, parse(body)?).await,
        ("commands", "get") => crate::commands_api::get(state, principal, parse(body)?).await,
        ("system", "stats") => {
            let s = state.sessions.as_ref().map(|r| r.stats());
            Ok(Json(json!({
                "gateway": s.map(|s| json!({
                    "sessions": s.sessions,
                    "opened": s.opened,
                    "liveness_writes": s.liveness_writes,
                    "pending_pulls": s.pending_pulls,
                    "revocation_reads": s.revocation_reads,
                    "revoked": s.revoked,
                })),
            })))
        }
        ("system", "info") => Ok(Json(json!({
            "trust_domain": state.ca.trust_domain(),
            "ca_pin": state.ca.pin(),
            "join_public_key": state.join_public_key,
            "gateway_url": state.gateway_url,
        }))),
        _ => Err(ApiError::not_found(format!("no method {group}.{method}"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateJoinToken {
    pool: String,
    #[serde(default = "one")]
    uses: i32,
    #[serde(default = "day")]
    ttl_seconds: i64,
    #[serde(default)]
    expect: Expectations,
    #[serde(default)]
    reclaim: bool,
}

fn one() -> i32 {
    1
}

fn day() -> i64 {
    86_400
}

async fn create_join_token(
    state: &ApiState,
    p: &Principal,
    req: CreateJoinToken,
) -> Result<Json<Value>, ApiError> {
    require(
        p,
        "compute:join-tokens:create",
        &format!("pool/{}", req.pool),
    )?;
    if !(1..=1_000_000).contains(&req.uses) {
        return Err(ApiError::invalid("uses must be between 1 and 1000000"));
    }
    if !(60..=365 * 86_400).contains(&req.ttl_seconds) {
        return Err(ApiError::invalid(
            "ttl_seconds must be between 60 and 31536000",
        ));
    }
    req.expect
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let pool = state.store.pool_by_id(&req.pool).await?;
    if req.reclaim && !pool.allow_reclaim {
        return Err(ApiError::invalid(format!(
            "pool {} does not allow reclaim",
            pool.id
        )));
    }
    let token =
        Token::generate(TokenKind::Join).map_err(|_| ApiError::unavailable("no randomness"))?;
    let expires_at_ms = now_ms() + req.ttl_seconds * 1000;
    state
        .store
        .create_join_token(NewJoinToken {
            id: token.id(),
            pool_id: &pool.id,
            secret_hash: &token.secret().hash(),
            uses: req.uses,
            expires_at_ms,
            expect: &req.expect,
            reclaim: req.reclaim,
            created_by: &format!("principal/{}", p.id),
        })
        .await?;
    Ok(Json(json!({
        "id": token.id(),
        "token": token.reveal(),
        "pool": pool.id,
        "uses": req.uses,
        "expires_at_ms": expires_at_ms,
        "reclaim": req.reclaim,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListJoinTokens {
    pool: Option<String>,
}

async fn list_join_tokens(
    state: &ApiState,
    p: &Principal,
    req: ListJoinTokens,
) -> Result<Json<Value>, ApiError> {
    let pools = req.pool.map(|p| vec![p]);
    let tokens = state.store.list_join_tokens(pools.as_deref()).await?;
    let visible: Vec<_> = tokens
        .into_iter()
        .filter(|t| {
            allows(
                &p.grants,
                "compute:join-tokens:list",
                &format!("pool/{}", t.pool_id),
            )
        })
        .collect();
    Ok(Json(json!({ "tokens": visible })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ById {
    id: String,
}

async fn revoke_join_token(
    state: &ApiState,
    p: &Principal,
    req: ById,
) -> Result<Json<Value>, ApiError> {
    let token = state
        .store
        .join_token(&req.id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("join token {:?} not found", req.id)))?;
    require(
        p,
        "compute:join-tokens:revoke",
        &format!("pool/{}", token.pool_id),
    )?;
    state
        .store
        .revoke_join_token(&req.id, &format!("principal/{}", p.id))
        .await?;
    Ok(Json(json!({"id": req.id, "revoked": true})))
}

/// Nodes as operators see them: with `desired_state` (desired and applied generations, and while the node cannot
/// apply it, the failed generation, the node's reason and since when) and that failure among its `conditions`.
async fn with_desired_state(
    state: &ApiState,
    nodes: Vec<bc_store::nodes::NodeRow>,
) -> Result<Vec<Value>, ApiError> {
    let ids: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
    let mut status = state.store.desired_status(&ids).await?;
    Ok(nodes
        .into_iter()
        .map(|n| {
            let s = status.remove(&n.id);
            let mut v = serde_json::to_value(n).unwrap_or_default();
            if let Some(s) = s {
                if let Some(c) = s.condition()
                    && let Some(conditions) = v["conditions"].as_array_mut()
                {
                    conditions.push(Value::String(c));
                }
                v["desired_state"] = json!({
                    "generation": s.desired_generation,
                    "applied_generation": s.applied_generation,
                    "failing": s.failing(),
                    "failed_generation": s.failed_generation,
                    "message": if s.failing() { s.message.clone() } else { None },
                    "failing_since_ms": s.failing_since_ms,
                });
            }
            v
        })
        .collect())
}

async fn list_nodes(state: &ApiState, p: &Principal) -> Result<Json<Value>, ApiError> {
    let nodes: Vec<_> = state
        .store
        .list_nodes()
        .await?
        .into_iter()
        .filter(|n| {
            allows(
                &p.grants,
                "compute:nodes:list",
                &format!("pool/{}", n.pool_id),
            )
        })
        .collect();
    Ok(Json(
        json!({ "nodes": with_desired_state(state, nodes).await? }),
    ))
}

async fn get_node(state: &ApiState, p: &Principal, req: ById) -> Result<Json<Value>, ApiError> {
    let node = state
        .store
        .node(&req.id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {:?} not found", req.id)))?;
    require(p, "compute:nodes:get", &format!("pool/{}", node.pool_id))?;
    let inventory: serde_json::Map<String, Value> = state
        .store
        .inventory(&node.id)
        .await?
        .into_iter()
        .map(|(name, _, payload)| (name, payload))
        .collect();
    let mut shown = with_desired_state(state, vec![node]).await?;
    Ok(Json(json!({ "node": shown.pop(), "inventory": inventory })))
}

/// The operator verbs on a node's state: `nodes.drain` (adopted → draining: no new bookings from the moment the
/// call returns; existing ones stay), `nodes.undrain` (draining → adopted), `nodes.revoke` (refused from now on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeVerb {
    Drain,
    Undrain,
    Revoke,
}

impl NodeVerb {
    fn name(self) -> &'static str {
        match self {
            NodeVerb::Drain => "drain",
            NodeVerb::Undrain => "undrain",
            NodeVerb::Revoke => "revoke",
        }
    }

    /// (states the verb applies to, the state it sets)
    fn transition(self) -> (&'static [&'static str], &'static str) {
        match self {
            NodeVerb::Drain => (&["adopted"], "draining"),
            NodeVerb::Undrain => (&["draining"], "adopted"),
            NodeVerb::Revoke => (&["adopting", "adopted", "draining", "failed"], "revoked"),
        }
    }
}

async fn set_node_state(
    state: &ApiState,
    p: &Principal,
    req: ById,
    verb: NodeVerb,
) -> Result<Json<Value>, ApiError> {
    let node = state
        .store
        .node(&req.id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {:?} not found", req.id)))?;
    require(
        p,
        &format!("compute:nodes:{}", verb.name()),
        &format!("pool/{}", node.pool_id),
    )?;
    let (from, to) = verb.transition();
    let change = state
        .store
        .set_node_schedulable(&node.id, from, to, &format!("principal/{}", p.id))
        .await?;
    let changed = match change {
        NodeStateChange::Changed { .. } => true,
        NodeStateChange::Unchanged => false,
        NodeStateChange::Refused { state: current } => {
            let why = match (verb, current.as_str()) {
                (_, "revoked") => format!("node {} is revoked; nothing to change", node.id),
                (NodeVerb::Drain, s) => format!(
                    "node {} is {s}: only an adopted node can be drained (a {s} node takes no bookings); drain it \
                     once it is adopted",
                    node.id
                ),
                (_, s) => format!(
                    "node {} is {s}, not draining: undrain returns a drained node to adopted",
                    node.id
                ),
            };
            return Err(ApiError::new(ApiCode::Conflict, why));
        }
    };
    // This process's gateway refuses the node from its next handshake and closes its session now; gateways in other
    // processes read the revocation on their own interval.
    if verb == NodeVerb::Revoke
        && let Some(sessions) = &state.sessions
        && let Ok(id) = bc_proto::spiffe::SpiffeId::new(
            state.ca.trust_domain(),
            bc_proto::spiffe::Role::Node,
            &node.id,
        )
    {
        sessions.revoke([id]);
    }
    Ok(Json(
        json!({"id": node.id, "state": to, "changed": changed}),
    ))
}

pub(crate) fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}
