//! Tenants, principals with API keys, grants, and pools.

use crate::{Store, StoreError};
use bc_core::iam::Grant;
use sqlx::Row;

/// A principal as the API sees it after authenticating its key.
#[derive(Debug, Clone)]
pub struct Principal {
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub api_key_hash: String,
    pub tenant_is_root: bool,
    pub grants: Vec<Grant>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Pool {
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub allow_reclaim: bool,
    pub acceptance: serde_json::Value,
}

pub const ROOT_TENANT: &str = "root";

impl Store {
    /// Creates the root tenant if absent.
    pub async fn ensure_root_tenant(&self) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO tenants (id, name, is_root) VALUES ($1, 'root', true) ON CONFLICT (id) DO NOTHING")
            .bind(ROOT_TENANT)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Creates a (non-root) tenant if absent.
    pub async fn ensure_tenant(&self, id: &str, name: &str) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO tenants (id, name) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Creates a new principal with its grants; CONFLICT when the id is taken (an API caller must never replace
    /// another principal's key).
    pub async fn create_principal(
        &self,
        id: &str,
        tenant_id: &str,
        name: &str,
        api_key_id: &str,
        api_key_hash: &str,
        grants: &[Grant],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let created = sqlx::query(
            "INSERT INTO principals (id, tenant_id, name, api_key_id, api_key_hash) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(id)
        .bind(tenant_id)
        .bind(name)
        .bind(api_key_id)
        .bind(api_key_hash)
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.code().as_deref() == Some("23503") => StoreError::NotFound {
                what: "tenant",
                id: tenant_id.to_string(),
            },
            _ => e.into(),
        })?
        .rows_affected();
        if created == 0 {
            return Err(StoreError::Conflict(format!(
                "principal {id:?} already exists"
            )));
        }
        for g in grants {
            sqlx::query("INSERT INTO grants (principal_id, permission, scope) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                .bind(id)
                .bind(&g.permission)
                .bind(&g.scope)
                .execute(&mut *tx)
                .await?;
        }
        audit(
            &mut tx,
            "api",
            "principal.create",
            &format!("principal/{id}"),
            serde_json::json!({"tenant": tenant_id, "grants": grants.len()}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Creates (or replaces the key of) a principal, with its grants.
    pub async fn upsert_principal(
        &self,
        id: &str,
        tenant_id: &str,
        name: &str,
        api_key_id: &str,
        api_key_hash: &str,
        grants: &[Grant],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO principals (id, tenant_id, name, api_key_id, api_key_hash) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (id) DO UPDATE SET api_key_id = $4, api_key_hash = $5, disabled = false",
        )
        .bind(id)
        .bind(tenant_id)
        .bind(name)
        .bind(api_key_id)
        .bind(api_key_hash)
        .execute(&mut *tx)
        .await?;
        for g in grants {
            sqlx::query("INSERT INTO grants (principal_id, permission, scope) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                .bind(id)
                .bind(&g.permission)
                .bind(&g.scope)
                .execute(&mut *tx)
                .await?;
        }
        audit(
            &mut tx,
            "system",
            "principal.key-set",
            &format!("principal/{id}"),
            serde_json::json!({"api_key_id": api_key_id}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The enabled principal owning API key `api_key_id`, with its grants (one round trip).
    pub async fn principal_by_api_key(
        &self,
        api_key_id: &str,
    ) -> Result<Option<Principal>, StoreError> {
        let row = sqlx::query(
            "SELECT p.id, p.tenant_id, p.name, p.api_key_hash, t.is_root, \
                    COALESCE((SELECT jsonb_agg(jsonb_build_object('permission', g.permission, 'scope', g.scope)) \
                              FROM grants g WHERE g.principal_id = p.id), '[]'::jsonb) \
             FROM principals p JOIN tenants t ON t.id = p.tenant_id \
             WHERE p.api_key_id = $1 AND NOT p.disabled",
        )
        .bind(api_key_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let grants: serde_json::Value = row.get(5);
        let grants: Vec<Grant> =
            serde_json::from_value(grants).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        Ok(Some(Principal {
            id: row.get(0),
            tenant_id: row.get(1),
            name: row.get(2),
            api_key_hash: row.get::<Option<String>, _>(3).unwrap_or_default(),
            tenant_is_root: row.get(4),
            grants,
        }))
    }

    pub async fn ensure_pool(
        &self,
        id: &str,
        tenant_id: &str,
        name: &str,
        allow_reclaim: bool,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO pools (id, tenant_id, name, allow_reclaim) VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO NOTHING",
        )
        .bind(id)
        .bind(tenant_id)
        .bind(name)
        .bind(allow_reclaim)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn pool_by_id(&self, id: &str) -> Result<Pool, StoreError> {
        let row = sqlx::query(
            "SELECT id, tenant_id, name, allow_reclaim, acceptance FROM pools WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| StoreError::NotFound {
            what: "pool",
            id: id.to_string(),
        })?;
        Ok(Pool {
            id: row.get(0),
            tenant_id: row.get(1),
            name: row.get(2),
            allow_reclaim: row.get(3),
            acceptance: row.get(4),
        })
    }
}

impl Store {
    /// Tenants (one when `only` names it), by id.
    pub async fn list_tenants(
        &self,
        only: Option<&str>,
    ) -> Result<Vec<bc_core::api::iam::TenantInfo>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, name, is_root, created_at FROM tenants WHERE $1::text IS NULL OR id = $1 ORDER BY id",
        )
        .bind(only)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| bc_core::api::iam::TenantInfo {
                id: r.get(0),
                name: r.get(1),
                is_root: r.get(2),
                created_at_ms: crate::to_ms(r.get(3)),
            })
            .collect())
    }

    /// The principals of `tenant` with their grants (never a key's hash), by id.
    pub async fn list_principals(
        &self,
        tenant: &str,
    ) -> Result<Vec<bc_core::api::iam::PrincipalInfo>, StoreError> {
        let rows = sqlx::query(
            "SELECT p.id, p.tenant_id, p.name, p.api_key_id, p.disabled, p.created_at, \
               COALESCE(jsonb_agg(jsonb_build_object('permission', g.permission, 'scope', g.scope) \
                 ORDER BY g.permission, g.scope) FILTER (WHERE g.principal_id IS NOT NULL), '[]') \
             FROM principals p LEFT JOIN grants g ON g.principal_id = p.id \
             WHERE p.tenant_id = $1 GROUP BY p.id ORDER BY p.id",
        )
        .bind(tenant)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                let grants: serde_json::Value = r.get(6);
                Ok(bc_core::api::iam::PrincipalInfo {
                    grants: serde_json::from_value(grants).map_err(|e| {
                        StoreError::Corrupt(format!("grants of principal {id:?}: {e}"))
                    })?,
                    id,
                    tenant: r.get(1),
                    name: r.get(2),
                    api_key_id: r.get(3),
                    disabled: r.get(4),
                    created_at_ms: crate::to_ms(r.get(5)),
                })
            })
            .collect()
    }
}

/// Appends an audit event inside `tx`.
pub(crate) async fn audit(
    tx: &mut sqlx::PgConnection,
    actor: &str,
    action: &str,
    subject: &str,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_events (actor, action, subject, detail) VALUES ($1, $2, $3, $4)",
    )
    .bind(actor)
    .bind(action)
    .bind(subject)
    .bind(detail)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
