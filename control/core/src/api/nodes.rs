//! The typed requests and responses of the nodes module's methods (`join-tokens.*`, `nodes.*`, `commands.get`),
//! shared by its handlers and by the operator CLI. Field names are the wire's: changing one changes the API.

use crate::ids::{CommandId, NodeId, PoolId};
use crate::join::Expectations;
use crate::node::NodeState;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

// === join-tokens ===

/// `join-tokens.create`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateJoinToken {
    pub pool: PoolId,
    /// How many joins it allows (1 to 1,000,000).
    #[serde(default = "one")]
    pub uses: i32,
    /// How long it is valid (60 s to a year).
    #[serde(default = "day")]
    pub ttl_seconds: i64,
    /// Claims a joining node must report.
    #[serde(default)]
    pub expect: Expectations,
    /// Whether a node that lost its identity may rejoin as itself with it (the pool must allow reclaim).
    #[serde(default)]
    pub reclaim: bool,
}

fn one() -> i32 {
    1
}

fn day() -> i64 {
    86_400
}

/// The created token; `token` (its secret) is shown only here.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CreatedJoinToken {
    pub id: String,
    pub token: String,
    pub pool: PoolId,
    pub uses: i32,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub expires_at_ms: i64,
    pub reclaim: bool,
}

/// `join-tokens.list`: every token the caller may list, or those of one pool.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListJoinTokens {
    #[serde(default)]
    pub pool: Option<PoolId>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct JoinTokens {
    pub tokens: Vec<JoinToken>,
}

/// A join token as listed (never its secret).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct JoinToken {
    pub id: String,
    pub pool_id: PoolId,
    pub uses_total: i32,
    pub uses_left: i32,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub expires_at_ms: i64,
    pub revoked: bool,
    pub expect: Expectations,
    pub reclaim: bool,
    pub created_by: String,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
}

/// `join-tokens.revoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct JoinTokenRef {
    pub id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RevokedJoinToken {
    pub id: String,
    pub revoked: bool,
}

// === nodes ===

/// `nodes.list`: the nodes the caller may see, by id, those matching every filter given, a page at a time (`after`
/// the previous page's `next`, at most `limit`, [`super::MAX_PAGE`] when absent).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListNodes {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<NodeState>,
    /// Nodes with a condition containing this text (`--condition DesiredStateFailed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<String>,
    /// Nodes whose hostname matches this pattern (`*` matches any run of characters: `gpu-*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<NodeId>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Nodes {
    pub nodes: Vec<Node>,
    /// The `after` of the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// `nodes.delete`: forgets a node. Refused (FAILED_PRECONDITION) unless it is revoked or failed, so its identity is
/// already refused, and while any of its GPUs is booked or an instance runs on it (release those first).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeletedNode {
    pub id: NodeId,
    pub deleted: bool,
}

/// `commands.list`: a node's commands, newest first (at most `limit`, [`super::MAX_PAGE`] when absent).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListCommands {
    pub node: NodeId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Commands {
    pub commands: Vec<Command>,
}

/// `nodes.get`, `nodes.drain`, `nodes.undrain`, `nodes.revoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct NodeRef {
    pub id: NodeId,
}

/// A node as operators see it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Node {
    pub id: NodeId,
    pub pool_id: PoolId,
    pub state: NodeState,
    pub hardware_key: Option<String>,
    /// The hardware claims it joined with (`hostname`, `gpus`, `nics`, ...).
    pub claims: Value,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub joined_at_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub cert_not_after_ms: i64,
    pub join_token_id: Option<String>,
    pub session_epoch: i64,
    pub online: bool,
    /// When a gateway last heard from the node: exact once its session closed, up to a minute old while it is online
    /// (`online` says whether it is up).
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub last_seen_ms: Option<i64>,
    pub desired_generation: i64,
    pub acked_generation: i64,
    /// Why it is not (fully) usable: the acceptance check's reasons, GPU conflicts, a desired state it cannot apply.
    pub conditions: Vec<String>,
    /// How far the node applied its desired state (absent when unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_state: Option<DesiredState>,
}

impl Node {
    /// The GPUs it claimed at join.
    pub fn gpu_count(&self) -> usize {
        self.claims["gpus"].as_array().map_or(0, Vec::len)
    }

    pub fn hostname(&self) -> &str {
        self.claims["hostname"].as_str().unwrap_or_default()
    }
}

