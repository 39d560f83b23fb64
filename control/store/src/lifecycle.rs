//! The lifecycle controller's reads and writes: acceptance-check candidates, finished checks not yet acted on, and
//! the state transitions they lead to; commands past their deadline expire.

use crate::iam::audit;
use crate::{Store, StoreError};
use bc_core::api::nodes::{CommandState, UnknownCommandState};
use bc_core::ids::NodeId;
use bc_core::lifecycle::CheckCandidate;
use bc_core::node::{NodeState, UnknownState};
use sqlx::Row;

/// A finished acceptance-check command not yet acted on.
#[derive(Debug, Clone)]
pub struct DiagResult {
    pub command_id: String,
    pub node_id: String,
    pub node_state: NodeState,
    pub desired_generation: i64,
    /// Done, failed or expired.
    pub state: CommandState,
    pub result: Option<serde_json::Value>,
    pub error: Option<String>,
}

impl Store {
    /// Expires commands whose deadline is before `now_ms` (the controller's clock); returns how many.
    pub async fn expire_commands(&self, now_ms: i64) -> Result<u64, StoreError> {
        Ok(sqlx::query(
            "UPDATE commands SET state = 'expired', finished_at = to_timestamp($1 / 1000.0) \
             WHERE state IN ('pending', 'sent') AND deadline_at < to_timestamp($1 / 1000.0)",
        )
        .bind(now_ms as f64)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// What [`bc_core::lifecycle::needs_check`] decides acceptance checks of `kind` from, for the online failed
    /// nodes of `shards` (the caller's leased shards) and the online adopting ones whose GPU inventory arrived:
    /// whether the GPU inventory arrived, whether a check is open, when the last one finished. Returns (node id, GPU
    /// count claimed at join, the facts). An adopting node without its GPU inventory is left out, as `needs_check`
    /// would leave it: it waits on the node, whose inventory pokes the controller when it comes. Reading every such
    /// node with its three lookups took 147–242 ms a tick with 50,000 of them online (`scripts/bench sessions`, whose
    /// simulated nodes send no inventory) and 407–860 ms in its reconnect storm; 27–55 and 177–297 ms now.
    pub async fn check_candidates(
        &self,
        kind: &str,
        shards: &[i16],
    ) -> Result<Vec<(NodeId, i64, CheckCandidate)>, StoreError> {
        let rows = sqlx::query(
            "SELECT n.id, COALESCE(jsonb_array_length(n.claims -> 'gpus'), 0)::bigint, n.state, n.online, \
               EXISTS (SELECT 1 FROM inventory_sections s WHERE s.node_id = n.id AND s.name = 'gpus'), \
               EXISTS (SELECT 1 FROM commands c WHERE c.node_id = n.id AND c.kind = $1 \
                       AND (c.state IN ('pending', 'sent') OR c.consumed_at IS NULL)), \
               (SELECT (extract(epoch FROM max(c.finished_at)) * 1000)::bigint FROM commands c \
                 WHERE c.node_id = n.id AND c.kind = $1) \
             FROM nodes n WHERE n.online AND n.shard = ANY($2) AND (n.state = 'failed' OR (n.state = 'adopting' \
               AND EXISTS (SELECT 1 FROM inventory_sections s WHERE s.node_id = n.id AND s.name = 'gpus')))",
        )
        .bind(kind)
        .bind(shards)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                let corrupt =
                    |what: String| StoreError::Corrupt(format!("nodes row {id:?}: {what}"));
                let state: String = r.get(2);
                Ok((
                    NodeId::parse(&id).map_err(|e| corrupt(e.to_string()))?,
                    r.get(1),
                    CheckCandidate {
                        state: state
                            .parse()
                            .map_err(|e: UnknownState| corrupt(e.to_string()))?,
                        online: r.get(3),
                        gpu_inventory: r.get(4),
                        check_open: r.get(5),
                        last_check_finished_ms: r.get(6),
                    },
                ))
            })
            .collect()
    }

    /// Finished checks of nodes in `shards` not yet acted on.
    pub async fn unconsumed_results(
        &self,
        kind: &str,
        shards: &[i16],
    ) -> Result<Vec<DiagResult>, StoreError> {
        let rows = sqlx::query(
            "SELECT c.id, c.node_id, n.state, n.desired_generation, c.state, c.result, c.error \
             FROM commands c JOIN nodes n ON n.id = c.node_id \
             WHERE c.kind = $1 AND c.consumed_at IS NULL AND c.state IN ('done', 'failed', 'expired') \
             AND n.shard = ANY($2) ORDER BY c.finished_at LIMIT 1000",
        )
        .bind(kind)
        .bind(shards)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let command_id: String = r.get(0);
                let corrupt = |what: String| {
                    StoreError::Corrupt(format!(
                        "commands row {command_id:?} (with its node): {what}"
                    ))
                };
                let node_state: String = r.get(2);
                let state: String = r.get(4);
                Ok(DiagResult {
                    node_id: r.get(1),
                    node_state: node_state
                        .parse()
                        .map_err(|e: UnknownState| corrupt(e.to_string()))?,
                    desired_generation: r.get(3),
                    state: state
                        .parse()
                        .map_err(|e: UnknownCommandState| corrupt(e.to_string()))?,
                    result: r.get(5),
                    error: r.get(6),
                    command_id: command_id.clone(),
                })
            })
            .collect()
    }

    /// Applies a lifecycle transition decided from a command's result, and marks the result consumed, in one
    /// transaction. `new_state` None keeps the state; `desired` sets the desired generation and spec.
    pub async fn apply_lifecycle(
        &self,
        command_id: &str,
        node_id: &str,
        expected_state: &str,
        new_state: Option<&str>,
        conditions: &serde_json::Value,
        desired: Option<(i64, serde_json::Value)>,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let n = sqlx::query(
            "UPDATE nodes SET state = COALESCE($3, state), conditions = $4, \
             desired_generation = COALESCE($5, desired_generation), desired_spec = COALESCE($6, desired_spec), \
             updated_at = now() WHERE id = $1 AND state = $2",
        )
        .bind(node_id)
        .bind(expected_state)
        .bind(new_state)
        .bind(conditions)
        .bind(desired.as_ref().map(|d| d.0))
        .bind(desired.as_ref().map(|d| d.1.clone()))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query("UPDATE commands SET consumed_at = now() WHERE id = $1")
            .bind(command_id)
            .execute(&mut *tx)
            .await?;
        if n == 1 && desired.is_some() {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(crate::pokes::OUTBOX)
                .bind(node_id)
                .execute(&mut *tx)
                .await?;
        }
        if let Some(state) = new_state.filter(|s| *s != expected_state) {
            // Adoption or failure changes what is bookable on the node.
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(crate::reservations::CAPACITY_CHANNEL)
                .bind(node_id)
                .execute(&mut *tx)
                .await?;
            audit(
                &mut tx,
                "controller/lifecycle",
                &format!("node.{state}"),
                &format!("node/{node_id}"),
                serde_json::json!({"from": expected_state, "conditions": conditions, "command": command_id}),
            )
            .await?;
        }
        tx.commit().await?;
        Ok(n == 1)
    }
}
