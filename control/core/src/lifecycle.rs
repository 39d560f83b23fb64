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

/// What the store knows of a node when the lifecycle controller chooses acceptance checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckCandidate {
    pub state: NodeState,
    /// It has a live session (a check can reach it).
    pub online: bool,
    /// Its GPU inventory section arrived (what the check compares against).
    pub gpu_inventory: bool,
    /// A check of the kind is queued, running, or finished and not yet acted on.
    pub check_open: bool,
    /// When its last check of the kind finished (ms since the epoch).
    pub last_check_finished_ms: Option<i64>,
}

/// Whether a node needs an acceptance check now: an online adopting node once its GPU inventory has arrived, and
/// an online failed node whose last check finished at least `recheck_after_ms` before `now_ms` (or never ran);
/// never while one is open. The store's read of candidates (`Store::check_candidates`) leaves out the adopting nodes
/// without GPU inventory, which this turns down: a rule that wanted them must change that read too.
pub fn needs_check(c: &CheckCandidate, now_ms: i64, recheck_after_ms: i64) -> bool {
    if !c.online || c.check_open {
        return false;
    }
    match c.state {
        NodeState::Adopting => c.gpu_inventory,
        NodeState::Failed => c
            .last_check_finished_ms
            .is_none_or(|at| at <= now_ms.saturating_sub(recheck_after_ms)),
        NodeState::Adopted | NodeState::Draining | NodeState::Revoked => false,
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

    fn candidate(state: NodeState) -> CheckCandidate {
        CheckCandidate {
            state,
            online: true,
            gpu_inventory: true,
            check_open: false,
            last_check_finished_ms: None,
        }
    }

    #[test]
    fn an_adopting_node_is_checked_once_its_gpus_are_reported_and_it_is_online() {
        let c = candidate(NodeState::Adopting);
        assert!(needs_check(&c, 0, 300_000));
        assert!(!needs_check(
            &CheckCandidate {
                gpu_inventory: false,
                ..c
            },
            0,
            300_000
        ));
        assert!(!needs_check(
            &CheckCandidate { online: false, ..c },
            0,
            300_000
        ));
        assert!(!needs_check(
            &CheckCandidate {
                check_open: true,
                ..c
            },
            0,
            300_000
        ));
    }

    #[test]
    fn a_failed_node_is_rechecked_only_after_the_recheck_interval() {
        let c = CheckCandidate {
            last_check_finished_ms: Some(1_000_000),
            ..candidate(NodeState::Failed)
        };
        assert!(!needs_check(&c, 1_000_000 + 299_999, 300_000));
        assert!(needs_check(&c, 1_000_000 + 300_000, 300_000));
        assert!(needs_check(
            &CheckCandidate {
                last_check_finished_ms: None,
                ..c
            },
            0,
            300_000
        ));
        assert!(!needs_check(
            &CheckCandidate {
                check_open: true,
                ..c
            },
            i64::MAX,
            300_000
        ));
        // A clock before the last check (another controller's skew) waits, never underflows.
        assert!(!needs_check(&c, i64::MIN, 300_000));
    }

    #[test]
    fn adopted_draining_and_revoked_nodes_are_never_checked() {
        for s in [NodeState::Adopted, NodeState::Draining, NodeState::Revoked] {
            assert!(!needs_check(&candidate(s), i64::MAX, 0), "{s}");
        }
    }
}
