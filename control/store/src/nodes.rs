//! Nodes: created or reclaimed by joins (in batches, one transaction per token per batch), listed by operators.

use crate::iam::audit;
use crate::{Store, StoreError, from_ms, to_ms};
use bc_core::ids::{NodeId, PoolId};
use bc_core::node::{NodeState, UnknownState};
use sqlx::Row;

/// One join that passed every check that does not need the token's row lock.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JoinCandidate {
    pub node_id: String,
    /// When set, re-adopt this existing node (reclaim) instead of inserting a new one.
    #[serde(skip)]
    pub reclaim: bool,
    pub hardware_key: Option<String>,
    pub claims: serde_json::Value,
    pub join_key_hash: String,
    pub cert_serial: String,
    pub not_after_ms: i64,
    /// Hex of the node key's public point.
    pub public_key_hex: String,
}

/// What became of one candidate once the token's row was locked (decided by [`bc_core::join_commit::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinCommit {
    Joined {
        node_id: String,
        reclaimed: bool,
    },
    Revoked,
    Expired,
    Exhausted,
    /// Another live node holds this hardware key and the join does not reclaim it.
    HardwareTaken {
        node_id: String,
    },
    /// This node key already belongs to a live node, and the join is not a retry within the replay window.
    KeyTaken {
        node_id: String,
        joined_at_ms: i64,
        same_token: bool,
    },
    /// The node to reclaim was revoked or changed hardware between the check and the commit.
    ReclaimLost,
    /// A retry of a join this token already committed for this node key within the replay window: the same node,
    /// no use spent.
    Replay {
        node_id: String,
    },
    /// Concurrent commits (another token's batches) kept taking this join's key or hardware between the read of
    /// the holders and the write: nothing was written for it; a retry is judged against what exists then.
    Raced,
}

/// What [`Store::revoked_identities_since`] found: revoked node ids and revoked site ids (each a SPIFFE identity
/// the gateways refuse at the handshake), and the watermark to pass next time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevokedIdentities {
    pub nodes: Vec<String>,
    pub sites: Vec<String>,
    /// SHA-256 (hex) of node keys superseded by a reclaim: every certificate of such a key is revoked.
    pub keys: Vec<String>,
    pub watermark_ms: i64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeRow {
    pub id: NodeId,
    pub pool_id: PoolId,
    pub state: NodeState,
    pub hardware_key: Option<String>,
    pub claims: serde_json::Value,
    pub joined_at_ms: i64,
    pub cert_not_after_ms: i64,
    pub join_token_id: Option<String>,
    pub session_epoch: i64,
    pub online: bool,
    pub last_seen_ms: Option<i64>,
    pub desired_generation: i64,
    pub acked_generation: i64,
    pub conditions: serde_json::Value,
}

/// A node found by its hardware key.
#[derive(Debug, Clone)]
pub struct HardwareOwner {
    pub node_id: String,
    pub join_token_id: Option<String>,
    pub join_key_hash: String,
}

/// The last two columns: UUIDs and holders of the node's GPU conflicts, shown as conditions (see
/// [`bc_core::devices`]).
const NODE_COLUMNS: &str = "id, pool_id, state, hardware_key, claims, joined_at, cert_not_after, join_token_id, \
                            session_epoch, online, last_seen_at, desired_generation, acked_generation, conditions, \
                            ARRAY(SELECT d.uuid FROM devices d \
                                  WHERE d.node_id = nodes.id AND d.conflict_with IS NOT NULL ORDER BY d.uuid), \
                            ARRAY(SELECT d.conflict_with FROM devices d \
                                  WHERE d.node_id = nodes.id AND d.conflict_with IS NOT NULL ORDER BY d.uuid)";

/// A node row, its id, pool and state parsed (an unknown state or malformed id is an error naming the row).
fn node_from_row(row: &sqlx::postgres::PgRow) -> Result<NodeRow, StoreError> {
    let id: String = row.get(0);
    let corrupt = |what: String| StoreError::Corrupt(format!("nodes row {id:?}: {what}"));
    let state: String = row.get(2);
    Ok(NodeRow {
        id: NodeId::parse(&id).map_err(|e| corrupt(e.to_string()))?,
        pool_id: PoolId::parse(row.get(1)).map_err(|e| corrupt(e.to_string()))?,
        state: state
            .parse()
            .map_err(|e: UnknownState| corrupt(e.to_string()))?,
        hardware_key: row.get(3),
        claims: row.get(4),
        joined_at_ms: to_ms(row.get(5)),
        cert_not_after_ms: to_ms(row.get(6)),
        join_token_id: row.get(7),
        session_epoch: row.get(8),
        online: row.get(9),
        last_seen_ms: row.get::<Option<time::OffsetDateTime>, _>(10).map(to_ms),
        desired_generation: row.get(11),
        acked_generation: row.get(12),
        conditions: with_gpu_conflicts(row.get(13), row.get(14), row.get(15)),
    })
}

