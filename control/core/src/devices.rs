//! Which node a GPU belongs to. Bookable devices are derived from each node's `gpus` inventory section, and a GPU
//! UUID belongs to one node at a time: the first live node to report it holds it. Another node reporting the same
//! UUID gets a conflict (a condition on that node and an audit event), never a second bookable device. When the
//! holder stops reporting the UUID (the GPU moved) or is revoked, the GPU goes to the node that has waited longest
//! for it.
//!
//! Input: the GPUs a node reports now and every device row of the UUIDs concerned (reported now, or held by the
//! node before). Output: a [`GpuSync`] plan the store applies in one transaction.

use std::collections::BTreeSet;

/// One GPU of a `gpus` inventory section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedGpu {
    pub uuid: String,
    pub index: i32,
    pub model: String,
    /// NVLink clique (fabric cluster + clique id) when the GPU reports one.
    pub clique: Option<String>,
}

/// A device row as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRow {
    pub node_id: String,
    pub uuid: String,
    /// Bookable on this node (when the node is adopted and the row is not booked).
    pub present: bool,
    /// The node holding this UUID when this row's node reported it too.
    pub conflict_with: Option<String>,
    /// Since when the conflict is recorded (who waits longest gets a released GPU).
    pub conflict_since_ms: Option<i64>,
    /// The row's node is not revoked.
    pub node_live: bool,
}

/// A released GPU given to a node that reported it while another held it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handover {
    pub uuid: String,
    pub to_node: String,
    /// Other nodes still waiting for it: their conflict now names `to_node`.
    pub still_waiting: Vec<String>,
}

/// What a report changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuSync {
    /// GPUs this node holds (present, no conflict).
    pub held: Vec<ReportedGpu>,
    /// GPUs this node reports that another live node holds: recorded, not bookable.
    pub conflicted: Vec<(ReportedGpu, String)>,
    /// UUIDs of this node's rows it no longer reports (or all of them when it is revoked): absent, no conflict.
    pub absent: Vec<String>,
    /// GPUs this node released that another node was waiting for.
    pub handovers: Vec<Handover>,
    /// (node, uuid) rows of revoked nodes still marked present for a UUID this node now holds.
    pub evicted: Vec<(String, String)>,
    /// Conflicts that did not exist before this report: (uuid, holder), one audit event each.
    pub new_conflicts: Vec<(String, String)>,
}

/// Decides what `node_id` reporting `reported` changes, given every row of the UUIDs concerned. A revoked node
/// reports nothing: pass an empty list to release everything it held.
pub fn plan_gpu_sync(node_id: &str, reported: &[ReportedGpu], rows: &[DeviceRow]) -> GpuSync {
    let mut plan = GpuSync::default();
    let mut seen = BTreeSet::new();
    for g in reported {
        if g.uuid.is_empty() || !seen.insert(g.uuid.as_str()) {
            continue;
        }
        let holder = rows
            .iter()
            .find(|r| r.uuid == g.uuid && r.present && r.node_live && r.node_id != node_id);
        match holder {
            Some(h) => {
                let before = rows
                    .iter()
                    .find(|r| r.uuid == g.uuid && r.node_id == node_id)
                    .and_then(|r| r.conflict_with.as_deref());
                if before != Some(h.node_id.as_str()) {
                    plan.new_conflicts.push((g.uuid.clone(), h.node_id.clone()));
                }
                plan.conflicted.push((g.clone(), h.node_id.clone()));
            }
            None => {
                plan.evicted.extend(
                    rows.iter()
                        .filter(|r| {
                            r.uuid == g.uuid && r.present && !r.node_live && r.node_id != node_id
                        })
                        .map(|r| (r.node_id.clone(), r.uuid.clone())),
                );
                plan.held.push(g.clone());
            }
        }
    }
    for own in rows.iter().filter(|r| r.node_id == node_id) {
        if seen.contains(own.uuid.as_str()) {
            continue;
        }
        if own.present || own.conflict_with.is_some() {
            plan.absent.push(own.uuid.clone());
        }
        if own.present {
            let mut waiting: Vec<&DeviceRow> = rows
                .iter()
                .filter(|r| {
                    r.uuid == own.uuid
                        && r.node_live
                        && r.node_id != node_id
                        && r.conflict_with.as_deref() == Some(node_id)
                })
                .collect();
            waiting.sort_by(|a, b| {
                (a.conflict_since_ms, &a.node_id).cmp(&(b.conflict_since_ms, &b.node_id))
            });
            if let Some((first, rest)) = waiting.split_first() {
                plan.handovers.push(Handover {
                    uuid: own.uuid.clone(),
                    to_node: first.node_id.clone(),
                    still_waiting: rest.iter().map(|r| r.node_id.clone()).collect(),
                });
            }
        }
    }
    plan
}

