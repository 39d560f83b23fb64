//! What nodes did with their desired state: the failure a node reported while it cannot apply it (shown with the
//! node, as one of its conditions) and how far each placed reservation's booking has reached its nodes. Written by
//! [`Store::ack_desired`]; read here for the operator's views.

use crate::{Store, StoreError, to_ms};
use bc_core::reservation::{Delivery, node_delivery};
use sqlx::Row;
use std::collections::HashMap;

/// A node's desired state as far as it got.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DesiredStatus {
    pub node_id: String,
    pub desired_generation: i64,
    /// The newest generation the node applied.
    pub applied_generation: i64,
    /// The newest generation the node reported it could not apply (0: none).
    pub failed_generation: i64,
    /// The node's reason for that failure.
    pub message: Option<String>,
    /// When the current run of failures began (None while the node is not failing).
    pub failing_since_ms: Option<i64>,
}

impl DesiredStatus {
    /// Whether the node is failing to apply its desired state: its newest report for a generation newer than what
    /// it applied is a failure.
    pub fn failing(&self) -> bool {
        self.failed_generation > self.applied_generation
    }

    /// The condition an operator sees on the node while it is failing.
    pub fn condition(&self) -> Option<String> {
        self.failing().then(|| {
            format!(
                "desired state generation {} could not be applied: {} (the node retries with backoff; fix the cause \
                 on the node and it applies the newest generation)",
                self.failed_generation,
                self.message.as_deref().unwrap_or("no reason given")
            )
        })
    }
}

pub use bc_core::api::capacity::NodeDelivery;

impl Store {
    /// The desired-state status of `nodes` (those that exist), by node id.
    pub async fn desired_status(
        &self,
        nodes: &[String],
    ) -> Result<HashMap<String, DesiredStatus>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, desired_generation, acked_generation, failed_generation, ack_message, ack_failed_at \
             FROM nodes WHERE id = ANY($1)",
        )
        .bind(nodes)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let s = DesiredStatus {
                    node_id: r.get(0),
                    desired_generation: r.get(1),
                    applied_generation: r.get(2),
                    failed_generation: r.get(3),
                    message: r.get(4),
                    failing_since_ms: r.get::<Option<time::OffsetDateTime>, _>(5).map(to_ms),
                };
                let s = DesiredStatus {
                    failing_since_ms: s.failing_since_ms.filter(|_| s.failing()),
                    ..s
                };
                (s.node_id.clone(), s)
            })
            .collect())
    }

    /// Per placed reservation among `reservations`, how far its booking has reached each of its nodes (a
    /// reservation placed before generations were recorded counts as carried by generation 0).
    pub async fn deliveries(
        &self,
        reservations: &[String],
    ) -> Result<HashMap<String, Vec<NodeDelivery>>, StoreError> {
        let rows = sqlx::query(
            "SELECT r.id, n.id, COALESCE((r.generations ->> n.id)::bigint, 0), n.acked_generation, \
                    n.failed_generation, n.ack_message \
             FROM reservations r JOIN nodes n ON n.id = ANY(r.node_ids) \
             WHERE r.id = ANY($1) AND r.state = 'placed' ORDER BY r.id, n.id",
        )
        .bind(reservations)
        .fetch_all(&self.pool)
        .await?;
        let mut out: HashMap<String, Vec<NodeDelivery>> = HashMap::new();
        for r in &rows {
            let generation: i64 = r.get(2);
            let state = node_delivery(generation, r.get(3), r.get(4));
            let node: String = r.get(1);
            let node = bc_core::ids::NodeId::new(node)
                .map_err(|e| StoreError::Corrupt(format!("delivery of a reservation: {e}")))?;
            out.entry(r.get(0)).or_default().push(NodeDelivery {
                node,
                generation,
                state,
                message: (state == Delivery::Failed)
                    .then(|| r.get::<Option<String>, _>(5))
                    .flatten(),
            });
        }
        Ok(out)
    }
}