/// The stored conditions (the lifecycle's) followed by one per GPU conflict: conflicts end when the GPUs do, not
/// when the next acceptance check rewrites the conditions.
fn with_gpu_conflicts(
    stored: serde_json::Value,
    uuids: Vec<String>,
    holders: Vec<String>,
) -> serde_json::Value {
    if uuids.is_empty() {
        return stored;
    }
    let mut all = match stored {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Null => Vec::new(),
        other => vec![other],
    };
    for (uuid, holder) in uuids.iter().zip(&holders) {
        all.push(bc_core::devices::conflict_condition(uuid, holder).into());
    }
    serde_json::Value::Array(all)
}

/// How many times a batch is planned when concurrent commits (another token's batches) took a key or hardware
/// between the read of the holders and the write.
const PLAN_ROUNDS: usize = 3;

impl Store {
    /// Spends `token_id` for a batch of candidates in one transaction: locks the token row, reads the live nodes
    /// holding the batch's node keys and hardware keys, lets [`bc_core::join_commit::plan`] decide each candidate
    /// at `now_ms`, then inserts or reclaims the nodes it admits, decrements the uses by what was actually used,
    /// records the keys reclaims superseded (their certificates revoked) and writes one audit event per node. The
    /// returned outcomes are in the order of `candidates`.
    pub async fn commit_joins(
        &self,
        token_id: &str,
        pool_id: &str,
        candidates: &[JoinCandidate],
        now_ms: i64,
    ) -> Result<Vec<JoinCommit>, StoreError> {
        use bc_core::join_commit::{Decision, TokenState};
        let mut tx = self.pool.begin().await?;
        let token = sqlx::query(
            "SELECT uses_left, revoked_at IS NOT NULL, (extract(epoch FROM expires_at) * 1000)::bigint \
             FROM join_tokens WHERE id = $1 FOR UPDATE",
        )
        .bind(token_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| StoreError::NotFound {
            what: "join token",
            id: token_id.to_string(),
        })?;
        let mut state = TokenState {
            uses_left: i64::from(token.get::<i32, _>(0)),
            revoked: token.get(1),
            expires_at_ms: token.get(2),
        };
        let mut out: Vec<Option<JoinCommit>> = vec![None; candidates.len()];
        let mut pending: Vec<usize> = (0..candidates.len()).collect();
        let mut applied: Vec<Applied> = Vec::new();
        for _ in 0..PLAN_ROUNDS {
            if pending.is_empty() {
                break;
            }
            let batch: Vec<&JoinCandidate> = pending.iter().map(|&i| &candidates[i]).collect();
            let holders = holders_of(&mut tx, &batch).await?;
            let input: Vec<bc_core::join_commit::Candidate<'_>> = batch
                .iter()
                .map(|c| bc_core::join_commit::Candidate {
                    node_id: &c.node_id,
                    reclaim: c.reclaim,
                    hardware_key: c.hardware_key.as_deref(),
                    join_key_hash: &c.join_key_hash,
                })
                .collect();
            let decisions = bc_core::join_commit::plan(token_id, &state, &input, &holders, now_ms);
            let chosen = |want: &Decision| -> Vec<&JoinCandidate> {
                batch
                    .iter()
                    .zip(&decisions)
                    .filter(|(_, d)| *d == want)
                    .map(|(c, _)| *c)
                    .collect()
            };
            let inserted = insert_nodes(
                &mut tx,
                token_id,
                pool_id,
                &chosen(&Decision::Insert),
                now_ms,
            )
            .await?;
            let reclaimed =
                reclaim_nodes(&mut tx, token_id, &chosen(&Decision::Reclaim), now_ms).await?;
            state.uses_left -= (inserted.len() + reclaimed.len()) as i64;
            let mut raced = Vec::new();
            for (&i, d) in pending.iter().zip(decisions) {
                let c = &candidates[i];
                out[i] = Some(match d {
                    Decision::Insert if inserted.contains(&c.node_id) => {
                        applied.push(Applied {
                            index: i,
                            reclaimed: false,
                            superseded: None,
                        });
                        JoinCommit::Joined {
                            node_id: c.node_id.clone(),
                            reclaimed: false,
                        }
                    }
                    Decision::Reclaim => match reclaimed.iter().find(|(id, _)| *id == c.node_id) {
                        Some((_, superseded)) => {
                            applied.push(Applied {
                                index: i,
                                reclaimed: true,
                                superseded: superseded.clone(),
                            });
                            JoinCommit::Joined {
                                node_id: c.node_id.clone(),
                                reclaimed: true,
                            }
                        }
                        None => {
                            raced.push(i);
                            continue;
                        }
                    },
                    Decision::Insert => {
                        raced.push(i);
                        continue;
                    }
                    Decision::Replay { node_id } => JoinCommit::Replay { node_id },
                    Decision::Revoked => JoinCommit::Revoked,
                    Decision::Expired => JoinCommit::Expired,
                    Decision::Exhausted => JoinCommit::Exhausted,
                    Decision::HardwareTaken { node_id } => JoinCommit::HardwareTaken { node_id },
                    Decision::KeyTaken {
                        node_id,
                        joined_at_ms,
                        same_token,
                    } => JoinCommit::KeyTaken {
                        node_id,
                        joined_at_ms,
                        same_token,
                    },
                    Decision::ReclaimLost => JoinCommit::ReclaimLost,
                });
            }
            pending = raced;
        }
        if !applied.is_empty() {
            record_joins(&mut tx, token_id, pool_id, candidates, &applied).await?;
        }
        tx.commit().await?;
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or(JoinCommit::Raced))
            .collect())
    }

    /// The public point of a node's key (for verifying its signed results).
    pub async fn node_public_key(&self, node_id: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key: Option<Option<Vec<u8>>> =
            sqlx::query_scalar("SELECT public_key FROM nodes WHERE id = $1")
                .bind(node_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(key.flatten())
    }

    /// The live (not revoked) node holding `hardware_key`.
    pub async fn node_by_hardware_key(
        &self,
        hardware_key: &str,
    ) -> Result<Option<HardwareOwner>, StoreError> {
        let row = sqlx::query(
            "SELECT id, join_token_id, join_key_hash FROM nodes WHERE hardware_key = $1 AND state <> 'revoked'",
        )
        .bind(hardware_key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| HardwareOwner {
            node_id: r.get(0),
            join_token_id: r.get(1),
            join_key_hash: r.get(2),
        }))
    }

    /// Records the certificate most recently issued to a node.
    pub async fn record_node_cert(
        &self,
        node_id: &str,
        serial: &str,
        not_after_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE nodes SET cert_serial = $2, cert_not_after = $3, updated_at = now() WHERE id = $1")
            .bind(node_id)
            .bind(serial)
            .bind(from_ms(not_after_ms))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Identities revoked since `since_ms` (all of them when None): nodes, sites and superseded node keys, and the
    /// watermark for the next call (the database's clock now). Rows are matched with a minute of overlap, so a revocation whose transaction
    /// began before the previous read but committed after it is still found. One statement.
    pub async fn revoked_identities_since(
        &self,
        since_ms: Option<i64>,
    ) -> Result<RevokedIdentities, StoreError> {
        let row = sqlx::query(
            "SELECT (extract(epoch FROM now()) * 1000)::bigint, \
             ARRAY(SELECT id FROM nodes WHERE state = 'revoked' \
                   AND ($1::bigint IS NULL OR revoked_at > to_timestamp(($1 - 60000) / 1000.0))), \
             ARRAY(SELECT id FROM sites WHERE revoked_at IS NOT NULL \
                   AND ($1::bigint IS NULL OR revoked_at > to_timestamp(($1 - 60000) / 1000.0))), \
             ARRAY(SELECT key_hash FROM node_key_revocations \
                   WHERE $1::bigint IS NULL OR revoked_at > to_timestamp(($1 - 60000) / 1000.0))",
        )
        .bind(since_ms)
        .fetch_one(&self.pool)
        .await?;
        Ok(RevokedIdentities {
            nodes: row.get(1),
            sites: row.get(2),
            keys: row.get(3),
            watermark_ms: row.get(0),
        })
    }

    pub async fn node(&self, id: &str) -> Result<Option<NodeRow>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {NODE_COLUMNS} FROM nodes WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(node_from_row).transpose()
    }

    pub async fn list_nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {NODE_COLUMNS} FROM nodes ORDER BY joined_at, id"
        )))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(node_from_row).collect()
    }
}

