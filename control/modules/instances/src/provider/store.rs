//! The provider workflow's rows (`instance_provider`, migration 1301): which instances are due, the fence and row
//! lock of a pass, and what a pass stores — its record, or the end of the instance's story.

use bc_core::api::instances::{InstanceRequest, InstanceState, ObservedInstance, Power};
use bc_core::provider::ProviderPool;
use bc_core::provider::workflow::{Desired, Outcome, Record, Step};
use bc_core::shards::ShardLease;
use bc_store::StoreError;
use bc_store::sqlx::{self, PgConnection, Row};

/// Notified when a provider instance has something new to do (created, changed, deleted).
pub const POKE: &str = "bc_instances";

/// An instance a pass works on, read under its row lock.
#[derive(Debug, Clone)]
pub struct Due {
    pub instance_id: String,
    pub state: InstanceState,
    pub power: Power,
    pub reboots: i64,
    pub generation: i64,
    pub request: InstanceRequest,
    pub created_ms: i64,
    pub pool: ProviderPool,
    pub record: Record,
}

impl Due {
    /// What the control plane wants: a deleted or failed instance is cleaned up at the provider.
    pub fn desired(&self) -> Desired {
        Desired {
            deleted: matches!(
                self.state,
                InstanceState::Deleting | InstanceState::Deleted | InstanceState::Failed
            ),
            power: self.power,
            reboots: self.reboots,
        }
    }
}

fn corrupt(id: &str, what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("instance {id:?}: {what}: {e}"))
}

/// The provider instances of `shards` due at `now_ms`, the most overdue first.
pub async fn scan_due(
    pool: &sqlx::PgPool,
    shards: &[i16],
    now_ms: i64,
) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT instance_id FROM instance_provider WHERE shard = ANY($1) AND next_at_ms <= $2 \
         ORDER BY next_at_ms LIMIT 256",
    )
    .bind(shards)
    .bind(now_ms)
    .fetch_all(pool)
    .await?)
}

/// Whether this process still holds the shard of instance `id` (the lease row held `FOR SHARE` until commit).
pub async fn fenced(
    tx: &mut PgConnection,
    role: &str,
    worker: &str,
    leases: &[ShardLease],
    id: &str,
) -> Result<bool, StoreError> {
    let shards: Vec<i16> = leases.iter().map(|l| l.shard.get()).collect();
    let fences: Vec<i64> = leases.iter().map(|l| l.fence).collect();
    let held: Option<i16> = sqlx::query_scalar(
        "SELECT l.shard FROM shard_leases l JOIN unnest($3::smallint[], $4::bigint[]) AS h(shard, fence) \
           ON l.shard = h.shard AND l.fence = h.fence \
         WHERE l.role = $1 AND l.owner = $2 AND l.expires_at > now() AND l.shard = bc_shard($5) FOR SHARE OF l",
    )
    .bind(role)
    .bind(worker)
    .bind(&shards)
    .bind(&fences)
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(held.is_some())
}

