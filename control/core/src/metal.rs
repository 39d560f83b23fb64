//! The bare-metal machine state machine (DESIGN.md "Metal flow"), pure: `plan(&input, now, &policy)` returns the
//! actions to take and the machine's next record; the metal module's reconciler applies them (BMC commands to the
//! site agent, ramdisk commands on the node's session, tokens and netboot entries in the store) and stores the
//! record with them, in one transaction.
//!
//! ```text
//! enrolled → inspecting → booting-ramdisk → diagnosing → wiping → ready → deploying → deployed
//!                                                          ↑                              │ release
//!                                                          └──────── releasing ←──────────┘
//! failed{phase, reason} from any wait phase (abort: the operator's); retry resumes the phase with a fresh plan.
//! ```
//! Every wait phase has a deadline ([`Machine::deadline`]) and a retry plan: a netboot attempt mints a
//! single-use boot token, publishes the netboot entry, sets the one-time PXE override (read back: a BMC that keeps
//! it as `Continuous` gets the disk boot restored once the ramdisk joined) and power-kicks the machine; with no
//! join by its deadline the next attempt re-kicks, and after `k` attempts the machine fails with "never joined: k
//! PXE attempts, last DHCP seen at …". Steps that must happen once (the stream, the seed, the kexec, a power
//! kick) are recorded per attempt ([`Machine::done`]) and never planned twice in it, so a control plane restarted
//! mid-deploy resumes without repeating them. Fast track: the ramdisk stays joined from the first netboot
//! through diagnose, wipe and deploy (one power cycle enroll → deployed, two with the reboot-from-disk fallback
//! or after the idle power-off in `ready`).
//!
//! Start at [`plan`]. Hardware comparison is in [`hardware`]; the planner is in `metal/plan.rs`.

pub mod hardware;
mod plan;
pub mod ramdisk;
pub mod site_report;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use hardware::{Comparison, ExpectedHardware, HardwareSummary, compare};
pub use plan::plan;

/// Unix milliseconds.
pub type Millis = i64;

/// Where a machine is in its flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    Enrolled,
    Inspecting,
    BootingRamdisk,
    Diagnosing,
    Wiping,
    Ready,
    Deploying,
    Deployed,
    Releasing,
}

impl Phase {
    pub const ALL: [Phase; 9] = [
        Phase::Enrolled,
        Phase::Inspecting,
        Phase::BootingRamdisk,
        Phase::Diagnosing,
        Phase::Wiping,
        Phase::Ready,
        Phase::Deploying,
        Phase::Deployed,
        Phase::Releasing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Enrolled => "enrolled",
            Phase::Inspecting => "inspecting",
            Phase::BootingRamdisk => "booting-ramdisk",
            Phase::Diagnosing => "diagnosing",
            Phase::Wiping => "wiping",
            Phase::Ready => "ready",
            Phase::Deploying => "deploying",
            Phase::Deployed => "deployed",
            Phase::Releasing => "releasing",
        }
    }

    /// A phase that waits for something (a BMC, the ramdisk, the installed system): it always has a deadline,
    /// and it can be aborted. The others rest until an operator verb.
    pub fn is_wait(self) -> bool {
        !matches!(self, Phase::Enrolled | Phase::Ready | Phase::Deployed)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The machine's state: in a phase, or failed in one (with why).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum State {
    Active { phase: Phase },
    Failed { phase: Phase, reason: String },
}

impl State {
    pub fn phase(&self) -> Phase {
        match self {
            State::Active { phase } | State::Failed { phase, .. } => *phase,
        }
    }

    pub fn is_failed(&self) -> bool {
        matches!(self, State::Failed { .. })
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            State::Active { phase } => write!(f, "{phase}"),
            State::Failed { phase, reason } => write!(f, "failed in {phase}: {reason}"),
        }
    }
}

/// What the operator asked the machine to become.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "goal", rename_all = "kebab-case")]
pub enum Goal {
    /// Stay where it rests.
    Rest,
    /// Inspect (Redfish inventory), then rest in `enrolled`.
    Inspected,
    /// Provide: ramdisk, diagnose, wipe, then rest in `ready`.
    Ready,
    Deployed(DeploySpec),
}

/// What to deploy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeploySpec {
    /// The image artifact's digest (`sha256:…`): streamed, then verified against it.
    pub image: String,
    pub user_data: String,
    pub meta_data: String,
}

/// One row of the machine's timeline: one attempt at one phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TimelineRow {
    pub phase: Phase,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub start: Millis,
    /// `None` while the row is open (the machine's current phase and attempt).
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub end: Option<Millis>,
    pub attempt: u32,
    pub outcome: Option<String>,
}