// === the join commit's statements ===

/// A candidate that became a node.
struct Applied {
    index: usize,
    reclaimed: bool,
    /// The key a reclaim superseded: (key hash, its last certificate's serial).
    superseded: Option<(String, String)>,
}

const RECORD: &str = "jsonb_to_recordset($1) AS x(node_id text, hardware_key text, claims jsonb, \
                      join_key_hash text, cert_serial text, not_after_ms bigint, public_key_hex text)";

fn records(candidates: &[&JoinCandidate]) -> Result<serde_json::Value, StoreError> {
    serde_json::to_value(candidates).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// Live nodes holding one of the batch's node keys or hardware keys: one statement on the two unique indexes.
async fn holders_of(
    tx: &mut sqlx::PgConnection,
    batch: &[&JoinCandidate],
) -> Result<Vec<bc_core::join_commit::Holder>, StoreError> {
    let keys: Vec<&str> = batch.iter().map(|c| c.join_key_hash.as_str()).collect();
    let hks: Vec<&str> = batch
        .iter()
        .filter_map(|c| c.hardware_key.as_deref())
        .collect();
    let rows = sqlx::query(
        "SELECT id, join_token_id, join_key_hash, hardware_key, (extract(epoch FROM joined_at) * 1000)::bigint \
         FROM nodes WHERE state <> 'revoked' AND (join_key_hash = ANY($1) OR hardware_key = ANY($2))",
    )
    .bind(&keys)
    .bind(&hks)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .iter()
        .map(|r| bc_core::join_commit::Holder {
            node_id: r.get(0),
            join_token_id: r.get(1),
            join_key_hash: r.get(2),
            hardware_key: r.get(3),
            joined_at_ms: r.get(4),
        })
        .collect())
}

