//! The module's queries: pools' port allowlists and the audit rows, one statement each.

use bc_core::api::tunnels::TunnelRecord;
use bc_store::Store;
use bc_store::StoreError;
use bc_store::sqlx;

/// The ports tunnels may reach on `pool`'s nodes (empty when none was set: every tunnel is refused).
pub async fn pool_ports(store: &Store, pool: &str) -> Result<Vec<u16>, StoreError> {
    let ports: Option<Vec<i32>> =
        sqlx::query_scalar("SELECT ports FROM tunnel_pool_ports WHERE pool_id = $1")
            .bind(pool)
            .fetch_optional(store.pool())
            .await?;
    Ok(ports
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| u16::try_from(p).ok())
        .collect())
}

/// Replaces `pool`'s allowlist; false when there is no such pool.
pub async fn set_pool_ports(store: &Store, pool: &str, ports: &[u16]) -> Result<bool, StoreError> {
    let ports: Vec<i32> = ports.iter().map(|&p| i32::from(p)).collect();
    let n = sqlx::query(
        "INSERT INTO tunnel_pool_ports (pool_id, ports) SELECT id, $2 FROM pools WHERE id = $1 \
         ON CONFLICT (pool_id) DO UPDATE SET ports = EXCLUDED.ports",
    )
    .bind(pool)
    .bind(&ports)
    .execute(store.pool())
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Who opens which tunnel.
#[derive(Debug, Clone)]
pub struct Opening<'a> {
    pub principal: &'a str,
    pub node: &'a str,
    pub pool: &'a str,
    pub port: u16,
    /// The gateway that carries it, once chosen.
    pub gateway: Option<&'a str>,
}

/// Starts a row: `outcome` is `OPEN` for a tunnel that goes on, else the refusal (stopped at once).
pub async fn start(
    store: &Store,
    o: &Opening<'_>,
    outcome: &str,
    reason: &str,
) -> Result<uuid::Uuid, StoreError> {
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO tunnel_connections \
           (id, principal_id, node_id, pool_id, port, outcome, reason, stopped_at, gateway_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, CASE WHEN $6 = 'OPEN' THEN NULL ELSE now() END, $8)",
    )
    .bind(id)
    .bind(o.principal)
    .bind(o.node)
    .bind(o.pool)
    .bind(i32::from(o.port))
    .bind(outcome)
    .bind(reason)
    .bind(o.gateway)
    .execute(store.pool())
    .await?;
    Ok(id)
}

/// Starts the `OPEN` row of a tunnel relayed by API process `worker`, unless `principal` already holds `cap` open
/// tunnels through any API process: then `Err(held)`. The count and the row are one transaction under an advisory
/// lock per principal, so two processes never both take the last place.
pub async fn start_open(
    store: &Store,
    o: &Opening<'_>,
    worker: &str,
    cap: usize,
) -> Result<Result<uuid::Uuid, i64>, StoreError> {
    let mut tx = store.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('bc-tunnels/' || $1, 0))")
        .bind(o.principal)
        .execute(&mut *tx)
        .await?;
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tunnel_connections WHERE principal_id = $1 AND stopped_at IS NULL",
    )
    .bind(o.principal)
    .fetch_one(&mut *tx)
    .await?;
    if held >= i64::try_from(cap).unwrap_or(i64::MAX) {
        return Ok(Err(held));
    }
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO tunnel_connections \
           (id, principal_id, node_id, pool_id, port, outcome, reason, gateway_id, api_worker) \
         VALUES ($1, $2, $3, $4, $5, 'OPEN', '', $6, $7)",
    )
    .bind(id)
    .bind(o.principal)
    .bind(o.node)
    .bind(o.pool)
    .bind(i32::from(o.port))
    .bind(o.gateway)
    .bind(worker)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Ok(id))
}

/// Closes (`LOST`) the open rows whose API process is no longer a live member of the `api` role (its lease ran
/// out: it died or was cut off); rows younger than 30 s are left to a process still starting. Returns how many.
pub async fn close_orphans(store: &Store) -> Result<u64, StoreError> {
    let r = sqlx::query(
        "UPDATE tunnel_connections t SET stopped_at = now(), outcome = 'LOST', \
           reason = 'the API process relaying it stopped (its membership of the api role expired)' \
         WHERE t.stopped_at IS NULL AND t.started_at < now() - interval '30 seconds' \
           AND NOT EXISTS (SELECT 1 FROM workers w \
                           WHERE w.role = 'api' AND w.id = t.api_worker AND w.expires_at > now())",
    )
    .execute(store.pool())
    .await?;
    Ok(r.rows_affected())
}

/// Ends a row with its bytes and outcome.
pub async fn stop(
    store: &Store,
    id: uuid::Uuid,
    bytes_from_node: u64,
    bytes_to_node: u64,
    outcome: &str,
    reason: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE tunnel_connections SET stopped_at = now(), bytes_from_node = $2, bytes_to_node = $3, \
         outcome = $4, reason = $5 WHERE id = $1",
    )
    .bind(id)
    .bind(i64::try_from(bytes_from_node).unwrap_or(i64::MAX))
    .bind(i64::try_from(bytes_to_node).unwrap_or(i64::MAX))
    .bind(outcome)
    .bind(reason)
    .execute(store.pool())
    .await?;
    Ok(())
}

type Row = (
    uuid::Uuid,
    String,
    String,
    String,
    i32,
    i64,
    Option<i64>,
    i64,
    i64,
    String,
    String,
    Option<String>,
);

/// The newest `limit` rows (of `node` when given).
pub async fn list(
    store: &Store,
    node: Option<&str>,
    limit: u32,
) -> Result<Vec<TunnelRecord>, StoreError> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, principal_id, node_id, pool_id, port, \
                (extract(epoch FROM started_at) * 1000)::bigint, \
                (extract(epoch FROM stopped_at) * 1000)::bigint, \
                bytes_from_node, bytes_to_node, outcome, reason, gateway_id \
         FROM tunnel_connections WHERE ($1::text IS NULL OR node_id = $1) \
         ORDER BY started_at DESC, id DESC LIMIT $2",
    )
    .bind(node)
    .bind(i64::from(limit))
    .fetch_all(store.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| TunnelRecord {
            id: r.0.to_string(),
            principal: r.1,
            node: r.2,
            pool: r.3,
            port: u16::try_from(r.4).unwrap_or(0),
            started_at_ms: r.5,
            stopped_at_ms: r.6,
            bytes_from_node: r.7,
            bytes_to_node: r.8,
            outcome: r.9,
            reason: r.10,
            gateway: r.11,
        })
        .collect())
}
