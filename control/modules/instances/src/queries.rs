//! The instances module's queries: its own tables (`instance_pools`, `instances`, `instance_idempotency`,
//! migration 1300), the atoms a hosted-pool node advertises (read from its inventory sections and its devices),
//! and the node's desired `instances` list with its outbox row, written in the transaction that changed it.

use bc_core::api::instances::{
    FreeAtoms, Instance, InstanceRequest, InstanceState, ObservedInstance, PoolClass, Power,
};
use bc_core::ids::{NodeId, TenantId};
use bc_core::provider::ProviderPool;
use bc_store::StoreError;
use bc_store::sqlx::{self, PgConnection, Row, postgres::PgRow};

/// Channel the outbox sink listens on (bc-store's; repeated here only as its value).
pub const OUTBOX_WRITTEN_CHANNEL: &str = bc_store::reservations::OUTBOX_WRITTEN_CHANNEL;

const COLUMNS: &str = "i.id, i.tenant_id, i.principal_id, i.state, i.request, i.node_id, i.gpus, i.power, \
                       i.reboots, i.generation, i.error, i.created_at, i.deleted_at, \
                       (SELECT n.state FROM nodes n WHERE n.id = i.node_id AND n.state <> 'adopted')";

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
        node_state: r.get(at + 13),
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
#[derive(Clone, Copy)]
pub struct NewInstance<'a> {
    pub id: &'a str,
    pub principal_id: &'a str,
    pub key: &'a str,
    pub body_hash: &'a str,
    pub request: &'a InstanceRequest,
}

/// The class of `pool` for instances (None when the pool exists but hosts none) and a provider pool's
/// configuration; NotFound when there is no pool.
pub async fn pool_class(
    conn: &mut PgConnection,
    id: &str,
) -> Result<(Option<PoolClass>, Option<ProviderPool>), StoreError> {
    let row: Option<(Option<String>, Option<serde_json::Value>)> = sqlx::query_as(
        "SELECT c.class, c.provider FROM pools p LEFT JOIN instance_pools c ON c.pool_id = p.id WHERE p.id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    match row {
        None => Err(StoreError::NotFound {
            what: "pool",
            id: id.to_string(),
        }),
        Some((class, provider)) => {
            let provider = provider
                .map(serde_json::from_value)
                .transpose()
                .map_err(|e| StoreError::Corrupt(format!("pool {id:?}: provider: {e}")))?;
            Ok((class.as_deref().and_then(PoolClass::parse), provider))
        }
    }
}

pub async fn set_pool_class(
    pool: &sqlx::PgPool,
    id: &str,
    class: PoolClass,
    provider: Option<&ProviderPool>,
) -> Result<(), StoreError> {
    let provider = provider
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("pool {id:?}: provider: {e}")))?;
    let r = sqlx::query(
        "INSERT INTO instance_pools (pool_id, class, provider) SELECT id, $2, $3 FROM pools WHERE id = $1 \
         ON CONFLICT (pool_id) DO UPDATE SET class = EXCLUDED.class, provider = EXCLUDED.provider, updated_at = now()",
    )
    .bind(id)
    .bind(class.as_str())
    .bind(provider)
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

/// Admission's tx 1 for a hosted (`vps-host`) pool, one statement: records the idempotency key and the pending
/// instance — or, when the key was used before, returns what it recorded then. The statement first checks that the
/// request's pool is a hosted pool and writes nothing when it is not (`None`): the class is a row the statement
/// reads, never a cached value, at no extra round trip.
pub async fn admit_if_hosted(
    conn: &mut PgConnection,
    n: NewInstance<'_>,
) -> Result<Option<Admission>, StoreError> {
    match record(conn, n, true).await? {
        (false, _) => Ok(None),
        (true, inserted) => outcome(conn, n, inserted).await.map(Some),
    }
}

