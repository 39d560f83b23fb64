//! Sharing work between processes of a role: worker membership (a row per live process), shard leases with
//! expiry and a fencing token, the delayed work queue (claimed with SKIP LOCKED), and the outbox sink. Which
//! shards a process *should* own is bc-core's rendezvous decision; this module makes ownership real and fenced:
//! work commits only inside a transaction that holds its shard's lease row `FOR SHARE`, so a takeover (an UPDATE
//! of that row) waits for it, and a process that lost its lease commits nothing.

use crate::reservations::{Reservation, end_reservation_in, notify_ids};
use crate::{Store, StoreError};
use sqlx::{PgConnection, Row};

/// Channel the outbox sink notifies with node ids whose desired state changed; gateways pull for those they hold.
pub const OUTBOX_CHANNEL: &str = "bc_outbox";

/// A shard this process holds: the shard and the fencing token it holds it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLease {
    pub shard: i16,
    pub fence: i64,
}

/// One claimed, due work item.
#[derive(Debug, Clone)]
pub struct WorkItem {
    pub id: i64,
    pub kind: String,
    pub subject: String,
    pub shard: i16,
}

impl Store {
    /// Renews this process's membership of `role` and lists the role's live workers (ids), this one included.
    pub async fn heartbeat_worker(
        &self,
        role: &str,
        id: &str,
        ttl_ms: i64,
    ) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(
            "WITH up AS (INSERT INTO workers (role, id, expires_at) \
               VALUES ($1, $2, now() + make_interval(secs => $3 / 1000.0)) \
               ON CONFLICT (role, id) DO UPDATE SET expires_at = EXCLUDED.expires_at) \
             SELECT id FROM workers WHERE role = $1 AND expires_at > now() AND id <> $2 \
             UNION ALL SELECT $2",
        )
        .bind(role)
        .bind(id)
        .bind(ttl_ms as f64)
        .fetch_all(&self.pool)
        .await?;
        let mut ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        ids.sort();
        Ok(ids)
    }

    /// Leaves `role` at once (a clean shutdown): the worker row and its leases expire now.
    pub async fn leave_role(&self, role: &str, id: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM workers WHERE role = $1 AND id = $2")
            .bind(role)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE shard_leases SET expires_at = now() - interval '1 millisecond' WHERE role = $1 AND owner = $2",
        )
        .bind(role)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Makes this process's leases match `want`: renews the wanted shards it holds, takes wanted shards that are
    /// free or expired (the fence increases on every change of owner), and lets go of shards it holds but no longer
    /// wants (expired at once, fence kept). Returns the leases held now.
    ///
    /// A lease row another process still has locked (`FOR SHARE`, inside a fenced transaction it has not ended:
    /// it may be paused, or cut off from the database) is skipped, not waited for: it is taken on a later round,
    /// once the server ended that transaction, and renewing this process's own leases never waits behind it.
    pub async fn sync_leases(
        &self,
        role: &str,
        me: &str,
        want: &[i16],
        ttl_ms: i64,
    ) -> Result<Vec<ShardLease>, StoreError> {
        let rows = sqlx::query(
            "WITH rel AS (UPDATE shard_leases SET expires_at = now() - interval '1 millisecond' \
                 WHERE role = $1 AND owner = $2 AND NOT (shard = ANY($3)) AND expires_at > now()), \
             renew AS (UPDATE shard_leases SET expires_at = now() + make_interval(secs => $4 / 1000.0) \
                 WHERE role = $1 AND owner = $2 AND shard = ANY($3) AND expires_at > now() \
                 RETURNING shard, fence), \
             free AS (SELECT shard FROM shard_leases \
                 WHERE role = $1 AND shard = ANY($3) AND expires_at <= now() FOR UPDATE SKIP LOCKED), \
             took AS (UPDATE shard_leases l SET owner = $2, fence = l.fence + 1, \
                   expires_at = now() + make_interval(secs => $4 / 1000.0) \
                 FROM free WHERE l.role = $1 AND l.shard = free.shard RETURNING l.shard, l.fence), \
             new AS (INSERT INTO shard_leases (role, shard, owner, fence, expires_at) \
                 SELECT $1, s, $2, 1, now() + make_interval(secs => $4 / 1000.0) FROM unnest($3::smallint[]) AS s \
                 WHERE NOT EXISTS (SELECT 1 FROM shard_leases x WHERE x.role = $1 AND x.shard = s) \
                 ON CONFLICT (role, shard) DO NOTHING RETURNING shard, fence) \
             SELECT shard, fence FROM renew UNION ALL SELECT shard, fence FROM took \
             UNION ALL SELECT shard, fence FROM new ORDER BY shard",
        )
        .bind(role)
        .bind(me)
        .bind(want)
        .bind(ttl_ms as f64)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| ShardLease {
                shard: r.get(0),
                fence: r.get(1),
            })
            .collect())
    }

    /// Queues (or reschedules) a work item.
    pub async fn queue_work(
        &self,
        kind: &str,
        subject: &str,
        run_at_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO work_queue (kind, subject, shard, run_at) VALUES ($1, $2, bc_shard($2), to_timestamp($3 / 1000.0)) \
             ON CONFLICT (kind, subject) DO UPDATE SET run_at = EXCLUDED.run_at",
        )
        .bind(kind)
        .bind(subject)
        .bind(run_at_ms as f64)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Runs due reservation expiries of the shards in `leases`, fenced: one transaction locks the still-valid
    /// leases `FOR SHARE`, claims due items of those shards with SKIP LOCKED, ends each reservation and deletes
    /// the item. Returns the reservations it expired.
    pub async fn run_due_expiries(
        &self,
        role: &str,
        me: &str,
        leases: &[ShardLease],
        limit: i64,
    ) -> Result<Vec<Reservation>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let valid = lock_valid_leases(&mut tx, role, me, leases).await?;
        if valid.is_empty() {
            return Ok(Vec::new());
        }
        let items: Vec<WorkItem> = sqlx::query(
            "SELECT id, kind, subject, shard FROM work_queue \
             WHERE kind = 'reservation.expire' AND shard = ANY($1) AND run_at <= now() \
             ORDER BY run_at LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(&valid)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| WorkItem {
            id: r.get(0),
            kind: r.get(1),
            subject: r.get(2),
            shard: r.get(3),
        })
        .collect();
        let mut ended = Vec::new();
        for item in &items {
            // end_reservation_in deletes the item itself when it ends the reservation; delete it anyway for one
            // whose reservation had already ended.
            if let Some(r) = end_reservation_in(
                &mut tx,
                &item.subject,
                bc_core::reservation::ReservationState::Expired,
                &format!("controller/{me}"),
            )
            .await?
            {
                ended.push(r);
            }
            sqlx::query("DELETE FROM work_queue WHERE id = $1")
                .bind(item.id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(ended)
    }

    /// The outbox sink, fenced like the work queue: deletes up to `limit` outbox rows of the valid leased shards
    /// and notifies the gateways with their node ids, in one transaction. Returns how many rows it delivered.
    pub async fn drain_outbox(
        &self,
        role: &str,
        me: &str,
        leases: &[ShardLease],
        limit: i64,
    ) -> Result<usize, StoreError> {
        let mut tx = self.pool.begin().await?;
        let valid = lock_valid_leases(&mut tx, role, me, leases).await?;
        if valid.is_empty() {
            return Ok(0);
        }
        let nodes: Vec<String> = sqlx::query_scalar(
            "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE shard = ANY($1) ORDER BY id LIMIT $2 \
               FOR UPDATE SKIP LOCKED) RETURNING node_id",
        )
        .bind(&valid)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let n = nodes.len();
        let mut unique = nodes;
        unique.sort();
        unique.dedup();
        notify_ids(&mut tx, OUTBOX_CHANNEL, &unique).await?;
        tx.commit().await?;
        Ok(n)
    }

    /// Takes offline, fenced like the work queue, up to `limit` online nodes of the valid leased shards whose
    /// session is held by a gateway in `silent` ([`bc_core::gateways::GatewayWatch`]), each with a `node.offline`
    /// row saying which gateway went silent and for how long. A gateway's nodes are taken only while its row still
    /// carries the refresh the watch saw unchanged: the row is locked first, so a gateway that came back (its
    /// restart closes its previous run's sessions itself) is left alone, and its refresh waits for this statement. A
    /// node that reconnected elsewhere meanwhile names that gateway and is left too. Returns (node, gateway), by
    /// node.
    pub async fn offline_on_silent_gateways(
        &self,
        role: &str,
        me: &str,
        leases: &[ShardLease],
        silent: &[bc_core::gateways::Silent],
        limit: i64,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let valid = lock_valid_leases(&mut tx, role, me, leases).await?;
        if valid.is_empty() || silent.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = silent.iter().map(|s| s.id.as_str()).collect();
        let refreshed: Vec<i64> = silent.iter().map(|s| s.refreshed_us).collect();
        let silent_ms: Vec<i64> = silent.iter().map(|s| s.silent_ms).collect();
        let rows = sqlx::query(concat!(
            "WITH s AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS s(id, refreshed_us, ms)), \
             g AS (SELECT g.id, s.ms FROM gateways g JOIN s ON g.id = s.id AND ",
            crate::gateways::refreshed_us!(),
            " = s.refreshed_us FOR UPDATE OF g), \
             l AS (SELECT n.id, g.id AS gateway, g.ms FROM nodes n JOIN g ON n.gateway_id = g.id \
                   WHERE n.online AND n.shard = ANY($4) ORDER BY n.id LIMIT $5 FOR UPDATE OF n), \
             u AS (UPDATE nodes n SET online = false FROM l WHERE n.id = l.id \
                   RETURNING n.id, n.session_epoch, l.gateway, l.ms), \
             a AS (INSERT INTO audit_events (actor, action, subject, detail) \
                   SELECT $6, 'node.offline', 'node/' || u.id, jsonb_build_object('epoch', u.session_epoch, \
                     'gateway', u.gateway, 'silent_ms', u.ms, \
                     'reason', 'its gateway went silent: no refresh of its row for longer than its lease') \
                   FROM u) \
             SELECT id, gateway FROM u ORDER BY id",
        ))
        .bind(&ids)
        .bind(&refreshed)
        .bind(&silent_ms)
        .bind(&valid)
        .bind(limit)
        .bind(format!("controller/{me}"))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The shard leases of `role` as stored: (shard, owner, fence, still valid).
    pub async fn shard_leases(
        &self,
        role: &str,
    ) -> Result<Vec<(i16, String, i64, bool)>, StoreError> {
        let rows = sqlx::query(
            "SELECT shard, owner, fence, expires_at > now() FROM shard_leases WHERE role = $1 ORDER BY shard",
        )
        .bind(role)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect())
    }
}

