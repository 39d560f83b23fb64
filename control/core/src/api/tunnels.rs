//! The typed requests and responses of the tunnels module (`tunnels.list`, `tunnels.set-ports`,
//! `tunnels.ports`), shared by its handlers and the CLI. The tunnel itself is not a method: it is
//! `GET /api/tunnels/{node}/{port}` upgraded to `bc-tunnel/1` (see bc-mod-tunnels).

use serde::{Deserialize, Serialize};

/// Most rows `tunnels.list` answers.
pub const MAX_LIST: u32 = 1000;

/// `tunnels.list`: the audit of tunnel connections, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListTunnels {
    /// Only this node's.
    #[serde(default)]
    pub node: Option<String>,
    /// At most this many rows (default and cap [`MAX_LIST`]).
    #[serde(default)]
    pub limit: Option<u32>,
}

/// One tunnel connection: who, to what, when, how many bytes, how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TunnelRecord {
    pub id: String,
    pub principal: String,
    pub node: String,
    pub pool: String,
    pub port: u16,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub started_at_ms: i64,
    /// None while it is open.
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub stopped_at_ms: Option<i64>,
    /// Bytes from the node's port to the operator.
    pub bytes_from_node: i64,
    /// Bytes from the operator to the node's port.
    pub bytes_to_node: i64,
    /// `OPEN` while open; `OK` after a half-close each way; else the refusal or close code (`ACCESS_DENIED`,
    /// `PORT_NOT_ALLOWED`, `DIAL_REFUSED`, `DIAL_TIMEOUT`, `IDLE`, `ABORTED`, ...).
    pub outcome: String,
    pub reason: String,
    /// The gateway that carried it (the one holding the node's session when it opened); None for a refusal before
    /// a gateway was chosen.
    #[serde(default)]
    pub gateway: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TunnelList {
    pub tunnels: Vec<TunnelRecord>,
}

/// `tunnels.set-ports`: the ports tunnels may reach on the pool's nodes (replaces the list; empty refuses all).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolPorts {
    pub pool: String,
    pub ports: Vec<u16>,
}

/// `tunnels.ports`: a pool's allowlist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct GetPoolPorts {
    pub pool: String,
}