/// Locks instance `id`'s workflow row (`SKIP LOCKED`: None when another pass holds it, or it is gone). The row's
/// `next_at_ms` column, not the copy in its record, says when it is due: [`poke`] zeroes the column after a change
/// of the desired state, and the pass must then run at once. (Before, the pass read the record's copy, so a stop,
/// start or delete waited for the steady poll planned before it: 30 s.)
pub async fn lock_due(tx: &mut PgConnection, id: &str) -> Result<Option<Due>, StoreError> {
    let row = sqlx::query(
        "SELECT p.record, i.state, i.power, i.reboots, i.generation, i.request, \
           (extract(epoch FROM i.created_at) * 1000)::bigint, ip.provider, p.next_at_ms \
         FROM instance_provider p JOIN instances i ON i.id = p.instance_id \
           JOIN instance_pools ip ON ip.pool_id = p.pool_id \
         WHERE p.instance_id = $1 FOR UPDATE OF p SKIP LOCKED",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(r) = row else {
        return Ok(None);
    };
    let state: String = r.get(1);
    let power: String = r.get(2);
    let provider: Option<serde_json::Value> = r.get(7);
    let mut record: Record =
        serde_json::from_value(r.get(0)).map_err(|e| corrupt(id, "record", e))?;
    record.next_at_ms = r.get(8);
    Ok(Some(Due {
        instance_id: id.to_owned(),
        record,
        state: InstanceState::parse(&state).ok_or_else(|| corrupt(id, "state", &state))?,
        power: Power::parse(&power).ok_or_else(|| corrupt(id, "power", &power))?,
        reboots: r.get(3),
        generation: r.get(4),
        request: serde_json::from_value(r.get(5)).map_err(|e| corrupt(id, "request", e))?,
        created_ms: r.get(6),
        pool: provider
            .ok_or_else(|| corrupt(id, "pool", "is no longer a provider pool"))
            .and_then(|v| serde_json::from_value(v).map_err(|e| corrupt(id, "pool", e)))?,
    }))
}

/// Stores what a pass decided: the record and when it is next due; [`Outcome::Gone`] ends the workflow (a deleting
/// instance becomes deleted), [`Outcome::Failed`] fails a live instance with its reason (the workflow goes on to
/// clean up what exists of it).
pub async fn apply(tx: &mut PgConnection, due: &Due, step: &Step) -> Result<(), StoreError> {
    let id = due.instance_id.as_str();
    match &step.outcome {
        Some(Outcome::Gone) => {
            sqlx::query("DELETE FROM instance_provider WHERE instance_id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "UPDATE instances SET state = 'deleted', deleted_at = now() WHERE id = $1 AND state = 'deleting'",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?;
            return Ok(());
        }
        Some(Outcome::Failed(why)) => {
            sqlx::query(
                "UPDATE instances SET state = 'failed', error = $2 WHERE id = $1 AND state IN ('pending', 'placed')",
            )
            .bind(id)
            .bind(why)
            .execute(&mut *tx)
            .await?;
        }
        None => {}
    }
    let record = serde_json::to_value(&step.record).map_err(|e| corrupt(id, "record", e))?;
    sqlx::query(
        "UPDATE instance_provider SET record = $2, next_at_ms = $3, generation = $4, updated_at = now() \
         WHERE instance_id = $1",
    )
    .bind(id)
    .bind(record)
    .bind(step.record.next_at_ms)
    .bind(due.generation)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Hands a placed instance to the workflow (in the placing transaction) and pokes it.
pub async fn enqueue(tx: &mut PgConnection, id: &str, pool: &str) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO instance_provider (instance_id, shard, pool_id) VALUES ($1, bc_shard($1), $2) \
         ON CONFLICT (instance_id) DO NOTHING",
    )
    .bind(id)
    .bind(pool)
    .execute(&mut *tx)
    .await?;
    poke(tx, id).await
}

/// Makes instance `id`'s workflow row due now and wakes the workflow (after a change to its desired state).
pub async fn poke(tx: &mut PgConnection, id: &str) -> Result<(), StoreError> {
    sqlx::query(
        "WITH u AS (UPDATE instance_provider SET next_at_ms = 0 WHERE instance_id = $1 RETURNING 1) \
         SELECT pg_notify($2, $1) FROM u",
    )
    .bind(id)
    .bind(POKE)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What the workflow last saw of each of `ids` (those of provider pools), as the API shows it.
pub async fn observed(
    pool: &sqlx::PgPool,
    ids: &[String],
) -> Result<std::collections::HashMap<String, ObservedInstance>, StoreError> {
    let rows: Vec<(String, serde_json::Value, i64)> = sqlx::query_as(
        "SELECT instance_id, record, generation FROM instance_provider WHERE instance_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?;
    let mut out = std::collections::HashMap::new();
    for (id, record, generation) in rows {
        let Ok(r) = serde_json::from_value::<Record>(record) else {
            continue;
        };
        out.insert(
            id,
            ObservedInstance {
                generation,
                state: r
                    .state
                    .map(|s| s.as_str().to_owned())
                    .unwrap_or_else(|| "launching".into()),
                reason: r.reason,
                cloud_init_done: false,
                pid: None,
                accel: None,
                provider_id: r.provider_id,
            },
        );
    }
    Ok(out)
}