/// A step of an attempt. Each is planned at most once per attempt ([`Machine::done`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum Step {
    /// `bmc.inspect`: the Redfish inventory.
    Inspect,
    /// Mint the attempt's single-use boot token.
    BootToken,
    /// Publish the netboot entry (the boot token on the ramdisk's kernel command line).
    PublishNetboot,
    /// `bmc.boot_once` PXE, read back.
    BootOnce,
    /// `bmc.power` on (or force-restart when on), read back: the netboot's power cycle.
    PowerKick,
    WithdrawNetboot,
    /// `bmc.boot_disk`: boot from the disk again (a BMC that kept the PXE override as persistent).
    RestoreDiskBoot,
    Diagnose,
    Wipe,
    Stream,
    /// Mint the single-use join token the installed system's bcd reclaims the node with.
    JoinToken,
    /// `ramdisk.kexec`: write the NoCloud seed (user-data, meta-data, the join token) on the installed root and
    /// jump into its kernel.
    Kexec,
    /// No join after the kexec: reboot from the disk through the BMC.
    FallbackReboot,
    /// `ready` for longer than the idle timeout: power off.
    IdlePowerOff,
}

/// The power action a BMC command asks for; the site agent reads the result back before it reports done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Power {
    Off,
    /// On when off, force-restart when on: a fresh boot either way. Read back: PowerState On.
    Boot,
}

/// A command for the site agent's BMC worker, and what it reads back before reporting it done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum BmcOp {
    /// Inventory: systems, processors, memory, NICs, GPUs.
    Inspect,
    /// One-time PXE override. Read back: Target=Pxe and Enabled Once, or Continuous on a BMC that keeps every
    /// override (reported as `persistent`; the flow restores the disk boot after the join).
    BootOncePxe,
    /// Read back: PowerState On (`Boot`) or Off.
    Power { power: Power },
    /// Target=Hdd, Enabled=Continuous, read back.
    BootDisk,
}

/// A command for the ramdisk on the machine's node session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum RamdiskCommand {
    /// `ramdisk.diagnose`: in-band hardware and health, signed.
    Diagnose,
    /// `ramdisk.wipe`: signed wipe evidence.
    Wipe,
    /// `ramdisk.stream`: stream the image to the disk and verify it against `image`.
    Stream { image: String },
    /// `ramdisk.kexec` into the installed system, after writing its NoCloud seed: the operator's user-data and
    /// meta-data, and the join token minted in the same plan (it travels only inside this command).
    Kexec {
        user_data: String,
        meta_data: String,
    },
}

/// What the executor does. Each carries its [`Step`] and the attempt it belongs to, so results come back to the
/// attempt that asked (a late result of an earlier attempt is ignored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum Action {
    Bmc {
        step: Step,
        attempt_id: u64,
        op: BmcOp,
    },
    MintBootToken {
        attempt_id: u64,
    },
    /// The netboot entry for the boot MAC, with the attempt's boot token on the kernel command line.
    PublishNetboot {
        mac: String,
        attempt_id: u64,
    },
    WithdrawNetboot {
        mac: String,
    },
    /// On the node the ramdisk joined as.
    Queue {
        step: Step,
        attempt_id: u64,
        node_id: String,
        command: RamdiskCommand,
    },
    /// The join token for the installed system, reclaiming `node_id`.
    MintJoinToken {
        attempt_id: u64,
        node_id: String,
    },
    /// Cancel this machine's queued commands that have no result yet.
    CancelCommands {
        reason: String,
    },
}

/// How one step ended (reported by the site agent for BMC steps, by the ramdisk for commands).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum Outcome {
    Done,
    Inspected(HardwareSummary),
    /// The override was read back as set; `persistent`: as Continuous although Once was asked.
    BootOnceSet {
        persistent: bool,
    },
    Diagnosed {
        hardware: HardwareSummary,
        healthy: bool,
        reasons: Vec<String>,
    },
    /// The image was streamed and its digest verified as `digest`.
    Streamed {
        digest: String,
    },
    /// `retryable`: a transient failure (the BMC was busy, a timeout) that another attempt may overcome; not
    /// retryable: the thing will not work as asked (an override accepted and not applied, a disk that failed).
    Failed {
        reason: String,
        retryable: bool,
    },
}

/// A step's result, for the attempt that planned it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepResult {
    pub attempt_id: u64,
    pub step: Step,
    pub outcome: Outcome,
}

/// An operator verb.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verb", rename_all = "kebab-case")]
pub enum Verb {
    Inspect,
    Provide,
    Deploy(DeploySpec),
    Release,
    Abort,
    Retry,
}

/// The machine as stored: state, goal, the current attempt and what it has done, and the timeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// The boot NIC's MAC (lower case).
    pub mac: String,
    pub expected: Option<ExpectedHardware>,
    pub state: State,
    pub goal: Goal,
    /// The attempt at the current phase, from 1 (the retry plan's count).
    pub attempt: u32,
    /// Unique over the machine's life: results and tokens name it.
    pub attempt_id: u64,
    pub phase_started: Millis,
    pub attempt_started: Millis,
    /// When the current wait ends; `Some` in every wait phase.
    pub deadline: Option<Millis>,
    /// What the deadline is for, worded for `metal show`.
    pub waiting_for: Option<String>,
    /// The steps planned in this attempt, and when.
    pub done: BTreeMap<Step, Millis>,
    /// The BMC kept this attempt's PXE override as Continuous.
    pub override_persistent: bool,
    pub netboot_published: bool,
    /// The node the ramdisk joined as (and the installed system reclaims).
    pub node_id: Option<String>,
    pub power_cycles: u32,
    pub inspection: Option<HardwareSummary>,
    pub diagnosis: Option<HardwareSummary>,
    /// Findings that do not fail the machine (inspection and diagnose disagree, a disk boot not restored).
    pub conditions: Vec<String>,
    pub last_error: Option<String>,
    pub timeline: Vec<TimelineRow>,
}

