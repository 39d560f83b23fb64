//! Reservation requests: what a caller may ask for, the admission check that runs before any database access,
//! and the body hash that tells an idempotent replay from a conflicting reuse of a key.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// How the GPUs of one reservation must sit relative to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// All on one node (the default: what a single training or inference job needs).
    #[default]
    Node,
    /// All in one NVLink clique (one node, or several nodes sharing an NVLink fabric clique).
    Nvlink,
    /// Anywhere; packed onto already-used nodes first to keep whole nodes free.
    Any,
}

/// A validated reservation request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ReservationRequest {
    pub tenant: String,
    pub gpus: u32,
    /// GPU model as the node reports it (e.g. "NVIDIA H100 80GB HBM3"); any model when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default)]
    pub topology: Topology,
    pub duration_s: u32,
    /// The pool to book in (any pool when absent); required when the control plane places by pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<crate::ids::PoolId>,
}

pub const MAX_GPUS: u32 = 1024;
pub const MAX_DURATION_S: u32 = 90 * 86_400;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("gpus must be between 1 and {MAX_GPUS}")]
    Gpus,
    #[error("duration_s must be between 1 and {MAX_DURATION_S}")]
    Duration,
    #[error("tenant must be a non-empty id of letters, digits, '-' or '_' (at most 64)")]
    Tenant,
    #[error("model must be non-empty and at most 128 characters when given")]
    Model,
}

impl ReservationRequest {
    pub fn validate(&self) -> Result<(), RequestError> {
        if !(1..=MAX_GPUS).contains(&self.gpus) {
            return Err(RequestError::Gpus);
        }
        if !(1..=MAX_DURATION_S).contains(&self.duration_s) {
            return Err(RequestError::Duration);
        }
        if !valid_id(&self.tenant) {
            return Err(RequestError::Tenant);
        }
        if let Some(m) = &self.model
            && (m.is_empty() || m.len() > 128)
        {
            return Err(RequestError::Model);
        }
        Ok(())
    }

    /// SHA-256 (hex) of the canonical form: the same request hashes the same whatever the JSON key order or
    /// defaults the caller wrote.
    pub fn body_hash(&self) -> String {
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(Sha256::digest(&canonical))
    }
}

pub fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Admission's first step, before any database access: a caller may act only in its own tenant unless it belongs to
/// the root tenant.
pub fn tenant_allowed(caller_tenant: &str, caller_is_root: bool, target_tenant: &str) -> bool {
    caller_is_root || caller_tenant == target_tenant
}

/// Reservation states as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ReservationState {
    /// Recorded (tx 1); the placer has not decided yet.
    Pending,
    /// GPUs booked; the booking is the nodes' next desired-state generation.
    Placed,
    /// Could not be placed (the error says why); nothing booked.
    Failed,
    /// Released by its owner; GPUs freed.
    Released,
    /// Ran past its duration; GPUs freed by the controllers.
    Expired,
}

impl ReservationState {
    pub const ALL: [ReservationState; 5] = [
        ReservationState::Pending,
        ReservationState::Placed,
        ReservationState::Failed,
        ReservationState::Released,
        ReservationState::Expired,
    ];

    /// The state as stored and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ReservationState::Pending => "pending",
            ReservationState::Placed => "placed",
            ReservationState::Failed => "failed",
            ReservationState::Released => "released",
            ReservationState::Expired => "expired",
        }
    }

    /// The state a stored string names (None for one this build does not know).
    pub fn parse(s: &str) -> Option<ReservationState> {
        ReservationState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
    }

    /// Released, expired or failed: nothing more happens to it.
    pub fn is_ended(self) -> bool {
        !matches!(self, ReservationState::Pending | ReservationState::Placed)
    }
}

impl std::fmt::Display for ReservationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How far a placed reservation's booking has reached a node (or, summed up, all of its nodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// Published as the node's desired state; the node has not applied it yet.
    Pending,
    /// The node applied a generation carrying the booking: its CDI spec names the booked GPUs.
    Applied,
    /// The node reported that it could not apply a generation carrying the booking, and has applied none since
    /// (it retries; the node's reason says what to fix).
    Failed,
}

/// A node's share of a booking first carried by desired generation `carried_by`, where the node has applied up to
/// generation `applied` and last reported a failure for generation `failed` (0: none).
pub fn node_delivery(carried_by: i64, applied: i64, failed: i64) -> Delivery {
    if applied >= carried_by {
        Delivery::Applied
    } else if failed >= carried_by {
        Delivery::Failed
    } else {
        Delivery::Pending
    }
}

/// A reservation's delivery from its nodes' shares: failed if any node failed, else pending while any has not
/// applied it, else applied.
pub fn delivery(nodes: impl IntoIterator<Item = Delivery>) -> Delivery {
    nodes
        .into_iter()
        .fold(Delivery::Applied, |sum, d| match (sum, d) {
            (Delivery::Failed, _) | (_, Delivery::Failed) => Delivery::Failed,
            (Delivery::Pending, _) | (_, Delivery::Pending) => Delivery::Pending,
            _ => Delivery::Applied,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_booking_is_delivered_once_its_generation_or_a_newer_one_is_applied() {
        use Delivery::*;
        // (carried by, applied, failed) -> delivery
        for (carried, applied, failed, want) in [
            (5, 4, 0, Pending),
            (5, 5, 0, Applied),
            (5, 7, 6, Applied),
            (5, 4, 5, Failed),
            (5, 4, 6, Failed),
            (5, 4, 4, Pending),
            (5, 6, 5, Applied),
        ] {
            assert_eq!(
                node_delivery(carried, applied, failed),
                want,
                "carried by {carried}, applied {applied}, failed {failed}"
            );
        }
        assert_eq!(delivery([Applied, Applied]), Applied);
        assert_eq!(delivery([Applied, Pending]), Pending);
        assert_eq!(delivery([Pending, Failed, Applied]), Failed);
        assert_eq!(delivery([]), Applied);
    }

    fn req() -> ReservationRequest {
        ReservationRequest {
            tenant: "team-a".into(),
            gpus: 2,
            model: None,
            topology: Topology::Node,
            duration_s: 3600,
            pool: None,
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(req().validate(), Ok(()));
        let mut r = req();
        r.gpus = 0;
        assert_eq!(r.validate(), Err(RequestError::Gpus));
        let mut r = req();
        r.duration_s = 0;
        assert_eq!(r.validate(), Err(RequestError::Duration));
        let mut r = req();
        r.tenant = "a/b".into();
        assert_eq!(r.validate(), Err(RequestError::Tenant));
        let mut r = req();
        r.model = Some(String::new());
        assert_eq!(r.validate(), Err(RequestError::Model));
    }

    #[test]
    fn body_hash_ignores_key_order_and_spelled_out_defaults() {
        let a: ReservationRequest =
            serde_json::from_str(r#"{"tenant":"t","gpus":1,"duration_s":60}"#).expect("a");
        let b: ReservationRequest =
            serde_json::from_str(r#"{"duration_s":60,"topology":"node","gpus":1,"tenant":"t"}"#)
                .expect("b");
        assert_eq!(a.body_hash(), b.body_hash());
        let mut c = a.clone();
        c.gpus = 2;
        assert_ne!(a.body_hash(), c.body_hash());
    }

    #[test]
    fn tenants() {
        assert!(tenant_allowed("a", false, "a"));
        assert!(!tenant_allowed("a", false, "b"));
        assert!(tenant_allowed("root", true, "b"));
    }
}
