//! Node lifecycle states as stored and shown.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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

/// Compares with a stored or shown name (`state == "adopted"`).
impl PartialEq<&str> for NodeState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A node that is not revoked: the only states a transition starts from. Revoked is terminal by type: no
/// [`Transition`] can be built from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LiveState {
    Adopting,
    Adopted,
    Draining,
    Failed,
}

impl LiveState {
    pub fn state(self) -> NodeState {
        match self {
            LiveState::Adopting => NodeState::Adopting,
            LiveState::Adopted => NodeState::Adopted,
            LiveState::Draining => NodeState::Draining,
            LiveState::Failed => NodeState::Failed,
        }
    }
}

/// Whether a node still has a life: [`NodeState`] split into the live states and the terminal one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    Live(LiveState),
    Revoked,
}

impl NodeState {
    pub fn standing(self) -> Standing {
        match self {
            NodeState::Adopting => Standing::Live(LiveState::Adopting),
            NodeState::Adopted => Standing::Live(LiveState::Adopted),
            NodeState::Draining => Standing::Live(LiveState::Draining),
            NodeState::Failed => Standing::Live(LiveState::Failed),
            NodeState::Revoked => Standing::Revoked,
        }
    }

    pub fn is_revoked(self) -> bool {
        self == NodeState::Revoked
    }
}

/// The operator verbs on a node's state: `nodes.drain` (adopted → draining: no new bookings from the moment the
/// call returns; existing ones stay), `nodes.undrain` (draining → adopted), `nodes.revoke` (refused from now on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeVerb {
    Drain,
    Undrain,
    Revoke,
}

impl NodeVerb {
    pub fn name(self) -> &'static str {
        match self {
            NodeVerb::Drain => "drain",
            NodeVerb::Undrain => "undrain",
            NodeVerb::Revoke => "revoke",
        }
    }

    /// The state the verb sets.
    pub fn target(self) -> NodeState {
        match self {
            NodeVerb::Drain => NodeState::Draining,
            NodeVerb::Undrain => NodeState::Adopted,
            NodeVerb::Revoke => NodeState::Revoked,
        }
    }
}

/// A change of a live node's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: LiveState,
    pub to: NodeState,
}

/// What a verb does to a node in a given state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerbPlan {
    Change(Transition),
    /// The node is already where the verb puts it.
    Unchanged,
    /// The verb does not apply to the node's state; why, and what to do.
    Refused(String),
}

/// Decides `verb` on node `node_id` found in `state` (read under the row lock; the caller applies the plan in the
/// same transaction).
pub fn plan_verb(verb: NodeVerb, node_id: &str, state: NodeState) -> VerbPlan {
    let to = verb.target();
    if state == to {
        return VerbPlan::Unchanged;
    }
    let from = match state.standing() {
        Standing::Revoked => {
            return VerbPlan::Refused(format!("node {node_id} is revoked; nothing to change"));
        }
        Standing::Live(from) => from,
    };
    let applies = match verb {
        NodeVerb::Drain => from == LiveState::Adopted,
        NodeVerb::Undrain => from == LiveState::Draining,
        NodeVerb::Revoke => true,
    };
    if applies {
        return VerbPlan::Change(Transition { from, to });
    }
    VerbPlan::Refused(match verb {
        NodeVerb::Drain => format!(
            "node {node_id} is {state}: only an adopted node can be drained (a {state} node takes no bookings); \
             drain it once it is adopted"
        ),
        _ => format!(
            "node {node_id} is {state}, not draining: undrain returns a drained node to adopted"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [NodeState; 5] = [
        NodeState::Adopting,
        NodeState::Adopted,
        NodeState::Draining,
        NodeState::Failed,
        NodeState::Revoked,
    ];

    #[test]
    fn drain_and_undrain_move_only_between_adopted_and_draining() {
        use NodeState::*;
        let change = |from, to| VerbPlan::Change(Transition { from, to });
        assert_eq!(
            plan_verb(NodeVerb::Drain, "n", Adopted),
            change(LiveState::Adopted, Draining)
        );
        assert_eq!(
            plan_verb(NodeVerb::Drain, "n", Draining),
            VerbPlan::Unchanged
        );
        assert_eq!(
            plan_verb(NodeVerb::Undrain, "n", Draining),
            change(LiveState::Draining, Adopted)
        );
        assert_eq!(
            plan_verb(NodeVerb::Undrain, "n", Adopted),
            VerbPlan::Unchanged
        );
        for s in [Adopting, Failed] {
            assert!(
                matches!(plan_verb(NodeVerb::Drain, "n", s), VerbPlan::Refused(m) if m.contains("only an adopted node"))
            );
            assert!(
                matches!(plan_verb(NodeVerb::Undrain, "n", s), VerbPlan::Refused(m) if m.contains("not draining"))
            );
        }
    }

    #[test]
    fn revoke_applies_to_every_live_state_and_nothing_leaves_revoked() {
        for s in ALL {
            match (s.standing(), plan_verb(NodeVerb::Revoke, "n", s)) {
                (Standing::Live(from), VerbPlan::Change(t)) => {
                    assert_eq!(
                        t,
                        Transition {
                            from,
                            to: NodeState::Revoked
                        }
                    )
                }
                (Standing::Revoked, VerbPlan::Unchanged) => {}
                other => panic!("{s}: {other:?}"),
            }
        }
        for verb in [NodeVerb::Drain, NodeVerb::Undrain] {
            assert_eq!(
                plan_verb(verb, "n-7", NodeState::Revoked),
                VerbPlan::Refused("node n-7 is revoked; nothing to change".into())
            );
        }
    }

    #[test]
    fn every_change_starts_from_the_state_it_was_planned_on() {
        for verb in [NodeVerb::Drain, NodeVerb::Undrain, NodeVerb::Revoke] {
            for s in ALL {
                if let VerbPlan::Change(t) = plan_verb(verb, "n", s) {
                    assert_eq!(t.from.state(), s);
                    assert_eq!(t.to, verb.target());
                    assert_ne!(t.to, s);
                }
            }
        }
    }
}
