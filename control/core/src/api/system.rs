//! The typed requests and responses of the kernel-side `system` methods the server serves (`system.stats`,
//! `system.info`).

use serde::{Deserialize, Serialize};

/// The request of a method that takes nothing (`{}`; other fields are ignored, as they always were).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Nothing {}

/// `system.stats`: the gateway's counters, when this process runs the gateway role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Stats {
    pub gateway: Option<GatewayStats>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GatewayStats {
    pub sessions: u64,
    pub opened: u64,
    pub liveness_writes: u64,
    pub pending_pulls: u64,
    pub revocation_reads: u64,
    pub revoked: u64,
}

/// `system.info`: what a node or operator needs to trust and reach this control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Info {
    pub trust_domain: String,
    pub ca_pin: String,
    pub join_public_key: String,
    pub gateway_url: String,
    /// The server's version (empty from a server older than the field).
    #[serde(default)]
    pub version: String,
}
