//! The planner: from the stored machine, the operator's verb and what was observed, the actions to take now and
//! the machine's next record. Built in named steps: the verb first, then the current phase, again for as long as
//! the phase or the attempt changes (results can carry a machine through several phases in one call).

use super::{
    Action, BmcOp, Goal, Machine, MachineInput, Millis, Outcome, Phase, Plan, Policy, Power,
    RamdiskCommand, State, Step, TimelineRow, Transition, Verb, compare, fmt_utc,
};

/// More phase changes than any one set of observations can cause: a bound, not a budget.
const MAX_ROUNDS: usize = 12;

/// Decides what to do for one machine at `now`. Pure: no clock, no I/O; the same input gives the same plan.
pub fn plan(input: &MachineInput, now: Millis, policy: &Policy) -> Plan {
    let mut p = Planner {
        input,
        now,
        policy,
        m: input.machine.clone(),
        actions: Vec::new(),
        transitions: Vec::new(),
        rejected: None,
    };
    if let Some(verb) = &input.verb {
        p.verb(verb);
    }
    for _ in 0..MAX_ROUNDS {
        let before = (p.m.state.clone(), p.m.attempt_id);
        p.advance();
        if (&p.m.state, p.m.attempt_id) == (&before.0, before.1) {
            break;
        }
    }
    Plan {
        actions: p.actions,
        next: p.m,
        transitions: p.transitions,
        rejected: p.rejected,
    }
}

struct Planner<'a> {
    input: &'a MachineInput,
    now: Millis,
    policy: &'a Policy,
    m: Machine,
    actions: Vec<Action>,
    transitions: Vec<Transition>,
    rejected: Option<String>,
}

/// Ramdisk commands: a step of these done in an attempt whose ramdisk then left can never report.
const QUEUED: [Step; 3] = [Step::Diagnose, Step::Wipe, Step::Stream];

fn secs(ms: Millis) -> String {
    format!("{} s", ms / 1000)
}

// === impl Planner: bookkeeping ===

