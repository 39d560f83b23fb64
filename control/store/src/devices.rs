//! Devices: the bookable GPUs derived from each node's `gpus` inventory section. A GPU UUID belongs to one node at
//! a time ([`bc_core::devices::plan_gpu_sync`] decides; the unique index `devices_one_holder` backs it): a second
//! live node reporting it gets a conflict (shown in its conditions, audited), not a second bookable device.

use crate::iam::audit;
use crate::reservations::CAPACITY_CHANNEL;
use crate::{Store, StoreError};
use bc_core::devices::{DeviceRow, GpuSync, ReportedGpu, plan_gpu_sync};
use sqlx::{PgConnection, Row};

/// The GPUs of a `gpus` inventory section (`{"gpus": [{"index", "uuid", "model", "clique"}]}`); entries without a
/// UUID are not devices.
pub fn reported_gpus(section: &serde_json::Value) -> Vec<ReportedGpu> {
    section["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| {
            let uuid = g["uuid"].as_str().filter(|u| !u.is_empty())?;
            Some(ReportedGpu {
                uuid: uuid.to_string(),
                index: g["index"]
                    .as_i64()
                    .and_then(|i| i32::try_from(i).ok())
                    .unwrap_or(0),
                model: g["model"].as_str().unwrap_or_default().to_string(),
                clique: g["clique"]
                    .as_str()
                    .filter(|c| !c.is_empty())
                    .map(str::to_string),
            })
        })
        .collect()
}

impl Store {
    /// Derives a node's devices from its `gpus` inventory section, in one transaction: GPUs no other live node holds
    /// become (or stay) bookable here; a GPU another live node holds is recorded as a conflict (not bookable, a
    /// condition on this node, an audit event the first time); GPUs no longer reported are marked absent (a booked
    /// one stays booked: its holder learns from the node's conditions, it is not silently moved) and handed to the
    /// node that waited longest for them. Returns the plan that was applied.
    pub async fn sync_gpu_devices(
        &self,
        node_id: &str,
        gpus: &serde_json::Value,
    ) -> Result<GpuSync, StoreError> {
        self.sync_reported_gpus(node_id, &reported_gpus(gpus)).await
    }

    /// [`Store::sync_gpu_devices`] of GPUs already read from the section (the inventory module reads it typed).
    pub async fn sync_reported_gpus(
        &self,
        node_id: &str,
        reported: &[ReportedGpu],
    ) -> Result<GpuSync, StoreError> {
        let mut tx = self.pool.begin().await?;
        let plan = sync_in(&mut tx, node_id, reported).await?;
        tx.commit().await?;
        Ok(plan)
    }
}

/// Releases every GPU of `node_id` (it is being revoked) inside the caller's transaction.
pub(crate) async fn release_all_in(
    tx: &mut PgConnection,
    node_id: &str,
) -> Result<GpuSync, StoreError> {
    sync_in(tx, node_id, &[]).await
}

async fn sync_in(
    tx: &mut PgConnection,
    node_id: &str,
    reported: &[ReportedGpu],
) -> Result<GpuSync, StoreError> {
    let mut uuids: Vec<String> = sqlx::query_scalar("SELECT uuid FROM devices WHERE node_id = $1")
        .bind(node_id)
        .fetch_all(&mut *tx)
        .await?;
    uuids.extend(reported.iter().map(|g| g.uuid.clone()));
    uuids.sort();
    uuids.dedup();
    if uuids.is_empty() {
        return Ok(GpuSync::default());
    }
    // Every decision about a UUID is taken under its lock, in one order: two nodes reporting one GPU at once are
    // decided one after the other.
    sqlx::query(
        "SELECT count(pg_advisory_xact_lock(k)) FROM \
         (SELECT hashtextextended('bc.gpu:' || u, 0) AS k FROM unnest($1::text[]) AS u ORDER BY 1) s",
    )
    .bind(&uuids)
    .fetch_one(&mut *tx)
    .await?;
    let rows = sqlx::query(
        "SELECT d.node_id, d.uuid, d.present, d.conflict_with, \
         (extract(epoch FROM d.conflict_since) * 1000)::bigint, n.state <> 'revoked' \
         FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.uuid = ANY($1)",
    )
    .bind(&uuids)
    .fetch_all(&mut *tx)
    .await?;
    let rows: Vec<DeviceRow> = rows
        .iter()
        .map(|r| DeviceRow {
            node_id: r.get(0),
            uuid: r.get(1),
            present: r.get(2),
            conflict_with: r.get(3),
            conflict_since_ms: r.get(4),
            node_live: r.get(5),
        })
        .collect();
    let plan = plan_gpu_sync(node_id, reported, &rows);
    apply(tx, node_id, &plan).await?;
    Ok(plan)
}

