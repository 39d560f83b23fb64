//! The join commit's decision: what becomes of each join of a batch once its token's row is locked.
//!
//! Input: the token as the locked row says, the batch in arrival order, the live nodes that already hold one of
//! the batch's node keys or hardware keys, and `now`. Output: one [`Decision`] per join, in order. Rules, per join:
//! 1. a revoked token refuses everything;
//! 2. a node key that already belongs to a live node is a retry only when that node joined with this token less
//!    than [`REPLAY_WINDOW_MS`] ago (the same node again, no use spent); later, or with another token, the key is
//!    taken, unless this join reclaims that very node;
//! 3. an expired token refuses what is not a retry;
//! 4. hardware that belongs to a live node is taken, unless this join reclaims that node (which must still hold
//!    it);
//! 5. what is left makes a new node or reclaims one, and only those spend uses, in arrival order: a retry never
//!    uses up what a new machine of the same batch needs.
//!
//! The batch itself counts as holders: a second join in the batch with a key or hardware an earlier one just took
//! is judged against it.

use crate::join::REPLAY_WINDOW_MS;

/// The join token as its locked row says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenState {
    pub uses_left: i64,
    pub revoked: bool,
    pub expires_at_ms: i64,
}

/// One join of the batch, as JoinService prepared it (its certificate already names `node_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// A fresh id, or the node to reclaim.
    pub node_id: &'a str,
    /// Re-adopt `node_id` (the token may reclaim and the node held this hardware when the join was checked).
    pub reclaim: bool,
    pub hardware_key: Option<&'a str>,
    /// SHA-256 (hex) of the node key's SubjectPublicKeyInfo.
    pub join_key_hash: &'a str,
}

/// A live (not revoked) node holding a batch member's node key or hardware key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub node_id: String,
    pub join_token_id: Option<String>,
    pub join_key_hash: String,
    pub hardware_key: Option<String>,
    pub joined_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new node; spends a use.
    Insert,
    /// Re-adopt the candidate's node with the new key; spends a use.
    Reclaim,
    /// A retry of a join of this token and key within the window: the same node, no use spent.
    Replay {
        node_id: String,
    },
    Revoked,
    Expired,
    Exhausted,
    /// This hardware belongs to another live node and the join does not reclaim it.
    HardwareTaken {
        node_id: String,
    },
    /// This node key already belongs to a live node and the join is not a retry within the window.
    KeyTaken {
        node_id: String,
        joined_at_ms: i64,
        same_token: bool,
    },
    /// The node to reclaim was revoked, lost this hardware, or is reclaimed by another join of this batch.
    ReclaimLost,
}

impl Decision {
    /// Whether applying the decision spends a use of the token.
    pub fn spends(&self) -> bool {
        matches!(self, Decision::Insert | Decision::Reclaim)
    }
}

/// Whether a node that joined at `joined_at_ms` can still be answered as a retry at `now_ms`.
pub fn within_replay_window(joined_at_ms: i64, now_ms: i64) -> bool {
    now_ms.saturating_sub(joined_at_ms) < REPLAY_WINDOW_MS
}