impl Planner<'_> {
    fn active(&self) -> Option<Phase> {
        match self.m.state {
            State::Active { phase } => Some(phase),
            State::Failed { .. } => None,
        }
    }

    fn result(&self, step: Step) -> Option<Outcome> {
        self.input
            .results
            .iter()
            .rev()
            .find(|r| r.attempt_id == self.m.attempt_id && r.step == step)
            .map(|r| r.outcome.clone())
    }

    fn done(&self, step: Step) -> bool {
        self.m.done.contains_key(&step)
    }

    fn mark(&mut self, step: Step) {
        self.m.done.insert(step, self.now);
    }

    fn wait(&mut self, what: String, ms: Millis) {
        self.m.deadline = Some(self.now.saturating_add(ms.max(0)));
        self.m.waiting_for = Some(what);
    }

    fn expired(&self) -> bool {
        self.m.deadline.is_some_and(|d| self.now >= d)
    }

    fn close_row(&mut self, outcome: &str) {
        if let Some(row) = self.m.timeline.last_mut()
            && row.end.is_none()
        {
            row.end = Some(self.now.max(row.start));
            row.outcome = Some(outcome.to_owned());
        }
    }

    fn open_row(&mut self, phase: Phase) {
        self.m.timeline.push(TimelineRow {
            phase,
            start: self.now,
            end: None,
            attempt: self.m.attempt,
            outcome: None,
        });
    }

    fn fresh_attempt(&mut self) {
        self.m.attempt_id += 1;
        self.m.attempt_started = self.now;
        self.m.deadline = None;
        self.m.waiting_for = None;
        self.m.done.clear();
        self.m.override_persistent = false;
    }

    /// Into `phase`, attempt 1.
    fn enter(&mut self, phase: Phase, why: &str) {
        let from = self.m.state.clone();
        self.close_row(why);
        self.m.state = State::Active { phase };
        self.m.attempt = 1;
        self.m.phase_started = self.now;
        self.fresh_attempt();
        self.open_row(phase);
        self.transitions.push(Transition {
            at: self.now,
            from,
            to: self.m.state.clone(),
            why: why.to_owned(),
        });
    }

    /// The attempt ended without success: the next one, or failed when `limit` attempts were made.
    fn attempt_over(&mut self, limit: u32, why: &str, final_reason: String) {
        let Some(phase) = self.active() else {
            return;
        };
        if self.m.attempt < limit {
            self.close_row(&format!("attempt {}: {why}", self.m.attempt));
            self.m.attempt += 1;
            self.fresh_attempt();
            self.m.last_error = Some(why.to_owned());
            self.open_row(phase);
        } else {
            self.fail(final_reason);
        }
    }

    /// Failed in the current phase: withdraw the netboot entry, cancel commands still waiting for a result.
    fn fail(&mut self, reason: String) {
        let Some(phase) = self.active() else {
            return;
        };
        if self.m.netboot_published {
            self.actions.push(Action::WithdrawNetboot {
                mac: self.m.mac.clone(),
            });
            self.m.netboot_published = false;
        }
        if QUEUED
            .iter()
            .any(|s| self.done(*s) && self.result(*s).is_none())
        {
            self.actions.push(Action::CancelCommands {
                reason: reason.clone(),
            });
        }
        self.close_row(&format!("failed: {reason}"));
        let from = self.m.state.clone();
        self.m.state = State::Failed {
            phase,
            reason: reason.clone(),
        };
        self.m.deadline = None;
        self.m.waiting_for = None;
        self.m.last_error = Some(reason.clone());
        self.transitions.push(Transition {
            at: self.now,
            from,
            to: self.m.state.clone(),
            why: reason,
        });
    }

    fn bmc(&mut self, step: Step, op: BmcOp) {
        self.mark(step);
        self.actions.push(Action::Bmc {
            step,
            attempt_id: self.m.attempt_id,
            op,
        });
    }

    fn queue(&mut self, step: Step, command: RamdiskCommand) {
        let Some(node_id) = self.m.node_id.clone() else {
            self.fail(format!("{step:?}: no ramdisk node to send it to"));
            return;
        };
        self.mark(step);
        self.actions.push(Action::Queue {
            step,
            attempt_id: self.m.attempt_id,
            node_id,
            command,
        });
    }

    /// The successful outcome of `step`, or `None`: not yet (and the deadline has not passed), or it failed and
    /// the attempt is over (retryable, another attempt within `limit`) or the machine failed.
    fn outcome(&mut self, step: Step, limit: u32, what: &str) -> Option<Outcome> {
        match self.result(step) {
            Some(Outcome::Failed {
                reason,
                retryable: true,
            }) => {
                let why = format!("{what}: {reason}");
                let n = self.m.attempt;
                self.attempt_over(limit, &why, format!("{why} (attempt {n} of {limit})"));
                None
            }
            Some(Outcome::Failed { reason, .. }) => {
                self.fail(format!("{what}: {reason}"));
                None
            }
            Some(o) => Some(o),
            None => {
                if self.expired() {
                    let waited = self.m.waiting_for.clone().unwrap_or_default();
                    let why =
                        format!("{what}: no result before the deadline (waiting for {waited})");
                    let n = self.m.attempt;
                    self.attempt_over(limit, &why, format!("{why}; {n} attempts"));
                }
                None
            }
        }
    }

    fn unexpected(&mut self, step: Step, o: &Outcome) {
        self.fail(format!(
            "{step:?} reported {o:?}, which is not a result of that step"
        ));
    }

    fn reject(&mut self, why: String) {
        self.rejected = Some(why);
    }
}

// === impl Planner: verbs ===

