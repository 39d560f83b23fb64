//! The instances module's queries: its own tables (`instance_pools`, `instances`, `instance_idempotency`,
//! migration 1300), the atoms a hosted-pool node advertises (read from its inventory sections and its devices),
//! and the node's desired `instances` list with its outbox row, written in the transaction that changed it.

use bc_core::api::instances::{
    FreeAtoms, Instance, InstanceRequest, InstanceState, ObservedInstance, PoolClass, Power,
};
use bc_core::ids::{NodeId, TenantId};
use bc_store::StoreError;
use bc_store::sqlx::{self, PgConnection, Row, postgres::PgRow};

/// Channel the outbox sink listens on (bc-store's; repeated here only as its value).
const OUTBOX_WRITTEN_CHANNEL: &str = bc_store::reservations::OUTBOX_WRITTEN_CHANNEL;
/// Channel the reservation placer hears capacity changes on: a GPU an instance gave back is bookable again.
const CAPACITY_CHANNEL: &str = bc_store::reservations::CAPACITY_CHANNEL;

const COLUMNS: &str = "i.id, i.tenant_id, i.principal_id, i.state, i.request, i.node_id, i.gpus, i.power, \
                       i.reboots, i.generation, i.error, i.created_at, i.deleted_at";

fn ms(t: time::OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

/// An instance row, parsed once: a value this build cannot read is an error naming the row.
fn row_to_instance(r: &PgRow, at: usize) -> Result<Instance, StoreError> {
    let id: String = r.get(at);
    let corrupt = |what: &str, e: &dyn std::fmt::Display| {
        StoreError::Corrupt(format!("instance {id:?}: {what}: {e}"))
    };
    let state: String = r.get(at + 3);
    let power: String = r.get(at + 7);
    Ok(Instance {
        id: id.clone(),
        tenant: TenantId::new(r.get(at + 1)).map_err(|e| corrupt("tenant", &e))?,
        principal: r.get(at + 2),
        state: InstanceState::parse(&state)
            .ok_or_else(|| corrupt("state", &format!("unknown state {state:?}")))?,
        request: serde_json::from_value(r.get(at + 4)).map_err(|e| corrupt("request", &e))?,
        node: r
            .get::<Option<String>, _>(at + 5)
            .map(NodeId::new)
            .transpose()
            .map_err(|e| corrupt("node", &e))?,
        gpus: serde_json::from_value(r.get(at + 6)).map_err(|e| corrupt("gpus", &e))?,
        power: Power::parse(&power)
            .ok_or_else(|| corrupt("power", &format!("unknown power {power:?}")))?,
        reboots: r.get(at + 8),
        generation: r.get(at + 9),
        error: r.get(at + 10),
        observed: None,
        created_at_ms: ms(r.get(at + 11)),
        deleted_at_ms: r.get::<Option<time::OffsetDateTime>, _>(at + 12).map(ms),
    })
}

/// What tx 1 found.
pub enum Admission {
    Recorded,
    /// The key was used before: the stored body hash and the instance it created.
    Existing {
        body_hash: String,
        instance: Box<Instance>,
    },
}

/// Admission's tx 1 input.
pub struct NewInstance<'a> {
    pub id: &'a str,
    pub principal_id: &'a str,
    pub key: &'a str,
    pub body_hash: &'a str,
    pub request: &'a InstanceRequest,
}

/// The class of `pool` for instances: None when the pool exists but hosts none; NotFound when there is no pool.
pub async fn pool_class(pool: &sqlx::PgPool, id: &str) -> Result<Option<PoolClass>, StoreError> {
    let row: Option<(Option<String>,)> = sqlx::query_as(
        "SELECT c.class FROM pools p LEFT JOIN instance_pools c ON c.pool_id = p.id WHERE p.id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    match row {
        None => Err(StoreError::NotFound {
            what: "pool",
            id: id.to_string(),
        }),
        Some((class,)) => Ok(class.as_deref().and_then(PoolClass::parse)),
    }
}

pub async fn set_pool_class(
    pool: &sqlx::PgPool,
    id: &str,
    class: PoolClass,
) -> Result<(), StoreError> {
    let r = sqlx::query(
        "INSERT INTO instance_pools (pool_id, class) SELECT id, $2 FROM pools WHERE id = $1 \
         ON CONFLICT (pool_id) DO UPDATE SET class = EXCLUDED.class, updated_at = now()",
    )
    .bind(id)
    .bind(class.as_str())
    .execute(pool)
    .await?;
    if r.rows_affected() == 0 {
        return Err(StoreError::NotFound {
            what: "pool",
            id: id.to_string(),
        });
    }
    Ok(())
}

