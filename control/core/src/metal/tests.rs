//! One test per transition of the machine state machine, driven through `plan` as the reconciler would: apply
//! the plan, store `next`, feed back the results.

use super::*;

const T0: Millis = 1_796_112_844_000; // 2026-12-01 08:14:04 UTC
const MAC: &str = "52:54:00:78:01:01";
const NODE: &str = "node-7";
const IMAGE: &str = "sha256:1111";

/// The reconciler's loop, by hand.
struct Sim {
    m: Machine,
    now: Millis,
    policy: Policy,
    ramdisk: Option<String>,
    installed: Option<String>,
    dhcp: Option<Millis>,
    image_at_site: bool,
    results: Vec<StepResult>,
    /// Every action of every plan, in order.
    log: Vec<Action>,
}

impl Sim {
    fn new() -> Sim {
        Sim {
            m: Machine::enrolled(MAC, None, T0),
            now: T0,
            policy: Policy::default(),
            ramdisk: None,
            installed: None,
            dhcp: None,
            image_at_site: true,
            results: Vec::new(),
            log: Vec::new(),
        }
    }

    fn plan(&mut self, verb: Option<Verb>) -> Plan {
        let input = MachineInput {
            machine: self.m.clone(),
            verb,
            results: self.results.clone(),
            ramdisk: self.ramdisk.clone(),
            installed: self.installed.clone(),
            last_dhcp_seen: self.dhcp,
            image_at_site: self.image_at_site,
        };
        let p = plan(&input, self.now, &self.policy);
        assert_eq!(p, plan(&input, self.now, &self.policy), "plan is pure");
        self.m = p.next.clone();
        self.log.extend(p.actions.iter().cloned());
        p
    }

    fn verb(&mut self, v: Verb) -> Plan {
        self.plan(Some(v))
    }

    fn tick(&mut self) -> Plan {
        self.plan(None)
    }

    /// Reports `outcome` for `step` of the current attempt, and plans.
    fn report(&mut self, step: Step, outcome: Outcome) -> Plan {
        self.results.push(StepResult {
            attempt_id: self.m.attempt_id,
            step,
            outcome,
        });
        self.tick()
    }

    /// Moves time to just past the current deadline, and plans.
    fn past_deadline(&mut self) -> Plan {
        let d = self.m.deadline.expect("a deadline to pass");
        self.now = self.now.max(d);
        self.tick()
    }

    fn phase(&self) -> Phase {
        self.m.state.phase()
    }

    fn active(&self, phase: Phase) -> bool {
        self.m.state == State::Active { phase }
    }

    /// From enrolled to a joined ramdisk in diagnosing, the BMC keeping overrides as Continuous.
    fn drive_to_diagnosing(&mut self) {
        self.verb(Verb::Provide);
        assert!(self.active(Phase::Inspecting));
        self.report(Step::Inspect, Outcome::Inspected(hw(8)));
        assert!(self.active(Phase::BootingRamdisk));
        self.report(Step::BootOnce, Outcome::BootOnceSet { persistent: true });
        self.ramdisk = Some(NODE.into());
        self.tick();
        assert!(self.active(Phase::Diagnosing), "{}", self.m.state);
    }

    fn drive_to_ready(&mut self) {
        self.drive_to_diagnosing();
        self.report(Step::Diagnose, diagnosed(8, true));
        assert!(self.active(Phase::Wiping));
        self.report(Step::Wipe, Outcome::Done);
        assert!(self.active(Phase::Ready), "{}", self.m.state);
    }

    fn steps_planned(&self, step: Step) -> usize {
        self.log.iter().filter(|a| step_of(a) == Some(step)).count()
    }
}

fn step_of(a: &Action) -> Option<Step> {
    match a {
        Action::Bmc { step, .. } | Action::Queue { step, .. } => Some(*step),
        Action::MintBootToken { .. } => Some(Step::BootToken),
        Action::PublishNetboot { .. } => Some(Step::PublishNetboot),
        Action::MintJoinToken { .. } => Some(Step::JoinToken),
        Action::WithdrawNetboot { .. } | Action::CancelCommands { .. } => None,
    }
}

fn hw(gpus: u32) -> HardwareSummary {
    HardwareSummary {
        cpus: Some(2),
        memory_mib: Some(65_536),
        gpus: Some(gpus),
        disks: Some(1),
        macs: vec![MAC.into()],
    }
}

