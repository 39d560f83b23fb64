//! Reservations in the store: admission's tx 1 (the request under its idempotency key), the placer's batch
//! transaction (claim pending, book devices with SKIP LOCKED, desired state + outbox in the same transaction),
//! release and expiry, and the devices derived from each node's `gpus` inventory section.

use crate::iam::audit;
use crate::{Store, StoreError, to_ms};
use bc_core::node::{
    LiveState, NodeState, NodeVerb, Transition, UnknownState, VerbPlan, plan_verb,
};
use sqlx::{PgConnection, Postgres, Row, Transaction};

/// Channel the API's tx 1 notifies (payload: the new reservation ids, comma-separated) so a scheduler claims them at
/// once by primary key instead of scanning the queue.
pub const PENDING_CHANNEL: &str = "bc_reservation_pending";
/// Channel the placer notifies with its decisions so waiting API calls answer: entries separated by newlines, each
/// `<id>\t<the reservation as decided>` ([`decided_entries`]), or the bare id of one too large to carry.
pub const DECIDED_CHANNEL: &str = "bc_reservation_decided";
/// Channel notified with node ids whose free devices changed (release, expiry, inventory, adoption).
pub const CAPACITY_CHANNEL: &str = "bc_capacity";
/// Channel notified when outbox rows were written, so the sink drains them before its tick.
pub const OUTBOX_WRITTEN_CHANNEL: &str = "bc_outbox_written";

use bc_core::api::capacity::BookedGpu;
pub use bc_core::api::capacity::Reservation;
use bc_core::ids::{NodeId, ReservationId, TenantId};
use bc_core::reservation::ReservationState;

const COLUMNS: &str = "r.id, r.tenant_id, r.principal_id, r.state, r.request, r.node_ids, r.gpus, r.error, \
                       r.created_at, r.placed_at, r.expires_at, r.ended_at";

/// The columns of a reservation as [`COLUMNS`] reads them, timestamps in epoch milliseconds; the placer's decision
/// notification carries the same as JSON ([`DECIDED_JSON`]).
#[derive(serde::Deserialize)]
struct ReservationColumns {
    id: String,
    tenant_id: String,
    principal_id: String,
    state: String,
    request: serde_json::Value,
    node_ids: Vec<String>,
    gpus: serde_json::Value,
    error: Option<String>,
    created_at_ms: Option<i64>,
    placed_at_ms: Option<i64>,
    expires_at_ms: Option<i64>,
    ended_at_ms: Option<i64>,
}

/// The reservation as it was decided, in the placement statement's `RETURNING` (of `reservations r`): the columns of
/// [`ReservationColumns`], each timestamp truncated to the millisecond as `to_ms` truncates a read one.
/// `json_build_object` writes text as it goes, where `jsonb_build_object` would build a tree to print.
const DECIDED_JSON: &str = "json_build_object('id', r.id, 'tenant_id', r.tenant_id, 'principal_id', r.principal_id, \
     'state', r.state, 'request', r.request, 'node_ids', to_json(r.node_ids), 'gpus', r.gpus, 'error', r.error, \
     'created_at_ms', floor(extract(epoch FROM r.created_at) * 1000)::bigint, \
     'placed_at_ms', floor(extract(epoch FROM r.placed_at) * 1000)::bigint, \
     'expires_at_ms', floor(extract(epoch FROM r.expires_at) * 1000)::bigint, \
     'ended_at_ms', floor(extract(epoch FROM r.ended_at) * 1000)::bigint)::text";

impl ReservationColumns {
    fn read(r: &sqlx::postgres::PgRow, at: usize) -> ReservationColumns {
        let ts = |i: usize| r.get::<Option<time::OffsetDateTime>, _>(at + i).map(to_ms);
        ReservationColumns {
            id: r.get(at),
            tenant_id: r.get(at + 1),
            principal_id: r.get(at + 2),
            state: r.get(at + 3),
            request: r.get(at + 4),
            node_ids: r.get(at + 5),
            gpus: r.get(at + 6),
            error: r.get(at + 7),
            created_at_ms: ts(8),
            placed_at_ms: ts(9),
            expires_at_ms: ts(10),
            ended_at_ms: ts(11),
        }
    }

