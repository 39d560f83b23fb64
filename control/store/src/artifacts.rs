//! Artifacts: what the control plane knows of the content-addressed files in its state directory (name, size).
//! The bytes never enter the database.

use crate::iam::audit;
use crate::{Store, StoreError, to_ms};
use sqlx::Row;

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ArtifactRow {
    pub sha256: String,
    pub name: String,
    pub size: i64,
    pub created_by: String,
    pub created_at_ms: i64,
}

impl Store {
    /// Records an artifact whose file is already in place. Putting the same content again keeps the first row
    /// (the content is the identity) and returns it.
    pub async fn put_artifact(
        &self,
        sha256: &str,
        name: &str,
        size: i64,
        actor: &str,
    ) -> Result<ArtifactRow, StoreError> {
        let mut tx = self.pool.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO artifacts (sha256, name, size, created_by) VALUES ($1, $2, $3, $4)
             ON CONFLICT (sha256) DO NOTHING",
        )
        .bind(sha256)
        .bind(name)
        .bind(size)
        .bind(actor)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if inserted {
            audit(
                &mut tx,
                actor,
                "artifacts.put",
                &format!("artifact/{sha256}"),
                serde_json::json!({"name": name, "size": size}),
            )
            .await?;
        }
        tx.commit().await?;
        self.artifact(sha256)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "artifact",
                id: sha256.to_string(),
            })
    }

    pub async fn artifact(&self, sha256: &str) -> Result<Option<ArtifactRow>, StoreError> {
        let row = sqlx::query(
            "SELECT sha256, name, size, created_by, created_at FROM artifacts WHERE sha256 = $1",
        )
        .bind(sha256)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(artifact_row))
    }

    pub async fn list_artifacts(&self) -> Result<Vec<ArtifactRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT sha256, name, size, created_by, created_at FROM artifacts ORDER BY created_at, sha256",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(artifact_row).collect())
    }
}

/// What `artifacts.delete` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArtifactDeletion {
    Deleted,
    NotFound,
    /// Still referenced: by these machines' boot specs (`machine/<mac>`) and metal machines' records
    /// (`metal/<mac>`).
    Referenced(Vec<String>),
}

impl Store {
    /// Deletes the row of `sha256` (the caller removes the file after) unless a boot spec or a metal machine's
    /// record names `sha256:<hex>`; audits it. The referrers are read in the same transaction, with the machines'
    /// rows locked, so a boot spec set meanwhile waits for it.
    pub async fn delete_artifact(
        &self,
        sha256: &str,
        actor: &str,
    ) -> Result<ArtifactDeletion, StoreError> {
        let reference = format!("sha256:{sha256}");
        let mut tx = self.pool.begin().await?;
        let mut referrers: Vec<String> = sqlx::query_scalar(
            "SELECT 'machine/' || mac FROM machines WHERE boot->>'kernel' = $1 OR boot->>'initrd' = $1 \
             ORDER BY mac FOR UPDATE",
        )
        .bind(&reference)
        .fetch_all(&mut *tx)
        .await?;
        // The metal module's table, when its migration ran (a bare store in tests has none).
        let metal: bool = sqlx::query_scalar("SELECT to_regclass('metal_machines') IS NOT NULL")
            .fetch_one(&mut *tx)
            .await?;
        if metal {
            let like = format!("%{reference}%");
            referrers.extend(
                sqlx::query_scalar::<_, String>(
                    "SELECT 'metal/' || mac FROM metal_machines WHERE record::text LIKE $1 ORDER BY mac",
                )
                .bind(like)
                .fetch_all(&mut *tx)
                .await?,
            );
        }
        if !referrers.is_empty() {
            return Ok(ArtifactDeletion::Referenced(referrers));
        }
        let n = sqlx::query("DELETE FROM artifacts WHERE sha256 = $1")
            .bind(sha256)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
            return Ok(ArtifactDeletion::NotFound);
        }
        audit(
            &mut tx,
            actor,
            "artifacts.delete",
            &format!("artifact/{sha256}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(ArtifactDeletion::Deleted)
    }
}

fn artifact_row(r: &sqlx::postgres::PgRow) -> ArtifactRow {
    ArtifactRow {
        sha256: r.get(0),
        name: r.get(1),
        size: r.get(2),
        created_by: r.get(3),
        created_at_ms: to_ms(r.get(4)),
    }
}
