//! The node lifecycle after join: `adopting` → (inventory, then the pool's acceptance check `diag.nvml`) →
//! `adopted` with desired-state generation 1, or `failed` with reasons; a failed node is re-checked and returns
//! to `adopted` when its fault clears.

use crate::node::NodeState;

/// What a finished acceptance check said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagOutcome {
    pub passed: bool,
    /// One sentence per failed check (empty when passed).
    pub reasons: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Accepted: state `adopted`, desired generation at least 1, conditions cleared.
    Adopt { desired_generation: i64 },
    /// Refused or broken: state `failed` with the reasons as conditions.
    Fail { reasons: Vec<String> },
    /// Nothing changes but the recorded conditions.
    Stay { reasons: Vec<String> },
}

/// The transition after an acceptance check on a node in `state` whose desired generation is
/// `desired_generation`.
pub fn after_diag(state: NodeState, desired_generation: i64, diag: &DiagOutcome) -> Transition {
    match (state, diag.passed) {
        (NodeState::Adopting | NodeState::Failed, true) => Transition::Adopt {
            desired_generation: desired_generation.max(1),
        },
        (NodeState::Adopting | NodeState::Adopted, false) => Transition::Fail {
            reasons: diag.reasons.clone(),
        },
        (_, passed) => Transition::Stay {
            reasons: if passed {
                Vec::new()
            } else {
                diag.reasons.clone()
            },
        },
    }
}

/// A command that produced no result in time is treated as a failed check with that reason.
pub fn timed_out(kind: &str) -> DiagOutcome {
    DiagOutcome {
        passed: false,
        reasons: vec![format!("{kind} produced no result before its deadline")],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass() -> DiagOutcome {
        DiagOutcome {
            passed: true,
            reasons: vec![],
        }
    }

    fn fail() -> DiagOutcome {
        DiagOutcome {
            passed: false,
            reasons: vec!["GPU 3: volatile DBE 2 > 0".into()],
        }
    }

    #[test]
    fn adoption_failure_and_recovery() {
        assert_eq!(
            after_diag(NodeState::Adopting, 0, &pass()),
            Transition::Adopt {
                desired_generation: 1
            }
        );
        assert!(matches!(
            after_diag(NodeState::Adopting, 0, &fail()),
            Transition::Fail { .. }
        ));
        assert_eq!(
            after_diag(NodeState::Failed, 1, &pass()),
            Transition::Adopt {
                desired_generation: 1
            }
        );
        assert!(matches!(
            after_diag(NodeState::Failed, 1, &fail()),
            Transition::Stay { .. }
        ));
        assert!(matches!(
            after_diag(NodeState::Adopted, 3, &fail()),
            Transition::Fail { .. }
        ));
        assert_eq!(
            after_diag(NodeState::Adopted, 3, &pass()),
            Transition::Stay { reasons: vec![] }
        );
        assert!(matches!(
            after_diag(NodeState::Draining, 3, &fail()),
            Transition::Stay { .. }
        ));
        assert!(matches!(
            after_diag(NodeState::Revoked, 3, &pass()),
            Transition::Stay { .. }
        ));
    }
}