    /// Parsed once: an id, state, request or booking this build cannot read is an error naming the row (never a
    /// panic, never a string passed on).
    fn parse(self) -> Result<Reservation, StoreError> {
        let id = self.id;
        let corrupt = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Corrupt(format!("reservation {id:?}: {what}: {e}"))
        };
        let state = self.state;
        Ok(Reservation {
            id: ReservationId::new(id.clone()).map_err(|e| corrupt("id", &e))?,
            tenant: TenantId::new(self.tenant_id).map_err(|e| corrupt("tenant", &e))?,
            principal: self.principal_id,
            state: ReservationState::parse(&state)
                .ok_or_else(|| corrupt("state", &format!("unknown state {state:?}")))?,
            request: serde_json::from_value(self.request).map_err(|e| corrupt("request", &e))?,
            nodes: self
                .node_ids
                .into_iter()
                .map(NodeId::new)
                .collect::<Result<_, _>>()
                .map_err(|e| corrupt("nodes", &e))?,
            gpus: serde_json::from_value::<Vec<BookedGpu>>(self.gpus)
                .map_err(|e| corrupt("gpus", &e))?,
            error: self.error,
            created_at_ms: self.created_at_ms.unwrap_or(0),
            placed_at_ms: self.placed_at_ms,
            expires_at_ms: self.expires_at_ms,
            ended_at_ms: self.ended_at_ms,
        })
    }
}

/// A reservation row read with [`COLUMNS`] from position `at`.
fn row_to_reservation(r: &sqlx::postgres::PgRow, at: usize) -> Result<Reservation, StoreError> {
    ReservationColumns::read(r, at).parse()
}

/// The entries of a [`DECIDED_CHANNEL`] payload: each reservation id with the reservation as decided, or with None
/// where the payload names only the id (a row too large to carry, or a scheduler of an older build, whose payload
/// was the ids separated by commas): read that one. Entries are cheap to skip: the JSON is parsed only by
/// [`decided_reservation`].
pub fn decided_entries(payload: &str) -> impl Iterator<Item = (&str, Option<&str>)> {
    // An id holds no comma (bc_core's ids), so splitting a carried entry's id at commas leaves it whole.
    payload
        .split('\n')
        .flat_map(|entry| {
            let (ids, json) = match entry.split_once('\t') {
                Some((id, json)) => (id, Some(json)),
                None => (entry, None),
            };
            ids.split(',').map(move |id| (id, json))
        })
        .filter(|(id, _)| !id.is_empty())
}

/// The reservation a [`decided_entries`] entry carries, parsed as a read of it is.
pub fn decided_reservation(json: &str) -> Result<Reservation, StoreError> {
    serde_json::from_str::<ReservationColumns>(json)
        .map_err(|e| StoreError::Corrupt(format!("a decision's notification: {e}")))?
        .parse()
}

/// What tx 1 found.
#[derive(Debug)]
pub enum Admission {
    /// Recorded as pending; the placer takes it from here.
    Recorded,
    /// The key was used before: the stored body hash and the reservation it created.
    Existing {
        body_hash: String,
        reservation: Box<Reservation>,
    },
}

/// Admission's tx 1 input.
#[derive(Debug, Clone, Copy)]
pub struct NewReservation<'a> {
    pub id: &'a str,
    pub principal_id: &'a str,
    /// The caller's idempotency key (scoped to the principal).
    pub key: &'a str,
    /// SHA-256 of the canonical request.
    pub body_hash: &'a str,
    pub tenant: &'a str,
    pub request: &'a serde_json::Value,
    pub duration_s: i64,
}

/// A pending reservation claimed by the placer.
#[derive(Debug, Clone)]
pub struct Pending {
    pub id: String,
    pub request: serde_json::Value,
    /// How long ago it was admitted when it was claimed, by the database's clock (the one that stamped
    /// `created_at`): the start of its placement latency.
    pub age: std::time::Duration,
}

/// A pending row as `SELECT id, request, state, <age in seconds>` reads it.
pub fn pending_row(r: &sqlx::postgres::PgRow) -> Pending {
    let age: f64 = r.get(3);
    Pending {
        id: r.get(0),
        request: r.get(1),
        age: std::time::Duration::try_from_secs_f64(age).unwrap_or_default(),
    }
}

