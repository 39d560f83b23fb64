//! The audit log as operators read it (`audit.list`): newest first, filtered by actor, action, subject and time,
//! paged by event id. Events are written where the change happens ([`crate::iam::audit`], in its transaction).

use crate::{Store, StoreError, from_ms, to_ms};
use bc_core::api::audit::{AuditEvent, like_pattern};
use sqlx::Row;

/// The filters of one page (see `bc_core::api::audit::ListAudit`).
#[derive(Debug, Clone, Default)]
pub struct AuditFilter<'a> {
    pub actor: Option<&'a str>,
    pub action: Option<&'a str>,
    pub subject: Option<&'a str>,
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
    pub before_id: Option<i64>,
}

impl Store {
    /// Up to `limit` events matching `f`, newest first.
    pub async fn list_audit(
        &self,
        f: &AuditFilter<'_>,
        limit: i64,
    ) -> Result<Vec<AuditEvent>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, at, actor, action, subject, detail FROM audit_events \
             WHERE ($1::text IS NULL OR actor = $1) \
               AND ($2::text IS NULL OR action LIKE $2) \
               AND ($3::text IS NULL OR subject LIKE $3) \
               AND ($4::timestamptz IS NULL OR at >= $4) \
               AND ($5::timestamptz IS NULL OR at < $5) \
               AND ($6::bigint IS NULL OR id < $6) \
             ORDER BY id DESC LIMIT $7",
        )
        .bind(f.actor)
        .bind(f.action.map(|a| like_pattern(a, '.')))
        .bind(f.subject.map(|s| like_pattern(s, '/')))
        .bind(f.since_ms.map(from_ms))
        .bind(f.until_ms.map(from_ms))
        .bind(f.before_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| AuditEvent {
                id: r.get(0),
                at_ms: to_ms(r.get(1)),
                actor: r.get(2),
                action: r.get(3),
                subject: r.get(4),
                detail: r.get(5),
            })
            .collect())
    }
}