/// Decides every join of a batch on `token_id` (see the module documentation for the rules).
pub fn plan(
    token_id: &str,
    token: &TokenState,
    candidates: &[Candidate<'_>],
    holders: &[Holder],
    now_ms: i64,
) -> Vec<Decision> {
    let mut holders: Vec<(Holder, bool)> = holders.iter().cloned().map(|h| (h, false)).collect();
    let mut uses_left = token.uses_left.max(0);
    let mut out = Vec::with_capacity(candidates.len());
    for c in candidates {
        let d = decide(token_id, token, c, &holders, now_ms, uses_left);
        if d.spends() {
            uses_left -= 1;
            // Later joins of the batch see this one as the holder of its key and hardware.
            holders.retain(|(h, _)| h.node_id != c.node_id);
            holders.push((
                Holder {
                    node_id: c.node_id.to_string(),
                    join_token_id: Some(token_id.to_string()),
                    join_key_hash: c.join_key_hash.to_string(),
                    hardware_key: c.hardware_key.map(str::to_string),
                    joined_at_ms: now_ms,
                },
                true,
            ));
        }
        out.push(d);
    }
    out
}

fn decide(
    token_id: &str,
    token: &TokenState,
    c: &Candidate<'_>,
    holders: &[(Holder, bool)],
    now_ms: i64,
    uses_left: i64,
) -> Decision {
    if token.revoked {
        return Decision::Revoked;
    }
    let by_key = holders
        .iter()
        .find(|(h, _)| h.join_key_hash == c.join_key_hash);
    if let Some((h, _)) = by_key {
        let same_token = h.join_token_id.as_deref() == Some(token_id);
        if same_token && within_replay_window(h.joined_at_ms, now_ms) {
            return Decision::Replay {
                node_id: h.node_id.clone(),
            };
        }
        if !(c.reclaim && h.node_id == c.node_id) {
            return Decision::KeyTaken {
                node_id: h.node_id.clone(),
                joined_at_ms: h.joined_at_ms,
                same_token,
            };
        }
    }
    if token.expires_at_ms <= now_ms {
        return Decision::Expired;
    }
    let by_hardware = c.hardware_key.and_then(|hk| {
        holders
            .iter()
            .find(|(h, _)| h.hardware_key.as_deref() == Some(hk))
    });
    let wanted = match (c.reclaim, by_hardware) {
        (true, Some((h, in_batch))) if h.node_id == c.node_id && !in_batch => Decision::Reclaim,
        (true, _) => return Decision::ReclaimLost,
        (false, Some((h, _))) => {
            return Decision::HardwareTaken {
                node_id: h.node_id.clone(),
            };
        }
        (false, None) => Decision::Insert,
    };
    if uses_left <= 0 {
        return Decision::Exhausted;
    }
    wanted
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;
    const T: &str = "tok";

    fn token(uses_left: i64) -> TokenState {
        TokenState {
            uses_left,
            revoked: false,
            expires_at_ms: NOW + 3_600_000,
        }
    }

    fn new_machine<'a>(id: &'a str, key: &'a str, hk: &'a str) -> Candidate<'a> {
        Candidate {
            node_id: id,
            reclaim: false,
            hardware_key: Some(hk),
            join_key_hash: key,
        }
    }

    fn holder(id: &str, token: &str, key: &str, hk: Option<&str>, joined_at_ms: i64) -> Holder {
        Holder {
            node_id: id.into(),
            join_token_id: Some(token.into()),
            join_key_hash: key.into(),
            hardware_key: hk.map(str::to_string),
            joined_at_ms,
        }
    }

    #[test]
    fn retries_spend_no_use_so_new_machines_get_every_use_left() {
        // Three uses left; the batch holds two retries of committed joins and four new machines, retries first.
        let holders = [
            holder("old-1", T, "k1", Some("hk1"), NOW - 1_000),
            holder("old-2", T, "k2", Some("hk2"), NOW - 2_000),
        ];
        let batch = [
            new_machine("r1", "k1", "hk1"),
            new_machine("r2", "k2", "hk2"),
            new_machine("n1", "k3", "hk3"),
            new_machine("n2", "k4", "hk4"),
            new_machine("n3", "k5", "hk5"),
            new_machine("n4", "k6", "hk6"),
        ];
        let d = plan(T, &token(3), &batch, &holders, NOW);
        assert_eq!(
            d,
            vec![
                Decision::Replay {
                    node_id: "old-1".into()
                },
                Decision::Replay {
                    node_id: "old-2".into()
                },
                Decision::Insert,
                Decision::Insert,
                Decision::Insert,
                Decision::Exhausted,
            ]
        );
    }

    #[test]
    fn the_replay_window_holds_with_and_without_a_hardware_key() {
        for hk in [Some("hk1"), None] {
            let c = Candidate {
                node_id: "fresh-id",
                reclaim: false,
                hardware_key: hk,
                join_key_hash: "k1",
            };
            let at = |age: i64| vec![holder("n1", T, "k1", hk, NOW - age)];
            // Just inside: the same node again.
            assert_eq!(
                plan(
                    T,
                    &token(0),
                    std::slice::from_ref(&c),
                    &at(REPLAY_WINDOW_MS - 1),
                    NOW
                ),
                vec![Decision::Replay {
                    node_id: "n1".into()
                }],
                "{hk:?}"
            );
            // At the window's end and a day later: refused, naming the node, spending nothing.
            for age in [REPLAY_WINDOW_MS, 24 * 3_600_000] {
                assert_eq!(
                    plan(T, &token(5), std::slice::from_ref(&c), &at(age), NOW),
                    vec![Decision::KeyTaken {
                        node_id: "n1".into(),
                        joined_at_ms: NOW - age,
                        same_token: true,
                    }],
                    "{hk:?} {age}"
                );
            }
        }
        // The same key with another token is never a retry.
        assert_eq!(
            plan(
                T,
                &token(5),
                &[new_machine("x", "k1", "hk1")],
                &[holder("n1", "other", "k1", Some("hk1"), NOW)],
                NOW
            ),
            vec![Decision::KeyTaken {
                node_id: "n1".into(),
                joined_at_ms: NOW,
                same_token: false
            }]
        );
    }

    #[test]
    fn revoked_expired_and_taken_hardware() {
        let mut revoked = token(5);
        revoked.revoked = true;
        let retry = [holder("n1", T, "k1", Some("hk1"), NOW)];
        assert_eq!(
            plan(T, &revoked, &[new_machine("x", "k1", "hk1")], &retry, NOW),
            vec![Decision::Revoked],
            "a revoked token answers no retry either"
        );
        let mut expired = token(5);
        expired.expires_at_ms = NOW;
        assert_eq!(
            plan(
                T,
                &expired,
                &[new_machine("x", "k1", "hk1"), new_machine("y", "k9", "hk9")],
                &retry,
                NOW
            ),
            vec![
                Decision::Replay {
                    node_id: "n1".into()
                },
                Decision::Expired
            ],
            "a retry within the window outlives the token's expiry"
        );
        assert_eq!(
            plan(T, &token(5), &[new_machine("x", "k2", "hk1")], &retry, NOW),
            vec![Decision::HardwareTaken {
                node_id: "n1".into()
            }]
        );
    }

    #[test]
    fn reclaims_need_the_node_to_still_hold_the_hardware_and_spend_a_use() {
        let held = [holder(
            "n1",
            "first",
            "k-old",
            Some("hk1"),
            NOW - 86_400_000,
        )];
        let reclaim = |key| Candidate {
            node_id: "n1",
            reclaim: true,
            hardware_key: Some("hk1"),
            join_key_hash: key,
        };
        assert_eq!(
            plan(T, &token(1), &[reclaim("k-new")], &held, NOW),
            vec![Decision::Reclaim]
        );
        assert_eq!(
            plan(T, &token(0), &[reclaim("k-new")], &held, NOW),
            vec![Decision::Exhausted]
        );
        // The node was revoked (no longer a holder) or another node holds the hardware now.
        assert_eq!(
            plan(T, &token(1), &[reclaim("k-new")], &[], NOW),
            vec![Decision::ReclaimLost]
        );
        // Reclaiming with the node's current key (its reply was lost long ago) re-adopts it.
        assert_eq!(
            plan(T, &token(1), &[reclaim("k-old")], &held, NOW),
            vec![Decision::Reclaim]
        );
        // Two reclaims of one node in a batch: the second waits for the next batch.
        assert_eq!(
            plan(T, &token(5), &[reclaim("k-a"), reclaim("k-b")], &held, NOW),
            vec![Decision::Reclaim, Decision::ReclaimLost]
        );
    }

    #[test]
    fn the_batch_counts_as_holders() {
        // The same machine twice in one batch with two keys, and one key twice (a client that retried at once).
        let d = plan(
            T,
            &token(5),
            &[
                new_machine("a", "k1", "hk1"),
                new_machine("b", "k2", "hk1"),
                new_machine("c", "k1", "hk1"),
            ],
            &[],
            NOW,
        );
        assert_eq!(
            d,
            vec![
                Decision::Insert,
                Decision::HardwareTaken {
                    node_id: "a".into()
                },
                Decision::Replay {
                    node_id: "a".into()
                },
            ]
        );
        // Machines without a hardware key never collide on it.
        let none = |id, key| Candidate {
            node_id: id,
            reclaim: false,
            hardware_key: None,
            join_key_hash: key,
        };
        assert_eq!(
            plan(T, &token(5), &[none("a", "k1"), none("b", "k2")], &[], NOW),
            vec![Decision::Insert, Decision::Insert]
        );
    }
}