/// The placer's decision for one claimed reservation.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Book these devices: (device id, node id, gpu json).
    Place {
        id: String,
        devices: Vec<(String, String, serde_json::Value)>,
        duration_s: i64,
    },
    Fail {
        id: String,
        error: String,
    },
    /// Leave pending for the next round (a stale capacity view lost a race).
    Retry {
        id: String,
    },
}

impl Store {
    /// Admission's tx 1, one statement: records the idempotency key and the pending reservation and wakes the
    /// schedulers — or, when the key was used before, returns what it recorded then.
    pub async fn admit_reservation(&self, r: NewReservation<'_>) -> Result<Admission, StoreError> {
        let NewReservation {
            id,
            principal_id,
            key,
            body_hash,
            tenant,
            request,
            duration_s,
        } = r;
        let inserted: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "WITH ins AS (INSERT INTO idempotency (principal_id, key, body_hash, reservation_id) \
               VALUES ($1, $2, $3, $4) ON CONFLICT (principal_id, key) DO NOTHING RETURNING reservation_id), \
             r AS (INSERT INTO reservations (id, shard, pool, tenant_id, principal_id, request, state, duration_s) \
               SELECT $4, bc_shard($4), $6::jsonb ->> 'pool', $5, $1, $6, 'pending', $7 FROM ins RETURNING id), \
             n AS (SELECT pg_notify($8, r.id) FROM r) \
             SELECT count(*) FROM n",
        )
        .bind(principal_id)
        .bind(key)
        .bind(body_hash)
        .bind(id)
        .bind(tenant)
        .bind(request)
        .bind(duration_s as i32)
        .bind(PENDING_CHANNEL)
        .fetch_one(&self.pool)
        .await;
        match inserted {
            Ok(1) => return Ok(Admission::Recorded),
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23503") => {
                return Err(StoreError::NotFound {
                    what: "tenant",
                    id: tenant.to_string(),
                });
            }
            Err(e) => return Err(e.into()),
        }
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT i.body_hash, {COLUMNS} FROM idempotency i JOIN reservations r ON r.id = i.reservation_id \
             WHERE i.principal_id = $1 AND i.key = $2"
        )))
        .bind(principal_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| StoreError::Corrupt(format!("idempotency key {key:?} has no reservation")))?;
        Ok(Admission::Existing {
            body_hash: row.get(0),
            reservation: Box::new(row_to_reservation(&row, 1)?),
        })
    }

    /// Admission's tx 1 for a batch (the API's group commit): one statement records every new key and pending
    /// reservation and wakes the schedulers once. Returns, per input, whether it was recorded; one that was not
    /// reuses a key and is answered by [`Store::admit_reservation`] (which reads what the key recorded). An error
    /// (a missing tenant, say) fails the batch: the caller retries each on its own to get its own answer.
    pub async fn admit_reservations(
        &self,
        batch: &[NewReservation<'_>],
    ) -> Result<Vec<bool>, StoreError> {
        let ids: Vec<&str> = batch.iter().map(|r| r.id).collect();
        let principals: Vec<&str> = batch.iter().map(|r| r.principal_id).collect();
        let keys: Vec<&str> = batch.iter().map(|r| r.key).collect();
        let hashes: Vec<&str> = batch.iter().map(|r| r.body_hash).collect();
        let tenants: Vec<&str> = batch.iter().map(|r| r.tenant).collect();
        let requests: Vec<&serde_json::Value> = batch.iter().map(|r| r.request).collect();
        let durations: Vec<i32> = batch.iter().map(|r| r.duration_s as i32).collect();
        let recorded: Vec<String> = sqlx::query_scalar(
            "WITH input AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
                 $6::jsonb[], $7::int[]) AS t(id, principal_id, key, body_hash, tenant_id, request, duration_s)), \
             ins AS (INSERT INTO idempotency (principal_id, key, body_hash, reservation_id) \
                 SELECT principal_id, key, body_hash, id FROM input \
                 ON CONFLICT (principal_id, key) DO NOTHING RETURNING reservation_id), \
             r AS (INSERT INTO reservations (id, shard, pool, tenant_id, principal_id, request, state, duration_s) \
                 SELECT i.id, bc_shard(i.id), i.request ->> 'pool', i.tenant_id, i.principal_id, i.request, 'pending', \
                        i.duration_s \
                 FROM input i JOIN ins ON ins.reservation_id = i.id RETURNING id), \
             n AS (SELECT pg_notify($8, string_agg(id, ',')) FROM \
                 (SELECT id, (row_number() OVER ()) / 150 AS g FROM r) AS c GROUP BY g) \
             SELECT r.id FROM r, (SELECT count(*) FROM n) AS x",
        )
        .bind(&ids)
        .bind(&principals)
        .bind(&keys)
        .bind(&hashes)
        .bind(&tenants)
        .bind(&requests)
        .bind(&durations)
        .bind(PENDING_CHANNEL)
        .fetch_all(&self.pool)
        .await?;
        let recorded: std::collections::HashSet<&str> =
            recorded.iter().map(String::as_str).collect();
        Ok(batch.iter().map(|r| recorded.contains(r.id)).collect())
    }

    pub async fn reservation(&self, id: &ReservationId) -> Result<Option<Reservation>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM reservations r WHERE r.id = $1"
        )))
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| row_to_reservation(&r, 0)).transpose()
    }

    /// Several reservations by id (one statement), in no particular order.
    pub async fn reservations(&self, ids: &[String]) -> Result<Vec<Reservation>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM reservations r WHERE r.id = ANY($1)"
        )))
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| row_to_reservation(r, 0)).collect()
    }

    /// A tenant's reservations (every tenant's when None), newest first.
    pub async fn list_reservations(
        &self,
        tenant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<Reservation>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM reservations r WHERE ($1::text IS NULL OR r.tenant_id = $1) \
             ORDER BY r.created_at DESC LIMIT $2"
        )))
        .bind(tenant)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| row_to_reservation(r, 0)).collect()
    }

    /// Free devices of adopted nodes (all, or only on `nodes`): (node, model, device id, uuid, index, clique).
    pub async fn free_devices(
        &self,
        nodes: Option<&[String]>,
    ) -> Result<Vec<FreeDevice>, StoreError> {
        let rows = sqlx::query(
            "SELECT d.node_id, d.model, d.id, d.uuid, d.idx, d.clique, n.pool_id FROM devices d JOIN nodes n ON n.id = d.node_id \
             WHERE n.state = 'adopted' AND d.present AND d.reservation_id IS NULL \
             AND ($1::text[] IS NULL OR d.node_id = ANY($1))",
        )
        .bind(nodes)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| FreeDevice {
                node_id: r.get(0),
                model: r.get(1),
                device_id: r.get(2),
                uuid: r.get(3),
                idx: r.get(4),
                clique: r.get(5),
                pool: r.get(6),
            })
            .collect())
    }

    /// Begins a placer's transaction (the claim, the booking and the placement of one batch), in which prepared
    /// statements run their generic plans (`SET LOCAL plan_cache_mode = force_generic_plan`, sent with `BEGIN` in
    /// one round trip). Left to PostgreSQL's default, the placer's statements got custom plans, made afresh on every
    /// execution, and making them cost more than running them: at 2,000 admissions/s on two cores, 0.26 ms to plan
    /// the claim that ran in 0.08, 0.31 ms for the booking that ran in 0.29 and 0.42 ms for the placement that ran
    /// in 0.69 (`pg_stat_statements.track_planning`, BENCHMARKS.md). The generic plans are the same index lookups
    /// (`the_placers_statements_run_generic_plans_that_read_by_key` reads them with EXPLAIN; the buffers read per
    /// call did not change), and one made while a table was empty is replaced when the statistics check analyzes
    /// it ([`Store::refresh_stale_statistics`]), as for every cached statement.
    pub async fn begin_placement(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        Ok(self
            .pool
            .begin_with("BEGIN; SET LOCAL plan_cache_mode = force_generic_plan")
            .await?)
    }

    /// Like [`Store::claim_pending`], for the reservations the admission notifications named (primary-key lookups,
    /// no queue scan); the periodic scan catches any whose notification was lost.
    pub async fn claim_pending_ids(
        &self,
        ids: &[String],
        shards: &[i16],
    ) -> Result<(Transaction<'static, Postgres>, Vec<Pending>), StoreError> {
        let mut tx = self.begin_placement().await?;
        // No `state = 'pending'` in WHERE: it would let the planner's generic plan walk the partial
        // `reservations_pending` index, which carries every placed reservation's dead entry until vacuum (2.8 ms
        // instead of 0.05 ms at 40k reservations, EXPLAIN ANALYZE). The state is checked on the locked rows.
        let rows = sqlx::query(
            "SELECT id, request, state, extract(epoch FROM clock_timestamp() - created_at)::float8 \
             FROM reservations WHERE id = ANY($1) AND shard = ANY($2) \
             ORDER BY created_at FOR UPDATE SKIP LOCKED",
        )
        .bind(ids)
        .bind(shards)
        .fetch_all(&mut *tx)
        .await?;
        let pending = rows
            .iter()
            .filter(|r| r.get::<&str, _>(2) == "pending")
            .map(pending_row)
            .collect();
        Ok((tx, pending))
    }

    /// The placer's transaction, part 1: claims up to `limit` pending reservations of `shards` (SKIP LOCKED, so
    /// several schedulers never take the same one).
    pub async fn claim_pending(
        &self,
        shards: &[i16],
        limit: i64,
    ) -> Result<(Transaction<'static, Postgres>, Vec<Pending>), StoreError> {
        let mut tx = self.begin_placement().await?;
        let rows = sqlx::query(
            "SELECT id, request, state, extract(epoch FROM clock_timestamp() - created_at)::float8 \
             FROM reservations WHERE state = 'pending' AND shard = ANY($1) \
             ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(shards)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let pending = rows.iter().map(pending_row).collect();
        Ok((tx, pending))
    }

    /// The placer's transaction, part 2: books what was decided (`FOR UPDATE SKIP LOCKED` on the devices, booking
    /// only those still free), undoes any reservation that did not get all its devices (returned for a retry),
    /// records placements and failures, bumps each touched node's desired state with an outbox row, queues expiry,
    /// notifies the waiting API calls, and commits. Returns the ids that must be retried.
    pub async fn commit_placements(
        &self,
        mut tx: Transaction<'static, Postgres>,
        decisions: &[Decision],
    ) -> Result<Vec<String>, StoreError> {
        let booked = book_devices(&mut tx, decisions).await?;
        let mut got: std::collections::HashMap<&str, usize> = Default::default();
        for (_, res) in &booked {
            *got.entry(res.as_str()).or_default() += 1;
        }
        let mut retry: Vec<String> = Vec::new();
        let mut placed_ids = Vec::new();
        let mut placed_nodes: Vec<Vec<String>> = Vec::new();
        let mut placed_gpus = Vec::new();
        let mut placed_secs = Vec::new();
        let mut failed_ids = Vec::new();
        let mut failed_errors = Vec::new();
        for d in decisions {
            match d {
                Decision::Place {
                    id,
                    devices,
                    duration_s,
                } => {
                    if got.get(id.as_str()).copied().unwrap_or(0) == devices.len() {
                        let mut nodes: Vec<String> =
                            devices.iter().map(|(_, n, _)| n.clone()).collect();
                        nodes.dedup();
                        placed_ids.push(id.clone());
                        placed_nodes.push(nodes);
                        placed_gpus.push(serde_json::Value::Array(
                            devices.iter().map(|(_, _, g)| g.clone()).collect(),
                        ));
                        placed_secs.push(*duration_s as f64);
                    } else {
                        retry.push(id.clone());
                    }
                }
                Decision::Fail { id, error } => {
                    failed_ids.push(id.clone());
                    failed_errors.push(error.clone());
                }
                Decision::Retry { id } => retry.push(id.clone()),
            }
        }
        if !retry.is_empty() {
            // By device id: the devices this statement booked for the reservations that did not get all theirs.
            let undo: Vec<&str> = booked
                .iter()
                .filter(|(_, res)| retry.contains(res))
                .map(|(dev, _)| dev.as_str())
                .collect();
            sqlx::query("UPDATE devices SET reservation_id = NULL WHERE id = ANY($1)")
                .bind(&undo)
                .execute(&mut *tx)
                .await?;
        }
        // text[][] must be rectangular; pass node lists as JSON instead.
        let nodes_json: Vec<serde_json::Value> =
            placed_nodes.iter().map(|n| serde_json::json!(n)).collect();
        let touched: Vec<String> = {
            let mut t: Vec<String> = placed_nodes.iter().flatten().cloned().collect();
            t.sort();
            t.dedup();
            t
        };
        // One statement: the nodes' desired state with outbox rows, placements (each remembering the generation
        // that carries it to each of its nodes) and failures, expiry work, and the notifications (outbox written,
        // decisions for the waiting API calls). A decision carries the reservation as decided, so the waiting call
        // answers without reading it: entries of up to 3,000 bytes, grouped by their running length so that each
        // payload stays under PostgreSQL's 8,000-byte limit; a larger one carries only its id.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH p AS (SELECT * FROM unnest($1::text[], $2::jsonb[], $3::jsonb[], $4::float8[]) AS p(id, nodes, gpus, secs)), \
             {publish}, \
             placed AS (UPDATE reservations r SET state = 'placed', \
                  node_ids = ARRAY(SELECT jsonb_array_elements_text(p.nodes)), gpus = p.gpus, placed_at = now(), \
                  expires_at = now() + make_interval(secs => p.secs), \
                  generations = (SELECT COALESCE(jsonb_object_agg(n.id, n.desired_generation), '{{}}') FROM n \
                    WHERE n.id IN (SELECT jsonb_array_elements_text(p.nodes))) \
                FROM p WHERE r.id = p.id RETURNING r.id, r.expires_at, {DECIDED_JSON} AS j), \
             q AS (INSERT INTO work_queue (kind, subject, shard, run_at) \
                SELECT 'reservation.expire', id, bc_shard(id), expires_at FROM placed \
                ON CONFLICT (kind, subject) DO UPDATE SET run_at = EXCLUDED.run_at), \
             f AS (UPDATE reservations r SET state = 'failed', error = f.error, ended_at = now() \
                FROM unnest($5::text[], $6::text[]) AS f(id, error) WHERE r.id = f.id RETURNING r.id, {DECIDED_JSON} AS j), \
             entries AS (SELECT id, CASE WHEN octet_length(j) <= 3000 THEN id || E'\\t' || j ELSE id END AS entry \
                FROM (SELECT id, j FROM placed UNION ALL SELECT id, j FROM f) x), \
             d AS (SELECT pg_notify($9, string_agg(entry, E'\\n')) FROM \
                (SELECT entry, sum(octet_length(entry) + 1) OVER (ORDER BY id ROWS UNBOUNDED PRECEDING) / 4000 AS g \
                 FROM entries) y GROUP BY g) \
             SELECT (SELECT count(*) FROM placed), (SELECT count(*) FROM f), (SELECT count(*) FROM w), \
                    (SELECT count(*) FROM d)",
            publish = publish_ctes(7, 8)
        )))
        .bind(&placed_ids)
        .bind(&nodes_json)
        .bind(&placed_gpus)
        .bind(&placed_secs)
        .bind(&failed_ids)
        .bind(&failed_errors)
        .bind(&touched)
        .bind(OUTBOX_WRITTEN_CHANNEL)
        .bind(DECIDED_CHANNEL)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(retry)
    }

    /// Ends a reservation (`released` by its owner or `expired` by the controllers): frees its devices, publishes
    /// the nodes' new desired state with outbox rows, drops its expiry work, audits — one transaction. Returns the
    /// reservation after the change, or None when it was already ended (nothing changed).
    pub async fn end_reservation(
        &self,
        id: &ReservationId,
        to: ReservationState,
        actor: &str,
    ) -> Result<Option<Reservation>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let r = end_reservation_in(&mut tx, id.as_str(), to, actor).await?;
        tx.commit().await?;
        Ok(r)
    }
}