/// Admission's tx 1 for a pool of any class, whose class the caller has read and accepted: as
/// [`admit_if_hosted`], without the class check.
pub async fn admit(conn: &mut PgConnection, n: NewInstance<'_>) -> Result<Admission, StoreError> {
    // Without the class check the statement's condition holds: only the count decides.
    let (_, inserted) = record(conn, n, false).await?;
    outcome(conn, n, inserted).await
}

/// Tx 1's statement: whether the pool passed the class check (always, without `hosted_only`) and how many
/// instances it inserted (0 when the key was used before).
async fn record(
    conn: &mut PgConnection,
    n: NewInstance<'_>,
    hosted_only: bool,
) -> Result<(bool, i64), StoreError> {
    let request = serde_json::to_value(n.request)
        .map_err(|e| StoreError::Corrupt(format!("instance request: {e}")))?;
    sqlx::query_as(
        "WITH c AS (SELECT 1 WHERE NOT $11 OR EXISTS (SELECT 1 FROM instance_pools WHERE pool_id = $6 \
           AND class = 'vps-host')), \
         ins AS (INSERT INTO instance_idempotency (principal_id, key, body_hash, instance_id) \
           SELECT $1, $2, $3, $4 FROM c ON CONFLICT (principal_id, key) DO NOTHING RETURNING instance_id), \
         i AS (INSERT INTO instances (id, tenant_id, principal_id, pool_id, request, state, vcpus, memory_mib, \
           disk_gib) SELECT $4, $5, $1, $6, $7, 'pending', $8, $9, $10 FROM ins RETURNING id) \
         SELECT EXISTS (SELECT 1 FROM c), (SELECT count(*) FROM i)",
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
    .bind(hosted_only)
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| tenant_or_pool_missing(e, n.request))
}

/// What tx 1 did: recorded the instance, or found the key's earlier one.
async fn outcome(
    conn: &mut PgConnection,
    n: NewInstance<'_>,
    inserted: i64,
) -> Result<Admission, StoreError> {
    if inserted == 1 {
        Ok(Admission::Recorded)
    } else {
        existing(conn, n.principal_id, n.key).await
    }
}

/// A foreign-key violation of tx 1 as NotFound naming the tenant and pool; any other error as it is.
fn tenant_or_pool_missing(e: sqlx::Error, r: &InstanceRequest) -> StoreError {
    match e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("23503") => StoreError::NotFound {
            what: "tenant or pool",
            id: format!("{}/{}", r.tenant, r.pool),
        },
        e => e.into(),
    }
}

/// The instance an idempotency key created, with the body hash stored with the key.
async fn existing(
    conn: &mut PgConnection,
    principal_id: &str,
    key: &str,
) -> Result<Admission, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT k.body_hash, {COLUMNS} FROM instance_idempotency k JOIN instances i ON i.id = k.instance_id \
         WHERE k.principal_id = $1 AND k.key = $2"
    )))
    .bind(principal_id)
    .bind(key)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(|| StoreError::Corrupt(format!("idempotency key {key:?} has no instance")))?;
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

const FITS: &str = "f.pool_id = $1 AND f.free_vcpus >= $2 AND f.free_memory_mib >= $3 AND f.free_disk_gib >= $4 \
    AND n.state = 'adopted' AND f.node_id <> ALL($6) AND ($5 = 0 OR (SELECT count(*) FROM devices g \
      WHERE g.node_id = f.node_id AND g.present AND g.reservation_id IS NULL) >= $5)";

