//! `tenants.create` and `principals.create`: the IAM groups the server keeps. A caller acts only in its own
//! tenant unless it belongs to the root tenant, and hands out only grants it holds.

use crate::api::{ApiCode, ApiError, ApiState};
use bc_core::api::iam::{CreatePrincipal, CreateTenant, PrincipalCreated, Tenant};
use bc_core::reservation::{tenant_allowed, valid_id};
use bc_kernel::{Caller, Cx};

fn body_tenant_check(p: &Caller, tenant: &str) -> Result<(), ApiError> {
    if tenant_allowed(&p.tenant_id, p.tenant_is_root, tenant) {
        Ok(())
    } else {
        Err(ApiError::new(
            ApiCode::AccessDenied,
            format!(
                "principal {} belongs to tenant {} and cannot act in tenant {tenant}",
                p.id, p.tenant_id
            ),
        ))
    }
}

/// `tenants.create` (the kernel has checked `compute:tenants:create` on `tenant/<id>`): root callers only.
pub async fn create_tenant(cx: Cx, req: CreateTenant) -> Result<Tenant, ApiError> {
    let (state, p) = (cx.get::<ApiState>()?, cx.caller());
    if !p.tenant_is_root {
        return Err(ApiError::new(
            ApiCode::AccessDenied,
            "only the root tenant creates tenants",
        ));
    }
    if !valid_id(&req.id) {
        return Err(ApiError::new(
            ApiCode::InvalidArgument,
            "id must be letters, digits, '-' or '_' (at most 64)",
        ));
    }
    let name = req.name.unwrap_or_else(|| req.id.clone());
    state.store.ensure_tenant(&req.id, &name).await?;
    Ok(Tenant { id: req.id, name })
}

/// `principals.create` (the kernel has checked `compute:principals:create` on `tenant/<tenant>`).
pub async fn create_principal(cx: Cx, req: CreatePrincipal) -> Result<PrincipalCreated, ApiError> {
    let (state, p) = (cx.get::<ApiState>()?, cx.caller());
    body_tenant_check(p, &req.tenant)?;
    if !valid_id(&req.id) {
        return Err(ApiError::new(
            ApiCode::InvalidArgument,
            "id must be letters, digits, '-' or '_' (at most 64)",
        ));
    }
    for (i, g) in req.grants.iter().enumerate() {
        if !valid_pattern(&g.permission) || !valid_pattern(&g.scope) {
            return Err(ApiError::invalid(format!(
                "grants[{i}]: permission and scope must be 1 to 256 visible ASCII characters (e.g. \
                 compute:nodes:get on pool/gpu-a)"
            )));
        }
    }
    // A non-root caller may hand out only grants scoped to its own tenant.
    if !p.tenant_is_root {
        let own = format!("tenant/{}", req.tenant);
        if let Some(g) = req.grants.iter().find(|g| g.scope != own) {
            return Err(ApiError::new(
                ApiCode::AccessDenied,
                format!("grant scope {:?} is outside tenant {}", g.scope, req.tenant),
            ));
        }
    }
    // Nobody hands out what it does not hold: each grant must be covered by one of the caller's own.
    if let Some(g) = bc_core::iam::first_uncovered(&p.grants, &req.grants) {
        return Err(ApiError::new(
            ApiCode::AccessDenied,
            format!(
                "principal {} cannot grant {} on {}: none of its own grants covers it (a principal grants only \
                 what it holds); ask a principal that holds it, or grant something narrower",
                p.id, g.permission, g.scope
            ),
        ));
    }
    let key = bc_proto::token::Token::generate(bc_proto::token::TokenKind::ApiKey)
        .map_err(|_| ApiError::new(ApiCode::Unavailable, "no randomness"))?;
    let name = req.name.unwrap_or_else(|| req.id.clone());
    state
        .store
        .create_principal(
            &req.id,
            &req.tenant,
            &name,
            key.id(),
            &key.secret().hash(),
            &req.grants,
        )
        .await?;
    Ok(PrincipalCreated {
        id: req.id,
        tenant: req.tenant,
        api_key: key.reveal(),
    })
}

/// A grant's permission or scope as stored: 1 to 256 visible ASCII characters.
fn valid_pattern(s: &str) -> bool {
    (1..=256).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic())
}
