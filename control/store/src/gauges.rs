//! Read-only figures for the control plane's own metrics (bc-control's `telemetry`): how much work waits in each
//! queue, and which shard leases a process holds. The metrics themselves go to a time-series database, never into
//! PostgreSQL; these are a few counting queries per sampling interval.

use crate::{Store, StoreError};
use sqlx::Row;

/// Work waiting, by queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueDepths {
    /// Outbox rows the sink has not delivered (pokes to gateways).
    pub outbox: i64,
    /// Work-queue items whose time has come (reservation expiry, …) and that no owner has run yet.
    pub work_due: i64,
    /// Reservations admitted and not yet placed or failed.
    pub reservations_pending: i64,
    /// Commands not yet finished (pending or sent to the node).
    pub commands_open: i64,
}

impl Store {
    /// The queue depths, in one statement.
    pub async fn queue_depths(&self) -> Result<QueueDepths, StoreError> {
        let r = sqlx::query(
            "SELECT (SELECT count(*) FROM outbox), \
                    (SELECT count(*) FROM work_queue WHERE run_at <= now()), \
                    (SELECT count(*) FROM reservations WHERE state = 'pending'), \
                    (SELECT count(*) FROM commands WHERE state IN ('pending', 'sent'))",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(QueueDepths {
            outbox: r.get(0),
            work_due: r.get(1),
            reservations_pending: r.get(2),
            commands_open: r.get(3),
        })
    }

    /// How many unexpired shard leases `owner` holds, per role (roles where it holds none are absent).
    pub async fn leases_held(&self, owner: &str) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query(
            "SELECT role, count(*) FROM shard_leases WHERE owner = $1 AND expires_at > now() \
             GROUP BY role ORDER BY role",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}