impl Planner<'_> {
    fn verb(&mut self, verb: &Verb) {
        let state = self.m.state.clone();
        let provisioning_start = if self.m.inspection.is_some() {
            Phase::BootingRamdisk
        } else {
            Phase::Inspecting
        };
        match (verb, &state) {
            (Verb::Abort, State::Active { phase }) if phase.is_wait() => {
                self.fail(format!("aborted by the operator during {phase}"));
            }
            (Verb::Abort, _) => self.reject(format!(
                "nothing to abort: the machine is {state} (abort stops a phase that is waiting)"
            )),
            (Verb::Retry, State::Failed { phase, .. }) => {
                self.enter(*phase, "retry by the operator");
            }
            (Verb::Retry, _) => self.reject(format!(
                "nothing to retry: the machine is {state}, not failed"
            )),
            (Verb::Inspect, State::Active { phase: Phase::Enrolled }) => {
                self.m.goal = Goal::Inspected;
                self.enter(Phase::Inspecting, "inspect by the operator");
            }
            (Verb::Provide, State::Active { phase: Phase::Enrolled }) => {
                self.m.goal = Goal::Ready;
                self.enter(provisioning_start, "provide by the operator");
            }
            (Verb::Deploy(spec), State::Active { phase: Phase::Enrolled }) => {
                self.m.goal = Goal::Deployed(spec.clone());
                self.enter(provisioning_start, "deploy by the operator");
            }
            (Verb::Deploy(spec), State::Active { phase: Phase::Ready }) => {
                self.m.goal = Goal::Deployed(spec.clone());
                self.enter(Phase::Deploying, "deploy by the operator");
            }
            (Verb::Release, State::Active { phase: Phase::Deployed }) => {
                self.m.goal = Goal::Ready;
                self.enter(Phase::Releasing, "release by the operator");
            }
            (verb, State::Failed { .. }) => self.reject(format!(
                "{} is not possible while the machine is {state}: retry it, or abort is not needed (it stopped)",
                verb_name(verb)
            )),
            (verb, State::Active { phase }) if phase.is_wait() => self.reject(format!(
                "{} is not possible while the machine is {phase}: wait for it to finish, or abort it",
                verb_name(verb)
            )),
            (verb, State::Active { phase }) => self.reject(format!(
                "{} is not possible while the machine is {phase}: {}",
                verb_name(verb),
                match phase {
                    Phase::Enrolled => "inspect, provide or deploy it",
                    Phase::Ready => "deploy it",
                    _ => "release it first",
                }
            )),
        }
    }
}

fn verb_name(v: &Verb) -> &'static str {
    match v {
        Verb::Inspect => "inspect",
        Verb::Provide => "provide",
        Verb::Deploy(_) => "deploy",
        Verb::Release => "release",
        Verb::Abort => "abort",
        Verb::Retry => "retry",
    }
}

// === impl Planner: phases ===