async fn apply(tx: &mut PgConnection, node_id: &str, plan: &GpuSync) -> Result<(), StoreError> {
    // Absent and evicted rows first: the unique index on present UUIDs must hold after every statement.
    if !plan.absent.is_empty() {
        sqlx::query(
            "UPDATE devices SET present = false, conflict_with = NULL, conflict_since = NULL \
             WHERE node_id = $1 AND uuid = ANY($2)",
        )
        .bind(node_id)
        .bind(&plan.absent)
        .execute(&mut *tx)
        .await?;
    }
    if !plan.evicted.is_empty() {
        let (nodes, uuids): (Vec<&str>, Vec<&str>) = plan
            .evicted
            .iter()
            .map(|(n, u)| (n.as_str(), u.as_str()))
            .unzip();
        sqlx::query(
            "UPDATE devices d SET present = false FROM unnest($1::text[], $2::text[]) AS x(n, u) \
             WHERE d.node_id = x.n AND d.uuid = x.u",
        )
        .bind(&nodes)
        .bind(&uuids)
        .execute(&mut *tx)
        .await?;
    }
    let all: Vec<(&ReportedGpu, Option<&str>)> = plan
        .held
        .iter()
        .map(|g| (g, None))
        .chain(plan.conflicted.iter().map(|(g, h)| (g, Some(h.as_str()))))
        .collect();
    if !all.is_empty() {
        let uuids: Vec<&str> = all.iter().map(|(g, _)| g.uuid.as_str()).collect();
        let idx: Vec<i32> = all.iter().map(|(g, _)| g.index).collect();
        let models: Vec<&str> = all.iter().map(|(g, _)| g.model.as_str()).collect();
        let cliques: Vec<Option<&str>> = all.iter().map(|(g, _)| g.clique.as_deref()).collect();
        let holders: Vec<Option<&str>> = all.iter().map(|(_, h)| *h).collect();
        sqlx::query(
            "INSERT INTO devices (id, node_id, idx, uuid, model, clique, present, conflict_with, conflict_since) \
             SELECT $1 || '/gpu/' || u, $1, i, u, m, c, h IS NULL, h, CASE WHEN h IS NULL THEN NULL ELSE now() END \
             FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::text[]) AS x(u, i, m, c, h) \
             ON CONFLICT (id) DO UPDATE SET idx = EXCLUDED.idx, model = EXCLUDED.model, clique = EXCLUDED.clique, \
               present = EXCLUDED.present, conflict_with = EXCLUDED.conflict_with, \
               conflict_since = CASE WHEN EXCLUDED.conflict_with IS NULL THEN NULL \
                 WHEN devices.conflict_with IS NOT DISTINCT FROM EXCLUDED.conflict_with THEN devices.conflict_since \
                 ELSE now() END",
        )
        .bind(node_id)
        .bind(&uuids)
        .bind(&idx)
        .bind(&models)
        .bind(&cliques)
        .bind(&holders)
        .execute(&mut *tx)
        .await?;
    }
    let mut touched = vec![node_id.to_string()];
    for h in &plan.handovers {
        sqlx::query(
            "UPDATE devices SET present = true, conflict_with = NULL, conflict_since = NULL \
             WHERE node_id = $1 AND uuid = $2",
        )
        .bind(&h.to_node)
        .bind(&h.uuid)
        .execute(&mut *tx)
        .await?;
        if !h.still_waiting.is_empty() {
            sqlx::query(
                "UPDATE devices SET conflict_with = $1 WHERE uuid = $2 AND node_id = ANY($3)",
            )
            .bind(&h.to_node)
            .bind(&h.uuid)
            .bind(&h.still_waiting)
            .execute(&mut *tx)
            .await?;
        }
        audit(
            tx,
            "controller/inventory",
            "gpu.handed-over",
            &format!("node/{}", h.to_node),
            serde_json::json!({"uuid": h.uuid, "from": node_id}),
        )
        .await?;
        touched.push(h.to_node.clone());
    }
    for (uuid, holder) in &plan.new_conflicts {
        tracing::warn!(
            node_id,
            uuid,
            holder,
            "GPU reported by two nodes: not bookable on the second"
        );
        audit(
            tx,
            "controller/inventory",
            "gpu.conflict",
            &format!("node/{node_id}"),
            serde_json::json!({"uuid": uuid, "held_by": holder}),
        )
        .await?;
    }
    sqlx::query("SELECT pg_notify($1, n) FROM unnest($2::text[]) AS n")
        .bind(CAPACITY_CHANNEL)
        .bind(&touched)
        .execute(&mut *tx)
        .await?;
    Ok(())
}