/// A node's desired state as far as it got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DesiredState {
    pub generation: i64,
    pub applied_generation: i64,
    /// Whether its newest report, for a generation newer than it applied, is a failure.
    pub failing: bool,
    pub failed_generation: i64,
    /// The node's reason, while failing.
    pub message: Option<String>,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub failing_since_ms: Option<i64>,
}

/// `nodes.get`: the node and its inventory sections by name.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct NodeDetail {
    pub node: Node,
    pub inventory: BTreeMap<String, Value>,
}

/// `nodes.drain|undrain|revoke`: the state the node is in now, and whether this call changed it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct NodeStateChanged {
    pub id: NodeId,
    pub state: NodeState,
    pub changed: bool,
}

// === commands ===

/// `nodes.command`: queue a command of `kind` for a node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct QueueCommand {
    pub node_id: NodeId,
    /// `^[a-z][a-z0-9_.-]{0,63}$`, e.g. `ramdisk.wipe`.
    pub kind: String,
    /// A JSON object of at most 64 KiB.
    #[serde(default = "empty_object")]
    pub args: Value,
    /// Seconds the node has to finish it (1 s to 7 days).
    #[serde(default = "ten_minutes")]
    pub timeout_s: u64,
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

fn ten_minutes() -> u64 {
    600
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct QueuedCommand {
    pub id: CommandId,
    pub node_id: NodeId,
    pub kind: String,
    pub state: CommandState,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub deadline_ms: i64,
}

/// `commands.get`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CommandRef {
    pub id: CommandId,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CommandDetail {
    pub command: Command,
}

/// A command: what was asked, how far it got and what the node answered.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Command {
    pub id: CommandId,
    pub node_id: NodeId,
    pub kind: String,
    pub args: Value,
    pub state: CommandState,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub sent_ms: Option<i64>,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub deadline_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub finished_ms: Option<i64>,
    /// The latest progress the node reported while it ran.
    pub progress: Option<Value>,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub progress_ms: Option<i64>,
    /// The signed result's payload (verified against the node's key).
    pub result: Option<Value>,
    pub error: Option<String>,
    /// How many times it was sent (more than once when a session was lost meanwhile).
    pub deliveries: i32,
}

/// Where a command is: queued, handed to the node, or finished one of three ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum CommandState {
    Pending,
    Sent,
    Done,
    Failed,
    Expired,
}

impl CommandState {
    pub fn as_str(self) -> &'static str {
        match self {
            CommandState::Pending => "pending",
            CommandState::Sent => "sent",
            CommandState::Done => "done",
            CommandState::Failed => "failed",
            CommandState::Expired => "expired",
        }
    }

    /// Done, failed or expired: it changes no more.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            CommandState::Done | CommandState::Failed | CommandState::Expired
        )
    }
}

impl fmt::Display for CommandState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Compares with a stored or shown name (`state == "done"`).
impl PartialEq<&str> for CommandState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown command state {0:?}")]
pub struct UnknownCommandState(pub String);

impl FromStr for CommandState {
    type Err = UnknownCommandState;

    fn from_str(s: &str) -> Result<CommandState, UnknownCommandState> {
        Ok(match s {
            "pending" => CommandState::Pending,
            "sent" => CommandState::Sent,
            "done" => CommandState::Done,
            "failed" => CommandState::Failed,
            "expired" => CommandState::Expired,
            other => return Err(UnknownCommandState(other.to_string())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_states_round_trip_and_refuse_the_unknown() {
        for s in [
            CommandState::Pending,
            CommandState::Sent,
            CommandState::Done,
            CommandState::Failed,
            CommandState::Expired,
        ] {
            assert_eq!(s.as_str().parse::<CommandState>().ok(), Some(s));
            assert_eq!(
                serde_json::to_value(s).ok(),
                Some(Value::String(s.as_str().into()))
            );
        }
        assert!("running".parse::<CommandState>().is_err());
    }

    #[test]
    fn a_node_without_desired_state_has_no_such_key() {
        let n: Node = serde_json::from_value(serde_json::json!({
            "id": "n-1", "pool_id": "default", "state": "adopted", "hardware_key": null, "claims": {"gpus": [{}]},
            "joined_at_ms": 1, "cert_not_after_ms": 2, "join_token_id": null, "session_epoch": 0, "online": true,
            "last_seen_ms": null, "desired_generation": 0, "acked_generation": 0, "conditions": []
        }))
        .expect("a node");
        assert_eq!(n.gpu_count(), 1);
        let v = serde_json::to_value(&n).expect("encode");
        assert!(v.get("desired_state").is_none(), "{v}");
    }
}