/// Admission's tx 1, one statement: records the idempotency key and the pending instance — or, when the key was
/// used before, returns what it recorded then.
pub async fn admit(pool: &sqlx::PgPool, n: NewInstance<'_>) -> Result<Admission, StoreError> {
    let request = serde_json::to_value(n.request)
        .map_err(|e| StoreError::Corrupt(format!("instance request: {e}")))?;
    let inserted: Result<i64, sqlx::Error> = sqlx::query_scalar(
        "WITH ins AS (INSERT INTO instance_idempotency (principal_id, key, body_hash, instance_id) \
           VALUES ($1, $2, $3, $4) ON CONFLICT (principal_id, key) DO NOTHING RETURNING instance_id), \
         i AS (INSERT INTO instances (id, tenant_id, principal_id, pool_id, request, state, vcpus, memory_mib, \
           disk_gib) SELECT $4, $5, $1, $6, $7, 'pending', $8, $9, $10 FROM ins RETURNING id) \
         SELECT count(*) FROM i",
    )
    .bind(n.principal_id)
    .bind(n.key)
    .bind(n.body_hash)
    .bind(n.id)
    .bind(&n.request.tenant)
    .bind(&n.request.pool)
    .bind(&request)
    .bind(n.request.vcpus as i32)
    .bind(n.request.memory_mib as i32)
    .bind(n.request.disk_gib as i32)
    .fetch_one(pool)
    .await;
    match inserted {
        Ok(1) => return Ok(Admission::Recorded),
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23503") => {
            return Err(StoreError::NotFound {
                what: "tenant or pool",
                id: format!("{}/{}", n.request.tenant, n.request.pool),
            });
        }
        Err(e) => return Err(e.into()),
    }
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT k.body_hash, {COLUMNS} FROM instance_idempotency k JOIN instances i ON i.id = k.instance_id \
         WHERE k.principal_id = $1 AND k.key = $2"
    )))
    .bind(n.principal_id)
    .bind(n.key)
    .fetch_optional(pool)
    .await?
    .ok_or_else(|| StoreError::Corrupt(format!("idempotency key {:?} has no instance", n.key)))?;
    Ok(Admission::Existing {
        body_hash: row.get(0),
        instance: Box::new(row_to_instance(&row, 1)?),
    })
}

pub async fn instance(pool: &sqlx::PgPool, id: &str) -> Result<Option<Instance>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM instances i WHERE i.id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    row.map(|r| row_to_instance(&r, 0)).transpose()
}

pub async fn list(
    pool: &sqlx::PgPool,
    tenant: Option<&str>,
    deleted: bool,
    limit: i64,
) -> Result<Vec<Instance>, StoreError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM instances i WHERE ($1::text IS NULL OR i.tenant_id = $1) \
         AND ($2 OR i.state <> 'deleted') ORDER BY i.created_at DESC LIMIT $3"
    )))
    .bind(tenant)
    .bind(deleted)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter().map(|r| row_to_instance(r, 0)).collect()
}

/// What the nodes last reported about `instances` (their `instances` inventory section), by instance id.
pub async fn observed(
    pool: &sqlx::PgPool,
    nodes: &[String],
) -> Result<std::collections::HashMap<String, ObservedInstance>, StoreError> {
    let rows: Vec<(serde_json::Value,)> = sqlx::query_as(
        "SELECT payload FROM inventory_sections WHERE node_id = ANY($1) AND name = 'instances'",
    )
    .bind(nodes)
    .fetch_all(pool)
    .await?;
    #[derive(serde::Deserialize)]
    struct Reported {
        id: String,
        #[serde(flatten)]
        observed: ObservedInstance,
    }
    #[derive(serde::Deserialize)]
    struct Section {
        #[serde(default)]
        instances: Vec<serde_json::Value>,
    }
    let mut out = std::collections::HashMap::new();
    for (payload,) in rows {
        // A report this build cannot read is left out (the node's section is its own business), not an error.
        let Ok(section) = serde_json::from_value::<Section>(payload) else {
            continue;
        };
        for v in section.instances {
            if let Ok(r) = serde_json::from_value::<Reported>(v) {
                out.insert(r.id, r.observed);
            }
        }
    }
    Ok(out)
}

