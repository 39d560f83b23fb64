//! Sessions in the store: epochs, batched liveness, inventory sections, desired state acknowledgements and
//! commands. Every write of a session names its epoch and is refused when the node has a newer one.

use crate::iam::audit;
use crate::{Store, StoreError};
use bc_core::api::nodes::{CommandState, UnknownCommandState};
use bc_core::ids::{CommandId, NodeId};
use bc_core::node::NodeState;
use sqlx::Row;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenRefusal {
    Unknown,
    Revoked,
    /// The certificate certifies a key that is not the node's current one (a reclaim superseded it).
    KeySuperseded,
}

#[derive(Debug, Clone)]
pub struct OpenedSession {
    pub epoch: i64,
    pub state: String,
    /// (section name, hash) the store holds.
    pub stored_hashes: Vec<(String, String)>,
}

/// A pending message for a live session.
#[derive(Debug, Clone)]
pub enum Outgoing {
    Command {
        node_id: String,
        id: String,
        kind: String,
        args: serde_json::Value,
        deadline_ms: i64,
    },
    Desired {
        node_id: String,
        generation: i64,
        spec: serde_json::Value,
    },
}

impl Store {
    /// Bumps the node's session epoch, marks it online and records the transition when it was offline — only for
    /// a node that is not revoked and whose current key is `public_key` (the uncompressed point the session's
    /// certificate certifies), checked in the same statement: a superseded key can neither open a session nor, by
    /// bumping the epoch, close the current one.
    pub async fn open_session(
        &self,
        node_id: &str,
        public_key: &[u8],
    ) -> Result<Result<OpenedSession, OpenRefusal>, StoreError> {
        self.open_session_on(node_id, public_key, None).await
    }

    /// [`Store::open_session`], recording `gateway_id` as the gateway that holds the session (the session row names
    /// its gateway: the tunnel relay finds the node there).
    pub async fn open_session_on(
        &self,
        node_id: &str,
        public_key: &[u8],
        gateway_id: Option<&str>,
    ) -> Result<Result<OpenedSession, OpenRefusal>, StoreError> {
        let mut opened = self
            .open_sessions_on(&[(node_id, public_key)], gateway_id)
            .await?;
        Ok(opened.pop().unwrap_or(Err(OpenRefusal::Unknown)))
    }

