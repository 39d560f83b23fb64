//! The typed answer of `fleet.overview`, the read-only fleet page's one call (`GET /fleet` renders it): counts by
//! state, each node with its GPUs free and booked, the machines in flight and the failures with their last error.

use crate::ids::{MachineId, NodeId, PoolId, SiteId};
use crate::metal::Phase;
use crate::node::NodeState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `fleet.overview` (it takes no argument).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FleetRequest {}

/// The fleet as one read sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FleetOverview {
    /// When the control plane read it (its clock: elapsed times on the page count from here).
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub at_ms: i64,
    pub counts: FleetCounts,
    pub nodes: Vec<FleetNode>,
    /// Metal machines in a waiting phase (inspecting, booting the ramdisk, diagnosing, wiping, deploying,
    /// releasing), oldest phase first.
    pub in_flight: Vec<InFlight>,
    /// What failed and why: failed metal machines, failed reservations, nodes in `failed` or failing to apply their
    /// desired state.
    pub failures: Vec<Failure>,
}

/// Counts by state. Every known state is present (0 when none), so a dashboard's columns stay put.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FleetCounts {
    /// Nodes by state (`adopting`, `adopted`, `draining`, `failed`, `revoked`).
    pub nodes: BTreeMap<String, u64>,
    /// Nodes with an open session.
    pub nodes_online: u64,
    pub gpus: GpuCounts,
    /// Reservations by state (`pending`, `placed`, `failed`, `released`, `expired`).
    pub reservations: BTreeMap<String, u64>,
    /// Metal machines by phase; failed ones count under `failed`, not their phase.
    pub machines: BTreeMap<String, u64>,
}

/// GPUs present on nodes that are not revoked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GpuCounts {
    pub total: u64,
    /// Booked by a reservation or an instance.
    pub booked: u64,
    pub free: u64,
}

/// A node with its GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FleetNode {
    pub id: NodeId,
    pub hostname: String,
    pub pool: PoolId,
    pub state: NodeState,
    pub online: bool,
    /// When a gateway last heard from the node: exact once its session closed, up to a minute old while it is online
    /// (`online` says whether it is up).
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub last_seen_ms: Option<i64>,
    pub gpus_total: u64,
    pub gpus_booked: u64,
    pub gpus_free: u64,
    /// The GPU model (the first one's), empty without GPUs.
    pub gpu_model: String,
    pub conditions: Vec<String>,
}

/// A metal machine in a waiting phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct InFlight {
    pub mac: MachineId,
    pub site: SiteId,
    pub phase: Phase,
    pub attempt: u32,
    /// When the phase started (elapsed time = `at_ms` − this).
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub phase_started_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub deadline_ms: Option<i64>,
    pub waiting_for: Option<String>,
}

/// Something that failed, with its last error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Failure {
    /// `machine`, `reservation` or `node`.
    pub kind: String,
    pub id: String,
    /// Where it failed: the machine's phase, the reservation's or node's state.
    pub at: String,
    pub error: String,
}

// === assembly (pure) ===

/// A node's GPUs as the store counts them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTally {
    pub node_id: String,
    pub total: u64,
    pub booked: u64,
    pub model: String,
}

/// What one read of the fleet found, before it is summed up.
#[derive(Debug, Clone, Default)]
pub struct FleetInput {
    pub nodes: Vec<super::nodes::Node>,
    pub gpus: Vec<GpuTally>,
    pub reservations: Vec<(String, u64)>,
    /// Failed reservations: (id, error).
    pub failed_reservations: Vec<(String, String)>,
    pub machines: Vec<super::metal::MachineSummary>,
}