fn diagnosed(gpus: u32, healthy: bool) -> Outcome {
    Outcome::Diagnosed {
        hardware: hw(gpus),
        healthy,
        reasons: if healthy {
            vec![]
        } else {
            vec!["GPU 3: volatile DBE 2 > 0".into()]
        },
    }
}

fn deploy() -> Verb {
    Verb::Deploy(DeploySpec {
        image: IMAGE.into(),
        user_data: "#cloud-config\n".into(),
        meta_data: "instance-id: m1\n".into(),
    })
}

fn kinds(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .map(|a| match a {
            Action::Bmc { op, .. } => format!("bmc.{op:?}"),
            Action::Queue { command, .. } => format!("queue.{command:?}")
                .split([' ', '{'])
                .next()
                .unwrap_or_default()
                .to_owned(),
            Action::MintBootToken { .. } => "mint-boot-token".into(),
            Action::PublishNetboot { .. } => "publish-netboot".into(),
            Action::WithdrawNetboot { .. } => "withdraw-netboot".into(),
            Action::MintJoinToken { .. } => "mint-join-token".into(),
            Action::CancelCommands { .. } => "cancel-commands".into(),
        })
        .collect()
}

#[test]
fn provide_inspects_then_boots_the_ramdisk_with_a_token_and_a_read_back_override() {
    let mut s = Sim::new();
    let p = s.verb(Verb::Provide);
    assert_eq!(kinds(&p), ["bmc.Inspect"]);
    assert!(s.active(Phase::Inspecting));
    assert_eq!(s.m.deadline, Some(T0 + 120_000));
    assert_eq!(p.transitions.len(), 1);

    let p = s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    assert!(s.active(Phase::BootingRamdisk));
    assert_eq!(
        kinds(&p),
        ["mint-boot-token", "publish-netboot", "bmc.BootOncePxe"]
    );
    assert_eq!(s.m.inspection, Some(hw(8)));
    // The power kick waits for the override's read-back.
    assert_eq!(s.m.power_cycles, 0);
    let p = s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: true });
    assert_eq!(kinds(&p), ["bmc.Power { power: Boot }"]);
    assert_eq!(s.m.power_cycles, 1);
    assert_eq!(s.m.deadline, Some(T0 + 300_000));
    assert!(
        s.m.waiting_for
            .as_deref()
            .unwrap_or_default()
            .contains("PXE attempt 1 of 3")
    );

    // Joined: netboot entry withdrawn, disk boot restored (the BMC kept the override), diagnose queued.
    s.ramdisk = Some(NODE.into());
    s.now += 9_000;
    let p = s.tick();
    assert_eq!(
        kinds(&p),
        ["withdraw-netboot", "bmc.BootDisk", "queue.Diagnose"]
    );
    assert!(s.active(Phase::Diagnosing));
    assert_eq!(s.m.node_id.as_deref(), Some(NODE));
    assert!(!s.m.netboot_published);
}

#[test]
fn a_bmc_that_honours_once_gets_no_disk_restore() {
    let mut s = Sim::new();
    s.verb(Verb::Provide);
    s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: false });
    s.ramdisk = Some(NODE.into());
    let p = s.tick();
    assert_eq!(kinds(&p), ["withdraw-netboot", "queue.Diagnose"]);
}

#[test]
fn diagnose_wipe_ready_and_the_timeline() {
    let mut s = Sim::new();
    s.drive_to_ready();
    let phases: Vec<(Phase, bool)> =
        s.m.timeline
            .iter()
            .map(|r| (r.phase, r.end.is_some()))
            .collect();
    assert_eq!(
        phases,
        [
            (Phase::Enrolled, true),
            (Phase::Inspecting, true),
            (Phase::BootingRamdisk, true),
            (Phase::Diagnosing, true),
            (Phase::Wiping, true),
            (Phase::Ready, false),
        ]
    );
    assert_eq!(s.m.goal, Goal::Rest);
    assert_eq!(
        s.m.timeline[4].outcome.as_deref(),
        Some("wiped (signed evidence)")
    );
    assert!(s.m.conditions.is_empty());
}

