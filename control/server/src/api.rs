//! The HTTP API: `POST /api/compute/{group}/{method}` with a JSON body and a bearer API key. Errors are
//! `{code, message}` with stable codes (INVALID_ARGUMENT, ACCESS_DENIED, NOT_FOUND, CONFLICT, UNAVAILABLE).

use crate::ca::Ca;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bc_core::iam::allows;
use bc_core::join::Expectations;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::iam::Principal;
use bc_store::join_tokens::NewJoinToken;
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
    /// Seals secrets at rest (`secrets.put`).
    pub secrets: Arc<crate::secrets::SecretBox>,
    /// Where artifacts are stored (`PUT /api/artifacts`).
    pub artifacts: crate::artifacts::ArtifactDir,
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

#[derive(Debug)]
pub struct ApiError {
    code: &'static str,
    message: String,
}

impl ApiError {
    pub fn new(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new("INVALID_ARGUMENT", message)
    }

    pub(crate) fn denied(message: impl Into<String>) -> ApiError {
        ApiError::new("ACCESS_DENIED", message)
    }
}

impl From<bc_store::StoreError> for ApiError {
    fn from(e: bc_store::StoreError) -> ApiError {
        match e {
            bc_store::StoreError::NotFound { what, id } => {
                ApiError::new("NOT_FOUND", format!("{what} {id:?} not found"))
            }
            bc_store::StoreError::Conflict(m) => ApiError::new("CONFLICT", m),
            other => {
                tracing::error!(error = %other, source = ?std::error::Error::source(&other), "store error");
                ApiError::new("UNAVAILABLE", "the database is unavailable; retry later")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match self.code {
            "INVALID_ARGUMENT" | "INVALID_CONFIG" => StatusCode::BAD_REQUEST,
            "ACCESS_DENIED" => StatusCode::FORBIDDEN,
            "UNAUTHENTICATED" => StatusCode::UNAUTHORIZED,
            "NOT_FOUND" => StatusCode::NOT_FOUND,
            "CONFLICT" => StatusCode::CONFLICT,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        (
            status,
            Json(json!({"code": self.code, "message": self.message})),
        )
            .into_response()
    }
}

pub fn router(state: ApiState) -> axum::Router {
    axum::Router::new()
        .route(
            "/api/compute/{group}/{method}",
            axum::routing::post(dispatch),
        )
        .route("/api/artifacts", axum::routing::put(crate::artifacts::put))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .with_state(state)
}

pub(crate) async fn authenticate(
    store: &Store,
    cache: &PrincipalCache,
    headers: &HeaderMap,
) -> Result<Principal, ApiError> {
    let unauth = |m: &str| ApiError::new("UNAUTHENTICATED", m.to_string());
    let header = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| unauth("missing Authorization: Bearer <api key>"))?;
    let key = header
        .strip_prefix("Bearer ")
        .ok_or_else(|| unauth("Authorization must be Bearer <api key>"))?;
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

async fn dispatch(
    State(state): State<ApiState>,
    Path((group, method)): Path<(String, String)>,
    headers: HeaderMap,
    body: Option<Json<Value>>,
) -> Result<Json<Value>, ApiError> {
    let principal = authenticate(&state.store, &state.principals, &headers).await?;
    let body = body.map(|Json(v)| v).unwrap_or(json!({}));
    match (group.as_str(), method.as_str()) {
        ("join-tokens", "create") => create_join_token(&state, &principal, parse(body)?).await,
        ("join-tokens", "list") => list_join_tokens(&state, &principal, parse(body)?).await,
        ("join-tokens", "revoke") => revoke_join_token(&state, &principal, parse(body)?).await,
        ("reservations", "create") => crate::admission::create(&state, &principal, body)
            .await
            .map(Json),
        ("reservations", "get") => crate::admission::get(&state, &principal, parse(body)?)
            .await
            .map(Json),
        ("reservations", "list") => crate::admission::list(&state, &principal, parse(body)?)
            .await
            .map(Json),
        ("reservations", "release") => crate::admission::release(&state, &principal, parse(body)?)
            .await
            .map(Json),
        ("tenants", "create") => crate::admission::create_tenant(&state, &principal, parse(body)?)
            .await
            .map(Json),
        ("principals", "create") => {
            crate::admission::create_principal(&state, &principal, parse(body)?)
                .await
                .map(Json)
        }
        ("sites", _) | ("site-tokens", _) | ("machines", _) | ("secrets", _) => {
            crate::site_api::dispatch(&state, &principal, &group, &method, body).await
        }
        ("artifacts", "list") => crate::artifacts::list(&state, &principal).await,
        ("nodes", "list") => list_nodes(&state, &principal).await,
        ("nodes", "get") => get_node(&state, &principal, parse(body)?).await,
        ("nodes", "drain") => set_node_state(&state, &principal, parse(body)?, "draining").await,
        ("nodes", "revoke") => set_node_state(&state, &principal, parse(body)?, "revoked").await,
        ("nodes", "command") => crate::commands_api::queue(&state, &principal, parse(body)?).await,
        ("commands", "get") => crate::commands_api::get(&state, &principal, parse(body)?).await,
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
        _ => Err(ApiError::new(
            "NOT_FOUND",
            format!("no method {group}.{method}"),
        )),
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
    let token = Token::generate(TokenKind::Join)
        .map_err(|_| ApiError::new("UNAVAILABLE", "no randomness"))?;
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
    let token =
        state.store.join_token(&req.id).await?.ok_or_else(|| {
            ApiError::new("NOT_FOUND", format!("join token {:?} not found", req.id))
        })?;
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
    Ok(Json(json!({ "nodes": nodes })))
}

async fn get_node(state: &ApiState, p: &Principal, req: ById) -> Result<Json<Value>, ApiError> {
    let node = state
        .store
        .node(&req.id)
        .await?
        .ok_or_else(|| ApiError::new("NOT_FOUND", format!("node {:?} not found", req.id)))?;
    require(p, "compute:nodes:get", &format!("pool/{}", node.pool_id))?;
    let inventory: serde_json::Map<String, Value> = state
        .store
        .inventory(&node.id)
        .await?
        .into_iter()
        .map(|(name, _, payload)| (name, payload))
        .collect();
    Ok(Json(json!({ "node": node, "inventory": inventory })))
}

async fn set_node_state(
    state: &ApiState,
    p: &Principal,
    req: ById,
    to: &str,
) -> Result<Json<Value>, ApiError> {
    let node = state
        .store
        .node(&req.id)
        .await?
        .ok_or_else(|| ApiError::new("NOT_FOUND", format!("node {:?} not found", req.id)))?;
    let verb = if to == "revoked" { "revoke" } else { "drain" };
    require(
        p,
        &format!("compute:nodes:{verb}"),
        &format!("pool/{}", node.pool_id),
    )?;
    if !state
        .store
        .set_node_state(&node.id, to, &format!("principal/{}", p.id))
        .await?
    {
        return Err(ApiError::new(
            "CONFLICT",
            format!("node {} is revoked; nothing to change", node.id),
        ));
    }
    // This process's gateway refuses the node from its next handshake and closes its session now; gateways in other
    // processes read the revocation on their own interval.
    if to == "revoked"
        && let Some(sessions) = &state.sessions
        && let Ok(id) = bc_proto::spiffe::SpiffeId::new(
            state.ca.trust_domain(),
            bc_proto::spiffe::Role::Node,
            &node.id,
        )
    {
        sessions.revoke([id]);
    }
    Ok(Json(json!({"id": node.id, "state": to})))
}

pub(crate) fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}
