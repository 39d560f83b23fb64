//! What the server's own methods ([`crate::plane`]) read ([`ApiState`]), and API-key authentication with its
//! cache ([`PrincipalCache`], [`authenticate_key`]) behind the kernel's `Authenticator` ([`crate::backend`]). The
//! router, `{code, message}` errors and the methods of every group are the kernel's and the modules'.

use crate::ca::Ca;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::iam::Principal;
use std::sync::Arc;

#[derive(Clone)]
pub struct ApiState {
    pub store: Store,
    pub ca: Arc<Ca>,
    pub join_public_key: String,
    pub gateway_url: String,
    /// The sessions of this process's gateway role, when it runs one.
    pub sessions: Option<bc_gateway::session::Registry>,
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