#[test]
fn deploy_on_the_fast_track_takes_one_power_cycle_and_runs_each_step_once() {
    let mut s = Sim::new();
    // Deploy straight from enrolled: inspect, ramdisk, diagnose, wipe, then deploy without resting.
    s.verb(deploy());
    s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: true });
    s.ramdisk = Some(NODE.into());
    s.tick();
    s.report(Step::Diagnose, diagnosed(8, true));
    let p = s.report(Step::Wipe, Outcome::Done);
    assert!(s.active(Phase::Deploying), "{}", s.m.state);
    assert_eq!(kinds(&p), ["queue.Stream"]);
    // A restarted control plane plans from the same record: nothing again.
    assert!(s.tick().actions.is_empty());
    let p = s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: IMAGE.into(),
        },
    );
    // The join token is minted in the plan that queues the kexec carrying it in the seed.
    assert_eq!(kinds(&p), ["mint-join-token", "queue.Kexec"]);
    assert!(s.tick().actions.is_empty());
    // The ramdisk is gone (kexec), the installed system joins as the same node.
    s.ramdisk = None;
    assert!(s.tick().actions.is_empty());
    s.installed = Some(NODE.into());
    let p = s.tick();
    assert!(s.active(Phase::Deployed), "{}", s.m.state);
    assert_eq!(
        p.transitions[0].why,
        "the installed system joined as node node-7"
    );
    assert_eq!(s.m.power_cycles, 1);
    for step in [Step::Stream, Step::Kexec, Step::PowerKick, Step::JoinToken] {
        assert_eq!(s.steps_planned(step), 1, "{step:?}");
    }
}

#[test]
fn never_pxe_boots_fails_after_k_rekicks_naming_the_last_dhcp() {
    let mut s = Sim::new();
    s.verb(Verb::Provide);
    s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    let mut tokens = Vec::new();
    for attempt in 1..=3 {
        assert!(s.active(Phase::BootingRamdisk));
        assert_eq!(s.m.attempt, attempt);
        tokens.push(s.m.attempt_id);
        s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: true });
        assert_eq!(s.m.power_cycles, attempt);
        s.dhcp = Some(s.now + 2_000);
        let p = s.past_deadline();
        if attempt < 3 {
            // Re-kick: a fresh token (a new attempt id), the entry republished, the override set again.
            assert_eq!(
                kinds(&p),
                ["mint-boot-token", "publish-netboot", "bmc.BootOncePxe"]
            );
        } else {
            assert_eq!(kinds(&p), ["withdraw-netboot"]);
        }
    }
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "one boot token per attempt");
    match &s.m.state {
        State::Failed { phase, reason } => {
            assert_eq!(*phase, Phase::BootingRamdisk);
            assert!(
                reason.starts_with("never joined: 3 PXE attempts, last DHCP seen at 2026-12-01 "),
                "{reason}"
            );
        }
        other => panic!("expected failed, got {other}"),
    }
    let attempts: Vec<u32> =
        s.m.timeline
            .iter()
            .filter(|r| r.phase == Phase::BootingRamdisk)
            .map(|r| r.attempt)
            .collect();
    assert_eq!(attempts, [1, 2, 3]);
    assert!(s.m.timeline.iter().all(|r| r.end.is_some()));
}

#[test]
fn never_seen_on_dhcp_says_so() {
    let mut s = Sim::new();
    s.policy.netboot.attempts = 1;
    s.verb(Verb::Provide);
    s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: false });
    s.past_deadline();
    assert_eq!(
        s.m.state,
        State::Failed {
            phase: Phase::BootingRamdisk,
            reason: format!("never joined: 1 PXE attempts, no DHCP seen from {MAC}"),
        }
    );
}

#[test]
fn an_override_accepted_and_not_applied_fails_with_that_reason() {
    let mut s = Sim::new();
    s.verb(Verb::Provide);
    s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    let p = s.report(
        Step::BootOnce,
        Outcome::Failed {
            reason: "the BMC accepted the one-time boot override to Pxe but reads back Target=Hdd, Enabled=Disabled".into(),
            retryable: false,
        },
    );
    assert_eq!(kinds(&p), ["withdraw-netboot"]);
    match &s.m.state {
        State::Failed { phase, reason } => {
            assert_eq!(*phase, Phase::BootingRamdisk);
            assert!(
                reason.contains("reads back Target=Hdd, Enabled=Disabled"),
                "{reason}"
            );
        }
        other => panic!("{other}"),
    }
    assert_eq!(s.m.power_cycles, 0, "never powered without the override");
}

