//! What to do next for one instance: [`decide`] takes what the control plane wants (the desired spec, if any), what
//! bcd observed (the instance's record on disk, its VM, the last failure) and the time, and returns the next step
//! and the state to report. Pure: no clock, no I/O. The supervisor runs one step per instance at a time and asks
//! again when it finishes, so every path converges by repeated small steps:
//!
//! - wanted, not created → Create (fetch and verify the image, make the overlay and the seed);
//! - wanted running, not running → Start; running with `reboots` above what was applied → Reboot;
//! - wanted stopped, running → Stop (graceful until the deadline, then forced);
//! - not wanted, anything on disk → Delete;
//! - a failed step waits out its backoff (or a new generation) before it is tried again.

use crate::vmm::{InstanceSpec, InstanceState, Power, VmStatus};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::Instant;

/// What bcd keeps on disk for a created instance (`instance.json`): the spec it was created from (disk and seed
/// follow it) and how far later changes were applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The spec at creation (its image, disk size, user-data and meta made the disk and seed).
    pub created: InstanceSpec,
    /// The latest desired spec bcd has acted on (vCPUs, memory, GPUs and power come from here at each start).
    pub current: InstanceSpec,
    /// `reboots` already carried out (a start counts as one).
    #[serde(default)]
    pub reboots_applied: u64,
}

/// The last failed step of an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub step: StepKind,
    pub reason: String,
    /// The generation it failed for: a newer one is tried at once.
    pub generation: u64,
    /// Failures in a row (backoff doubles with each).
    pub count: u32,
    pub retry_at: Instant,
}

/// What is known of one instance.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub record: Option<Record>,
    /// Anything of the instance on disk (a record or leftovers).
    pub on_disk: bool,
    pub vm: Option<VmStatus>,
    pub failure: Option<Failure>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    Create,
    Start,
    Stop,
    Reboot,
    Delete,
}

/// The next step and what to report meanwhile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub step: Option<StepKind>,
    pub state: InstanceState,
    pub reason: Option<String>,
}

/// Backoff after `count` failures in a row: 2 s doubling, at most 5 min.
pub fn backoff(count: u32) -> Duration {
    Duration::from_secs(2u64 << count.saturating_sub(1).min(8)).min(Duration::from_secs(300))
}

fn running(vm: &Option<VmStatus>) -> bool {
    matches!(vm, Some(VmStatus::Running { .. }))
}

