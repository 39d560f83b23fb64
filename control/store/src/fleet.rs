//! Read-only figures for the fleet page (bc-control's `fleet.overview`): GPUs per node free and booked, and
//! reservations by state with the failed ones' errors. A few statements per page refresh.

use crate::{Store, StoreError};
use sqlx::Row;

/// A node's GPUs: present ones, and how many of those a reservation or an instance books.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeGpus {
    pub node_id: String,
    pub total: i64,
    pub booked: i64,
    /// The first GPU's model (by index).
    pub model: String,
}

/// A failed reservation and its error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedReservation {
    pub id: String,
    pub error: String,
}

impl Store {
    /// Present GPUs per node, with how many are booked (nodes without GPUs are absent).
    pub async fn node_gpus(&self) -> Result<Vec<NodeGpus>, StoreError> {
        let rows = sqlx::query(
            "SELECT node_id, count(*), count(reservation_id), \
                    (array_agg(model ORDER BY idx))[1] \
             FROM devices WHERE kind = 'gpu' AND present GROUP BY node_id ORDER BY node_id",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| NodeGpus {
                node_id: r.get(0),
                total: r.get(1),
                booked: r.get(2),
                model: r.get::<Option<String>, _>(3).unwrap_or_default(),
            })
            .collect())
    }

    /// Reservations by state (states without any are absent).
    pub async fn reservation_counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query("SELECT state, count(*) FROM reservations GROUP BY state")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The newest `limit` failed reservations with their error.
    pub async fn failed_reservations(
        &self,
        limit: i64,
    ) -> Result<Vec<FailedReservation>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, coalesce(error, '') FROM reservations WHERE state = 'failed' \
             ORDER BY coalesce(ended_at, created_at) DESC, id LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| FailedReservation {
                id: r.get(0),
                error: r.get(1),
            })
            .collect())
    }
}