impl Machine {
    pub fn enrolled(mac: &str, expected: Option<ExpectedHardware>, now: Millis) -> Machine {
        Machine {
            mac: mac.to_ascii_lowercase(),
            expected,
            state: State::Active {
                phase: Phase::Enrolled,
            },
            goal: Goal::Rest,
            attempt: 1,
            attempt_id: 1,
            phase_started: now,
            attempt_started: now,
            deadline: None,
            waiting_for: None,
            done: BTreeMap::new(),
            override_persistent: false,
            netboot_published: false,
            node_id: None,
            power_cycles: 0,
            inspection: None,
            diagnosis: None,
            conditions: Vec::new(),
            last_error: None,
            timeline: vec![TimelineRow {
                phase: Phase::Enrolled,
                start: now,
                end: None,
                attempt: 1,
                outcome: None,
            }],
        }
    }
}

/// Everything the planner looks at: the stored machine and what was observed since.
#[derive(Debug, Clone)]
pub struct MachineInput {
    pub machine: Machine,
    /// The operator's verb, if one arrived.
    pub verb: Option<Verb>,
    /// Results of steps (those of other attempts are ignored).
    pub results: Vec<StepResult>,
    /// The node a ramdisk joined as with one of this machine's boot tokens, while its session is up.
    pub ramdisk: Option<String>,
    /// The node the installed system's bcd joined as with this machine's join token, while its session is up.
    pub installed: Option<String>,
    /// When the site last saw DHCP from the boot MAC.
    pub last_dhcp_seen: Option<Millis>,
    /// The deploy image is where the ramdisk streams it from (the site's cache holds it, or a configured mirror
    /// serves it): the stream waits for it.
    pub image_at_site: bool,
}

impl MachineInput {
    pub fn new(machine: Machine) -> MachineInput {
        MachineInput {
            machine,
            verb: None,
            results: Vec::new(),
            ramdisk: None,
            installed: None,
            last_dhcp_seen: None,
            image_at_site: false,
        }
    }
}

/// A deadline and how many attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retry {
    pub timeout_ms: Millis,
    pub attempts: u32,
}

/// Deadlines and retry plans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// For one BMC command's result (boot override, power, disk boot).
    pub bmc_timeout_ms: Millis,
    pub inspect: Retry,
    /// From the power kick to the ramdisk's join; `attempts` is k, the re-kicks before failing.
    pub netboot: Retry,
    pub diagnose: Retry,
    pub wipe: Retry,
    /// Stream + kexec (with the seed) + the installed system's join, as one attempt.
    pub deploy: Retry,
    pub stream_timeout_ms: Millis,
    /// From the kexec to the installed system's join, before the reboot-from-disk fallback.
    pub kexec_join_timeout_ms: Millis,
    pub reboot_join_timeout_ms: Millis,
    /// In `ready` with the ramdisk up and nothing to do: power off after this long.
    pub ready_idle_timeout_ms: Option<Millis>,
}

impl Default for Policy {
    fn default() -> Policy {
        const S: Millis = 1000;
        Policy {
            bmc_timeout_ms: 120 * S,
            inspect: Retry {
                timeout_ms: 120 * S,
                attempts: 3,
            },
            netboot: Retry {
                timeout_ms: 300 * S,
                attempts: 3,
            },
            diagnose: Retry {
                timeout_ms: 600 * S,
                attempts: 2,
            },
            wipe: Retry {
                timeout_ms: 3600 * S,
                attempts: 2,
            },
            deploy: Retry {
                timeout_ms: 3600 * S,
                attempts: 2,
            },
            stream_timeout_ms: 1800 * S,
            kexec_join_timeout_ms: 300 * S,
            reboot_join_timeout_ms: 600 * S,
            ready_idle_timeout_ms: Some(1800 * S),
        }
    }
}

/// An audit event: one transition of the state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    pub at: Millis,
    pub from: State,
    pub to: State,
    pub why: String,
}

/// What [`plan`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// In order: apply them in this order.
    pub actions: Vec<Action>,
    /// The record to store with the actions.
    pub next: Machine,
    /// Audit events, one per change of state.
    pub transitions: Vec<Transition>,
    /// The verb was refused: why, and what to do instead.
    pub rejected: Option<String>,
}

/// `YYYY-MM-DD HH:MM:SS UTC` from Unix milliseconds (civil-from-days, proleptic Gregorian).
pub fn fmt_utc(ms: Millis) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod proptests;