impl Planner<'_> {
    fn advance(&mut self) {
        let Some(phase) = self.active() else {
            return;
        };
        let k = self.policy.netboot.attempts;
        match phase {
            Phase::Enrolled | Phase::Deployed => {}
            Phase::Inspecting => self.inspecting(),
            Phase::BootingRamdisk => {
                if self.ramdisk(k) {
                    let why = self.joined_why();
                    self.enter(Phase::Diagnosing, &why);
                }
            }
            Phase::Releasing => {
                if self.ramdisk(k) {
                    let why = self.joined_why();
                    self.enter(Phase::Wiping, &why);
                }
            }
            Phase::Diagnosing => {
                if self.ramdisk(self.policy.diagnose.attempts) {
                    self.diagnosing();
                }
            }
            Phase::Wiping => {
                if self.ramdisk(self.policy.wipe.attempts) {
                    self.wiping();
                }
            }
            Phase::Ready => self.ready(),
            Phase::Deploying => self.deploying(),
        }
    }

    fn joined_why(&self) -> String {
        format!(
            "the ramdisk joined as node {}",
            self.m.node_id.as_deref().unwrap_or("?")
        )
    }

    fn inspecting(&mut self) {
        let retry = self.policy.inspect;
        if !self.done(Step::Inspect) {
            self.bmc(Step::Inspect, BmcOp::Inspect);
            self.wait("the BMC's inventory".into(), retry.timeout_ms);
            return;
        }
        match self.outcome(Step::Inspect, retry.attempts, "inspection") {
            Some(Outcome::Inspected(hw)) => {
                self.m.inspection = Some(hw);
                if self.m.goal == Goal::Inspected {
                    self.m.goal = Goal::Rest;
                    self.enter(Phase::Enrolled, "inspected");
                } else {
                    self.enter(Phase::BootingRamdisk, "inspected");
                }
            }
            Some(o) => self.unexpected(Step::Inspect, &o),
            None => {}
        }
    }

    /// Whether the ramdisk is joined (then the netboot entry is withdrawn and, on a BMC that kept the override,
    /// the disk boot restored); otherwise the netboot steps of this attempt, the re-kick, or the failure.
    fn ramdisk(&mut self, limit: u32) -> bool {
        if let Some(node) = self.input.ramdisk.clone() {
            self.m.node_id = Some(node);
            if self.m.netboot_published && !self.done(Step::WithdrawNetboot) {
                self.mark(Step::WithdrawNetboot);
                self.actions.push(Action::WithdrawNetboot {
                    mac: self.m.mac.clone(),
                });
                self.m.netboot_published = false;
            }
            if self.m.override_persistent && !self.done(Step::RestoreDiskBoot) {
                self.bmc(Step::RestoreDiskBoot, BmcOp::BootDisk);
            }
            return true;
        }
        if QUEUED.iter().any(|s| self.done(*s)) {
            let n = self.m.attempt;
            self.attempt_over(
                limit,
                "the ramdisk's session ended before its command reported",
                format!("the ramdisk's session ended before its command reported, in {n} attempts"),
            );
            return false;
        }
        self.netboot();
        false
    }

    fn never_joined(&self, n: u32) -> String {
        match self.input.last_dhcp_seen {
            Some(at) => format!(
                "never joined: {n} PXE attempts, last DHCP seen at {}",
                fmt_utc(at)
            ),
            None => format!(
                "never joined: {n} PXE attempts, no DHCP seen from {}",
                self.m.mac
            ),
        }
    }

    fn netboot(&mut self) {
        let k = self.policy.netboot.attempts;
        let n = self.m.attempt;
        if !self.done(Step::BootToken) {
            self.mark(Step::BootToken);
            self.actions.push(Action::MintBootToken {
                attempt_id: self.m.attempt_id,
            });
            self.mark(Step::PublishNetboot);
            self.actions.push(Action::PublishNetboot {
                mac: self.m.mac.clone(),
                attempt_id: self.m.attempt_id,
            });
            self.m.netboot_published = true;
            self.bmc(Step::BootOnce, BmcOp::BootOncePxe);
            self.wait(
                "the BMC to set the one-time PXE boot".into(),
                self.policy.bmc_timeout_ms,
            );
            return;
        }
        if !self.done(Step::PowerKick) {
            match self.outcome(Step::BootOnce, k, "the one-time PXE boot") {
                Some(Outcome::BootOnceSet { persistent }) => {
                    self.m.override_persistent = persistent;
                    self.bmc(Step::PowerKick, BmcOp::Power { power: Power::Boot });
                    self.m.power_cycles += 1;
                    self.wait(
                        format!("the ramdisk to join (PXE attempt {n} of {k})"),
                        self.policy.netboot.timeout_ms,
                    );
                }
                Some(o) => self.unexpected(Step::BootOnce, &o),
                None => {}
            }
            return;
        }
        match self.result(Step::PowerKick) {
            Some(Outcome::Failed { .. }) => {
                let _ = self.outcome(Step::PowerKick, k, "power on for the netboot");
                return;
            }
            Some(
                o @ (Outcome::Inspected(_)
                | Outcome::BootOnceSet { .. }
                | Outcome::Diagnosed { .. }
                | Outcome::Streamed { .. }),
            ) => {
                self.unexpected(Step::PowerKick, &o);
                return;
            }
            Some(Outcome::Done) | None => {}
        }
        if self.expired() {
            let why = format!(
                "no join within {} of the power kick",
                secs(self.policy.netboot.timeout_ms)
            );
            let reason = self.never_joined(n);
            self.attempt_over(k, &why, reason);
        }
    }

    fn diagnosing(&mut self) {
        let retry = self.policy.diagnose;
        if !self.done(Step::Diagnose) {
            self.queue(Step::Diagnose, RamdiskCommand::Diagnose);
            self.wait("the ramdisk's signed diagnose".into(), retry.timeout_ms);
            return;
        }
        match self.outcome(Step::Diagnose, retry.attempts, "diagnose") {
            Some(Outcome::Diagnosed {
                hardware,
                healthy,
                reasons,
            }) => {
                let c = compare(
                    self.m.inspection.as_ref(),
                    &hardware,
                    self.m.expected.as_ref(),
                );
                self.m.diagnosis = Some(hardware);
                for cond in c.conditions {
                    if !self.m.conditions.contains(&cond) {
                        self.m.conditions.push(cond);
                    }
                }
                if !c.violations.is_empty() {
                    self.fail(format!("expected hardware: {}", c.violations.join("; ")));
                } else if !healthy {
                    self.fail(format!("diagnose: {}", reasons.join("; ")));
                } else {
                    self.enter(Phase::Wiping, "diagnosed healthy");
                }
            }
            Some(o) => self.unexpected(Step::Diagnose, &o),
            None => {}
        }
    }

    fn wiping(&mut self) {
        let retry = self.policy.wipe;
        if !self.done(Step::Wipe) {
            self.queue(Step::Wipe, RamdiskCommand::Wipe);
            self.wait(
                "the ramdisk's signed wipe evidence".into(),
                retry.timeout_ms,
            );
            return;
        }
        match self.outcome(Step::Wipe, retry.attempts, "wipe") {
            Some(Outcome::Done) => {
                if self.m.goal == Goal::Ready {
                    self.m.goal = Goal::Rest;
                }
                self.enter(Phase::Ready, "wiped (signed evidence)");
            }
            Some(o) => self.unexpected(Step::Wipe, &o),
            None => {}
        }
    }

    fn ready(&mut self) {
        if matches!(self.m.goal, Goal::Deployed(_)) {
            self.enter(
                Phase::Deploying,
                "deploy (fast track: the ramdisk is still joined)",
            );
            return;
        }
        let (Some(idle), Some(_)) = (self.policy.ready_idle_timeout_ms, &self.input.ramdisk) else {
            return;
        };
        if self.done(Step::IdlePowerOff) {
            return;
        }
        let at = self.m.phase_started.saturating_add(idle);
        if self.now >= at {
            self.bmc(Step::IdlePowerOff, BmcOp::Power { power: Power::Off });
            self.m.deadline = None;
            self.m.waiting_for = None;
        } else {
            self.m.deadline = Some(at);
            self.m.waiting_for = Some(format!("idle in ready: power off after {}", secs(idle)));
        }
    }

    /// The site does not hold the image yet (its cache fetches it once the machine deploys): wait for it, within
    /// the stream's deadline.
    fn image_wait(&mut self, image: &str, limit: u32) {
        let what = format!("the site to cache {image}");
        if self.m.waiting_for.as_deref() != Some(what.as_str()) {
            self.wait(what, self.policy.stream_timeout_ms);
        } else if self.expired() {
            let why = format!(
                "the site did not cache {image} within {}",
                secs(self.policy.stream_timeout_ms)
            );
            let n = self.m.attempt;
            self.attempt_over(limit, &why, format!("{why} ({n} attempts)"));
        }
    }

    fn deploying(&mut self) {
        let Goal::Deployed(spec) = self.m.goal.clone() else {
            self.fail(
                "deploying without an image to deploy (the goal was lost): retry after deploy"
                    .into(),
            );
            return;
        };
        let retry = self.policy.deploy;
        if !self.done(Step::Kexec) {
            if !self.ramdisk(retry.attempts) {
                return;
            }
            if !self.done(Step::Stream) {
                if !self.input.image_at_site {
                    self.image_wait(&spec.image, retry.attempts);
                    return;
                }
                self.queue(
                    Step::Stream,
                    RamdiskCommand::Stream {
                        image: spec.image.clone(),
                    },
                );
                self.wait(
                    format!("the ramdisk to stream and verify {}", spec.image),
                    self.policy.stream_timeout_ms,
                );
                return;
            }
            match self.outcome(Step::Stream, retry.attempts, "stream") {
                Some(Outcome::Streamed { digest }) if digest == spec.image => {}
                Some(Outcome::Streamed { digest }) => {
                    self.fail(format!(
                        "stream: the disk verified as {digest}, not the image {}",
                        spec.image
                    ));
                    return;
                }
                Some(o) => {
                    self.unexpected(Step::Stream, &o);
                    return;
                }
                None => return,
            }
            // The installed system's join token and the kexec that carries it in its NoCloud seed, in one plan:
            // the token reaches the ramdisk only inside the command that writes it to the disk and jumps.
            let Some(node_id) = self.m.node_id.clone() else {
                return;
            };
            self.mark(Step::JoinToken);
            self.actions.push(Action::MintJoinToken {
                attempt_id: self.m.attempt_id,
                node_id,
            });
            self.queue(
                Step::Kexec,
                RamdiskCommand::Kexec {
                    user_data: spec.user_data.clone(),
                    meta_data: spec.meta_data.clone(),
                },
            );
            self.wait(
                "the installed system to join after the kexec".into(),
                self.policy.kexec_join_timeout_ms,
            );
            return;
        }
        if let Some(installed) = self.input.installed.clone() {
            if Some(&installed) == self.m.node_id.as_ref() {
                self.m.goal = Goal::Rest;
                self.enter(
                    Phase::Deployed,
                    &format!("the installed system joined as node {installed}"),
                );
            } else {
                self.fail(format!(
                    "the installed system joined as node {installed}, not as the machine's node {}",
                    self.m.node_id.as_deref().unwrap_or("(none)")
                ));
            }
            return;
        }
        if self.done(Step::FallbackReboot)
            && let Some(Outcome::Failed { .. }) = self.result(Step::FallbackReboot)
        {
            let _ = self.outcome(Step::FallbackReboot, retry.attempts, "reboot from disk");
            return;
        }
        // A kexec the ramdisk could not stage (it stays up, or reboots by itself): the fallback now, not at the
        // deadline.
        let kexec_failed = matches!(self.result(Step::Kexec), Some(Outcome::Failed { .. }));
        if !self.expired() && (!kexec_failed || self.done(Step::FallbackReboot)) {
            return;
        }
        if !self.done(Step::FallbackReboot) {
            if !self.done(Step::RestoreDiskBoot) {
                self.bmc(Step::RestoreDiskBoot, BmcOp::BootDisk);
            }
            self.bmc(Step::FallbackReboot, BmcOp::Power { power: Power::Boot });
            self.m.power_cycles += 1;
            self.wait(
                "the installed system to join after the reboot from disk".into(),
                self.policy.reboot_join_timeout_ms,
            );
            return;
        }
        let at = |s: Step| self.m.done.get(&s).map_or("?".to_owned(), |t| fmt_utc(*t));
        let why = format!(
            "the installed system never joined: kexec at {}, reboot from disk at {}",
            at(Step::Kexec),
            at(Step::FallbackReboot)
        );
        let n = self.m.attempt;
        self.attempt_over(retry.attempts, &why, format!("{why} ({n} attempts)"));
    }
}
