//! Secrets as operators see them (`secrets.list|delete`): names and metadata, never a value; putting and reading
//! the sealed value is in [`crate::sites`].

use crate::iam::audit;
use crate::{Store, StoreError, to_ms};
use bc_core::api::sites::SecretInfo;
use bc_core::ids::SiteId;
use sqlx::Row;

/// What `secrets.delete` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretDeletion {
    Deleted,
    NotFound,
    /// Metal machines (`metal/<mac>`) whose BMC credentials it is.
    InUse(Vec<String>),
}

impl Store {
    /// The secrets of `site` (all sites when None), by site and name.
    pub async fn list_secrets(&self, site: Option<&str>) -> Result<Vec<SecretInfo>, StoreError> {
        let rows = sqlx::query(
            "SELECT site_id, name, created_by, updated_at FROM secrets \
             WHERE $1::text IS NULL OR site_id = $1 ORDER BY site_id, name",
        )
        .bind(site)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let site: String = r.get(0);
                Ok(SecretInfo {
                    site_id: SiteId::new(site.clone()).map_err(|e| {
                        StoreError::Corrupt(format!("secrets row of site {site:?}: {e}"))
                    })?,
                    name: r.get(1),
                    created_by: r.get(2),
                    updated_at_ms: to_ms(r.get(3)),
                })
            })
            .collect()
    }

    /// Deletes a secret unless a metal machine of its site uses it as BMC credentials; audits it.
    pub async fn delete_secret(
        &self,
        site: &str,
        name: &str,
        actor: &str,
    ) -> Result<SecretDeletion, StoreError> {
        let mut tx = self.pool.begin().await?;
        let metal: bool = sqlx::query_scalar("SELECT to_regclass('metal_machines') IS NOT NULL")
            .fetch_one(&mut *tx)
            .await?;
        if metal {
            let users: Vec<String> = sqlx::query_scalar(
                "SELECT 'metal/' || mac FROM metal_machines WHERE site_id = $1 AND bmc_credentials = $2 \
                 ORDER BY mac",
            )
            .bind(site)
            .bind(name)
            .fetch_all(&mut *tx)
            .await?;
            if !users.is_empty() {
                return Ok(SecretDeletion::InUse(users));
            }
        }
        let n = sqlx::query("DELETE FROM secrets WHERE site_id = $1 AND name = $2")
            .bind(site)
            .bind(name)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
            return Ok(SecretDeletion::NotFound);
        }
        audit(
            &mut tx,
            actor,
            "secret.delete",
            &format!("site/{site}/secret/{name}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(SecretDeletion::Deleted)
    }
}