    /// [`Store::open_session_on`] for many sessions at once, in one statement per round (a round holds each node
    /// once: a node named twice opens twice, one round after the other, as two opens one after the other would).
    /// The answers are in the order of `opens`. A reconnect storm is tens of thousands of opens, and the nodes
    /// module's session backend groups those that wait together: one statement and one commit per group instead of
    /// one per node.
    pub async fn open_sessions_on(
        &self,
        opens: &[(&str, &[u8])],
        gateway_id: Option<&str>,
    ) -> Result<Vec<Result<OpenedSession, OpenRefusal>>, StoreError> {
        let mut answers: Vec<Option<Result<OpenedSession, OpenRefusal>>> = vec![None; opens.len()];
        let mut left: Vec<usize> = (0..opens.len()).collect();
        while !left.is_empty() {
            let mut seen = std::collections::HashSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) =
                left.iter().partition(|&&i| seen.insert(opens[i].0));
            let ids: Vec<&str> = round.iter().map(|&i| opens[i].0).collect();
            let keys: Vec<&[u8]> = round.iter().map(|&i| opens[i].1).collect();
            // One statement, so one round trip and one implicit transaction: the bumps, the transitions' audit rows
            // for nodes that were offline, and the inventory hashes the store holds (a data-modifying WITH runs to
            // completion whether or not the outer query reads it). The rows are locked in id order first (`l`), so
            // two gateways' rounds that share nodes cannot deadlock; `l` also gives each node's online as it was.
            let rows = sqlx::query(
                "WITH x AS (SELECT * FROM unnest($1::text[], $2::bytea[]) AS x(id, key)), \
                 l AS (SELECT id, online FROM nodes WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE), \
                 u AS (UPDATE nodes n SET session_epoch = n.session_epoch + 1, online = true, \
                 last_seen_at = now(), gateway_id = $3 \
                 FROM x JOIN l ON l.id = x.id WHERE n.id = x.id AND n.state <> 'revoked' AND n.public_key = x.key \
                 RETURNING n.id, n.session_epoch, n.state, l.online), \
                 a AS (INSERT INTO audit_events (actor, action, subject, detail) \
                 SELECT 'gateway', 'node.online', 'node/' || u.id, jsonb_build_object('epoch', u.session_epoch) \
                 FROM u WHERE NOT u.online) \
                 SELECT u.id, u.session_epoch, u.state, h.names, h.hashes FROM u, \
                 LATERAL (SELECT array_agg(name ORDER BY name) AS names, array_agg(hash ORDER BY name) AS hashes \
                 FROM inventory_sections WHERE node_id = u.id) h",
            )
            .bind(&ids)
            .bind(&keys)
            .bind(gateway_id)
            .fetch_all(&self.pool)
            .await?;
            let mut opened: std::collections::HashMap<String, OpenedSession> = rows
                .iter()
                .map(|row| {
                    let names: Option<Vec<String>> = row.get(3);
                    let hashes: Option<Vec<String>> = row.get(4);
                    (
                        row.get::<String, _>(0),
                        OpenedSession {
                            epoch: row.get(1),
                            state: row.get(2),
                            stored_hashes: names
                                .unwrap_or_default()
                                .into_iter()
                                .zip(hashes.unwrap_or_default())
                                .collect(),
                        },
                    )
                })
                .collect();
            for &i in &round {
                let (node_id, public_key) = opens[i];
                answers[i] = Some(match opened.remove(node_id) {
                    Some(o) => Ok(o),
                    None => Err(self.open_refusal(node_id, public_key).await?),
                });
            }
            left = later;
        }
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or(Err(OpenRefusal::Unknown)))
            .collect())
    }

    /// Why an open of `node_id` with `public_key` changed nothing.
    async fn open_refusal(
        &self,
        node_id: &str,
        public_key: &[u8],
    ) -> Result<OpenRefusal, StoreError> {
        let found: Option<(String, bool)> = sqlx::query_as(
            "SELECT state, public_key IS NOT DISTINCT FROM $2 FROM nodes WHERE id = $1",
        )
        .bind(node_id)
        .bind(public_key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match found {
            None => OpenRefusal::Unknown,
            Some((state, _)) if matches!(state.parse(), Ok(NodeState::Revoked)) => {
                OpenRefusal::Revoked
            }
            Some(_) => OpenRefusal::KeySuperseded,
        })
    }

    /// Stores an inventory section if `epoch` is still the node's; false when the session is stale.
    pub async fn put_inventory(
        &self,
        node_id: &str,
        epoch: i64,
        name: &str,
        hash: &str,
        payload: &serde_json::Value,
    ) -> Result<bool, StoreError> {
        let n = sqlx::query(
            "INSERT INTO inventory_sections (node_id, name, hash, payload) \
             SELECT $1, $3, $4, $5 WHERE EXISTS (SELECT 1 FROM nodes WHERE id = $1 AND session_epoch = $2) \
             ON CONFLICT (node_id, name) DO UPDATE SET hash = $4, payload = $5, updated_at = now()",
        )
        .bind(node_id)
        .bind(epoch)
        .bind(name)
        .bind(hash)
        .bind(payload)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if n == 1 && name == "gpus" {
            self.poke(crate::pokes::LIFECYCLE, node_id).await?;
        }
        Ok(n == 1)
    }

    pub async fn inventory(
        &self,
        node_id: &str,
    ) -> Result<Vec<(String, String, serde_json::Value)>, StoreError> {
        let rows = sqlx::query(
            "SELECT name, hash, payload FROM inventory_sections WHERE node_id = $1 ORDER BY name",
        )
        .bind(node_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }

    /// Records a desired-state acknowledgement; false when the session is stale. `applied` advances the node's
    /// acknowledged (applied) generation; a failure records `message` as the node's reason and leaves the
    /// acknowledged generation where it is, so the generation is sent again on the node's next session (a failure
    /// of a generation older than one already applied changes nothing).
    pub async fn ack_desired(
        &self,
        node_id: &str,
        epoch: i64,
        generation: i64,
        applied: bool,
        message: &str,
    ) -> Result<bool, StoreError> {
        let message = bounded_reason(message);
        let n = sqlx::query(
            "UPDATE nodes SET \
               acked_generation = CASE WHEN $4 THEN GREATEST(acked_generation, $3) ELSE acked_generation END, \
               failed_generation = CASE WHEN NOT $4 AND $3 > acked_generation \
                 THEN GREATEST(failed_generation, $3) ELSE failed_generation END, \
               ack_message = CASE WHEN NOT $4 AND $3 > acked_generation THEN $5 ELSE ack_message END, \
               ack_failed_at = CASE WHEN NOT $4 AND $3 > acked_generation \
                 THEN (CASE WHEN failed_generation > acked_generation THEN ack_failed_at ELSE now() END) \
                 ELSE ack_failed_at END, \
               ack_outcome = CASE WHEN $4 THEN 'applied' ELSE 'failed' END, updated_at = now() \
             WHERE id = $1 AND session_epoch = $2 AND desired_generation >= $3",
        )
        .bind(node_id)
        .bind(epoch)
        .bind(generation)
        .bind(applied)
        .bind(&message)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    /// One statement for every live session of a gateway: records last-seen where the epoch is current and
    /// returns the nodes whose sessions must close: revoked, a newer epoch elsewhere, or offline, which a session
    /// the store has closed is (its close was written while this round was under way, or the `controllers` role took
    /// it for dead while its gateway was cut off from the database: [`Store::offline_on_silent_gateways`]). The
    /// node then reconnects, and its open records it online again; liveness never marks a node online. A row is
    /// rewritten only when the session's last-seen is more than `resolution_ms` ahead of the stored one, so an online
    /// node's `last_seen_at` is at most that (and one interval) behind; the close writes the exact one
    /// ([`Store::close_sessions`]). At 0 every message moves it: with 15 s heartbeats and a 5 s interval a third of
    /// the row versions of rewriting every row every time; at 60 s, one row version per node every 75 s.
    /// A session's first last-seen is its Hello, before the open stored the database's time, so a session just
    /// opened is not written again. (A data-modifying WITH runs to completion whether or not the outer query reads
    /// it.)
    ///
    /// Each session is one index lookup (the `LATERAL … LIMIT 1` cannot be planned as anything else) and each row
    /// written one fetch by its `ctid`, whatever the statistics say. Written as a join, the plan followed them: after
    /// a fleet had been analyzed offline and then came online, PostgreSQL estimated one online node and joined a
    /// sequential scan of `nodes` to every session of the round, 11.4 s for 2,500 sessions of 50,000 nodes where
    /// this takes 39 ms (`scripts/bench sessions` saw it: 12.3 s per liveness statement at 10,000 sessions). A row
    /// that another statement updated since this one's snapshot is left to the next round (its new version has
    /// another `ctid`).
    pub async fn record_liveness(
        &self,
        seen: &[(String, i64, i64)],
        resolution_ms: i64,
    ) -> Result<Vec<String>, StoreError> {
        let ids: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        let epochs: Vec<i64> = seen.iter().map(|s| s.1).collect();
        let at: Vec<i64> = seen.iter().map(|s| s.2).collect();
        let rows = sqlx::query(
            "WITH x AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS x(id, epoch, ms)), \
             live AS (SELECT x.id, x.epoch, x.ms, n.at, n.due FROM x CROSS JOIN LATERAL ( \
                        SELECT n.ctid AS at, \
                          (n.last_seen_at IS NULL OR n.last_seen_at < to_timestamp((x.ms - $4) / 1000.0)) AS due \
                        FROM nodes n WHERE n.id = x.id AND n.session_epoch = x.epoch \
                        AND n.state <> 'revoked' AND n.online LIMIT 1) n), \
             u AS (UPDATE nodes n SET last_seen_at = to_timestamp(l.ms / 1000.0) FROM live l \
                   WHERE l.due AND n.ctid = l.at AND n.id = l.id AND n.session_epoch = l.epoch \
                   AND n.state <> 'revoked' AND n.online \
                   AND (n.last_seen_at IS NULL OR n.last_seen_at < to_timestamp((l.ms - $4) / 1000.0)) \
                   RETURNING n.id) \
             SELECT x.id FROM x WHERE x.id NOT IN (SELECT id FROM live)",
        )
        .bind(&ids)
        .bind(&epochs)
        .bind(&at)
        .bind(resolution_ms.max(0))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Marks the node offline if `epoch` is still its session, recording the transition.
    pub async fn close_session(&self, node_id: &str, epoch: i64) -> Result<(), StoreError> {
        self.close_sessions(&[(node_id, epoch, None)]).await
    }

    /// [`Store::close_session`] for many sessions at once, in one statement (one round trip, one implicit
    /// transaction): each node whose session is still `epoch` goes offline, with a `node.offline` audit row; a node
    /// that opened a newer session meanwhile, on this gateway or another, is left as it is. A gateway that stops
    /// closes every session it holds at once, and one statement per close recorded about 1,000 a second in
    /// `scripts/bench sessions`' rolling restart, fewer than a gateway of 8,000 sessions has in its 5 s drain.
    /// The rows are locked in id order first, as the opens lock theirs, so a round of opens and a round of closes
    /// that share nodes cannot deadlock. Each close may carry when the gateway last heard from the session
    /// (milliseconds since the epoch): the node's `last_seen_at` moves to it (never back), exact where liveness
    /// writes it only coarsely ([`Store::record_liveness`]).
    pub async fn close_sessions(
        &self,
        closes: &[(&str, i64, Option<i64>)],
    ) -> Result<(), StoreError> {
        self.close_sessions_because(closes, None).await.map(drop)
    }

    /// [`Store::close_sessions`] with the `reason` each `node.offline` row gives (none: the session ended as
    /// sessions end); returns how many nodes went offline.
    pub async fn close_sessions_because(
        &self,
        closes: &[(&str, i64, Option<i64>)],
        reason: Option<&str>,
    ) -> Result<u64, StoreError> {
        let ids: Vec<&str> = closes.iter().map(|c| c.0).collect();
        let epochs: Vec<i64> = closes.iter().map(|c| c.1).collect();
        let seen: Vec<Option<i64>> = closes.iter().map(|c| c.2).collect();
        let written = sqlx::query(
            "WITH x AS (SELECT * FROM unnest($1::text[], $2::bigint[], $4::bigint[]) AS x(id, epoch, ms)), \
             l AS (SELECT n.id, x.ms FROM nodes n JOIN x ON n.id = x.id AND n.session_epoch = x.epoch \
             WHERE n.online ORDER BY n.id FOR UPDATE OF n), \
             u AS (UPDATE nodes n SET online = false, \
                   last_seen_at = GREATEST(n.last_seen_at, to_timestamp(l.ms / 1000.0)) \
                   FROM l WHERE n.id = l.id RETURNING n.id, n.session_epoch) \
             INSERT INTO audit_events (actor, action, subject, detail) \
             SELECT 'gateway', 'node.offline', 'node/' || u.id, \
               jsonb_strip_nulls(jsonb_build_object('epoch', u.session_epoch, 'reason', $3::text)) FROM u",
        )
        .bind(&ids)
        .bind(&epochs)
        .bind(reason)
        .bind(&seen)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(written)
    }

    /// Claims commands for the given live sessions (marking them sent on that epoch) and lists desired state newer
    /// than what the node acknowledged, in one statement. Delivery is at least once: besides pending commands, a
    /// command `sent` on an older session of the node (which may have died before the daemon received it) and not
    /// past its deadline is sent again on the current one. The daemon runs an id once and answers a repeat with
    /// its stored result; the gateway acknowledges a repeated result of a finished command and changes nothing.
    /// `now_ms` is the caller's clock: a command whose deadline is not after it is not sent again.
    pub async fn pending_for(
        &self,
        nodes: &[(String, i64)],
        now_ms: i64,
    ) -> Result<Vec<Outgoing>, StoreError> {
        let ids: Vec<&str> = nodes.iter().map(|n| n.0.as_str()).collect();
        let epochs: Vec<i64> = nodes.iter().map(|n| n.1).collect();
        let rows = sqlx::query(
            "WITH x AS (SELECT * FROM unnest($1::text[], $2::bigint[]) AS x(id, epoch)), \
             c AS (UPDATE commands c SET state = 'sent', sent_at = now(), sent_epoch = x.epoch, \
                   deliveries = c.deliveries + 1 FROM nodes n, x \
                   WHERE c.node_id = n.id AND n.id = x.id AND n.session_epoch = x.epoch \
                   AND (c.state = 'pending' OR (c.state = 'sent' AND COALESCE(c.sent_epoch, 0) < x.epoch \
                        AND c.deadline_at > to_timestamp($3 / 1000.0))) \
                   RETURNING c.node_id, c.id, c.kind, c.args, (extract(epoch FROM c.deadline_at) * 1000)::bigint AS ms) \
             SELECT true, node_id, id, kind, args, ms, NULL::bigint, NULL::jsonb FROM c \
             UNION ALL \
             SELECT false, n.id, NULL, NULL, NULL, NULL, n.desired_generation, n.desired_spec FROM nodes n \
             JOIN x ON x.id = n.id WHERE n.desired_generation > n.acked_generation",
        )
        .bind(&ids)
        .bind(&epochs)
        .bind(now_ms as f64)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| {
                if r.get::<bool, _>(0) {
                    Outgoing::Command {
                        node_id: r.get(1),
                        id: r.get(2),
                        kind: r.get(3),
                        args: r.get(4),
                        deadline_ms: r.get(5),
                    }
                } else {
                    Outgoing::Desired {
                        node_id: r.get(1),
                        generation: r.get(6),
                        spec: r.get(7),
                    }
                }
            })
            .collect())
    }

    /// Queues a command for a node.
    pub async fn queue_command(
        &self,
        id: &str,
        node_id: &str,
        kind: &str,
        args: &serde_json::Value,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "WITH i AS (INSERT INTO commands (id, node_id, kind, args, deadline_at) \
             VALUES ($1, $2, $3, $4, to_timestamp($5 / 1000.0)) RETURNING node_id) \
             SELECT pg_notify($6, node_id) FROM i",
        )
        .bind(id)
        .bind(node_id)
        .bind(kind)
        .bind(args)
        .bind(deadline_ms as f64)
        .bind(crate::pokes::OUTBOX)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Queues a command an operator asked for, with an audit event naming `actor`, in one transaction.
    pub async fn queue_command_by(
        &self,
        actor: &str,
        id: &str,
        node_id: &str,
        kind: &str,
        args: &serde_json::Value,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO commands (id, node_id, kind, args, deadline_at)              VALUES ($1, $2, $3, $4, to_timestamp($5 / 1000.0))",
        )
        .bind(id)
        .bind(node_id)
        .bind(kind)
        .bind(args)
        .bind(deadline_ms as f64)
        .execute(&mut *tx)
        .await?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(crate::pokes::OUTBOX)
            .bind(node_id)
            .execute(&mut *tx)
            .await?;
        audit(
            &mut tx,
            actor,
            "command.queued",
            &format!("node/{node_id}"),
            serde_json::json!({"command": id, "kind": kind, "deadline_ms": deadline_ms}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Stores a verified command result if `epoch` is current; false when stale or unknown. A signed error the
    /// node marked `deadline_passed` (it refused the command as late, or the command failed once its deadline had
    /// passed, e.g. a stream cut there) is stored as `expired`, as the expiry sweep would have: the control plane
    /// had given up on it, and a metal step retries an expiry where it fails on the command's own failure.
    pub async fn finish_command(
        &self,
        node_id: &str,
        epoch: i64,
        id: &str,
        result: Result<&serde_json::Value, &str>,
        envelope: &[u8],
    ) -> Result<bool, StoreError> {
        let (state, payload, error) = match result {
            Ok(v) if v.get("deadline_passed") == Some(&serde_json::Value::Bool(true)) => (
                "expired",
                Some(v.clone()),
                v.get("error").and_then(|e| e.as_str()).map(str::to_owned),
            ),
            Ok(v) => ("done", Some(v.clone()), None),
            Err(e) => ("failed", None, Some(e.to_string())),
        };
        let n = sqlx::query(
            "UPDATE commands c SET state = $4, result = $5, error = $6, envelope = $7, finished_at = now() \
             FROM nodes n WHERE c.id = $3 AND c.node_id = $1 AND n.id = $1 AND n.session_epoch = $2 \
             AND c.state IN ('pending', 'sent')",
        )
        .bind(node_id)
        .bind(epoch)
        .bind(id)
        .bind(state)
        .bind(payload)
        .bind(error)
        .bind(envelope)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if n == 1 {
            self.poke(crate::pokes::LIFECYCLE, node_id).await?;
        }
        Ok(n == 1)
    }
}

impl Store {
    /// Keeps the latest progress of command `id` when it is a command of `node_id` in state `sent` and `epoch` is
    /// the node's current session; false otherwise (another node's command, finished, unknown, stale session).
    pub async fn command_progress(
        &self,
        node_id: &str,
        epoch: i64,
        id: &str,
        progress: &serde_json::Value,
        at_ms: i64,
    ) -> Result<bool, StoreError> {
        let n = sqlx::query(
            "UPDATE commands c SET progress = $4, progress_at = to_timestamp($5 / 1000.0)              FROM nodes n WHERE c.id = $3 AND c.node_id = $1 AND n.id = $1 AND n.session_epoch = $2              AND c.state = 'sent'",
        )
        .bind(node_id)
        .bind(epoch)
        .bind(id)
        .bind(progress)
        .bind(at_ms as f64)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    /// Whether command `id` of `node_id` has finished (done, failed or expired).
    pub async fn command_finished(&self, node_id: &str, id: &str) -> Result<bool, StoreError> {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM commands WHERE id = $1 AND node_id = $2")
                .bind(id)
                .bind(node_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(matches!(
            state.as_deref(),
            Some("done" | "failed" | "expired")
        ))
    }

    /// One command as an operator sees it.
    pub async fn command(&self, id: &str) -> Result<Option<CommandView>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COMMAND_COLUMNS} FROM commands WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(command_from_row).transpose()
    }

    /// The commands of `node_id`, newest first, at most `limit`.
    pub async fn node_commands(
        &self,
        node_id: &str,
        limit: i64,
    ) -> Result<Vec<CommandView>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COMMAND_COLUMNS} FROM commands WHERE node_id = $1 ORDER BY created_at DESC, id DESC \
             LIMIT $2"
        )))
        .bind(node_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(command_from_row).collect()
    }
}

