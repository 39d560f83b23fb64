//! The HTTP API: `POST /api/compute/{group}/{method}` with a JSON body and a bearer API key. Errors are
//! `{code, message}` with stable codes (INVALID_ARGUMENT, ACCESS_DENIED, NOT_FOUND, CONFLICT, UNAVAILABLE).

use crate::ca::Ca;
use axum::Json;

use bc_core::iam::allows;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::iam::Principal;
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
        ("tenants", "create") => crate::iam_api::create_tenant(state, principal, parse(body)?)
            .await
            .map(Json),
        ("principals", "create") => {
            crate::iam_api::create_principal(state, principal, parse(body)?)
                .await
                .map(Json)
        }
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
