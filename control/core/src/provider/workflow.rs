//! The provider workflow's decisions, pure: for one instance of a provider pool, given what the control plane
//! wants ([`Desired`]), what the workflow recorded ([`Record`]) and what the provider said when asked just now
//! ([`Observed`]), [`plan`] picks at most one call and the next record; [`after`] takes the call's result. The
//! module's reconciler does the I/O: it asks the provider (a describe, by the provider id it knows or else by the
//! instance's tag) before every call, so a launch whose answer was lost is found, never repeated — the workflow is
//! idempotent by itself even where the provider does not deduplicate client tokens (moto). Every wait polls with a
//! deadline; failed calls back off ([`Policy::backoff`], jitter from a random number passed in).
//!
//! ```text
//! desired exists:  absent → launch → pending → running ⇄ (stop) stopping → stopped ⇄ (start) pending
//! desired deleted: anything → terminate → shutting-down → terminated (or absent) → gone
//! ```

use super::ec2::{Ec2State, StateAction};
use crate::api::instances::Power;
use bc_backoff::{ExponentialBackoff, Jitter};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Unix milliseconds.
pub type Millis = i64;

/// What the control plane wants of the instance now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// Deleted (or failed: what was launched for it is cleaned up).
    pub deleted: bool,
    pub power: Power,
    /// The reboots counter: each increase is one reboot of a running instance.
    pub reboots: i64,
}

/// What the workflow keeps per instance between passes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The provider's id of the instance, once known (from the launch's answer or a describe by tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<String>,
    /// Its state as last seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Ec2State>,
    /// The reboots counter the provider was last asked to honour.
    #[serde(default)]
    pub reboots_done: i64,
    /// Failed calls in a row (the backoff's attempt).
    #[serde(default)]
    pub failures: u32,
    /// The workflow does nothing for this instance before then.
    #[serde(default)]
    pub next_at_ms: Millis,
    /// When the workflow first asked for it to be launched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launched_at_ms: Option<Millis>,
    /// Since when it has been waiting in its current state for a state it should reach.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_since_ms: Option<Millis>,
    /// Why the last call failed or what is overdue; cleared when things move again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The failure of a call, as the module classified it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError {
    /// Worth retrying: the provider unreachable or slow, a 5xx, throttling.
    pub transient: bool,
    pub message: String,
}

/// What asking the provider about the instance found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    Found {
        provider_id: String,
        state: Ec2State,
    },
    /// No instance by the provider id, or none tagged with the instance id.
    Absent,
    Failed(CallError),
}

/// The one call a pass makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `RunInstances` with the instance's client token and tag.
    Launch,
    Change(StateAction, String),
}

/// How the instance's story ended, when it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Deleted and nothing of it is left at the provider: the record can go.
    Gone,
    /// It cannot be what was asked (the reason says why); what exists of it is cleaned up from now on.
    Failed(String),
}

/// What a pass does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub call: Option<Call>,
    pub record: Record,
    pub outcome: Option<Outcome>,
}

/// The workflow's timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// How often an instance between states is asked about.
    pub poll: Duration,
    /// How often an instance in the state it should have is asked about (to see drift).
    pub steady_poll: Duration,
    /// How long a wanted state may take before the delay is reported in the record's reason.
    pub transition_deadline: Duration,
    /// How long a create may go without the provider knowing the instance before it fails.
    pub launch_deadline: Duration,
    /// How long a launched instance may stay invisible to a describe (eventual consistency) before it counts as
    /// gone.
    pub visibility_grace: Duration,
    pub backoff: ExponentialBackoff,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            poll: Duration::from_secs(2),
            steady_poll: Duration::from_secs(30),
            transition_deadline: Duration::from_secs(300),
            launch_deadline: Duration::from_secs(900),
            visibility_grace: Duration::from_secs(60),
            backoff: ExponentialBackoff::new(
                Duration::from_secs(1),
                Duration::from_secs(60),
                Jitter::Fraction(0.5),
            ),
        }
    }
}