/// What [`Store::set_node_schedulable`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeStateChange {
    /// The node moved from `from` to the new state.
    Changed { from: LiveState },
    /// The node was already in the new state; nothing changed.
    Unchanged,
    /// The node is in a state the verb does not apply to; nothing changed. `reason` says why and what to do.
    Refused { state: NodeState, reason: String },
}

impl Store {
    // === impl drains ===

    /// Applies `verb` to a node as [`bc_core::node::plan_verb`] decides from its state read under the row lock
    /// (drain: adopted → draining; undrain: draining → adopted; revoke: any but revoked → revoked), fenced against the placer: the node row is locked FOR UPDATE, which
    /// waits for every placement transaction that read the node as bookable (they hold it FOR KEY SHARE, see
    /// [`Store::commit_placements`]), and no later placement books on it unless it is `adopted`. The schedulers
    /// hear the capacity change at commit. Once this returns, no booking is committed on a node that left
    /// `adopted`. NotFound when there is no such node.
    pub async fn set_node_schedulable(
        &self,
        node_id: &str,
        verb: NodeVerb,
        actor: &str,
    ) -> Result<NodeStateChange, StoreError> {
        let mut tx = self.pool.begin().await?;
        let state: String = sqlx::query_scalar("SELECT state FROM nodes WHERE id = $1 FOR UPDATE")
            .bind(node_id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "node",
                id: node_id.to_string(),
            })?;
        let state: NodeState = state.parse().map_err(|e: UnknownState| {
            StoreError::Corrupt(format!("nodes row {node_id:?}: {e}"))
        })?;
        let Transition { from, to } = match plan_verb(verb, node_id, state) {
            VerbPlan::Change(t) => t,
            VerbPlan::Unchanged => return Ok(NodeStateChange::Unchanged),
            VerbPlan::Refused(reason) => return Ok(NodeStateChange::Refused { state, reason }),
        };
        let state = from.state();
        sqlx::query("UPDATE nodes SET state = $2, updated_at = now() WHERE id = $1")
            .bind(node_id)
            .bind(to.as_str())
            .execute(&mut *tx)
            .await?;
        audit(
            &mut tx,
            actor,
            &format!("node.{to}"),
            &format!("node/{node_id}"),
            serde_json::json!({"from": state.as_str()}),
        )
        .await?;
        if to.is_revoked() {
            // A revoked node holds no GPU: each goes to a node that reported it meanwhile.
            crate::devices::release_all_in(&mut tx, node_id).await?;
        }
        notify_ids(&mut tx, CAPACITY_CHANNEL, &[node_id.to_string()]).await?;
        tx.commit().await?;
        Ok(NodeStateChange::Changed { from })
    }
}