/// Claims the node `r` goes on and books its vCPUs, memory and disk there, in one statement: the fullest adopted
/// node of its pool that still fits (bc-core's `choose_node` order: least vCPUs free, then memory, disk, node id),
/// walked on `instance_node_free`'s index and locked for this transaction — its free-atoms row `FOR NO KEY UPDATE`
/// and its node `FOR SHARE` (a drain waits for the placement), both `SKIP LOCKED`: a node another placement holds is
/// passed over, never waited for. None when no node that fits is free now (see [`any_fits`]). `skip`: nodes this
/// placement already found short of GPUs. A placement that does not go on (too few GPUs free) rolls the booking
/// back with its transaction.
pub async fn claim_node(
    conn: &mut PgConnection,
    r: &InstanceRequest,
    skip: &[String],
) -> Result<Option<String>, StoreError> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "WITH c AS (SELECT f.node_id FROM instance_node_free f JOIN nodes n ON n.id = f.node_id WHERE {FITS} \
           ORDER BY f.free_vcpus, f.free_memory_mib, f.free_disk_gib, f.node_id \
           LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED FOR SHARE OF n SKIP LOCKED) \
         UPDATE instance_node_free f SET used_vcpus = f.used_vcpus + $2, used_memory_mib = f.used_memory_mib + $3, \
           used_disk_gib = f.used_disk_gib + $4 FROM c WHERE f.node_id = c.node_id RETURNING f.node_id"
    )))
    .bind(&r.pool)
    .bind(i64::from(r.vcpus))
    .bind(i64::from(r.memory_mib))
    .bind(i64::from(r.disk_gib))
    .bind(i64::from(r.gpus))
    .bind(skip)
    .fetch_optional(&mut *conn)
    .await?)
}

/// A whole placement without GPUs as one statement, its own transaction (no BEGIN, no COMMIT, no second
/// statement: on this 2-core machine most of PostgreSQL's time under admission load was the kernel's, per round
/// trip): claims the node as [`claim_node`] does, records the placement, books the atoms and publishes as
/// [`place_and_publish`] does. None (nothing written) when no node that fits is free right now or the instance
/// is no longer pending: the caller then takes the general path, which tells the two apart.
pub async fn place_without_gpus(
    conn: &mut PgConnection,
    r: &InstanceRequest,
    id: &str,
    entry: serde_json::Value,
) -> Result<Option<Instance>, StoreError> {
    let no_skip: &[String] = &[];
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH c AS (SELECT f.node_id FROM instance_node_free f JOIN nodes n ON n.id = f.node_id WHERE {FITS} \
           ORDER BY f.free_vcpus, f.free_memory_mib, f.free_disk_gib, f.node_id \
           LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED FOR SHARE OF n SKIP LOCKED), \
         placed AS (UPDATE instances i SET state = 'placed', node_id = c.node_id, gpus = '[]', placed_at = now(), \
           error = NULL FROM c WHERE i.id = $7 AND i.state = 'pending' RETURNING {COLUMNS}), \
         hold AS (UPDATE instance_node_free f SET used_vcpus = f.used_vcpus + $2, \
           used_memory_mib = f.used_memory_mib + $3, used_disk_gib = f.used_disk_gib + $4 \
           FROM placed p WHERE f.node_id = p.node_id), \
         {} \
         SELECT * FROM placed",
        append_ctes(8)
    )))
    .bind(&r.pool)
    .bind(i64::from(r.vcpus))
    .bind(i64::from(r.memory_mib))
    .bind(i64::from(r.disk_gib))
    .bind(i64::from(r.gpus))
    .bind(no_skip)
    .bind(id)
    .bind(entry)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|r| row_to_instance(&r, 0)).transpose()
}

/// Whether some node of `r`'s pool fits it, locked or not (after [`claim_node`] found none free: busy or full).
pub async fn any_fits(
    pool: &sqlx::PgPool,
    r: &InstanceRequest,
    skip: &[String],
) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM instance_node_free f JOIN nodes n ON n.id = f.node_id WHERE {FITS})"
    )))
    .bind(&r.pool)
    .bind(i64::from(r.vcpus))
    .bind(i64::from(r.memory_mib))
    .bind(i64::from(r.disk_gib))
    .bind(i64::from(r.gpus))
    .bind(skip)
    .fetch_one(pool)
    .await?)
}

