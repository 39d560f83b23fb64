//! `diag.nvml`: the GPU acceptance check of DESIGN.md "GPU". [`check`] is a pure function from observed GPU health
//! ([`GpuHealth`]) and a [`DiagPolicy`] to a [`DiagReport`]; [`run`] queries a [`GpuBackend`] and then checks. Each
//! check reports pass, fail or skip with the observed value and the threshold; a reading the GPU does not support
//! is a skip with that reason, never a pass. The report is JSON ([`DiagReport::to_json`]) and is signed into a
//! bc_proto `SignedEnvelope` of type [`PAYLOAD_TYPE`] with [`sign`]. Start with [`checks`] for the rules.

pub mod checks;

use crate::gpu::{GpuBackend, GpuHealth};
use bc_proto::envelope::{EnvelopeError, EnvelopeSigner};
use bc_proto::v1::SignedEnvelope;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The payload type of a signed `diag.nvml` report.
pub const PAYLOAD_TYPE: &str = "application/vnd.bettercompute.diag.nvml+json";
/// The report's `kind`.
pub const KIND: &str = "diag.nvml";

#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    #[error("encoding the diag.nvml report")]
    Encode(#[source] serde_json::Error),
    #[error("signing the diag.nvml report")]
    Sign(#[source] EnvelopeError),
    #[error("diag.nvml policy is not valid")]
    Policy(#[source] serde_json::Error),
}

// === policy ===

/// What the pool accepts. Built by the caller (the expected GPU count comes from the pool or the inventory);
/// arrives as JSON in a command's arguments, so every field but the count has a default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiagPolicy {
    pub expected_gpu_count: u32,
    /// Fail when a GPU has at least this many retired pages.
    #[serde(default = "default_retired_pages_fail_at")]
    pub retired_pages_fail_at: u64,
    /// Throttle reason bits that do not fail the check, beyond GPU idle (which never does).
    #[serde(default)]
    pub throttle_ignore_mask: u64,
    #[serde(default = "yes")]
    pub require_persistence_mode: bool,
    #[serde(default)]
    pub mig: MigExpectation,
    #[serde(default = "yes")]
    pub require_nvlink_up: bool,
    /// Fail when the temperature is within this many °C of the slowdown threshold.
    #[serde(default)]
    pub temperature_margin_c: u32,
    /// Power draw may exceed the enforced limit by this many percent (sampling jitter).
    #[serde(default = "default_power_tolerance_pct")]
    pub power_tolerance_pct: u32,
    /// Critical XID errors that fail the check; others are reported and pass.
    #[serde(default = "default_fail_xids")]
    pub fail_xids: Vec<u64>,
    /// The PCIe generation the slot must support (for example 5); none: whatever the GPU's maximum is.
    #[serde(default)]
    pub pcie_min_gen: Option<u32>,
    /// The PCIe width the slot must support (for example 16).
    #[serde(default)]
    pub pcie_min_width: Option<u32>,
}

fn default_retired_pages_fail_at() -> u64 {
    63
}
fn yes() -> bool {
    true
}
fn default_power_tolerance_pct() -> u32 {
    5
}
/// 48 DBE, 61/62 internal micro-controller, 64 row remap failure, 74 NVLink, 79 fallen off the bus, 92 high
/// single-bit rate, 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC.
pub fn default_fail_xids() -> Vec<u64> {
    vec![48, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140]
}

impl DiagPolicy {
    /// The default policy for a node that should show `expected_gpu_count` GPUs.
    pub fn new(expected_gpu_count: u32) -> DiagPolicy {
        DiagPolicy {
            expected_gpu_count,
            retired_pages_fail_at: default_retired_pages_fail_at(),
            throttle_ignore_mask: 0,
            require_persistence_mode: true,
            mig: MigExpectation::default(),
            require_nvlink_up: true,
            temperature_margin_c: 0,
            power_tolerance_pct: default_power_tolerance_pct(),
            fail_xids: default_fail_xids(),
            pcie_min_gen: None,
            pcie_min_width: None,
        }
    }

    /// Parses a policy from a command's JSON arguments (unknown fields are refused).
    pub fn from_json(bytes: &[u8]) -> Result<DiagPolicy, DiagError> {
        serde_json::from_slice(bytes).map_err(DiagError::Policy)
    }
}

/// The MIG configuration the pool expects.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum MigExpectation {
    /// MIG off, and not pending on.
    #[default]
    Disabled,
    /// MIG on with exactly these profiles (any order); an empty list accepts any layout.
    Enabled { layout: Vec<String> },
    /// The pool does not care.
    Any,
}