fn ms(d: Duration) -> Millis {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Whether the instance is due for a pass at `now`.
pub fn due(record: &Record, now: Millis) -> bool {
    now >= record.next_at_ms
}

struct Planner<'a> {
    desired: &'a Desired,
    now: Millis,
    policy: &'a Policy,
    unit: f64,
    created_ms: Millis,
    r: Record,
}

impl Planner<'_> {
    fn done(self, call: Option<Call>, outcome: Option<Outcome>) -> Step {
        Step {
            call,
            record: self.r,
            outcome,
        }
    }

    fn backoff(mut self, e: &CallError) -> Step {
        let d = self
            .policy
            .backoff
            .delay(self.r.failures, self.unit)
            .max(Duration::from_millis(1));
        self.r.failures = self.r.failures.saturating_add(1);
        self.r.next_at_ms = self.now.saturating_add(ms(d));
        self.r.reason = Some(e.message.clone());
        self.done(None, None)
    }

    /// Waits for the instance to leave `state` on its own; past the deadline the record says so.
    fn wait(mut self, state: Ec2State, target: &str) -> Step {
        let since = *self.r.waiting_since_ms.get_or_insert(self.now);
        self.r.next_at_ms = self.now.saturating_add(ms(self.policy.poll));
        if self.now - since > ms(self.policy.transition_deadline) {
            self.r.reason = Some(format!(
                "instance {} has been {state} for {} s, waiting to be {target}",
                self.r.provider_id.as_deref().unwrap_or("?"),
                (self.now - since) / 1000
            ));
        }
        self.done(None, None)
    }

    fn call(mut self, call: Call) -> Step {
        self.r.next_at_ms = self.now.saturating_add(ms(self.policy.poll));
        self.done(Some(call), None)
    }

    fn steady(mut self) -> Step {
        self.r.waiting_since_ms = None;
        self.r.reason = None;
        self.r.next_at_ms = self.now.saturating_add(ms(self.policy.steady_poll));
        self.done(None, None)
    }

    fn found(mut self, provider_id: String, state: Ec2State) -> Step {
        if self.r.state != Some(state) {
            self.r.waiting_since_ms = None;
        }
        let id = provider_id.clone();
        self.r.provider_id = Some(provider_id);
        self.r.state = Some(state);
        self.r.failures = 0;
        if self.desired.deleted {
            return match state {
                Ec2State::Terminated => self.done(None, Some(Outcome::Gone)),
                Ec2State::ShuttingDown => self.wait(state, "terminated"),
                _ => self.call(Call::Change(StateAction::Terminate, id)),
            };
        }
        match (state, self.desired.power) {
            (Ec2State::Terminated | Ec2State::ShuttingDown, _) => {
                let why = format!(
                    "instance {id} was terminated at the provider, not by this control plane"
                );
                self.done(None, Some(Outcome::Failed(why)))
            }
            (Ec2State::Running, Power::Stopped) => self.call(Call::Change(StateAction::Stop, id)),
            (Ec2State::Stopped, Power::Running) => self.call(Call::Change(StateAction::Start, id)),
            (Ec2State::Running, Power::Running) if self.desired.reboots > self.r.reboots_done => {
                self.call(Call::Change(StateAction::Reboot, id))
            }
            (Ec2State::Running, Power::Running) => self.steady(),
            (Ec2State::Stopped, Power::Stopped) => {
                // A reboot asked of a stopped instance has nothing to reset.
                self.r.reboots_done = self.desired.reboots;
                self.steady()
            }
            (Ec2State::Pending, Power::Running) => self.wait(state, "running"),
            (Ec2State::Stopping, Power::Stopped) => self.wait(state, "stopped"),
            (Ec2State::Pending, Power::Stopped) => self.wait(state, "running, then stopped"),
            (Ec2State::Stopping, Power::Running) => self.wait(state, "stopped, then started"),
        }
    }

    fn absent(mut self) -> Step {
        if self.desired.deleted {
            return self.done(None, Some(Outcome::Gone));
        }
        if let Some(id) = self.r.provider_id.clone() {
            let launched = self.r.launched_at_ms.unwrap_or(self.created_ms);
            if self.now - launched <= ms(self.policy.visibility_grace) {
                return self.wait(Ec2State::Pending, "visible");
            }
            let why = format!("instance {id} no longer exists at the provider");
            return self.done(None, Some(Outcome::Failed(why)));
        }
        if self.r.launched_at_ms.is_some() {
            // A launch went out and its answer never came: the provider may still make it (a request held in a
            // stalled provider's socket is served when it resumes, after describes on other connections said
            // "absent"). Launching again could make a second instance, so absent must hold for the visibility
            // grace, counted from the first answer that said so, before the next launch.
            let since = *self.r.waiting_since_ms.get_or_insert(self.now);
            if self.now - since <= ms(self.policy.visibility_grace) {
                self.r.next_at_ms = self.now.saturating_add(ms(self.policy.poll));
                self.r.reason = Some(format!(
                    "a launch was not answered; waiting up to {} s for the provider to show it before launching again",
                    self.policy.visibility_grace.as_secs()
                ));
                return self.done(None, None);
            }
            self.r.waiting_since_ms = None;
        }
        self.r.launched_at_ms.get_or_insert(self.now);
        self.call(Call::Launch)
    }

    fn launch_overdue(&self) -> Option<Outcome> {
        let overdue = !self.desired.deleted
            && self.r.provider_id.is_none()
            && self.now - self.created_ms > ms(self.policy.launch_deadline);
        overdue.then(|| {
            Outcome::Failed(format!(
                "the provider did not launch it within {} s (last error: {})",
                self.policy.launch_deadline.as_secs(),
                self.r.reason.as_deref().unwrap_or("none")
            ))
        })
    }
}

