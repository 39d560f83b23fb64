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

/// The payload type of a signed `diag.nvml` report and the report's `kind`.
pub use bc_proto::payloads::diag::{KIND, PAYLOAD_TYPE};

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

pub use bc_proto::payloads::diag::{Check, CheckResult, Counts, DiagReport, GpuRef, Status};

/// A report of `checks` (its status and counts follow from them).
fn report_of(
    backend: &str,
    policy: &DiagPolicy,
    observed: u32,
    checks: Vec<CheckResult>,
) -> DiagReport {
    DiagReport::new(backend, policy.expected_gpu_count, observed, checks)
}

/// Signs a report with the node key (payload type [`PAYLOAD_TYPE`]).
pub fn sign(report: &DiagReport, signer: &EnvelopeSigner) -> Result<SignedEnvelope, DiagError> {
    signer
        .sign(PAYLOAD_TYPE, report.to_json().map_err(DiagError::Encode)?)
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
            report_of(backend.name(), policy, 0, checks)
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
    report_of(backend, policy, observed, checks::all(gpus, policy))
}

#[cfg(test)]
mod tests;