/// The hosted-pool placement's candidates: every adopted node of `pool_id` (or only `node`) with its free atoms.
/// A node's capacity is what its inventory advertises: `cpu.threads` vCPUs, `memory.total_bytes` in MiB, the sum
/// of its fixed disks in GiB; the instances placed on it hold the rest. Its GPUs are its present, unbooked devices.
pub async fn free_atoms(
    conn: &mut PgConnection,
    pool_id: &str,
    node: Option<&str>,
) -> Result<Vec<FreeAtoms>, StoreError> {
    // One node: by its primary key (a generic `$2 IS NULL OR n.id = $2` would read the whole pool again).
    let only = if node.is_some() {
        "n.id = $2"
    } else {
        "$2::text IS NULL"
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT n.id, \
           COALESCE((c.payload->>'threads')::bigint, 0) - COALESCE(u.vcpus, 0), \
           COALESCE((m.payload->>'total_bytes')::bigint / 1048576, 0) - COALESCE(u.memory_mib, 0), \
           COALESCE(d.gib, 0) - COALESCE(u.disk_gib, 0), \
           (SELECT count(*) FROM devices g WHERE g.node_id = n.id AND g.present AND g.reservation_id IS NULL) \
         FROM nodes n \
         LEFT JOIN inventory_sections c ON c.node_id = n.id AND c.name = 'cpu' \
         LEFT JOIN inventory_sections m ON m.node_id = n.id AND m.name = 'memory' \
         LEFT JOIN LATERAL (SELECT (sum((x->>'size_bytes')::bigint) / 1073741824)::bigint AS gib \
             FROM inventory_sections k, jsonb_array_elements(k.payload->'disks') x \
             WHERE k.node_id = n.id AND k.name = 'disks' AND NOT COALESCE((x->>'removable')::boolean, false)) d ON true \
         LEFT JOIN LATERAL (SELECT sum(vcpus)::bigint AS vcpus, sum(memory_mib)::bigint AS memory_mib, \
             sum(disk_gib)::bigint AS disk_gib FROM instances i WHERE i.node_id = n.id AND i.state = 'placed') u ON true \
         WHERE n.pool_id = $1 AND n.state = 'adopted' AND {only}"
    )))
    .bind(pool_id)
    .bind(node)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .iter()
        .map(|r| FreeAtoms {
            node: r.get(0),
            vcpus: r.get(1),
            memory_mib: r.get(2),
            disk_gib: r.get(3),
            gpus: r.get(4),
        })
        .collect())
}

/// What [`lock_node`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLock {
    /// Locked for this transaction, and adopted.
    Held,
    /// Another transaction holds it (a concurrent placement, a drain, a reservation booking): try another.
    Busy,
    /// No longer adopted.
    Gone,
}

/// Locks `node` for a placement (`FOR UPDATE SKIP LOCKED`: placements on one node, drains and the reservation
/// placer's bookings, which hold it FOR KEY SHARE, take turns; a concurrent create moves on to another node
/// instead of queueing behind this one).
pub async fn lock_node(conn: &mut PgConnection, node: &str) -> Result<NodeLock, StoreError> {
    let state: Option<String> =
        sqlx::query_scalar("SELECT state FROM nodes WHERE id = $1 FOR UPDATE SKIP LOCKED")
            .bind(node)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(match state.as_deref() {
        Some("adopted") => NodeLock::Held,
        Some(_) => NodeLock::Gone,
        None => NodeLock::Busy,
    })
}

/// Books `count` free GPUs of `node` for instance `id` (SKIP LOCKED: a reservation booking one at the same
/// moment keeps it); returns their UUIDs, fewer than `count` when not enough were free.
pub async fn book_gpus(
    conn: &mut PgConnection,
    node: &str,
    id: &str,
    count: i64,
) -> Result<Vec<String>, StoreError> {
    if count == 0 {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_scalar(
        "UPDATE devices d SET reservation_id = $2 FROM (SELECT id FROM devices WHERE node_id = $1 AND present \
           AND reservation_id IS NULL ORDER BY idx LIMIT $3 FOR UPDATE SKIP LOCKED) f \
         WHERE d.id = f.id RETURNING d.uuid",
    )
    .bind(node)
    .bind(id)
    .bind(count)
    .fetch_all(&mut *conn)
    .await?)
}

/// Records a placement (only of a pending instance): true when it was.
pub async fn mark_placed(
    conn: &mut PgConnection,
    id: &str,
    node: &str,
    gpus: &[String],
) -> Result<bool, StoreError> {
    let n = sqlx::query(
        "UPDATE instances SET state = 'placed', node_id = $2, gpus = $3, placed_at = now(), error = NULL \
         WHERE id = $1 AND state = 'pending'",
    )
    .bind(id)
    .bind(node)
    .bind(serde_json::json!(gpus))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub async fn mark_failed(pool: &sqlx::PgPool, id: &str, error: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE instances SET state = 'failed', error = $2 WHERE id = $1 AND state = 'pending'",
    )
    .bind(id)
    .bind(error)
    .execute(pool)
    .await?;
    Ok(())
}

