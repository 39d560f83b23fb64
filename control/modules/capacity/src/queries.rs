//! The capacity module's own queries and schema: the pool leases of the pool-lease placer (`scheduler/pool:<pool>`,
//! with an expiry and a fencing token, like the shard leases) and the pending reservations of the pools a placer
//! holds (the tables are in the base schema, `0013_pool_leases.sql`, so every test database and `migrate` has them).
//! Everything else it reads and writes is bc-store's (the reservation rows the controllers' expiry shares).

use bc_store::reservations::Pending;
use bc_store::sqlx::{self, Postgres, Row, Transaction};
use bc_store::{Store, StoreError};

/// A pool this process holds and the fencing token it holds it with: bookings in the pool commit only while the
/// lease row still carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLease {
    pub pool: String,
    pub fence: i64,
}

/// How many processes of `role` are alive (an unexpired worker row).
pub async fn live_workers(store: &Store, role: &str) -> Result<i64, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM workers WHERE role = $1 AND expires_at > now()")
            .bind(role)
            .fetch_one(store.pool())
            .await?,
    )
}

/// Every pool's id.
pub async fn pools(store: &Store) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar("SELECT id FROM pools ORDER BY id")
        .fetch_all(store.pool())
        .await?)
}

/// Makes `me`'s pool leases match `want`, like [`Store::sync_leases`] for shards: renews the wanted pools it
/// holds, takes wanted pools that are free or expired (the fence increases on every change of owner), lets go of
/// the rest (expired at once, fence kept). Returns the leases held now.
pub async fn sync_pool_leases(
    store: &Store,
    me: &str,
    want: &[String],
    ttl_ms: i64,
) -> Result<Vec<PoolLease>, StoreError> {
    let rows = sqlx::query(
        "WITH rel AS (UPDATE pool_leases SET expires_at = now() - interval '1 millisecond' \
             WHERE owner = $1 AND NOT (pool = ANY($2)) AND expires_at > now()), \
         acq AS (INSERT INTO pool_leases (pool, owner, fence, expires_at) \
             SELECT p, $1, 1, now() + make_interval(secs => $3 / 1000.0) FROM unnest($2::text[]) AS p \
             ON CONFLICT (pool) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at, \
               fence = CASE WHEN pool_leases.owner = EXCLUDED.owner AND pool_leases.expires_at > now() \
                            THEN pool_leases.fence ELSE pool_leases.fence + 1 END \
             WHERE pool_leases.owner = EXCLUDED.owner OR pool_leases.expires_at < now() \
             RETURNING pool, fence) \
         SELECT pool, fence FROM acq ORDER BY pool",
    )
    .bind(me)
    .bind(want)
    .bind(ttl_ms as f64)
    .fetch_all(store.pool())
    .await?;
    Ok(rows
        .iter()
        .map(|r| PoolLease {
            pool: r.get(0),
            fence: r.get(1),
        })
        .collect())
}

/// Lets go of every pool lease `me` holds (a clean shutdown): they expire now, fences kept.
pub async fn leave_pools(store: &Store, me: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE pool_leases SET expires_at = now() - interval '1 millisecond' WHERE owner = $1 AND expires_at > now()",
    )
    .bind(me)
    .execute(store.pool())
    .await?;
    Ok(())
}

/// The pool leases as stored: (pool, owner, fence, still valid).
pub async fn pool_leases(store: &Store) -> Result<Vec<(String, String, i64, bool)>, StoreError> {
    let rows =
        sqlx::query("SELECT pool, owner, fence, expires_at > now() FROM pool_leases ORDER BY pool")
            .fetch_all(store.pool())
            .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
}

/// The pool-lease placer's transaction, part 1: locks, `FOR SHARE`, the leases among `held` that `me` still holds
/// with the same fence and that have not expired (a takeover, an UPDATE of the row, waits for this transaction),
/// then claims pending reservations of those pools (SKIP LOCKED) — all of them, or those among `ids`. Returns the
/// transaction (which [`Store::commit_placements`] commits), the pools still held and the claimed reservations.
pub async fn claim_pending_in_pools(
    store: &Store,
    me: &str,
    held: &[PoolLease],
    ids: Option<&[String]>,
    limit: i64,
) -> Result<(Transaction<'static, Postgres>, Vec<String>, Vec<Pending>), StoreError> {
    let mut tx = store.begin_placement().await?;
    let pools: Vec<&str> = held.iter().map(|l| l.pool.as_str()).collect();
    let fences: Vec<i64> = held.iter().map(|l| l.fence).collect();
    let valid: Vec<String> = sqlx::query_scalar(
        "SELECT l.pool FROM pool_leases l JOIN unnest($2::text[], $3::bigint[]) AS h(pool, fence) \
           ON l.pool = h.pool AND l.fence = h.fence \
         WHERE l.owner = $1 AND l.expires_at > now() ORDER BY l.pool FOR SHARE OF l",
    )
    .bind(me)
    .bind(&pools)
    .bind(&fences)
    .fetch_all(&mut *tx)
    .await?;
    if valid.is_empty() {
        return Ok((tx, valid, Vec::new()));
    }
    // Two statements, not one with `$2 IS NULL OR id = ANY($2)`: the transaction runs generic plans
    // ([`Store::begin_placement`]), and a generic plan of that disjunction cannot look the named ids up by key. The
    // named ones are read by key alone and their state checked on the locked rows, as
    // [`Store::claim_pending_ids`] does (`state = 'pending'` would let the generic plan walk the partial index).
    let rows = match ids {
        Some(ids) => {
            let rows = sqlx::query(
                "SELECT id, request, state, extract(epoch FROM clock_timestamp() - created_at)::float8 \
                 FROM reservations WHERE id = ANY($2) AND pool = ANY($1) \
                 ORDER BY created_at LIMIT $3 FOR UPDATE SKIP LOCKED",
            )
            .bind(&valid)
            .bind(ids)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
            rows.into_iter()
                .filter(|r| r.get::<&str, _>(2) == "pending")
                .collect()
        }
        None => sqlx::query(
            "SELECT id, request, state, extract(epoch FROM clock_timestamp() - created_at)::float8 \
                 FROM reservations WHERE state = 'pending' AND pool IS NOT NULL AND pool = ANY($1) \
                 ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(&valid)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?,
    };
    let pending = rows
        .iter()
        .map(bc_store::reservations::pending_row)
        .collect();
    Ok((tx, valid, pending))
}