/// The node condition a conflict shows, with what to do about it.
pub fn conflict_condition(uuid: &str, holder: &str) -> String {
    format!(
        "GPU {uuid} is also reported by node {holder}, which holds it: it is not bookable on this node. If the GPU \
         moved here, it comes here when node {holder} reports its GPUs without it or is revoked; if not, two \
         machines report one UUID: check the hardware"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(uuid: &str) -> ReportedGpu {
        ReportedGpu {
            uuid: uuid.into(),
            index: 0,
            model: "H100".into(),
            clique: None,
        }
    }

    fn row(node: &str, uuid: &str, present: bool, conflict: Option<&str>, since: i64) -> DeviceRow {
        DeviceRow {
            node_id: node.into(),
            uuid: uuid.into(),
            present,
            conflict_with: conflict.map(str::to_string),
            conflict_since_ms: conflict.map(|_| since),
            node_live: true,
        }
    }

    #[test]
    fn a_uuid_another_node_holds_is_a_conflict_never_a_second_device() {
        let rows = [row("a", "GPU-1", true, None, 0)];
        let p = plan_gpu_sync("b", &[gpu("GPU-1"), gpu("GPU-2")], &rows);
        assert_eq!(p.held, vec![gpu("GPU-2")]);
        assert_eq!(p.conflicted, vec![(gpu("GPU-1"), "a".to_string())]);
        assert_eq!(
            p.new_conflicts,
            vec![("GPU-1".to_string(), "a".to_string())]
        );
        // Reported again: still a conflict, but not a new one (one audit event per conflict).
        let rows = [
            row("a", "GPU-1", true, None, 0),
            row("b", "GPU-1", false, Some("a"), 5),
        ];
        let p = plan_gpu_sync("b", &[gpu("GPU-1")], &rows);
        assert_eq!(p.conflicted.len(), 1);
        assert!(p.new_conflicts.is_empty());
        // The holder reporting it again changes nothing for it.
        let p = plan_gpu_sync("a", &[gpu("GPU-1")], &rows);
        assert_eq!(p.held, vec![gpu("GPU-1")]);
        assert!(p.conflicted.is_empty() && p.handovers.is_empty() && p.absent.is_empty());
    }

    #[test]
    fn a_released_gpu_goes_to_the_node_waiting_longest() {
        let rows = [
            row("a", "GPU-1", true, None, 0),
            row("c", "GPU-1", false, Some("a"), 20),
            row("b", "GPU-1", false, Some("a"), 10),
        ];
        // The holder's new report no longer has it (the GPU moved).
        let p = plan_gpu_sync("a", &[], &rows);
        assert_eq!(p.absent, vec!["GPU-1".to_string()]);
        assert_eq!(
            p.handovers,
            vec![Handover {
                uuid: "GPU-1".into(),
                to_node: "b".into(),
                still_waiting: vec!["c".into()],
            }]
        );
    }

    #[test]
    fn revoked_holders_hold_nothing() {
        let mut dead = row("a", "GPU-1", true, None, 0);
        dead.node_live = false;
        let p = plan_gpu_sync("b", &[gpu("GPU-1")], &[dead]);
        assert_eq!(p.held, vec![gpu("GPU-1")]);
        assert_eq!(p.evicted, vec![("a".to_string(), "GPU-1".to_string())]);
        assert!(p.conflicted.is_empty());
    }

    #[test]
    fn a_gpu_no_longer_reported_is_absent_and_its_conflict_ends() {
        let rows = [
            row("b", "GPU-1", false, Some("a"), 3),
            row("b", "GPU-2", true, None, 0),
            row("b", "GPU-3", false, None, 0),
            row("a", "GPU-1", true, None, 0),
        ];
        let p = plan_gpu_sync("b", &[], &rows);
        assert_eq!(p.absent, vec!["GPU-1".to_string(), "GPU-2".to_string()]);
        assert!(p.handovers.is_empty(), "nobody waits for GPU-2");
        // Duplicates and empty UUIDs in one report count once / not at all.
        let p = plan_gpu_sync("b", &[gpu("GPU-9"), gpu("GPU-9"), gpu("")], &[]);
        assert_eq!(p.held, vec![gpu("GPU-9")]);
    }
}
