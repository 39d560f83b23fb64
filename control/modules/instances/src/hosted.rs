//! What the instances reconciler does for hosted (`vps-host`) pools, each a set-based statement over the shards
//! this process leases (idempotent, row-locked with `SKIP LOCKED`, so a second process doing the same changes
//! nothing twice):
//!
//! - **Deletes are confirmed by the node.** `instances.delete` takes the instance off its node's desired state
//!   and leaves it `deleting`, still holding its vCPUs, memory, disk and GPUs. Once the node has applied that
//!   generation (`acked_generation`) and its `instances` inventory section no longer lists the instance (bcd drops
//!   it once the VM is gone and its GPUs are given back), the instance becomes `deleted` and its GPUs bookable.
//!   Past [`crate::Config::delete_deadline`] unconfirmed, the instance stays `deleting` (its GPUs may still be
//!   attached to a VM) and its `error` says so; a revoked node confirms nothing and needs nothing confirmed.
//! - **A revoked node's instances fail** with the reason, their GPUs unbooked and their atoms back (the node is
//!   gone; what ran there is lost). A draining or failed node keeps its instances, shown with the node's state in
//!   `node_state`, and gets no new one (placement takes only adopted nodes).

use crate::Instances;
use bc_core::shards::ShardLease;
use bc_store::StoreError;
use bc_store::sqlx;

const CAPACITY_CHANNEL: &str = bc_store::reservations::CAPACITY_CHANNEL;

/// What one step changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    pub confirmed: Vec<String>,
    pub overdue: Vec<String>,
    pub revoked: Vec<String>,
}

/// One step at `now_ms` over the instances of `leases`' shards.
pub async fn step(
    instances: &Instances,
    _worker: &str,
    leases: &[ShardLease],
    now_ms: i64,
) -> Result<Swept, StoreError> {
    let shards: Vec<i16> = leases.iter().map(|l| l.shard.get()).collect();
    if shards.is_empty() {
        return Ok(Swept::default());
    }
    let pool = instances.store.pool();
    let mut tx = pool.begin().await?;
    let confirmed: Vec<(String, String)> = sqlx::query_as(
        "WITH gone AS (SELECT i.id, i.node_id FROM instances i JOIN nodes n ON n.id = i.node_id \
           WHERE i.state = 'deleting' AND bc_shard(i.id) = ANY($1) AND (n.state = 'revoked' OR \
             (n.acked_generation >= COALESCE(i.removal_generation, 0) AND NOT EXISTS (SELECT 1 FROM inventory_sections s \
               WHERE s.node_id = i.node_id AND s.name = 'instances' \
                 AND jsonb_path_exists(s.payload, '$.instances[*] ? (@.id == $id)', jsonb_build_object('id', i.id))))) \
           FOR UPDATE OF i SKIP LOCKED), \
         g AS (UPDATE devices d SET reservation_id = NULL FROM gone \
           WHERE d.node_id = gone.node_id AND d.reservation_id = gone.id RETURNING d.id) \
         UPDATE instances i SET state = 'deleted', deleted_at = now(), error = NULL \
         FROM gone WHERE i.id = gone.id RETURNING i.id, gone.node_id",
    )
    .bind(&shards)
    .fetch_all(&mut *tx)
    .await?;
    let revoked: Vec<(String, String)> = sqlx::query_as(
        "WITH lost AS (SELECT i.id, i.node_id FROM instances i JOIN nodes n ON n.id = i.node_id \
           WHERE i.state = 'placed' AND n.state = 'revoked' AND bc_shard(i.id) = ANY($1) FOR UPDATE OF i SKIP LOCKED), \
         g AS (UPDATE devices d SET reservation_id = NULL FROM lost \
           WHERE d.node_id = lost.node_id AND d.reservation_id = lost.id RETURNING d.id) \
         UPDATE instances i SET state = 'failed', generation = i.generation + 1, \
           error = 'node ' || lost.node_id || ' was revoked: the instance is lost with it (its atoms are back in the \
pool); create it again' FROM lost WHERE i.id = lost.id RETURNING i.id, lost.node_id",
    )
    .bind(&shards)
    .fetch_all(&mut *tx)
    .await?;
    let mut nodes: Vec<&String> = confirmed.iter().chain(&revoked).map(|(_, n)| n).collect();
    nodes.sort();
    nodes.dedup();
    for n in nodes {
        sqlx::query("SELECT bc_instance_node_used($2), pg_notify($1, $2)")
            .bind(CAPACITY_CHANNEL)
            .bind(n)
            .execute(&mut *tx)
            .await?;
    }
    let deadline_ms = instances.config.delete_deadline.as_millis() as i64;
    let overdue: Vec<String> = sqlx::query_scalar(
        "UPDATE instances i SET error = 'node ' || i.node_id || ' has not confirmed that the VM is gone ' || \
           (($2 - (extract(epoch FROM i.deleting_at) * 1000)::bigint) / 1000) || ' s after the delete: its GPUs stay \
booked until it does (check the node: `better-compute nodes show ' || i.node_id || '`)' \
         WHERE i.state = 'deleting' AND i.node_id IS NOT NULL AND bc_shard(i.id) = ANY($1) \
           AND (extract(epoch FROM i.deleting_at) * 1000)::bigint + $3 < $2 AND i.error IS NULL RETURNING i.id",
    )
    .bind(&shards)
    .bind(now_ms)
    .bind(deadline_ms)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    for (id, node) in &confirmed {
        tracing::info!(
            instance = id,
            node,
            "instance deleted: the node confirmed the VM is gone"
        );
    }
    for (id, node) in &revoked {
        tracing::warn!(instance = id, node, "instance failed: its node was revoked");
    }
    for id in &overdue {
        tracing::warn!(
            instance = id,
            "instance delete not confirmed by its node past the deadline"
        );
    }
    Ok(Swept {
        confirmed: confirmed.into_iter().map(|(i, _)| i).collect(),
        overdue,
        revoked: revoked.into_iter().map(|(i, _)| i).collect(),
    })
}