/// Inserts new nodes as `adopting`; returns the ids inserted (a concurrent commit of the same key or hardware
/// makes a row conflict, and it is skipped).
async fn insert_nodes(
    tx: &mut sqlx::PgConnection,
    token_id: &str,
    pool_id: &str,
    chosen: &[&JoinCandidate],
    now_ms: i64,
) -> Result<Vec<String>, StoreError> {
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO nodes (id, shard, pool_id, state, hardware_key, claims, join_token_id, join_key_hash, joined_at, \
         cert_serial, cert_not_after, public_key) \
         SELECT x.node_id, bc_shard(x.node_id), $2, 'adopting', x.hardware_key, x.claims, $3, x.join_key_hash, to_timestamp($4 / 1000.0), \
         x.cert_serial, to_timestamp(x.not_after_ms / 1000.0), decode(x.public_key_hex, 'hex') FROM {RECORD} \
         ON CONFLICT DO NOTHING RETURNING id"
    )))
    .bind(records(chosen)?)
    .bind(pool_id)
    .bind(token_id)
    .bind(now_ms as f64)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Re-adopts nodes with their new key: state `adopting`, the new key and certificate, and a new session epoch (the
/// old key's session can write nothing more, and its gateway closes it at the next liveness write). Returns (node
/// id, superseded (key hash, certificate serial)) per node reclaimed; the superseded key is None when the reclaim
/// kept the node's key.
async fn reclaim_nodes(
    tx: &mut sqlx::PgConnection,
    token_id: &str,
    chosen: &[&JoinCandidate],
    now_ms: i64,
) -> Result<Vec<(String, Option<(String, String)>)>, StoreError> {
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE nodes n SET state = 'adopting', claims = x.claims, join_token_id = $2, \
         join_key_hash = x.join_key_hash, joined_at = to_timestamp($3 / 1000.0), cert_serial = x.cert_serial, \
         cert_not_after = to_timestamp(x.not_after_ms / 1000.0), public_key = decode(x.public_key_hex, 'hex'), \
         session_epoch = n.session_epoch + 1, online = false, updated_at = now() \
         FROM {RECORD}, nodes o WHERE n.id = x.node_id AND o.id = n.id AND n.hardware_key = x.hardware_key \
         AND n.state <> 'revoked' RETURNING n.id, o.join_key_hash, o.cert_serial, o.join_key_hash = x.join_key_hash"
    )))
    .bind(records(chosen)?)
    .bind(token_id)
    .bind(now_ms as f64)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let kept: bool = r.get(3);
            (r.get(0), (!kept).then(|| (r.get(1), r.get(2))))
        })
        .collect())
}