#[test]
fn a_busy_bmc_costs_an_attempt_not_the_machine() {
    let mut s = Sim::new();
    s.verb(Verb::Provide);
    s.report(
        Step::Inspect,
        Outcome::Failed {
            reason: "HTTP 503".into(),
            retryable: true,
        },
    );
    assert!(s.active(Phase::Inspecting));
    assert_eq!(s.m.attempt, 2);
    assert_eq!(s.steps_planned(Step::Inspect), 2);
    s.report(Step::Inspect, Outcome::Inspected(hw(8)));
    assert!(s.active(Phase::BootingRamdisk));
}

#[test]
fn inspection_without_an_answer_fails_after_its_attempts() {
    let mut s = Sim::new();
    s.verb(Verb::Inspect);
    for _ in 0..3 {
        s.past_deadline();
    }
    match &s.m.state {
        State::Failed { phase, reason } => {
            assert_eq!(*phase, Phase::Inspecting);
            assert!(reason.contains("no result before the deadline"), "{reason}");
            assert!(reason.ends_with("3 attempts"), "{reason}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn inspect_alone_returns_to_enrolled_with_the_inventory() {
    let mut s = Sim::new();
    s.verb(Verb::Inspect);
    s.report(Step::Inspect, Outcome::Inspected(hw(4)));
    assert!(s.active(Phase::Enrolled));
    assert_eq!(s.m.inspection, Some(hw(4)));
    assert_eq!(s.m.deadline, None);
    // Provide now skips the inspection.
    let p = s.verb(Verb::Provide);
    assert!(s.active(Phase::BootingRamdisk));
    assert_eq!(kinds(&p)[0], "mint-boot-token");
}

#[test]
fn a_missing_gpu_is_a_condition_and_an_expected_hardware_violation_fails() {
    let mut s = Sim::new();
    s.drive_to_diagnosing();
    s.report(Step::Diagnose, diagnosed(7, true));
    assert!(s.active(Phase::Wiping));
    assert_eq!(
        s.m.conditions,
        ["GPUs: the BMC reports 8, the ramdisk sees 7"]
    );

    let mut s = Sim::new();
    s.m.expected = Some(ExpectedHardware {
        gpus: Some(8),
        ..ExpectedHardware::default()
    });
    s.drive_to_diagnosing();
    s.report(Step::Diagnose, diagnosed(7, true));
    assert_eq!(
        s.m.state,
        State::Failed {
            phase: Phase::Diagnosing,
            reason: "expected hardware: GPUs: expected 8, found 7".into()
        }
    );
}

#[test]
fn an_unhealthy_diagnose_fails_with_its_reasons() {
    let mut s = Sim::new();
    s.drive_to_diagnosing();
    s.report(Step::Diagnose, diagnosed(8, false));
    assert_eq!(
        s.m.state,
        State::Failed {
            phase: Phase::Diagnosing,
            reason: "diagnose: GPU 3: volatile DBE 2 > 0".into()
        }
    );
}

#[test]
fn abort_during_wiping_cancels_and_retry_wipes_again_in_a_new_attempt() {
    let mut s = Sim::new();
    s.drive_to_diagnosing();
    s.report(Step::Diagnose, diagnosed(8, true));
    assert!(s.active(Phase::Wiping));
    let wipe_attempt = s.m.attempt_id;
    let p = s.verb(Verb::Abort);
    assert_eq!(kinds(&p), ["cancel-commands"]);
    assert_eq!(
        s.m.state,
        State::Failed {
            phase: Phase::Wiping,
            reason: "aborted by the operator during wiping".into()
        }
    );
    assert_eq!(s.m.deadline, None);
    // A late wipe result of the aborted attempt changes nothing.
    s.results.push(StepResult {
        attempt_id: wipe_attempt,
        step: Step::Wipe,
        outcome: Outcome::Done,
    });
    assert!(s.tick().actions.is_empty());
    assert!(s.m.state.is_failed());

    let p = s.verb(Verb::Retry);
    assert!(s.active(Phase::Wiping));
    assert_eq!(s.m.attempt, 1);
    assert_ne!(s.m.attempt_id, wipe_attempt);
    assert_eq!(kinds(&p), ["queue.Wipe"]);
    assert!(s.m.deadline.is_some());
    s.report(Step::Wipe, Outcome::Done);
    assert!(s.active(Phase::Ready));
}

#[test]
fn verbs_that_do_not_fit_are_refused_with_what_to_do() {
    let mut s = Sim::new();
    let p = s.verb(Verb::Abort);
    assert!(
        p.rejected
            .as_deref()
            .unwrap_or_default()
            .starts_with("nothing to abort")
    );
    let p = s.verb(Verb::Retry);
    assert!(
        p.rejected
            .as_deref()
            .unwrap_or_default()
            .starts_with("nothing to retry")
    );
    let p = s.verb(Verb::Release);
    assert_eq!(
        p.rejected.as_deref(),
        Some(
            "release is not possible while the machine is enrolled: inspect, provide or deploy it"
        )
    );
    s.verb(Verb::Provide);
    let p = s.verb(deploy());
    assert_eq!(
        p.rejected.as_deref(),
        Some(
            "deploy is not possible while the machine is inspecting: wait for it to finish, or abort it"
        )
    );
    assert!(s.active(Phase::Inspecting));
    assert!(p.actions.is_empty());
}

#[test]
fn idle_in_ready_powers_off_once_and_a_later_deploy_netboots_again() {
    let mut s = Sim::new();
    s.drive_to_ready();
    let idle = s.policy.ready_idle_timeout_ms.unwrap_or_default();
    assert_eq!(s.m.deadline, Some(s.m.phase_started + idle));
    let p = s.past_deadline();
    assert_eq!(kinds(&p), ["bmc.Power { power: Off }"]);
    assert!(s.tick().actions.is_empty(), "powered off once");
    s.ramdisk = None;
    s.tick();
    let p = s.verb(deploy());
    assert!(s.active(Phase::Deploying));
    assert_eq!(
        kinds(&p),
        ["mint-boot-token", "publish-netboot", "bmc.BootOncePxe"]
    );
    s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: true });
    s.ramdisk = Some(NODE.into());
    let p = s.tick();
    assert_eq!(
        kinds(&p),
        ["withdraw-netboot", "bmc.BootDisk", "queue.Stream"]
    );
    assert_eq!(s.m.power_cycles, 2);
}

#[test]
fn no_join_after_the_kexec_reboots_from_disk_through_the_bmc() {
    let mut s = Sim::new();
    s.drive_to_ready();
    s.verb(deploy());
    s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: IMAGE.into(),
        },
    );
    s.ramdisk = None;
    let p = s.past_deadline();
    // The disk is made the boot device (read back) before the reboot that must boot it.
    assert_eq!(kinds(&p), ["bmc.BootDisk", "bmc.Power { power: Boot }"]);
    assert_eq!(s.m.power_cycles, 2);
    s.installed = Some(NODE.into());
    s.tick();
    assert!(s.active(Phase::Deployed));
    assert_eq!(s.steps_planned(Step::Kexec), 1);
}

