//! The typed requests and responses of the metal module's methods (`metal.enroll|inspect|provide|deploy|release|
//! abort|retry|show|list`), shared by its handlers and by the CLI's client. The machine's flow itself is
//! [`crate::metal`]'s: the responses carry its [`State`], [`Goal`] and [`TimelineRow`]s as they are stored.

use crate::ids::{MachineId, SiteId};
use crate::metal::{ExpectedHardware, Goal, HardwareSummary, Millis, Phase, State, TimelineRow};
use serde::{Deserialize, Serialize};

/// How the site agent reaches the machine's BMC: its Redfish address and the name of the site secret holding the
/// credentials (`secrets.put`); the credentials themselves never pass through this API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BmcRef {
    /// `https://10.0.0.5` or `http://127.0.0.1:8000` (a Redfish service root's base URL).
    pub address: String,
    /// The site secret with `{"username": .., "password": ..}`.
    pub credentials: String,
}

/// `metal.enroll`: a machine of `site` with its BMC and boot NIC; it rests in `enrolled`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct EnrollRequest {
    #[serde(deserialize_with = "crate::api::sites::site_name")]
    pub site: SiteId,
    /// The boot NIC's MAC, any common form.
    pub mac: String,
    pub bmc: BmcRef,
    #[serde(default)]
    pub expected: Option<ExpectedHardware>,
}

/// `metal.inspect|provide|release|abort|retry|show`: one machine by its boot MAC.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct MachineRef {
    pub mac: String,
}

/// `metal.deploy`: the image by its artifact digest and the cloud-init NoCloud data.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DeployRequest {
    pub mac: String,
    /// `sha256:<64 hex>` of an uploaded artifact.
    pub image: String,
    #[serde(default)]
    pub user_data: String,
    #[serde(default)]
    pub meta_data: String,
}

/// `metal.list`: filters, all optional.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    #[serde(default)]
    pub site: Option<SiteId>,
    #[serde(default)]
    pub phase: Option<Phase>,
    /// Only failed machines (true) or only the others (false).
    #[serde(default)]
    pub failed: Option<bool>,
}

/// A machine as `metal.show` answers it (and every verb, after applying it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct MachineView {
    pub mac: MachineId,
    pub site: SiteId,
    pub bmc: BmcRef,
    pub state: State,
    pub goal: Goal,
    pub attempt: u32,
    /// When the current wait ends, and what for.
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub deadline_ms: Option<Millis>,
    pub waiting_for: Option<String>,
    /// The node the ramdisk joined as (and the installed system reclaims).
    pub node_id: Option<String>,
    pub power_cycles: u32,
    pub inspection: Option<HardwareSummary>,
    pub diagnosis: Option<HardwareSummary>,
    pub conditions: Vec<String>,
    pub last_error: Option<String>,
    /// When the site agent last saw a DHCP request from the boot MAC (its report).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub last_dhcp_ms: Option<Millis>,
    pub timeline: Vec<TimelineRow>,
    /// The BMC and ramdisk steps of the current attempt with their outcomes (evidence).
    pub steps: Vec<StepView>,
    /// The latest signed result of each ramdisk step the machine went through (diagnose, wipe, stream, kexec),
    /// whatever attempt it belonged to: what the machine's node signed, verified by the control plane.
    #[serde(default)]
    pub evidence: Vec<Evidence>,
}

/// A ramdisk command's signed result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Evidence {
    pub step: crate::metal::Step,
    pub command_id: String,
    /// The node that signed it (the ramdisk's node).
    pub node_id: String,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub finished_ms: Option<Millis>,
    /// The signer's SPIFFE ID and the payload type as the envelope names them (verified against the node's key
    /// before the result was stored).
    pub signer: String,
    pub payload_type: String,
    /// The signed payload.
    pub result: serde_json::Value,
}

/// A step sent for the machine: to the site's BMC worker or to the ramdisk, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct StepView {
    pub attempt_id: u64,
    pub step: crate::metal::Step,
    /// `bmc` or `ramdisk`.
    pub via: String,
    /// pending, sent, done, failed, expired.
    pub state: String,
    pub outcome: Option<serde_json::Value>,
}

/// One line of `metal.list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct MachineSummary {
    pub mac: MachineId,
    pub site: SiteId,
    pub state: State,
    pub attempt: u32,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub deadline_ms: Option<Millis>,
    pub last_error: Option<String>,
    /// When the current phase started (absent from a server older than the field).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub phase_started_ms: Option<Millis>,
    /// What the deadline is for.
    #[serde(default)]
    pub waiting_for: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ListResponse {
    pub machines: Vec<MachineSummary>,
}