/// The page's answer from one read, at `at_ms`. Revoked nodes are counted but not listed, and their GPUs count
/// nowhere.
pub fn overview(input: FleetInput, at_ms: i64) -> FleetOverview {
    use crate::metal::State;
    use crate::reservation::ReservationState;
    let mut counts = FleetCounts::default();
    for s in [
        NodeState::Adopting,
        NodeState::Adopted,
        NodeState::Draining,
        NodeState::Failed,
        NodeState::Revoked,
    ] {
        counts.nodes.insert(s.as_str().into(), 0);
    }
    for s in ReservationState::ALL {
        counts.reservations.insert(s.as_str().into(), 0);
    }
    for p in Phase::ALL {
        counts.machines.insert(p.as_str().into(), 0);
    }
    counts.machines.insert("failed".into(), 0);
    for (state, n) in input.reservations {
        *counts.reservations.entry(state).or_default() += n;
    }
    let gpus: BTreeMap<&str, &GpuTally> =
        input.gpus.iter().map(|g| (g.node_id.as_str(), g)).collect();
    let mut failures = Vec::new();
    let mut nodes = Vec::new();
    for n in input.nodes {
        *counts.nodes.entry(n.state.as_str().into()).or_default() += 1;
        if n.state == NodeState::Revoked {
            continue;
        }
        counts.nodes_online += u64::from(n.online);
        let g = gpus.get(n.id.as_str());
        let (total, booked) = g.map_or((0, 0), |g| (g.total, g.booked.min(g.total)));
        counts.gpus.total += total;
        counts.gpus.booked += booked;
        let failing = n.desired_state.as_ref().filter(|d| d.failing);
        if n.state == NodeState::Failed || failing.is_some() {
            let error = failing
                .and_then(|d| d.message.clone())
                .or_else(|| n.conditions.first().cloned())
                .unwrap_or_default();
            failures.push(Failure {
                kind: "node".into(),
                id: n.id.to_string(),
                at: n.state.as_str().into(),
                error,
            });
        }
        nodes.push(FleetNode {
            hostname: n.hostname().to_string(),
            id: n.id,
            pool: n.pool_id,
            state: n.state,
            online: n.online,
            last_seen_ms: n.last_seen_ms,
            gpus_total: total,
            gpus_booked: booked,
            gpus_free: total - booked,
            gpu_model: g.map(|g| g.model.clone()).unwrap_or_default(),
            conditions: n.conditions,
        });
    }
    counts.gpus.free = counts.gpus.total - counts.gpus.booked;
    let mut in_flight = Vec::new();
    for m in input.machines {
        match m.state {
            State::Failed { phase, reason } => {
                *counts.machines.entry("failed".into()).or_default() += 1;
                failures.push(Failure {
                    kind: "machine".into(),
                    id: m.mac.to_string(),
                    at: phase.as_str().into(),
                    error: m.last_error.unwrap_or(reason),
                });
            }
            State::Active { phase } => {
                *counts.machines.entry(phase.as_str().into()).or_default() += 1;
                if phase.is_wait() {
                    in_flight.push(InFlight {
                        mac: m.mac,
                        site: m.site,
                        phase,
                        attempt: m.attempt,
                        phase_started_ms: m.phase_started_ms.unwrap_or(at_ms),
                        deadline_ms: m.deadline_ms,
                        waiting_for: m.waiting_for,
                    });
                }
            }
        }
    }
    in_flight.sort_by(|a, b| (a.phase_started_ms, &a.mac).cmp(&(b.phase_started_ms, &b.mac)));
    failures.extend(
        input
            .failed_reservations
            .into_iter()
            .map(|(id, error)| Failure {
                kind: "reservation".into(),
                id,
                at: "failed".into(),
                error,
            }),
    );
    FleetOverview {
        at_ms,
        counts,
        nodes,
        in_flight,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::metal::MachineSummary;
    use crate::api::nodes::Node;
    use crate::metal::State;

    fn node(id: &str, state: NodeState, online: bool) -> Node {
        serde_json::from_value(serde_json::json!({
            "id": id, "pool_id": "default", "state": state.as_str(), "hardware_key": null,
            "claims": {"hostname": format!("host-{id}")}, "joined_at_ms": 1, "cert_not_after_ms": 2,
            "join_token_id": null, "session_epoch": 0, "online": online, "last_seen_ms": null,
            "desired_generation": 0, "acked_generation": 0, "conditions": []
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn machine(mac: &str, state: State, started: i64) -> MachineSummary {
        MachineSummary {
            mac: MachineId::parse(mac).unwrap_or_else(|e| panic!("{e}")),
            site: SiteId::parse("rack-1").unwrap_or_else(|e| panic!("{e}")),
            state,
            attempt: 1,
            deadline_ms: Some(started + 60_000),
            last_error: None,
            phase_started_ms: Some(started),
            waiting_for: None,
        }
    }

    #[test]
    fn counts_every_state_and_lists_what_is_in_flight_or_failed() {
        let tally = |id: &str, total, booked| GpuTally {
            node_id: id.into(),
            total,
            booked,
            model: "H100".into(),
        };
        let input = FleetInput {
            nodes: vec![
                node("n1", NodeState::Adopted, true),
                node("n2", NodeState::Failed, false),
                node("n3", NodeState::Revoked, false),
            ],
            gpus: vec![tally("n1", 8, 3), tally("n2", 4, 0), tally("n3", 8, 0)],
            reservations: vec![("placed".into(), 2), ("failed".into(), 1)],
            failed_reservations: vec![("r1".into(), "no capacity".into())],
            machines: vec![
                machine(
                    "aa",
                    State::Active {
                        phase: Phase::Wiping,
                    },
                    500,
                ),
                machine(
                    "bb",
                    State::Active {
                        phase: Phase::Ready,
                    },
                    100,
                ),
                machine(
                    "cc",
                    State::Failed {
                        phase: Phase::Diagnosing,
                        reason: "2 GPUs, expected 8".into(),
                    },
                    50,
                ),
                machine(
                    "dd",
                    State::Active {
                        phase: Phase::Inspecting,
                    },
                    200,
                ),
            ],
        };
        let o = overview(input, 1_000);
        assert_eq!(o.counts.nodes["adopted"], 1);
        assert_eq!(o.counts.nodes["revoked"], 1);
        assert_eq!(o.counts.nodes["draining"], 0);
        assert_eq!(o.counts.nodes_online, 1);
        assert_eq!(
            o.counts.gpus,
            GpuCounts {
                total: 12,
                booked: 3,
                free: 9
            }
        );
        assert_eq!(o.counts.reservations["pending"], 0);
        assert_eq!(o.counts.reservations["placed"], 2);
        assert_eq!(o.counts.machines["failed"], 1);
        assert_eq!(o.counts.machines["wiping"], 1);
        assert_eq!(o.nodes.len(), 2, "revoked nodes are not listed");
        assert_eq!(o.nodes[0].gpus_free, 5);
        let flying: Vec<&str> = o.in_flight.iter().map(|m| m.mac.as_str()).collect();
        assert_eq!(flying, ["dd", "aa"], "waiting phases only, oldest first");
        let failed: Vec<(&str, &str)> = o
            .failures
            .iter()
            .map(|f| (f.kind.as_str(), f.id.as_str()))
            .collect();
        assert_eq!(
            failed,
            [("node", "n2"), ("machine", "cc"), ("reservation", "r1")]
        );
        assert_eq!(o.failures[1].error, "2 GPUs, expected 8");
    }
}