#[derive(Debug, Clone)]
pub struct FreeDevice {
    pub node_id: String,
    pub model: String,
    pub device_id: String,
    pub uuid: String,
    pub idx: i32,
    pub clique: Option<String>,
    pub pool: String,
}

/// Books the devices `decisions` place (`FOR UPDATE SKIP LOCKED`, only those still free): returns each booked
/// device with its reservation. Only on nodes still `adopted`, read under FOR KEY SHARE: a drain (or revoke) locks
/// the node FOR UPDATE (see `set_node_schedulable`), so it waits for this transaction and this statement, if it comes
/// later, waits for the drain and then sees the new state. Devices of a node that left `adopted` are not booked, and
/// their reservation is retried with fresh capacity.
async fn book_devices(
    tx: &mut PgConnection,
    decisions: &[Decision],
) -> Result<Vec<(String, String)>, StoreError> {
    let mut dev_ids = Vec::new();
    let mut dev_res = Vec::new();
    for d in decisions {
        if let Decision::Place { id, devices, .. } = d {
            for (dev, _, _) in devices {
                dev_ids.push(dev.as_str());
                dev_res.push(id.as_str());
            }
        }
    }
    if dev_ids.is_empty() {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_as(
        "WITH want AS (SELECT * FROM unnest($1::text[], $2::text[]) AS w(dev, res)), \
         free AS (SELECT d.id FROM devices d JOIN want ON d.id = want.dev JOIN nodes n ON n.id = d.node_id \
                  WHERE d.reservation_id IS NULL AND d.present AND n.state = 'adopted' \
                  FOR UPDATE OF d SKIP LOCKED FOR KEY SHARE OF n) \
         UPDATE devices d SET reservation_id = want.res FROM want, free \
         WHERE d.id = want.dev AND d.id = free.id RETURNING d.id, want.res",
    )
    .bind(&dev_ids)
    .bind(&dev_res)
    .fetch_all(&mut *tx)
    .await?)
}

