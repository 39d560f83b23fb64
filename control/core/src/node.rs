//! Node lifecycle states as stored and shown.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Joined; inventory and acceptance checks pending.
    Adopting,
    /// Accepted; desired state is handed out.
    Adopted,
    Draining,
    Failed,
    Revoked,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Adopting => "adopting",
            NodeState::Adopted => "adopted",
            NodeState::Draining => "draining",
            NodeState::Failed => "failed",
            NodeState::Revoked => "revoked",
        }
    }
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown node state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for NodeState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<NodeState, UnknownState> {
        Ok(match s {
            "adopting" => NodeState::Adopting,
            "adopted" => NodeState::Adopted,
            "draining" => NodeState::Draining,
            "failed" => NodeState::Failed,
            "revoked" => NodeState::Revoked,
            other => return Err(UnknownState(other.to_string())),
        })
    }
}