#[test]
fn the_stream_waits_for_the_site_to_cache_the_image_within_its_deadline() {
    let mut s = Sim::new();
    s.drive_to_ready();
    s.image_at_site = false;
    let p = s.verb(deploy());
    assert!(s.active(Phase::Deploying));
    assert!(
        kinds(&p).is_empty(),
        "no stream before the site holds the image"
    );
    let deadline = s.m.deadline.expect("a deadline");
    s.now += 5_000;
    assert!(s.tick().actions.is_empty());
    assert_eq!(
        s.m.deadline,
        Some(deadline),
        "waiting does not move the deadline"
    );
    s.image_at_site = true;
    let p = s.tick();
    assert_eq!(kinds(&p), ["queue.Stream"]);

    let mut s = Sim::new();
    s.policy.deploy.attempts = 1;
    s.drive_to_ready();
    s.image_at_site = false;
    s.verb(deploy());
    s.past_deadline();
    assert!(
        matches!(&s.m.state, State::Failed { reason, .. } if reason.starts_with("the site did not cache sha256:1111")),
        "{}",
        s.m.state
    );
}

#[test]
fn a_kexec_the_ramdisk_could_not_stage_reboots_from_disk_at_once() {
    let mut s = Sim::new();
    s.drive_to_ready();
    s.verb(deploy());
    s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: IMAGE.into(),
        },
    );
    let before = s.m.deadline.expect("waits for the join");
    let p = s.report(
        Step::Kexec,
        Outcome::Failed {
            reason: "kexec_file_load: Operation not permitted".into(),
            retryable: false,
        },
    );
    assert!(s.now < before, "not at the deadline");
    assert_eq!(kinds(&p), ["bmc.BootDisk", "bmc.Power { power: Boot }"]);
    assert!(s.active(Phase::Deploying));
    assert!(s.tick().actions.is_empty(), "the fallback runs once");
    s.installed = Some(NODE.into());
    s.tick();
    assert!(s.active(Phase::Deployed));
}

