//! Properties of the machine state machine over random observation sequences from enrolled: verbs, results
//! (right, wrong and stale), the ramdisk and the installed system coming and going, time passing.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

const T0: Millis = 1_796_112_844_000;
const IMAGE: &str = "sha256:1111";

#[derive(Debug, Clone)]
enum Event {
    Verb(Verb),
    /// A result for a step of the current attempt (index into the steps done, or any step).
    Result(usize, OutcomeKind),
    /// The successful result of a step of the current attempt (index into the steps done).
    Good(usize, bool),
    /// A result for an earlier attempt.
    Stale(usize, OutcomeKind),
    Ramdisk(Option<&'static str>),
    Installed(Option<&'static str>),
    Dhcp,
    /// Milliseconds; sometimes straight to the deadline.
    Wait(Millis),
    ToDeadline,
}

#[derive(Debug, Clone)]
enum OutcomeKind {
    Done,
    Inspected(u32),
    BootOnce(bool),
    Diagnosed(u32, bool),
    Streamed(bool),
    Failed(bool),
}

fn outcome(k: &OutcomeKind) -> Outcome {
    let hw = |gpus| HardwareSummary {
        gpus: Some(gpus),
        ..HardwareSummary::default()
    };
    match k {
        OutcomeKind::Done => Outcome::Done,
        OutcomeKind::Inspected(g) => Outcome::Inspected(hw(*g)),
        OutcomeKind::BootOnce(p) => Outcome::BootOnceSet { persistent: *p },
        OutcomeKind::Diagnosed(g, healthy) => Outcome::Diagnosed {
            hardware: hw(*g),
            healthy: *healthy,
            reasons: if *healthy { vec![] } else { vec!["bad".into()] },
        },
        OutcomeKind::Streamed(right) => Outcome::Streamed {
            digest: if *right {
                IMAGE.into()
            } else {
                "sha256:x".into()
            },
        },
        OutcomeKind::Failed(retryable) => Outcome::Failed {
            reason: "it broke".into(),
            retryable: *retryable,
        },
    }
}

/// What a step reports when it worked.
fn good(step: Step, persistent: bool) -> Outcome {
    match step {
        Step::Inspect => Outcome::Inspected(HardwareSummary::default()),
        Step::BootOnce => Outcome::BootOnceSet { persistent },
        Step::Diagnose => Outcome::Diagnosed {
            hardware: HardwareSummary::default(),
            healthy: true,
            reasons: vec![],
        },
        Step::Stream => Outcome::Streamed {
            digest: IMAGE.into(),
        },
        _ => Outcome::Done,
    }
}

fn verb() -> impl Strategy<Value = Verb> {
    prop_oneof![
        Just(Verb::Inspect),
        Just(Verb::Provide),
        Just(Verb::Deploy(DeploySpec {
            image: IMAGE.into(),
            user_data: String::new(),
            meta_data: String::new(),
        })),
        Just(Verb::Release),
        Just(Verb::Abort),
        Just(Verb::Retry),
    ]
}

fn kind() -> impl Strategy<Value = OutcomeKind> {
    prop_oneof![
        Just(OutcomeKind::Done),
        (7u32..9).prop_map(OutcomeKind::Inspected),
        any::<bool>().prop_map(OutcomeKind::BootOnce),
        ((7u32..9), any::<bool>()).prop_map(|(g, h)| OutcomeKind::Diagnosed(g, h)),
        any::<bool>().prop_map(OutcomeKind::Streamed),
        any::<bool>().prop_map(OutcomeKind::Failed),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        2 => verb().prop_map(Event::Verb),
        // Mostly the right outcome for the step, sometimes any.
        8 => ((0usize..12), any::<bool>()).prop_map(|(i, p)| Event::Good(i, p)),
        3 => ((0usize..16), kind()).prop_map(|(i, k)| Event::Result(i, k)),
        1 => ((0usize..16), kind()).prop_map(|(i, k)| Event::Stale(i, k)),
        3 => prop_oneof![Just(None), Just(Some("node-1")), Just(Some("node-1")), Just(Some("node-2"))].prop_map(Event::Ramdisk),
        1 => prop_oneof![Just(None), Just(Some("node-1")), Just(Some("node-2"))].prop_map(Event::Installed),
        1 => Just(Event::Dhcp),
        2 => (0i64..600_000).prop_map(Event::Wait),
        2 => Just(Event::ToDeadline),
    ]
}

/// The step an action plans, for the once-per-attempt check.
fn planned(a: &Action) -> Option<(u64, Step)> {
    match a {
        Action::Bmc {
            step, attempt_id, ..
        }
        | Action::Queue {
            step, attempt_id, ..
        } => Some((*attempt_id, *step)),
        Action::MintBootToken { attempt_id } => Some((*attempt_id, Step::BootToken)),
        Action::PublishNetboot { attempt_id, .. } => Some((*attempt_id, Step::PublishNetboot)),
        Action::MintJoinToken { attempt_id, .. } => Some((*attempt_id, Step::JoinToken)),
        Action::WithdrawNetboot { .. } | Action::CancelCommands { .. } => None,
    }
}

/// What must hold of every record the planner returns.
fn check_record(m: &Machine, before: &Machine, p: &Plan) -> Result<(), TestCaseError> {
    match &m.state {
        State::Active { phase } => {
            if phase.is_wait() {
                prop_assert!(m.deadline.is_some(), "{phase} without a deadline: {m:?}");
            }
            let open: Vec<&TimelineRow> = m.timeline.iter().filter(|r| r.end.is_none()).collect();
            prop_assert_eq!(open.len(), 1, "one open row while active");
            prop_assert_eq!(open[0].phase, *phase);
            prop_assert_eq!(open[0].attempt, m.attempt);
            prop_assert!(m.timeline.last().is_some_and(|r| r.end.is_none()));
        }
        State::Failed { phase: _, reason } => {
            prop_assert!(!reason.is_empty(), "failed without a reason");
            prop_assert!(m.deadline.is_none());
            prop_assert!(
                m.timeline.iter().all(|r| r.end.is_some()),
                "no open row while failed"
            );
        }
    }
    prop_assert!(m.attempt >= 1);
    prop_assert!(m.attempt_id >= before.attempt_id);
    for r in &m.timeline {
        prop_assert!(r.end.is_none_or(|e| e >= r.start));
        prop_assert!(r.attempt >= 1);
    }
    prop_assert!(m.timeline.len() >= before.timeline.len());
    for t in &p.transitions {
        prop_assert_ne!(&t.from, &t.to);
    }
    Ok(())
}

struct World {
    m: Machine,
    now: Millis,
    results: Vec<StepResult>,
    ramdisk: Option<String>,
    installed: Option<String>,
    dhcp: Option<Millis>,
}

impl World {
    fn input(&self, verb: Option<Verb>) -> MachineInput {
        MachineInput {
            machine: self.m.clone(),
            verb,
            results: self.results.clone(),
            ramdisk: self.ramdisk.clone(),
            installed: self.installed.clone(),
            last_dhcp_seen: self.dhcp,
            image_at_site: true,
        }
    }
}

fn step_at(m: &Machine, i: usize) -> Step {
    let done: Vec<Step> = m.done.keys().copied().collect();
    const ALL: [Step; 14] = [
        Step::Inspect,
        Step::BootToken,
        Step::PublishNetboot,
        Step::BootOnce,
        Step::PowerKick,
        Step::WithdrawNetboot,
        Step::RestoreDiskBoot,
        Step::Diagnose,
        Step::Wipe,
        Step::Stream,
        Step::JoinToken,
        Step::Kexec,
        Step::FallbackReboot,
        Step::IdlePowerOff,
    ];
    if !done.is_empty() && i < 12 {
        done[i % done.len()]
    } else {
        ALL[i % ALL.len()]
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// No panic; every wait phase has a deadline; failed carries phase and reason; the timeline has one open row
    /// while active; each step is planned at most once per attempt (the stream, the kexec, a power kick among
    /// them); the plan is a function of its input; from every state reached, abort fails a wait phase in that
    /// phase and is refused elsewhere, and retry resumes a failed phase at attempt 1.
    #[test]
    fn any_observation_sequence(events in prop::collection::vec(event(), 1..60)) {
        let policy = Policy::default();
        let mut w = World {
            m: Machine::enrolled("52:54:00:78:01:01", None, T0),
            now: T0,
            results: Vec::new(),
            ramdisk: None,
            installed: None,
            dhcp: None,
        };
        let mut planned_steps: BTreeSet<(u64, Step)> = BTreeSet::new();
        for ev in events {
            let mut verb = None;
            match ev {
                Event::Verb(v) => verb = Some(v),
                Event::Result(i, k) => w.results.push(StepResult {
                    attempt_id: w.m.attempt_id,
                    step: step_at(&w.m, i),
                    outcome: outcome(&k),
                }),
                Event::Good(i, persistent) => {
                    let step = step_at(&w.m, i);
                    w.results.push(StepResult {
                        attempt_id: w.m.attempt_id,
                        step,
                        outcome: good(step, persistent),
                    });
                }
                Event::Stale(i, k) => w.results.push(StepResult {
                    attempt_id: w.m.attempt_id.saturating_sub(1 + (i as u64 % 3)),
                    step: step_at(&w.m, i),
                    outcome: outcome(&k),
                }),
                Event::Ramdisk(n) => w.ramdisk = n.map(str::to_owned),
                Event::Installed(n) => w.installed = n.map(str::to_owned),
                Event::Dhcp => w.dhcp = Some(w.now),
                Event::Wait(ms) => w.now += ms,
                Event::ToDeadline => {
                    if let Some(d) = w.m.deadline {
                        w.now = w.now.max(d);
                    }
                }
            }
            let input = w.input(verb);
            let p = plan(&input, w.now, &policy);
            prop_assert_eq!(&p, &plan(&input, w.now, &policy));
            check_record(&p.next, &w.m, &p)?;
            for a in &p.actions {
                if let Some(key) = planned(a) {
                    prop_assert!(planned_steps.insert(key), "{:?} planned twice in attempt {}", key.1, key.0);
                    prop_assert!(p.next.done.contains_key(&key.1) || p.next.attempt_id != key.0,
                        "{:?} planned but not recorded as done", key.1);
                }
            }

            // Abort and retry from the state this plan left.
            let mut probe = w.input(Some(Verb::Abort));
            probe.machine = p.next.clone();
            let aborted = plan(&probe, w.now, &policy);
            match &p.next.state {
                State::Active { phase } if phase.is_wait() => {
                    match &aborted.next.state {
                        State::Failed { phase: f, reason } => {
                            prop_assert_eq!(f, phase);
                            prop_assert!(reason.contains("aborted"), "{}", reason);
                        }
                        other => prop_assert!(false, "abort in {} left {}", phase, other),
                    }
                    prop_assert!(aborted.rejected.is_none());
                    // ... and retry resumes that phase at attempt 1, with a deadline.
                    let mut again = w.input(Some(Verb::Retry));
                    again.machine = aborted.next.clone();
                    let retried = plan(&again, w.now, &policy);
                    check_record(&retried.next, &aborted.next, &retried)?;
                    if !retried.next.state.is_failed() {
                        prop_assert_eq!(retried.next.attempt_id > aborted.next.attempt_id, true);
                    }
                    match (&retried.next.state, retried.transitions.first()) {
                        (_, Some(t)) => prop_assert_eq!(&t.to, &State::Active { phase: *phase }),
                        (s, None) => prop_assert!(false, "retry made no transition: {}", s),
                    }
                }
                State::Active { .. } | State::Failed { .. } => {
                    prop_assert!(aborted.rejected.is_some());
                }
            }
            if let State::Failed { phase, .. } = &p.next.state {
                let mut again = w.input(Some(Verb::Retry));
                again.machine = p.next.clone();
                let retried = plan(&again, w.now, &policy);
                prop_assert!(retried.rejected.is_none());
                prop_assert_eq!(&retried.transitions[0].to, &State::Active { phase: *phase });
                prop_assert_eq!(retried.next.timeline.iter().rfind(|r| r.phase == *phase).map(|r| r.start), Some(w.now));
            }

            if p.next.attempt_id != w.m.attempt_id {
                // The executor hands the planner the results of the current attempt (and, here, keeps the old
                // ones around as stale ones).
                w.results.retain(|r| r.attempt_id + 3 >= p.next.attempt_id);
            }
            w.m = p.next;
        }
    }

    /// On a happy path the machine goes from enrolled to deployed in at most two power cycles whatever the
    /// order of joins and waits (fast track: one; with the reboot-from-disk fallback: two).
    #[test]
    fn enroll_to_deployed_within_two_power_cycles(persistent in any::<bool>(), fallback in any::<bool>()) {
        let policy = Policy::default();
        let mut w = World {
            m: Machine::enrolled("52:54:00:78:01:01", None, T0),
            now: T0,
            results: Vec::new(),
            ramdisk: None,
            installed: None,
            dhcp: None,
        };
        let mut verb = Some(Verb::Deploy(DeploySpec { image: IMAGE.into(), user_data: String::new(), meta_data: String::new() }));
        for _ in 0..40 {
            let p = plan(&w.input(verb.take()), w.now, &policy);
            w.m = p.next;
            let id = w.m.attempt_id;
            let mut report = |step, o| w.results.push(StepResult { attempt_id: id, step, outcome: o });
            for a in &p.actions {
                match a {
                    Action::Bmc { step: Step::Inspect, .. } => report(Step::Inspect, Outcome::Inspected(HardwareSummary::default())),
                    Action::Bmc { step: Step::BootOnce, .. } => report(Step::BootOnce, Outcome::BootOnceSet { persistent }),
                    Action::Bmc { step: Step::PowerKick, .. } => w.ramdisk = Some("node-1".into()),
                    Action::Queue { step: Step::Diagnose, .. } => report(Step::Diagnose, Outcome::Diagnosed { hardware: HardwareSummary::default(), healthy: true, reasons: vec![] }),
                    Action::Queue { step: Step::Wipe, .. } => report(Step::Wipe, Outcome::Done),
                    Action::Queue { step: Step::Stream, .. } => report(Step::Stream, Outcome::Streamed { digest: IMAGE.into() }),
                    Action::Queue { step: Step::Kexec, .. } => {
                        w.ramdisk = None;
                        if !fallback { w.installed = Some("node-1".into()); }
                    }
                    Action::Bmc { step: Step::FallbackReboot, .. } => w.installed = Some("node-1".into()),
                    _ => {}
                }
            }
            if w.m.state == (State::Active { phase: Phase::Deployed }) {
                break;
            }
            if p.actions.is_empty()
                && let Some(d) = w.m.deadline
            {
                w.now = w.now.max(d);
            }
        }
        prop_assert_eq!(&w.m.state, &State::Active { phase: Phase::Deployed });
        prop_assert_eq!(w.m.power_cycles, if fallback { 2 } else { 1 });
    }
}