/// The columns [`command_from_row`] reads.
const COMMAND_COLUMNS: &str = "id, node_id, kind, args, state, \
     (extract(epoch FROM created_at) * 1000)::bigint, (extract(epoch FROM sent_at) * 1000)::bigint, \
     (extract(epoch FROM deadline_at) * 1000)::bigint, (extract(epoch FROM finished_at) * 1000)::bigint, \
     progress, (extract(epoch FROM progress_at) * 1000)::bigint, result, error, deliveries";

fn command_from_row(r: &sqlx::postgres::PgRow) -> Result<CommandView, StoreError> {
    let id: String = r.get(0);
    let corrupt = |what: String| StoreError::Corrupt(format!("commands row {id:?}: {what}"));
    let state: String = r.get(4);
    Ok(CommandView {
        id: CommandId::parse(&id).map_err(|e| corrupt(e.to_string()))?,
        node_id: NodeId::parse(r.get(1)).map_err(|e| corrupt(e.to_string()))?,
        kind: r.get(2),
        args: r.get(3),
        state: state
            .parse()
            .map_err(|e: UnknownCommandState| corrupt(e.to_string()))?,
        created_ms: r.get(5),
        sent_ms: r.get(6),
        deadline_ms: r.get(7),
        finished_ms: r.get(8),
        progress: r.get(9),
        progress_ms: r.get(10),
        result: r.get(11),
        error: r.get(12),
        deliveries: r.get(13),
    })
}

