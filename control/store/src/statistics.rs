//! Planner statistics for the tables that start empty and fill fast (reservations, idempotency keys, the work
//! queue, the outbox, and devices and nodes while a fleet joins).
//!
//! Why: sqlx prepares each statement once per pooled connection, and PostgreSQL keeps a statement's *generic*
//! plan (chosen after 5 executions when it looks no costlier than the custom ones) as long as the table's
//! statistics do not change. A statement first run while its table
//! was empty gets a generic plan that scans the table (cheap when it is empty) and keeps it while the table grows
//! to 100,000 rows, until autovacuum's first ANALYZE — which comes only after `autovacuum_naptime` (1 minute) — or
//! any later ANALYZE invalidates the plan. Measured: a fresh database admitted 2,411 reservations/s with p99 55 ms
//! at 1,000/s offered, against 4,465/s and p99 18 ms once statistics knew the tables had rows (BENCHMARKS.md).
//! A single ANALYZE after a table has a few thousand rows is enough: the plans made then are index lookups by
//! primary key, which stay right however much the table grows (autovacuum keeps the statistics from then on).
//!
//! [`Store::refresh_stale_statistics`] is the cheap check the controllers and the scheduler run every few seconds:
//! one catalog query, and an `ANALYZE` only of a table whose statistics still describe a nearly empty table while it
//! has filled.

use crate::{Store, StoreError};

/// The tables whose plans matter on the admission and booking paths.
pub const HOT_TABLES: &[&str] = &[
    "reservations",
    "idempotency",
    "work_queue",
    "outbox",
    "devices",
    "nodes",
];

/// A table smaller than this is cheap to scan whatever its plan: no ANALYZE for it. Statistics that describe at
/// least this many rows already give index lookups, which stay right as the table grows (the planner scales the
/// row estimate to the table's current size whenever it plans), so the check leaves such tables to autovacuum.
pub const MIN_ROWS: i64 = 1000;

/// A table is stale when its planner estimate (`pg_class.reltuples`: -1 before its first ANALYZE or VACUUM) is
/// below [`MIN_ROWS`] while its live rows are at least [`MIN_ROWS`] and this many times the estimate. So the
/// check analyzes a table once after it first fills (at a few thousand rows: milliseconds), once more only if it
/// was emptied and refilled, and never a large table that has statistics: ANALYZE of a large table is
/// autovacuum's (throttled) work, not the hot path's (measured: 464 ms at 28,000 reservations on the loaded
/// 2-core machine, when this rule re-analyzed on every fourfold growth).
pub const GROWTH: i64 = 4;

impl Store {
    /// ANALYZEs those of `tables` (in the current schema) whose planner estimate is below [`MIN_ROWS`] while they
    /// have at least [`MIN_ROWS`] live rows and [`GROWTH`] times the estimate; returns their names. Live rows come
    /// from the cumulative statistics (`pg_stat_user_tables.n_live_tup`, flushed by the writing backends within
    /// about a second).
    /// `ANALYZE (SKIP_LOCKED)`: a table that autovacuum or another process is analyzing right now is skipped, not
    /// waited for. A role that may not analyze a table (not its owner) gets a warning from PostgreSQL, no error.
    pub async fn refresh_stale_statistics(
        &self,
        tables: &[&str],
    ) -> Result<Vec<String>, StoreError> {
        let stale: Vec<String> = sqlx::query_scalar(
            "SELECT s.relname::text FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
             WHERE s.schemaname = current_schema() AND s.relname = ANY($1::text[]) \
             AND s.n_live_tup >= $2 AND c.reltuples < $2 AND c.reltuples * $3 < s.n_live_tup ORDER BY 1",
        )
        .bind(tables)
        .bind(MIN_ROWS)
        .bind(GROWTH as f64)
        .fetch_all(&self.pool)
        .await?;
        for table in &stale {
            let ident = format!("\"{}\"", table.replace('"', "\"\""));
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "ANALYZE (SKIP_LOCKED) {ident}"
            )))
            .execute(&self.pool)
            .await?;
        }
        Ok(stale)
    }

    /// The planner's row estimate of a table (`pg_class.reltuples`: -1 before its first ANALYZE or VACUUM).
    pub async fn planner_row_estimate(&self, table: &str) -> Result<f64, StoreError> {
        let n: f32 = sqlx::query_scalar(
            "SELECT c.reltuples FROM pg_class c WHERE c.oid = to_regclass(quote_ident($1))",
        )
        .bind(table)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| StoreError::NotFound {
            what: "table",
            id: table.to_string(),
        })?;
        Ok(f64::from(n))
    }
}
