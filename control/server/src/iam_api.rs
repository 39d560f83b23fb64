//! `tenants.create|list`, `principals.create|list` and `audit.list`: the IAM groups the server keeps. A caller acts only in its own
//! tenant unless it belongs to the root tenant, and hands out only grants it holds.

use crate::api::{ApiCode, ApiError, ApiState};
use bc_core::api::MAX_PAGE;
use bc_core::api::audit::{AuditEvents, ListAudit};
use bc_core::api::iam::{
    CreatePrincipal, CreateTenant, ListPrincipals, ListTenants, PrincipalCreated, Principals,
    Tenant, Tenants,
};
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

/// `tenants.list`: a root caller sees every tenant its grant reaches, any other caller at most its own.
pub async fn list_tenants(cx: Cx, _: ListTenants) -> Result<Tenants, ApiError> {
    let (state, p) = (cx.get::<ApiState>()?, cx.caller());
    let only = (!p.tenant_is_root).then_some(p.tenant_id.as_str());
    let tenants = state
        .store
        .list_tenants(only)
        .await?
        .into_iter()
        .filter(|t| cx.allows(&format!("tenant/{}", t.id)))
        .collect();
    Ok(Tenants { tenants })
}

/// `principals.list` of a tenant (the caller's own when the request names none; another only for root callers):
/// ids, names, grants and API key ids, never a key.
pub async fn list_principals(cx: Cx, req: ListPrincipals) -> Result<Principals, ApiError> {
    let (state, p) = (cx.get::<ApiState>()?, cx.caller());
    let tenant = req.tenant.unwrap_or_else(|| p.tenant_id.clone());
    body_tenant_check(p, &tenant)?;
    cx.authorize(&format!("tenant/{tenant}"))?;
    Ok(Principals {
        principals: state.store.list_principals(&tenant).await?,
    })
}

/// `audit.list`: newest first, filtered; `next` is the `before` of the next page.
pub async fn list_audit(cx: Cx, req: ListAudit) -> Result<AuditEvents, ApiError> {
    let state = cx.get::<ApiState>()?;
    let limit = req.limit.unwrap_or(MAX_PAGE).clamp(1, MAX_PAGE);
    let filter = bc_store::audit::AuditFilter {
        actor: req.actor.as_deref(),
        action: req.action.as_deref(),
        subject: req.subject.as_deref(),
        since_ms: req.since_ms,
        until_ms: req.until_ms,
        before_id: req.before,
    };
    // One more than asked tells whether a next page exists.
    let mut events = state
        .store
        .list_audit(&filter, i64::from(limit) + 1)
        .await?;
    let next = (events.len() > limit as usize).then(|| {
        events.truncate(limit as usize);
        events.last().map(|e| e.id)
    });
    Ok(AuditEvents {
        events,
        next: next.flatten(),
    })
}