/// A command row for the API (`commands.get`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct CommandView {
    pub id: CommandId,
    pub node_id: NodeId,
    pub kind: String,
    pub args: serde_json::Value,
    pub state: CommandState,
    pub created_ms: i64,
    pub sent_ms: Option<i64>,
    pub deadline_ms: i64,
    pub finished_ms: Option<i64>,
    /// The latest progress the node reported while the command ran.
    pub progress: Option<serde_json::Value>,
    pub progress_ms: Option<i64>,
    /// The signed result's payload (verified against the node's key).
    pub result: Option<serde_json::Value>,
    pub error: Option<String>,
    /// How many times the command was sent to the node (more than once when a session was lost meanwhile).
    pub deliveries: i32,
}

/// The largest failure reason kept from a node (daemons send a sentence or two).
pub const MAX_ACK_REASON_BYTES: usize = 2048;

/// A node's failure reason as stored: NUL characters (which PostgreSQL cannot keep) replaced, at most
/// [`MAX_ACK_REASON_BYTES`] bytes (cut at a character boundary).
fn bounded_reason(message: &str) -> String {
    let mut reason = message.replace('\0', "\u{fffd}");
    if reason.len() > MAX_ACK_REASON_BYTES {
        let mut end = MAX_ACK_REASON_BYTES;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
}
