//! Join-token rules: the refusals a join can meet and whether a node's claims meet the token's `expect`.
//! Revocation, expiry and uses are decided where they can be decided atomically: under the token's row lock when
//! the join commits (bc-store), in the order revoked, expired (unless the join is a retry within
//! [`REPLAY_WINDOW_MS`]), exhausted.

use crate::hardware::HardwareClaims;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Hardware claims a token requires, by claim name. Names: `dmi.system_uuid`, `dmi.system_serial`,
/// `dmi.board_serial`, `dmi.chassis_serial`, `dmi.vendor`, `dmi.product`, `gpu.count`, `gpu.model` (every GPU),
/// `nic.mac` (some NIC), `hostname`, `arch`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(transparent)]
pub struct Expectations(pub BTreeMap<String, String>);

pub const EXPECT_KEYS: &[&str] = &[
    "dmi.system_uuid",
    "dmi.system_serial",
    "dmi.board_serial",
    "dmi.chassis_serial",
    "dmi.vendor",
    "dmi.product",
    "gpu.count",
    "gpu.model",
    "nic.mac",
    "hostname",
    "arch",
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenRejection {
    #[error("join token has been revoked")]
    Revoked,
    #[error("join token expired")]
    Expired,
    #[error("join token has no uses left")]
    Exhausted,
    #[error(
        "hardware does not match the token's expect: {claim} is {found:?}, the token expects {expected:?}"
    )]
    ExpectMismatch {
        claim: String,
        expected: String,
        found: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown expect key {key:?}; known keys: {known}")]
pub struct UnknownExpectKey {
    pub key: String,
    pub known: String,
}

impl Expectations {
    /// Validates the keys (operator input at token creation).
    pub fn validate(&self) -> Result<(), UnknownExpectKey> {
        for key in self.0.keys() {
            if !EXPECT_KEYS.contains(&key.as_str()) {
                return Err(UnknownExpectKey {
                    key: key.clone(),
                    known: EXPECT_KEYS.join(", "),
                });
            }
        }
        Ok(())
    }

    /// The first expectation the claims do not meet.
    pub fn check(&self, claims: &HardwareClaims) -> Result<(), TokenRejection> {
        for (claim, expected) in &self.0 {
            let eq = |a: &str| a.trim().eq_ignore_ascii_case(expected.trim());
            let (ok, found) = match claim.as_str() {
                "dmi.system_uuid" => (eq(&claims.dmi.system_uuid), claims.dmi.system_uuid.clone()),
                "dmi.system_serial" => (
                    eq(&claims.dmi.system_serial),
                    claims.dmi.system_serial.clone(),
                ),
                "dmi.board_serial" => (
                    eq(&claims.dmi.board_serial),
                    claims.dmi.board_serial.clone(),
                ),
                "dmi.chassis_serial" => (
                    eq(&claims.dmi.chassis_serial),
                    claims.dmi.chassis_serial.clone(),
                ),
                "dmi.vendor" => (eq(&claims.dmi.vendor), claims.dmi.vendor.clone()),
                "dmi.product" => (eq(&claims.dmi.product), claims.dmi.product.clone()),
                "hostname" => (eq(&claims.hostname), claims.hostname.clone()),
                "arch" => (eq(&claims.arch), claims.arch.clone()),
                "gpu.count" => {
                    let n = claims.gpus.len().to_string();
                    (eq(&n), n)
                }
                "gpu.model" => {
                    let models: Vec<&str> = claims.gpus.iter().map(|g| g.model.as_str()).collect();
                    (
                        !models.is_empty() && models.iter().all(|m| eq(m)),
                        models.join(","),
                    )
                }
                "nic.mac" => {
                    let macs: Vec<&str> = claims.nics.iter().map(|n| n.mac.as_str()).collect();
                    (macs.iter().any(|m| eq(m)), macs.join(","))
                }
                _ => (false, "<unknown claim>".to_string()),
            };
            if !ok {
                return Err(TokenRejection::ExpectMismatch {
                    claim: claim.clone(),
                    expected: expected.clone(),
                    found,
                });
            }
        }
        Ok(())
    }
}

/// How long a retry with the same token and the same node key returns the same node without spending a use.
pub const REPLAY_WINDOW_MS: i64 = 10 * 60 * 1000;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::GpuClaim;

    #[test]
    fn expectations() {
        let c = HardwareClaims {
            gpus: vec![
                GpuClaim {
                    model: "NVIDIA H100".into(),
                    ..Default::default()
                };
                8
            ],
            ..Default::default()
        };
        let mut e = Expectations::default();
        e.0.insert("gpu.count".into(), "8".into());
        e.0.insert("gpu.model".into(), "nvidia h100".into());
        assert_eq!(e.check(&c), Ok(()));
        e.0.insert("gpu.count".into(), "4".into());
        assert!(
            matches!(e.check(&c), Err(TokenRejection::ExpectMismatch { claim, .. }) if claim == "gpu.count")
        );
        let mut bad = Expectations::default();
        bad.0.insert("gpu.colour".into(), "red".into());
        assert!(bad.validate().is_err());
    }
}
