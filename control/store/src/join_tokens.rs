//! Join tokens: created by operators, spent by joins. Only the SHA-256 of the secret is stored.

use crate::iam::audit;
use crate::{Store, StoreError, from_ms, to_ms};
use bc_core::join::Expectations;
use sqlx::Row;

#[derive(Debug, Clone, serde::Serialize)]
pub struct JoinTokenRow {
    pub id: String,
    pub pool_id: String,
    #[serde(skip)]
    pub secret_hash: String,
    pub uses_total: i32,
    pub uses_left: i32,
    pub expires_at_ms: i64,
    pub revoked: bool,
    pub expect: Expectations,
    pub reclaim: bool,
    pub created_by: String,
    pub created_at_ms: i64,
}

pub struct NewJoinToken<'a> {
    pub id: &'a str,
    pub pool_id: &'a str,
    pub secret_hash: &'a str,
    pub uses: i32,
    pub expires_at_ms: i64,
    pub expect: &'a Expectations,
    pub reclaim: bool,
    pub created_by: &'a str,
}

const COLUMNS: &str = "id, pool_id, secret_hash, uses_total, uses_left, expires_at, revoked_at IS NOT NULL, expect, \
                       reclaim, created_by, created_at";

fn from_row(row: &sqlx::postgres::PgRow) -> Result<JoinTokenRow, StoreError> {
    Ok(JoinTokenRow {
        id: row.get(0),
        pool_id: row.get(1),
        secret_hash: row.get(2),
        uses_total: row.get(3),
        uses_left: row.get(4),
        expires_at_ms: to_ms(row.get(5)),
        revoked: row.get(6),
        expect: serde_json::from_value(row.get(7))
            .map_err(|e| StoreError::Corrupt(e.to_string()))?,
        reclaim: row.get(8),
        created_by: row.get(9),
        created_at_ms: to_ms(row.get(10)),
    })
}

impl Store {
    pub async fn create_join_token(&self, t: NewJoinToken<'_>) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO join_tokens (id, pool_id, secret_hash, uses_total, uses_left, expires_at, expect, reclaim, \
             created_by) VALUES ($1, $2, $3, $4, $4, $5, $6, $7, $8)",
        )
        .bind(t.id)
        .bind(t.pool_id)
        .bind(t.secret_hash)
        .bind(t.uses)
        .bind(from_ms(t.expires_at_ms))
        .bind(serde_json::to_value(t.expect).map_err(|e| StoreError::Corrupt(e.to_string()))?)
        .bind(t.reclaim)
        .bind(t.created_by)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            t.created_by,
            "join-token.created",
            &format!("join-token/{}", t.id),
            serde_json::json!({"pool": t.pool_id, "uses": t.uses, "reclaim": t.reclaim}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn join_token(&self, id: &str) -> Result<Option<JoinTokenRow>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM join_tokens WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Tokens of the given pools (all pools when `pools` is `None`), newest first.
    pub async fn list_join_tokens(
        &self,
        pools: Option<&[String]>,
    ) -> Result<Vec<JoinTokenRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM join_tokens WHERE $1::text[] IS NULL OR pool_id = ANY($1) ORDER BY created_at DESC"
        )))
        .bind(pools)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// Revokes a token; revoking twice is not an error. Returns false when no such token exists.
    pub async fn revoke_join_token(&self, id: &str, actor: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let n = sqlx::query(
            "UPDATE join_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            return Ok(false);
        }
        audit(
            &mut tx,
            actor,
            "join-token.revoked",
            &format!("join-token/{id}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }
}