pub(crate) async fn end_reservation_in(
    tx: &mut PgConnection,
    id: &str,
    to: ReservationState,
    actor: &str,
) -> Result<Option<Reservation>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE reservations r SET state = $2, ended_at = now() WHERE r.id = $1 AND r.state IN ('pending', 'placed') \
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(to.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let r = row_to_reservation(&row, 0)?;
    let nodes: Vec<String> = r.nodes.iter().map(|n| n.to_string()).collect();
    // By node (`devices_node`): no index names `reservation_id` (migration 16), and a reservation's devices are on
    // the nodes its placement recorded (none while it was pending).
    sqlx::query(
        "UPDATE devices SET reservation_id = NULL WHERE node_id = ANY($2) AND reservation_id = $1",
    )
    .bind(id)
    .bind(&nodes)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM work_queue WHERE kind = 'reservation.expire' AND subject = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    publish_bookings(tx, &nodes).await?;
    notify_ids(tx, CAPACITY_CHANNEL, &nodes).await?;
    audit(
        tx,
        actor,
        &format!("reservation.{to}"),
        &format!("reservation/{id}"),
        serde_json::json!({ "nodes": nodes }),
    )
    .await?;
    Ok(Some(r))
}

/// Sets each node's desired `bookings` from its booked devices, bumps its desired generation and writes an outbox
/// row for it — inside the caller's transaction, so the change and its delivery record commit together.
/// See [`publish_ctes`] for why the per-node subquery filters bookings in the aggregate.
async fn publish_bookings(tx: &mut PgConnection, nodes: &[String]) -> Result<(), StoreError> {
    if nodes.is_empty() {
        return Ok(());
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH {} SELECT count(*) FROM w",
        publish_ctes(1, 2)
    )))
    .bind(nodes)
    .bind(OUTBOX_WRITTEN_CHANNEL)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The CTEs `n` (nodes' new bookings and generation, for the node ids in parameter `$nodes`; a GPU an instance
/// holds, booked under its `inst-…` id, is no booking: it reaches the node in its `instances` list), `o` (their outbox
/// rows) and `w` (one notification on the channel in parameter `$channel` when rows were written). The per-node
/// subquery filters bookings in the aggregate, not in WHERE: with `reservation_id IS NOT NULL` in WHERE the planner,
/// misled by statistics from an unbooked fleet, walked the partial `devices_reservation` index (dropped since, by
/// migration 16) for every node (276 ms instead of 7 ms for 30 nodes, measured with EXPLAIN ANALYZE at 24k
/// bookings); the aggregate keeps the read on `devices_node` whatever indexes come.
fn publish_ctes(nodes: u8, channel: u8) -> String {
    format!(
        "n AS (UPDATE nodes n SET desired_generation = n.desired_generation + 1, updated_at = now(), \
           desired_spec = jsonb_set(n.desired_spec, '{{bookings}}', COALESCE(( \
             SELECT jsonb_agg(jsonb_build_object('reservation', b.rid, 'gpus', b.uuids) ORDER BY b.rid) \
               FILTER (WHERE b.rid IS NOT NULL AND b.rid NOT LIKE 'inst-%') \
             FROM (SELECT reservation_id AS rid, jsonb_agg(uuid ORDER BY idx) AS uuids FROM devices \
                   WHERE node_id = n.id GROUP BY reservation_id) b), '[]'::jsonb)) \
           WHERE n.id = ANY(${nodes}::text[]) RETURNING n.id, n.desired_generation), \
         o AS (INSERT INTO outbox (node_id, shard, kind, generation) \
           SELECT id, bc_shard(id), 'desired', desired_generation FROM n \
           RETURNING shard), \
         w AS (SELECT pg_notify(${channel}, '') FROM (SELECT 1 FROM o LIMIT 1) x)"
    )
}

/// pg_notify with comma-separated ids, split so each payload stays under PostgreSQL's 8000-byte limit.
pub(crate) async fn notify_ids(
    tx: &mut PgConnection,
    channel: &str,
    ids: &[String],
) -> Result<(), StoreError> {
    let chunks = chunk_ids(ids);
    if chunks.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT pg_notify($1, c) FROM unnest($2::text[]) AS c")
        .bind(channel)
        .bind(&chunks)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Comma-separated ids in payloads under PostgreSQL's 8000-byte NOTIFY limit.
fn chunk_ids(ids: &[String]) -> Vec<String> {
    let mut chunks: Vec<String> = Vec::new();
    let mut cur = String::new();
    for id in ids {
        if !cur.is_empty() && cur.len() + id.len() + 1 > 7000 {
            chunks.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push(',');
        }
        cur.push_str(id);
    }
    if !cur.is_empty() {
        chunks.push(cur);
    }
    chunks
}