#[test]
fn the_installed_system_that_never_joins_fails_the_deploy_after_its_attempts() {
    let mut s = Sim::new();
    s.policy.deploy.attempts = 1;
    s.drive_to_ready();
    s.verb(deploy());
    s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: IMAGE.into(),
        },
    );
    s.ramdisk = None;
    s.past_deadline();
    s.past_deadline();
    match &s.m.state {
        State::Failed { phase, reason } => {
            assert_eq!(*phase, Phase::Deploying);
            assert!(
                reason.starts_with("the installed system never joined: kexec at 2026-12-01 "),
                "{reason}"
            );
            assert!(
                reason.contains("reboot from disk at 2026-12-01"),
                "{reason}"
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_wrong_digest_or_a_foreign_node_fails_the_deploy() {
    let mut s = Sim::new();
    s.drive_to_ready();
    s.verb(deploy());
    s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: "sha256:2222".into(),
        },
    );
    assert_eq!(
        s.m.state,
        State::Failed {
            phase: Phase::Deploying,
            reason: "stream: the disk verified as sha256:2222, not the image sha256:1111".into()
        }
    );

    let mut s = Sim::new();
    s.drive_to_ready();
    s.verb(deploy());
    s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: IMAGE.into(),
        },
    );
    s.ramdisk = None;
    s.installed = Some("node-9".into());
    s.tick();
    assert!(
        matches!(&s.m.state, State::Failed { reason, .. } if reason.contains("node-9, not as the machine's node node-7"))
    );
}

#[test]
fn the_ramdisk_leaving_during_diagnose_ends_the_attempt_and_the_next_netboots() {
    let mut s = Sim::new();
    s.drive_to_diagnosing();
    s.ramdisk = None;
    let p = s.tick();
    assert!(s.active(Phase::Diagnosing));
    assert_eq!(s.m.attempt, 2);
    assert_eq!(
        kinds(&p),
        ["mint-boot-token", "publish-netboot", "bmc.BootOncePxe"]
    );
}

#[test]
fn release_netboots_the_ramdisk_then_wipes() {
    let mut s = Sim::new();
    s.drive_to_ready();
    s.verb(deploy());
    s.report(
        Step::Stream,
        Outcome::Streamed {
            digest: IMAGE.into(),
        },
    );
    s.ramdisk = None;
    s.installed = Some(NODE.into());
    s.tick();
    assert!(s.active(Phase::Deployed));
    let p = s.verb(Verb::Release);
    assert!(s.active(Phase::Releasing));
    assert_eq!(
        kinds(&p),
        ["mint-boot-token", "publish-netboot", "bmc.BootOncePxe"]
    );
    s.report(Step::BootOnce, Outcome::BootOnceSet { persistent: false });
    s.installed = None;
    s.ramdisk = Some(NODE.into());
    let p = s.tick();
    assert!(s.active(Phase::Wiping));
    assert_eq!(kinds(&p), ["withdraw-netboot", "queue.Wipe"]);
    s.report(Step::Wipe, Outcome::Done);
    assert!(s.active(Phase::Ready));
    assert_eq!(s.phase(), Phase::Ready);
}

#[test]
fn utc_formatting() {
    assert_eq!(fmt_utc(0), "1970-01-01 00:00:00 UTC");
    assert_eq!(fmt_utc(T0), "2026-12-01 08:14:04 UTC");
    assert_eq!(fmt_utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    assert_eq!(fmt_utc(-1_000), "1969-12-31 23:59:59 UTC");
}
