//! The typed requests and responses of the capacity module's methods (`reservations.create|get|list|release`),
//! shared by its handlers and by the CLI's client. The JSON on the wire is what the server answered before these
//! types existed: a reservation is `{id, tenant, principal, state, request, nodes, gpus, error, created_at_ms, …}`,
//! and `get` and `list` add `delivery` to a placed one.

use crate::ids::{NodeId, ReservationId, TenantId};
use crate::reservation::{Delivery, ReservationRequest, Topology};
use serde::{Deserialize, Serialize};

/// `reservations.create`: a [`ReservationRequest`] and, optionally, the caller's idempotency key (one key and one
/// body replay the reservation it created; the same key with another body is CONFLICT).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateReservation {
    pub tenant: String,
    pub gpus: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default)]
    pub topology: Topology,
    pub duration_s: u32,
    /// The pool to book in; required when the control plane places by pool (`capacity.placer = "pool-lease"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<crate::ids::PoolId>,
    /// 1 to 128 printable ASCII characters; the reservation's id when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl CreateReservation {
    /// The request without its idempotency key.
    pub fn request(&self) -> ReservationRequest {
        ReservationRequest {
            tenant: self.tenant.clone(),
            gpus: self.gpus,
            model: self.model.clone(),
            topology: self.topology,
            duration_s: self.duration_s,
            pool: self.pool.clone(),
        }
    }

    /// Whether the idempotency key, if any, is 1 to 128 printable ASCII characters.
    pub fn key_is_valid(&self) -> bool {
        self.idempotency_key.as_ref().is_none_or(|k| {
            !k.is_empty() && k.len() <= 128 && k.bytes().all(|b| b.is_ascii_graphic())
        })
    }
}

/// `reservations.get` and `reservations.release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ReservationById {
    pub id: ReservationId,
}

/// `reservations.list`: a tenant's reservations (the caller's own tenant when absent, every tenant's for a root
/// caller), newest first, at most `limit` (1 to 1000, default 100).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListReservations {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
}

/// One GPU a placed reservation booked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct BookedGpu {
    pub node: NodeId,
    pub uuid: String,
    pub index: i32,
    pub model: String,
}

/// A reservation as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Reservation {
    pub id: ReservationId,
    pub tenant: TenantId,
    pub principal: String,
    pub state: crate::reservation::ReservationState,
    pub request: ReservationRequest,
    pub nodes: Vec<NodeId>,
    pub gpus: Vec<BookedGpu>,
    pub error: Option<String>,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub placed_at_ms: Option<i64>,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub expires_at_ms: Option<i64>,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub ended_at_ms: Option<i64>,
}

/// One node's share of a placed reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct NodeDelivery {
    pub node: NodeId,
    /// The desired generation that first carried the booking to this node.
    pub generation: i64,
    pub state: Delivery,
    /// The node's reason, while `state` is failed.
    pub message: Option<String>,
}

/// How far a placed reservation's booking has reached its nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ReservationDelivery {
    /// Failed if any node failed, else pending while any has not applied it, else applied.
    pub state: Delivery,
    pub nodes: Vec<NodeDelivery>,
}

/// A reservation as `get` and `list` show it: a placed one carries its delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ReservationView {
    #[serde(flatten)]
    pub reservation: Reservation,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<ReservationDelivery>,
}

/// The answer of `create`, `get` and `release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ReservationAnswer {
    pub reservation: ReservationView,
}

/// The answer of `list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ReservationList {
    pub reservations: Vec<ReservationView>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placed_reservation_reads_back_from_the_json_the_server_answered_before() {
        let wire = serde_json::json!({
            "id": "rsv-1", "tenant": "acme", "principal": "alice", "state": "placed",
            "request": {"tenant": "acme", "gpus": 1, "topology": "node", "duration_s": 60},
            "nodes": ["node-1"],
            "gpus": [{"node": "node-1", "uuid": "GPU-1", "index": 0, "model": "H100"}],
            "error": null, "created_at_ms": 1, "placed_at_ms": 2, "expires_at_ms": 3, "ended_at_ms": null,
            "delivery": {"state": "applied", "nodes": [
                {"node": "node-1", "generation": 2, "state": "applied", "message": null}]},
        });
        let view: ReservationView = serde_json::from_value(wire.clone()).expect("reads");
        assert_eq!(view.reservation.nodes[0].as_str(), "node-1");
        assert_eq!(
            view.delivery.as_ref().expect("delivery").state,
            Delivery::Applied
        );
        assert_eq!(serde_json::to_value(&view).expect("writes"), wire);
    }

    #[test]
    fn create_refuses_an_unknown_field_and_a_bad_key() {
        let bad = serde_json::from_value::<CreateReservation>(serde_json::json!({
            "tenant": "a", "gpus": 1, "duration_s": 1, "colour": "red"
        }));
        assert!(bad.is_err());
        let c: CreateReservation = serde_json::from_value(serde_json::json!({
            "tenant": "a", "gpus": 1, "duration_s": 1, "idempotency_key": "has space"
        }))
        .expect("reads");
        assert!(!c.key_is_valid());
    }
}
