//! Nodes: created or reclaimed by joins (in batches, one transaction per token per batch), listed by operators.

use crate::{Store, StoreError, from_ms, to_ms};
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

/// What became of one candidate once the token's row was locked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinCommit {
    Joined {
        node_id: String,
        reclaimed: bool,
    },
    Revoked,
    Expired,
    Exhausted,
    /// Another live node already holds this hardware key. `same_key` when that node joined with the same token and
    /// node key (a retry that raced its own first attempt).
    HardwareTaken {
        node_id: String,
        same_key: bool,
    },
    /// The node to reclaim was revoked or changed hardware between the check and the commit.
    ReclaimLost,
    /// A retry of a join this token already committed for this node key within the replay window: the same node,
    /// no use spent.
    Replay {
        node_id: String,
    },
}

/// What [`Store::revoked_identities_since`] found: revoked node ids and revoked site ids (each a SPIFFE identity
/// the gateways refuse at the handshake), and the watermark to pass next time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevokedIdentities {
    pub nodes: Vec<String>,
    pub sites: Vec<String>,
    pub watermark_ms: i64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeRow {
    pub id: String,
    pub pool_id: String,
    pub state: String,
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

const NODE_COLUMNS: &str = "id, pool_id, state, hardware_key, claims, joined_at, cert_not_after, join_token_id, \
                            session_epoch, online, last_seen_at, desired_generation, acked_generation, conditions";

fn node_from_row(row: &sqlx::postgres::PgRow) -> NodeRow {
    NodeRow {
        id: row.get(0),
        pool_id: row.get(1),
        state: row.get(2),
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
        conditions: row.get(13),
    }
}

impl Store {
    /// Spends `token_id` for a batch of candidates in one transaction: locks the token row, grants at most
    /// `uses_left` of them in order, reclaims or inserts the nodes, decrements the uses by what was actually used,
    /// and writes one audit event per node. The returned outcomes are in the order of `candidates`.
    pub async fn commit_joins(
        &self,
        token_id: &str,
        pool_id: &str,
        candidates: &[JoinCandidate],
    ) -> Result<Vec<JoinCommit>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let token = sqlx::query(
            "SELECT uses_left, revoked_at IS NOT NULL, expires_at <= now() FROM join_tokens WHERE id = $1 FOR UPDATE",
        )
        .bind(token_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| StoreError::NotFound {
            what: "join token",
            id: token_id.to_string(),
        })?;
        let (uses_left, revoked, expired): (i32, bool, bool) =
            (token.get(0), token.get(1), token.get(2));
        if revoked {
            return Ok(vec![JoinCommit::Revoked; candidates.len()]);
        }
        if expired {
            tx.commit().await?;
            let keys: Vec<&str> = candidates
                .iter()
                .map(|c| c.join_key_hash.as_str())
                .collect();
            let replays = self
                .recent_joins_by_key(token_id, &keys, bc_core::join::REPLAY_WINDOW_MS)
                .await?;
            return Ok(candidates
                .iter()
                .map(
                    |c| match replays.iter().find(|(k, _)| *k == c.join_key_hash) {
                        Some((_, node_id)) => JoinCommit::Replay {
                            node_id: node_id.clone(),
                        },
                        None => JoinCommit::Expired,
                    },
                )
                .collect());
        }
        let granted = usize::try_from(uses_left)
            .unwrap_or(0)
            .min(candidates.len());
        let (chosen, _) = candidates.split_at(granted);
        let to_json = |reclaim: bool| {
            serde_json::to_value(
                chosen
                    .iter()
                    .filter(|c| c.reclaim == reclaim)
                    .collect::<Vec<_>>(),
            )
            .map_err(|e| StoreError::Corrupt(e.to_string()))
        };
        const RECORD: &str = "jsonb_to_recordset($1) AS x(node_id text, hardware_key text, claims jsonb, \
                              join_key_hash text, cert_serial text, not_after_ms bigint, public_key_hex text)";
        let mut done: Vec<(String, bool)> = Vec::with_capacity(granted);
        if chosen.iter().any(|c| c.reclaim) {
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE nodes n SET state = 'adopting', claims = x.claims, join_token_id = $2, \
                 join_key_hash = x.join_key_hash, joined_at = now(), cert_serial = x.cert_serial, \
                 cert_not_after = to_timestamp(x.not_after_ms / 1000.0), public_key = decode(x.public_key_hex, 'hex'), \
                 updated_at = now() \
                 FROM {RECORD} WHERE n.id = x.node_id AND n.hardware_key = x.hardware_key AND n.state <> 'revoked' \
                 AND n.join_key_hash <> x.join_key_hash RETURNING n.id"
            )))
            .bind(to_json(true)?)
            .bind(token_id)
            .fetch_all(&mut *tx)
            .await?;
            done.extend(rows.iter().map(|r| (r.get::<String, _>(0), true)));
        }
        if chosen.iter().any(|c| !c.reclaim) {
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO nodes (id, pool_id, state, hardware_key, claims, join_token_id, join_key_hash, joined_at, \
                 cert_serial, cert_not_after, public_key) \
                 SELECT x.node_id, $2, 'adopting', x.hardware_key, x.claims, $3, x.join_key_hash, now(), \
                 x.cert_serial, to_timestamp(x.not_after_ms / 1000.0), decode(x.public_key_hex, 'hex') FROM {RECORD} \
                 ON CONFLICT DO NOTHING RETURNING id"
            )))
            .bind(to_json(false)?)
            .bind(pool_id)
            .bind(token_id)
            .fetch_all(&mut *tx)
            .await?;
            done.extend(rows.iter().map(|r| (r.get::<String, _>(0), false)));
        }
        if !done.is_empty() {
            let used = i32::try_from(done.len()).unwrap_or(i32::MAX);
            sqlx::query("UPDATE join_tokens SET uses_left = uses_left - $2 WHERE id = $1")
                .bind(token_id)
                .bind(used)
                .execute(&mut *tx)
                .await?;
            let ids: Vec<&str> = done.iter().map(|(id, _)| id.as_str()).collect();
            let reclaimed: Vec<bool> = done.iter().map(|(_, r)| *r).collect();
            sqlx::query(
                "INSERT INTO audit_events (actor, action, subject, detail) \
                 SELECT 'join-token/' || $1, CASE WHEN r THEN 'node.reclaimed' ELSE 'node.joined' END, \
                 'node/' || id, jsonb_build_object('pool', $2::text) FROM unnest($3::text[], $4::bool[]) AS u(id, r)",
            )
            .bind(token_id)
            .bind(pool_id)
            .bind(&ids)
            .bind(&reclaimed)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;

        // Candidates that did not become nodes: a retry of an earlier join with the same key is a replay (unless
        // the token was revoked since); otherwise say why.
        let missing: Vec<&str> = candidates
            .iter()
            .enumerate()
            .filter(|(i, c)| *i >= granted || !done.iter().any(|(id, _)| *id == c.node_id))
            .map(|(_, c)| c.join_key_hash.as_str())
            .collect();
        let replays = self
            .recent_joins_by_key(token_id, &missing, bc_core::join::REPLAY_WINDOW_MS)
            .await?;
        let mut out = Vec::with_capacity(candidates.len());
        for (i, c) in candidates.iter().enumerate() {
            if let Some((_, reclaimed)) = done.iter().find(|(id, _)| *id == c.node_id) {
                out.push(JoinCommit::Joined {
                    node_id: c.node_id.clone(),
                    reclaimed: *reclaimed,
                });
            } else if let Some((_, node_id)) = replays.iter().find(|(k, _)| *k == c.join_key_hash) {
                out.push(JoinCommit::Replay {
                    node_id: node_id.clone(),
                });
            } else if i >= granted {
                out.push(JoinCommit::Exhausted);
            } else if c.reclaim {
                out.push(JoinCommit::ReclaimLost);
            } else {
                let owner = match &c.hardware_key {
                    Some(hk) => self.node_by_hardware_key(hk).await?,
                    None => None,
                };
                out.push(match owner {
                    Some(o) => JoinCommit::HardwareTaken {
                        same_key: o.join_key_hash == c.join_key_hash
                            && o.join_token_id.as_deref() == Some(token_id),
                        node_id: o.node_id,
                    },
                    // The conflicting node was revoked in between: report it as taken; a retry will succeed.
                    None => JoinCommit::HardwareTaken {
                        node_id: String::new(),
                        same_key: false,
                    },
                });
            }
        }
        Ok(out)
    }

    /// (key hash, node id) of live nodes that joined with `token_id` and one of `key_hashes` within `window_ms`:
    /// retries of joins whose reply was lost.
    pub async fn recent_joins_by_key(
        &self,
        token_id: &str,
        key_hashes: &[&str],
        window_ms: i64,
    ) -> Result<Vec<(String, String)>, StoreError> {
        if key_hashes.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(
            "SELECT join_key_hash, id FROM nodes WHERE join_token_id = $1 AND join_key_hash = ANY($2) \
             AND joined_at > now() - make_interval(secs => $3 / 1000.0) AND state <> 'revoked'",
        )
        .bind(token_id)
        .bind(key_hashes)
        .bind(window_ms as f64)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
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

    /// Identities revoked since `since_ms` (all of them when None): nodes and sites, and the watermark for the next
    /// call (the database's clock now). Rows are matched with a minute of overlap, so a revocation whose transaction
    /// began before the previous read but committed after it is still found. One statement.
    pub async fn revoked_identities_since(
        &self,
        since_ms: Option<i64>,
    ) -> Result<RevokedIdentities, StoreError> {
        let row = sqlx::query(
            "SELECT (extract(epoch FROM now()) * 1000)::bigint, \
             ARRAY(SELECT id FROM nodes WHERE state = 'revoked' \
                   AND ($1::bigint IS NULL OR updated_at > to_timestamp(($1 - 60000) / 1000.0))), \
             ARRAY(SELECT id FROM sites WHERE revoked_at IS NOT NULL \
                   AND ($1::bigint IS NULL OR revoked_at > to_timestamp(($1 - 60000) / 1000.0)))",
        )
        .bind(since_ms)
        .fetch_one(&self.pool)
        .await?;
        Ok(RevokedIdentities {
            nodes: row.get(1),
            sites: row.get(2),
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
        Ok(row.as_ref().map(node_from_row))
    }

    pub async fn list_nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {NODE_COLUMNS} FROM nodes ORDER BY joined_at, id"
        )))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(node_from_row).collect())
    }
}