// === report ===

/// The checks of `diag.nvml`, in the order they are reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    Backend,
    DeviceCount,
    RetiredPagesPending,
    RowRemapPending,
    RowRemapFailure,
    VolatileDbe,
    RetiredPages,
    PcieGen,
    PcieWidth,
    Throttle,
    Xid,
    PersistenceMode,
    Mig,
    Nvlink,
    Temperature,
    Power,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self).ok();
        f.write_str(s.as_ref().and_then(|v| v.as_str()).unwrap_or("?"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

/// The GPU a check is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRef {
    pub index: u32,
    pub uuid: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub check: Check,
    /// None for node-level checks (backend, device count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRef>,
    pub status: Status,
    pub observed: String,
    pub threshold: String,
    /// For fail and skip: one sentence naming the GPU and the check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub pass: u32,
    pub fail: u32,
    pub skip: u32,
}

/// The result of `diag.nvml`. `status` is fail when any check failed, else pass; skips are counted, so the
/// control plane can refuse a report that judged too little.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiagReport {
    pub kind: String,
    pub backend: String,
    pub status: Status,
    pub expected_gpu_count: u32,
    pub observed_gpu_count: u32,
    pub counts: Counts,
    pub checks: Vec<CheckResult>,
}

impl DiagReport {
    fn from_checks(
        backend: &str,
        policy: &DiagPolicy,
        observed: u32,
        checks: Vec<CheckResult>,
    ) -> DiagReport {
        let mut counts = Counts::default();
        for c in &checks {
            match c.status {
                Status::Pass => counts.pass += 1,
                Status::Fail => counts.fail += 1,
                Status::Skip => counts.skip += 1,
            }
        }
        DiagReport {
            kind: KIND.to_string(),
            backend: backend.to_string(),
            status: if counts.fail > 0 {
                Status::Fail
            } else {
                Status::Pass
            },
            expected_gpu_count: policy.expected_gpu_count,
            observed_gpu_count: observed,
            counts,
            checks,
        }
    }

    pub fn passed(&self) -> bool {
        self.status == Status::Pass
    }

    pub fn failures(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| c.status == Status::Fail)
    }

    /// The reasons of the failed checks, for node conditions and operator output.
    pub fn failure_reasons(&self) -> Vec<String> {
        self.failures().filter_map(|c| c.reason.clone()).collect()
    }

    pub fn to_json(&self) -> Result<Vec<u8>, DiagError> {
        serde_json::to_vec(self).map_err(DiagError::Encode)
    }
}

/// Signs a report with the node key (payload type [`PAYLOAD_TYPE`]).
pub fn sign(report: &DiagReport, signer: &EnvelopeSigner) -> Result<SignedEnvelope, DiagError> {
    signer
        .sign(PAYLOAD_TYPE, report.to_json()?)
        .map_err(DiagError::Sign)
}

/// Queries the backend and checks. A backend that cannot answer fails the `backend` check (and the device count),
/// so an absent driver is a reported failure, not an error the caller might drop.
pub fn run(backend: &dyn GpuBackend, policy: &DiagPolicy) -> DiagReport {
    match backend.health() {
        Ok(gpus) => check_with_backend(backend.name(), &gpus, policy),
        Err(e) => {
            let checks = vec![
                CheckResult {
                    check: Check::Backend,
                    gpu: None,
                    status: Status::Fail,
                    observed: e.to_string(),
                    threshold: "backend answers".into(),
                    reason: Some(format!("backend: {e}")),
                },
                checks::device_count(0, policy),
            ];
            DiagReport::from_checks(backend.name(), policy, 0, checks)
        }
    }
}

/// Judges observed health against the policy (pure: no clock, no I/O). The report's backend is "unspecified";
/// [`run`] and [`check_with_backend`] name it.
pub fn check(gpus: &[GpuHealth], policy: &DiagPolicy) -> DiagReport {
    check_with_backend("unspecified", gpus, policy)
}

/// [`check`] with the backend's name in the report.
pub fn check_with_backend(backend: &str, gpus: &[GpuHealth], policy: &DiagPolicy) -> DiagReport {
    let observed = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
    DiagReport::from_checks(backend, policy, observed, checks::all(gpus, policy))
}

#[cfg(test)]
mod tests;