/// Every adopted node of `pool_id` with its free atoms (for the answer of a create that found no node).
pub async fn free_atoms(pool: &sqlx::PgPool, pool_id: &str) -> Result<Vec<FreeAtoms>, StoreError> {
    let rows = sqlx::query(
        "SELECT f.node_id, f.free_vcpus, f.free_memory_mib, f.free_disk_gib, \
           (SELECT count(*) FROM devices g WHERE g.node_id = f.node_id AND g.present AND g.reservation_id IS NULL) \
         FROM instance_node_free f JOIN nodes n ON n.id = f.node_id WHERE f.pool_id = $1 AND n.state = 'adopted'",
    )
    .bind(pool_id)
    .fetch_all(pool)
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

/// What [`change`] did to a live instance.
pub struct Changed {
    /// The node whose desired state must be published (a placed hosted instance's).
    pub node: Option<String>,
    /// Its state after the change (`Deleting` for a delete that its node or provider must confirm).
    pub state: InstanceState,
}

/// Applies `change` to instance `id` if it is live (not deleting or deleted), raising its generation; None when it
/// is not. A delete of a placed instance leaves it `deleting`, holding its atoms and GPUs until its node confirms
/// the VM gone ([`crate::hosted`]) or the provider the instance terminated ([`crate::provider`]); one never placed
/// (or failed) is deleted at once.
pub async fn change(
    conn: &mut PgConnection,
    id: &str,
    change: &Change,
) -> Result<Option<Changed>, StoreError> {
    let sql = match change {
        Change::Power(_) => {
            "UPDATE instances SET power = $2, generation = generation + 1 \
             WHERE id = $1 AND state NOT IN ('deleting', 'deleted') RETURNING node_id, state"
        }
        Change::Reboot => {
            "UPDATE instances SET reboots = reboots + 1, generation = generation + 1 \
             WHERE id = $1 AND state NOT IN ('deleting', 'deleted') RETURNING node_id, state"
        }
        Change::Delete => {
            "UPDATE instances SET generation = generation + 1, deleting_at = now(), \
               state = CASE WHEN state = 'placed' THEN 'deleting' ELSE 'deleted' END, \
               deleted_at = CASE WHEN state = 'placed' THEN NULL ELSE now() END \
             WHERE id = $1 AND state NOT IN ('deleting', 'deleted') RETURNING node_id, state"
        }
    };
    let mut q = sqlx::query_as::<_, (Option<String>, String)>(sql).bind(id);
    if let Change::Power(p) = change {
        q = q.bind(p.as_str());
    }
    let Some((node, state)) = q.fetch_optional(&mut *conn).await? else {
        return Ok(None);
    };
    let state = InstanceState::parse(&state).ok_or_else(|| {
        StoreError::Corrupt(format!("instance {id:?}: state: unknown state {state:?}"))
    })?;
    let placed_on_node = matches!(state, InstanceState::Placed | InstanceState::Deleting);
    Ok(Some(Changed {
        node: node.filter(|_| placed_on_node),
        state,
    }))
}

/// Records the node generation that took a deleting instance off its node (its delete is confirmed once the node
/// applied it).
pub async fn set_removal_generation(
    conn: &mut PgConnection,
    id: &str,
    generation: i64,
) -> Result<(), StoreError> {
    sqlx::query("UPDATE instances SET removal_generation = $2 WHERE id = $1")
        .bind(id)
        .bind(generation)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Records a provider pool's placement (only of a pending instance): it belongs to the provider workflow now.
pub async fn mark_placed_provider(
    conn: &mut PgConnection,
    id: &str,
    pool: &str,
) -> Result<bool, StoreError> {
    let n = sqlx::query(
        "UPDATE instances SET state = 'placed', placed_at = now(), error = NULL WHERE id = $1 AND state = 'pending'",
    )
    .bind(id)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if n == 1 {
        crate::provider::store::enqueue(conn, id, pool).await?;
    }
    Ok(n == 1)
}

/// Sets `node`'s desired `instances` from the instances placed on it, raises its desired generation and writes its
/// outbox row, inside the caller's transaction (the change and its delivery commit together). The caller pokes the
/// outbox sink after its commit (`Instances::outbox`): a NOTIFY inside the placement's transaction would serialize every
/// placement's commit (bc-store's `pokes`).
///
/// It locks the node's row before it reads the list: a placement on the node (which holds the row `FOR SHARE` from
/// its claim to its commit) commits first and is in the list. Read without the lock, the list of a change that ran
/// beside a placement missed the new instance and, written after it, took it off the node.
pub async fn publish(conn: &mut PgConnection, node: &str) -> Result<i64, StoreError> {
    sqlx::query("SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE")
        .bind(node)
        .execute(&mut *conn)
        .await?;
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
         o AS (INSERT INTO outbox (node_id, shard, kind, generation) \
           SELECT id, bc_shard(id), 'desired', desired_generation FROM n \
           RETURNING generation) \
         SELECT o.generation FROM o",
    )
    .bind(node)
    .bind(serde_json::Value::Array(list))
    .fetch_one(&mut *conn)
    .await?;
    Ok(generation)
}

/// The CTEs `node` and `ob` of a placement's statement, after its CTE `placed` (the placed instance's row): the
/// entry in parameter `$entry` ([`placement_entry`]), with the row's `generation`, `power` and `reboots`, appended to
/// the node's desired `instances`, the node's desired generation raised, and its outbox row.
fn append_ctes(entry: u8) -> String {
    format!(
        "node AS (UPDATE nodes SET desired_generation = desired_generation + 1, updated_at = now(), \
           desired_spec = jsonb_set(desired_spec, '{{instances}}', \
             CASE WHEN jsonb_typeof(desired_spec -> 'instances') = 'array' THEN desired_spec -> 'instances' \
                  ELSE '[]'::jsonb END \
             || jsonb_build_array(${entry}::jsonb || (SELECT jsonb_build_object('generation', p.generation, \
                  'power', p.power, 'reboots', p.reboots) FROM placed p))) \
           WHERE id = (SELECT p.node_id FROM placed p) RETURNING id, desired_generation), \
         ob AS (INSERT INTO outbox (node_id, shard, kind, generation) \
           SELECT id, bc_shard(id), 'desired', desired_generation FROM node)"
    )
}

/// Records a placement (only of a pending instance) and publishes it, in one statement: the instance becomes
/// `placed` on `node` with `gpus`, and `entry` ([`placement_entry`], with the row's `generation`, `power` and
/// `reboots` added) is appended to `node`'s desired `instances`, with the node's next desired generation and
/// its outbox row. None (and nothing written) when the instance was not pending. Its cost does not grow with the
/// instances already on the node (a full [`publish`] read, parsed and rewrote all of them for each new one). The
/// list stays the set [`publish`] would write: only placements add to it, one per node at a time (the claim locks
/// the node's free-atoms row), and every other change rewrites it whole under the node's row lock.
pub async fn place_and_publish(
    conn: &mut PgConnection,
    id: &str,
    node: &str,
    gpus: &[String],
    entry: serde_json::Value,
) -> Result<Option<Instance>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH placed AS (UPDATE instances i SET state = 'placed', node_id = $2, gpus = $3, placed_at = now(), \
           error = NULL WHERE i.id = $1 AND i.state = 'pending' RETURNING {COLUMNS}), \
         {} \
         SELECT * FROM placed",
        append_ctes(4)
    )))
    .bind(id)
    .bind(node)
    .bind(serde_json::json!(gpus))
    .bind(entry)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|r| row_to_instance(&r, 0)).transpose()
}

pub use bc_core::api::instances::{desired_entry, placement_entry};