/// A change to a live instance's desired state, applied under its row lock.
pub enum Change {
    Power(Power),
    Reboot,
    Delete,
}

/// Applies `change` to instance `id` (not deleted), raising its generation; for a delete, gives its GPUs back.
/// Returns the node whose desired state must be published (None when the instance was never placed), or None
/// overall when there is no live instance `id`.
pub async fn change(
    conn: &mut PgConnection,
    id: &str,
    change: &Change,
) -> Result<Option<Option<String>>, StoreError> {
    let sql = match change {
        Change::Power(_) => {
            "UPDATE instances SET power = $2, generation = generation + 1 \
             WHERE id = $1 AND state <> 'deleted' RETURNING node_id, state"
        }
        Change::Reboot => {
            "UPDATE instances SET reboots = reboots + 1, generation = generation + 1 \
             WHERE id = $1 AND state <> 'deleted' RETURNING node_id, state"
        }
        Change::Delete => {
            "UPDATE instances SET state = 'deleted', deleted_at = now(), generation = generation + 1 \
             WHERE id = $1 AND state <> 'deleted' RETURNING node_id, state"
        }
    };
    let mut q = sqlx::query_as::<_, (Option<String>, String)>(sql).bind(id);
    if let Change::Power(p) = change {
        q = q.bind(p.as_str());
    }
    let row = q.fetch_optional(&mut *conn).await?;
    let Some((node, _)) = row else {
        return Ok(None);
    };
    if matches!(change, Change::Delete) {
        sqlx::query("UPDATE devices SET reservation_id = NULL WHERE reservation_id = $1")
            .bind(id)
            .execute(&mut *conn)
            .await?;
        if let Some(n) = &node {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(CAPACITY_CHANNEL)
                .bind(n)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(Some(node))
}

/// Sets `node`'s desired `instances` from the instances placed on it, raises its desired generation and writes its
/// outbox row, inside the caller's transaction (the change and its delivery commit together).
pub async fn publish(conn: &mut PgConnection, node: &str) -> Result<i64, StoreError> {
    let rows = sqlx::query(
        "SELECT id, generation, request, gpus, power, reboots FROM instances \
         WHERE node_id = $1 AND state = 'placed' ORDER BY id",
    )
    .bind(node)
    .fetch_all(&mut *conn)
    .await?;
    let mut list = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: String = r.get(0);
        let request: InstanceRequest = serde_json::from_value(r.get(2))
            .map_err(|e| StoreError::Corrupt(format!("instance {id:?}: request: {e}")))?;
        list.push(desired_entry(
            &id,
            r.get(1),
            &request,
            r.get(3),
            r.get::<String, _>(4).as_str(),
            r.get(5),
        ));
    }
    let generation: i64 = sqlx::query_scalar(
        "WITH n AS (UPDATE nodes SET desired_generation = desired_generation + 1, updated_at = now(), \
           desired_spec = jsonb_set(desired_spec, '{instances}', $2) WHERE id = $1 \
           RETURNING id, desired_generation), \
         o AS (INSERT INTO outbox (node_id, kind, generation) SELECT id, 'desired', desired_generation FROM n \
           RETURNING generation), \
         w AS (SELECT pg_notify($3, '') FROM o) \
         SELECT o.generation FROM o, (SELECT count(*) FROM w) x",
    )
    .bind(node)
    .bind(serde_json::Value::Array(list))
    .bind(OUTBOX_WRITTEN_CHANNEL)
    .fetch_one(&mut *conn)
    .await?;
    Ok(generation)
}

/// One instance as the node's desired state lists it (the contract of docs/instances.md).
pub fn desired_entry(
    id: &str,
    generation: i64,
    r: &InstanceRequest,
    gpus: serde_json::Value,
    power: &str,
    reboots: i64,
) -> serde_json::Value {
    let mut meta = serde_json::json!({ "ssh_keys": r.ssh_keys });
    if let Some(h) = &r.hostname {
        meta["hostname"] = serde_json::json!(h);
    }
    let mut v = serde_json::json!({
        "id": id,
        "generation": generation,
        "vcpus": r.vcpus,
        "memory_mib": r.memory_mib,
        "disk_gib": r.disk_gib,
        "image": {"url": r.image.url, "sha256": r.image.sha256},
        "meta": meta,
        "gpus": gpus,
        "power": power,
        "reboots": reboots,
    });
    if let Some(u) = &r.user_data {
        v["user_data"] = serde_json::json!(u);
    }
    v
}