/// Locks, `FOR SHARE`, the leases among `leases` that this process still holds with the same fence and that have
/// not expired; returns their shards. A takeover must wait for the caller's transaction to end.
async fn lock_valid_leases(
    tx: &mut PgConnection,
    role: &str,
    me: &str,
    leases: &[ShardLease],
) -> Result<Vec<i16>, StoreError> {
    let shards: Vec<i16> = leases.iter().map(|l| l.shard).collect();
    let fences: Vec<i64> = leases.iter().map(|l| l.fence).collect();
    let valid: Vec<i16> = sqlx::query_scalar(
        "SELECT l.shard FROM shard_leases l JOIN unnest($3::smallint[], $4::bigint[]) AS h(shard, fence) \
           ON l.shard = h.shard AND l.fence = h.fence \
         WHERE l.role = $1 AND l.owner = $2 AND l.expires_at > now() FOR SHARE OF l",
    )
    .bind(role)
    .bind(me)
    .bind(&shards)
    .bind(&fences)
    .fetch_all(&mut *tx)
    .await?;
    if valid.len() < leases.len() {
        // A process that was paused (or starved) past its lease: another owner may hold these shards now, with a
        // higher fence. Nothing is written on them.
        tracing::warn!(
            role,
            owner = me,
            held = leases.len(),
            valid = valid.len(),
            "fenced out: {} of {} shard leases expired or were taken over; nothing written on those shards",
            leases.len() - valid.len(),
            leases.len()
        );
    }
    Ok(valid)
}