/// One pass: what to do about the instance created at `created_ms`, after asking the provider. `unit` is a
/// uniform random number in `[0, 1]` (the backoff's jitter).
pub fn plan(
    desired: &Desired,
    record: &Record,
    observed: Observed,
    created_ms: Millis,
    now: Millis,
    policy: &Policy,
    unit: f64,
) -> Step {
    let p = Planner {
        desired,
        now,
        policy,
        unit,
        created_ms,
        r: record.clone(),
    };
    if let Some(failed) = p.launch_overdue() {
        return p.done(None, Some(failed));
    }
    match observed {
        Observed::Failed(e) => p.backoff(&e),
        Observed::Found { provider_id, state } => p.found(provider_id, state),
        Observed::Absent => p.absent(),
    }
}

/// What the call's result changes. A launch answers the new instance's id and state; a state change answers the
/// state it moved to (a reboot answers nothing). A launch refused for a reason retrying cannot fix (a bad image,
/// no capacity of that type, credentials refused) fails the instance; any other failure backs off, and the next
/// pass asks the provider again before it calls again.
pub fn after(
    desired: &Desired,
    record: &Record,
    call: &Call,
    result: Result<Vec<(String, Ec2State)>, CallError>,
    now: Millis,
    policy: &Policy,
    unit: f64,
) -> Step {
    let mut p = Planner {
        desired,
        now,
        policy,
        unit,
        created_ms: now,
        r: record.clone(),
    };
    match result {
        Err(e) if !e.transient && *call == Call::Launch => {
            let why = format!("the provider refused the launch: {}", e.message);
            p.done(None, Some(Outcome::Failed(why)))
        }
        Err(e) => p.backoff(&e),
        Ok(states) => {
            p.r.failures = 0;
            p.r.reason = None;
            p.r.waiting_since_ms = Some(now);
            p.r.next_at_ms = now.saturating_add(ms(policy.poll));
            if let Call::Change(StateAction::Reboot, _) = call {
                p.r.reboots_done = desired.reboots;
            }
            if let Some((id, state)) = states.into_iter().next() {
                if *call == Call::Launch {
                    p.r.provider_id = Some(id);
                    p.r.launched_at_ms = Some(now);
                }
                p.r.state = Some(state);
            }
            p.done(None, None)
        }
    }
}

#[cfg(test)]
#[path = "workflow_tests.rs"]
mod tests;