/// The next step for one instance. `desired` is `None` when the desired state no longer lists it.
pub fn decide(desired: Option<&InstanceSpec>, o: &Observed, now: Instant) -> Decision {
    let Some(d) = desired else {
        return if o.on_disk || running(&o.vm) {
            Decision {
                step: Some(StepKind::Delete),
                state: InstanceState::Deleting,
                reason: None,
            }
        } else {
            Decision {
                step: None,
                state: InstanceState::Deleting,
                reason: None,
            }
        };
    };
    // A failure holds its step back until its backoff ends, unless the control plane changed the instance since.
    let held = |step: StepKind| {
        o.failure
            .as_ref()
            .filter(|f| f.step == step && f.generation == d.generation && now < f.retry_at)
    };
    let failed = |f: &Failure| Decision {
        step: None,
        state: InstanceState::Failed,
        reason: Some(f.reason.clone()),
    };
    let Some(record) = &o.record else {
        if let Some(f) = held(StepKind::Create) {
            return failed(f);
        }
        return Decision {
            step: Some(StepKind::Create),
            state: InstanceState::Starting,
            reason: None,
        };
    };
    // A change that cannot apply to an existing instance is reported; power and reboots still are honoured.
    let condition = d.immutable_change(&record.created).map(|field| {
        format!(
            "{field} changed since the instance was created; it cannot change on an existing instance: delete it \
             and create it again"
        )
    });
    match (d.power, &o.vm) {
        (Power::Running, Some(VmStatus::Running { .. })) => {
            if d.reboots > record.reboots_applied {
                if let Some(f) = held(StepKind::Reboot) {
                    return failed(f);
                }
                return Decision {
                    step: Some(StepKind::Reboot),
                    state: InstanceState::Running,
                    reason: condition,
                };
            }
            Decision {
                step: None,
                state: InstanceState::Running,
                reason: condition,
            }
        }
        (Power::Running, _) => {
            if let Some(f) = held(StepKind::Start) {
                return failed(f);
            }
            Decision {
                step: Some(StepKind::Start),
                state: InstanceState::Starting,
                reason: condition,
            }
        }
        (Power::Stopped, Some(VmStatus::Running { .. })) => {
            if let Some(f) = held(StepKind::Stop) {
                return failed(f);
            }
            Decision {
                step: Some(StepKind::Stop),
                state: InstanceState::Stopping,
                reason: condition,
            }
        }
        (Power::Stopped, _) => Decision {
            step: None,
            state: InstanceState::Stopped,
            reason: condition,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::spec::{ImageRef, Meta};

    fn spec(power: Power) -> InstanceSpec {
        InstanceSpec {
            id: "i".into(),
            generation: 1,
            vcpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            image: ImageRef {
                url: "http://127.0.0.1:1/x".into(),
                sha256: "0".repeat(64),
            },
            user_data: None,
            meta: Meta::default(),
            gpus: vec![],
            power,
            reboots: 0,
        }
    }

    fn created(s: &InstanceSpec) -> Observed {
        Observed {
            record: Some(Record {
                created: s.clone(),
                current: s.clone(),
                reboots_applied: 0,
            }),
            on_disk: true,
            vm: Some(VmStatus::Stopped),
            failure: None,
        }
    }

    fn up() -> Option<VmStatus> {
        Some(VmStatus::Running {
            pid: 7,
            run_state: Some("running".into()),
        })
    }

    #[test]
    fn the_lifecycle_converges_step_by_step() {
        let now = Instant::now();
        let mut s = spec(Power::Running);
        let d = decide(Some(&s), &Observed::default(), now);
        assert_eq!(
            (d.step, d.state),
            (Some(StepKind::Create), InstanceState::Starting)
        );
        let mut o = created(&s);
        assert_eq!(decide(Some(&s), &o, now).step, Some(StepKind::Start));
        o.vm = up();
        let d = decide(Some(&s), &o, now);
        assert_eq!((d.step, d.state), (None, InstanceState::Running));
        s.reboots = 1;
        assert_eq!(decide(Some(&s), &o, now).step, Some(StepKind::Reboot));
        s.reboots = 0;
        // Only power changes: stop, then nothing.
        let mut stopped = s.clone();
        stopped.power = Power::Stopped;
        stopped.generation = 2;
        let d = decide(Some(&stopped), &o, now);
        assert_eq!(
            (d.step, d.state),
            (Some(StepKind::Stop), InstanceState::Stopping)
        );
        o.vm = Some(VmStatus::Stopped);
        let d = decide(Some(&stopped), &o, now);
        assert_eq!((d.step, d.state), (None, InstanceState::Stopped));
        // Removed from the desired state: delete while anything is left, then nothing.
        assert_eq!(decide(None, &o, now).step, Some(StepKind::Delete));
        assert_eq!(decide(None, &Observed::default(), now).step, None);
    }

    #[test]
    fn a_failure_waits_out_its_backoff_unless_the_generation_moves() {
        let now = Instant::now();
        let s = spec(Power::Running);
        let o = Observed {
            failure: Some(Failure {
                step: StepKind::Create,
                reason: "image hashes to ab…".into(),
                generation: 1,
                count: 1,
                retry_at: now + Duration::from_secs(2),
            }),
            ..Default::default()
        };
        let d = decide(Some(&s), &o, now);
        assert_eq!(d.step, None);
        assert_eq!(d.state, InstanceState::Failed);
        assert_eq!(d.reason.as_deref(), Some("image hashes to ab…"));
        assert_eq!(
            decide(Some(&s), &o, now + Duration::from_secs(2)).step,
            Some(StepKind::Create)
        );
        let mut newer = s.clone();
        newer.generation = 2;
        assert_eq!(decide(Some(&newer), &o, now).step, Some(StepKind::Create));
        assert_eq!(backoff(1), Duration::from_secs(2));
        assert_eq!(backoff(3), Duration::from_secs(8));
        assert_eq!(backoff(30), Duration::from_secs(300));
    }

    #[test]
    fn an_immutable_change_is_reported_and_power_still_applies() {
        let now = Instant::now();
        let s = spec(Power::Running);
        let mut o = created(&s);
        o.vm = up();
        let mut changed = s.clone();
        changed.disk_gib = 9;
        changed.power = Power::Stopped;
        let d = decide(Some(&changed), &o, now);
        assert_eq!(d.step, Some(StepKind::Stop));
        assert!(d.reason.unwrap_or_default().starts_with("disk_gib changed"));
    }
}