/// Spends the uses, revokes the keys reclaims superseded and writes one audit event per node.
async fn record_joins(
    tx: &mut sqlx::PgConnection,
    token_id: &str,
    pool_id: &str,
    candidates: &[JoinCandidate],
    applied: &[Applied],
) -> Result<(), StoreError> {
    sqlx::query("UPDATE join_tokens SET uses_left = uses_left - $2 WHERE id = $1")
        .bind(token_id)
        .bind(i32::try_from(applied.len()).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await?;
    let ids: Vec<&str> = applied
        .iter()
        .map(|a| candidates[a.index].node_id.as_str())
        .collect();
    let reclaimed: Vec<bool> = applied.iter().map(|a| a.reclaimed).collect();
    let keys: Vec<Option<&str>> = applied
        .iter()
        .map(|a| a.superseded.as_ref().map(|(k, _)| k.as_str()))
        .collect();
    let serials: Vec<Option<&str>> = applied
        .iter()
        .map(|a| a.superseded.as_ref().map(|(_, serial)| serial.as_str()))
        .collect();
    if keys.iter().any(Option::is_some) {
        sqlx::query(
            // revoked_at is the database's clock, like the watermark gateways read revocations by.
            "INSERT INTO node_key_revocations (key_hash, node_id, cert_serial, reason) \
             SELECT k, n, s, 'superseded by a reclaim' \
             FROM unnest($1::text[], $2::text[], $3::text[]) AS u(n, k, s) WHERE k IS NOT NULL \
             ON CONFLICT (key_hash) DO NOTHING",
        )
        .bind(&ids)
        .bind(&keys)
        .bind(&serials)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query(
        "INSERT INTO audit_events (actor, action, subject, detail) \
         SELECT 'join-token/' || $1, CASE WHEN r THEN 'node.reclaimed' ELSE 'node.joined' END, 'node/' || id, \
         jsonb_strip_nulls(jsonb_build_object('pool', $2::text, 'revoked_key', k, 'revoked_cert', s)) \
         FROM unnest($3::text[], $4::bool[], $5::text[], $6::text[]) AS u(id, r, k, s)",
    )
    .bind(token_id)
    .bind(pool_id)
    .bind(&ids)
    .bind(&reclaimed)
    .bind(&keys)
    .bind(&serials)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What `nodes.delete` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeDeletion {
    Deleted,
    NotFound,
    /// Why not, as the operator is told (what to do first).
    Refused(String),
}

impl Store {
    /// Deletes a revoked node that holds no booking, with its inventory, commands and devices, and audits it. A
    /// node that is not revoked is refused (naming its bookings, if any): its certificate would still open sessions,
    /// so its identity must be refused first (revoking also releases its GPUs; a deleted node opens no session, it
    /// is unknown). A row elsewhere that still names it (an instance) is refused naming its table.
    pub async fn delete_node(&self, id: &str, actor: &str) -> Result<NodeDeletion, StoreError> {
        let mut tx = self.pool.begin().await?;
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM nodes WHERE id = $1 FOR UPDATE")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(state) = state else {
            return Ok(NodeDeletion::NotFound);
        };
        let state: NodeState = state
            .parse()
            .map_err(|e: UnknownState| StoreError::Corrupt(format!("nodes row {id:?}: {e}")))?;
        let booked: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT reservation_id FROM devices WHERE node_id = $1 AND reservation_id IS NOT NULL \
             ORDER BY 1",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await?;
        let bookings = || {
            format!(
                "it holds GPUs of reservation(s) {}: release those (`better-compute reservations release <id>`)",
                booked.join(", ")
            )
        };
        if state != NodeState::Revoked {
            let why = if booked.is_empty() {
                String::new()
            } else {
                format!(" and {}, or", bookings())
            };
            return Ok(NodeDeletion::Refused(format!(
                "node {id} is {state}{why}: revoke it first (`better-compute nodes revoke {id}`, which also \
                 releases its GPUs) so its certificate opens no session, then delete it"
            )));
        }
        if !booked.is_empty() {
            return Ok(NodeDeletion::Refused(format!(
                "node {id} is revoked but {} first",
                bookings()
            )));
        }
        let deleted = sqlx::query("DELETE FROM nodes WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await;
        if let Err(sqlx::Error::Database(e)) = &deleted
            && e.code().as_deref() == Some("23503")
        {
            return Ok(NodeDeletion::Refused(format!(
                "node {id} is still named by {} rows: delete those first",
                e.table().unwrap_or("other")
            )));
        }
        deleted?;
        audit(
            &mut tx,
            actor,
            "node.delete",
            &format!("node/{id}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(NodeDeletion::Deleted)
    }
}
