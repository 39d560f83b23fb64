//! Actions on a system: power and the one-time boot override. Both read back what the BMC did: an accepted
//! request whose effect never shows is an error ([`RedfishError::PowerNotApplied`],
//! [`RedfishError::BootOverrideNotApplied`]), never a success.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Map, Value, json};
use tracing::{info, warn};

use super::client::Bmc;
use super::error::{ObservedBoot, RedfishError};
use super::listing::{Listed, normalize};
use super::models::{ActionInfo, ComputerSystem};
use super::quirks::{IfMatch, OverrideMode};

/// What the operator wants of the power.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerAction {
    On,
    /// Immediately (ForceOff).
    Off,
    /// Through the OS (GracefulShutdown).
    GracefulOff,
    /// Immediately (ForceRestart, else PowerCycle).
    Reset,
    GracefulRestart,
    PowerCycle,
}

impl PowerAction {
    /// ResetType values that carry the action out, preferred first.
    pub fn reset_types(self) -> &'static [&'static str] {
        match self {
            PowerAction::On => &["On", "ForceOn"],
            PowerAction::Off => &["ForceOff"],
            PowerAction::GracefulOff => &["GracefulShutdown"],
            PowerAction::Reset => &["ForceRestart", "PowerCycle"],
            PowerAction::GracefulRestart => &["GracefulRestart"],
            PowerAction::PowerCycle => &["PowerCycle", "ForceRestart"],
        }
    }

    /// The PowerState the action ends in, when it ends in a steady one.
    pub fn wanted_state(self) -> Option<&'static str> {
        match self {
            PowerAction::On => Some("On"),
            PowerAction::Off | PowerAction::GracefulOff => Some("Off"),
            _ => None,
        }
    }
}

impl fmt::Display for PowerAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PowerAction::On => "on",
            PowerAction::Off => "off",
            PowerAction::GracefulOff => "graceful-off",
            PowerAction::Reset => "reset",
            PowerAction::GracefulRestart => "graceful-restart",
            PowerAction::PowerCycle => "cycle",
        })
    }
}

/// Operator spelling (`on`, `off`, `graceful-off`, `reset`, `graceful-restart`, `cycle`).
impl FromStr for PowerAction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "on" => PowerAction::On,
            "off" | "force-off" => PowerAction::Off,
            "graceful-off" | "shutdown" => PowerAction::GracefulOff,
            "reset" | "restart" | "force-restart" => PowerAction::Reset,
            "graceful-restart" | "reboot" => PowerAction::GracefulRestart,
            "cycle" | "power-cycle" => PowerAction::PowerCycle,
            _ => {
                return Err(format!(
                    "unknown power action {s:?}: on, off, graceful-off, reset, graceful-restart, cycle"
                ));
            }
        })
    }
}

/// How a power request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PowerOutcome {
    /// The system was already in the wanted state; nothing was sent (or the BMC said so).
    AlreadyInState(String),
    /// Applied and read back.
    Applied {
        reset_type: String,
        power_state: String,
    },
    /// Accepted; a restart has no steady state to read back.
    Accepted { reset_type: String },
}

impl fmt::Display for PowerOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PowerOutcome::AlreadyInState(state) => {
                write!(f, "power already {state}: nothing to do")
            }
            PowerOutcome::Applied {
                reset_type,
                power_state,
            } => write!(
                f,
                "Reset {reset_type} applied: PowerState reads {power_state}"
            ),
            PowerOutcome::Accepted { reset_type } => write!(
                f,
                "Reset {reset_type} accepted (a restart has no steady PowerState to read back)"
            ),
        }
    }
}

/// The one-time boot targets a netboot needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootTarget {
    Pxe,
    UefiHttp,
}

impl BootTarget {
    pub fn as_redfish(self) -> &'static str {
        match self {
            BootTarget::Pxe => "Pxe",
            BootTarget::UefiHttp => "UefiHttp",
        }
    }
}

impl FromStr for BootTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "pxe" => Ok(BootTarget::Pxe),
            "uefihttp" | "uefi-http" | "http" => Ok(BootTarget::UefiHttp),
            _ => Err(format!("unknown boot target {s:?}: pxe or uefi-http")),
        }
    }
}

/// The override as read back after setting it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootOverride {
    pub target: String,
    pub enabled: String,
    pub mode: Option<String>,
}

impl fmt::Display for BootOverride {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "one-time boot override read back: Target={}, Enabled={}",
            self.target, self.enabled
        )?;
        if let Some(mode) = &self.mode {
            write!(f, ", Mode={mode}")?;
        }
        Ok(())
    }
}

fn last_segment(path: &str) -> &str {
    let p = path.split('?').next().unwrap_or(path).trim_end_matches('/');
    p.rsplit('/').next().unwrap_or(p)
}

fn or_unset(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "(absent)".into())
}

impl Bmc {
    /// The systems, all pages. A BMC without a Systems collection (a chassis manager, a switch) has none.
    pub async fn systems(&self) -> Result<Listed, RedfishError> {
        let Some(link) = self.service_root().systems.as_ref() else {
            return Ok(Listed {
                collection: String::new(),
                complete: true,
                ..Listed::default()
            });
        };
        self.list(&link.odata_id).await
    }

    /// The path of the system `wanted` names (its Id, the last segment of its path, or its full `@odata.id`), or
    /// of the only system when `wanted` is `None`. With several systems and no name, or a list that could not be
    /// read to its end, nothing is picked: the error lists the Ids to choose from.
    pub async fn system_path(&self, wanted: Option<&str>) -> Result<String, RedfishError> {
        let listed = self.systems().await?;
        let url = self.base_url().to_owned();
        let ids: Vec<String> = listed
            .members
            .iter()
            .map(|m| last_segment(&m.odata_id).to_owned())
            .collect();
        let incomplete = || RedfishError::SystemsIncomplete {
            url: url.clone(),
            why: listed.warnings.join("; "),
        };
        let Some(wanted) = wanted.map(str::trim).filter(|w| !w.is_empty()) else {
            if !listed.complete {
                return Err(incomplete());
            }
            return match listed.members.as_slice() {
                [only] => Ok(only.odata_id.clone()),
                [] => Err(RedfishError::NoSuchSystem {
                    url,
                    wanted: "(the only system)".into(),
                    have: Vec::new(),
                }),
                _ => Err(RedfishError::SeveralSystems { url, ids }),
            };
        };
        let wanted_path = normalize(wanted);
        if let Some(m) = listed.members.iter().find(|m| {
            normalize(&m.odata_id) == wanted_path
                || last_segment(&m.odata_id) == wanted.trim_matches('/')
        }) {
            return Ok(m.odata_id.clone());
        }
        // An Id that differs from the path's last segment: read the systems' Ids.
        for m in &listed.members {
            if let Ok(f) = self.member::<ComputerSystem>(m).await
                && f.value.id.as_deref() == Some(wanted)
            {
                return Ok(m.odata_id.clone());
            }
        }
        if !listed.complete {
            return Err(incomplete());
        }
        Err(RedfishError::NoSuchSystem {
            url,
            wanted: wanted.to_owned(),
            have: ids,
        })
    }

    /// Carries out a power action and, for on/off, waits until PowerState shows it.
    pub async fn power(
        &self,
        system: &str,
        action: PowerAction,
    ) -> Result<PowerOutcome, RedfishError> {
        let (sys, _) = self.get::<ComputerSystem>(system).await?;
        let current = sys.power_state.clone().unwrap_or_default();
        if let Some(wanted) = action.wanted_state()
            && current.eq_ignore_ascii_case(wanted)
        {
            return Ok(PowerOutcome::AlreadyInState(current));
        }
        // Never POST a reset the system does not advertise.
        let Some(reset) = sys.actions.reset.clone() else {
            return Err(RedfishError::NoResetAction {
                system: system.to_owned(),
                action: action.to_string(),
            });
        };
        let mut allowed = reset.allowed.clone().unwrap_or_default();
        if allowed.is_empty()
            && let Some(info) = &reset.action_info
            && let Ok((info, _)) = self.get::<ActionInfo>(info).await
        {
            allowed = info
                .parameters
                .into_iter()
                .find(|p| p.name.as_deref() == Some("ResetType"))
                .map(|p| p.allowable_values)
                .unwrap_or_default();
        }
        let wanted = action.reset_types();
        let reset_type = if allowed.is_empty() {
            wanted[0]
        } else {
            *wanted
                .iter()
                .find(|w| allowed.iter().any(|a| a == *w))
                .ok_or_else(|| RedfishError::ResetNotAllowed {
                    system: system.to_owned(),
                    action: action.to_string(),
                    wanted: wanted.iter().map(|s| (*s).to_owned()).collect(),
                    allowed: allowed.clone(),
                })?
        };
        let target = reset.target.clone().unwrap_or_else(|| {
            format!(
                "{}/Actions/ComputerSystem.Reset",
                system.trim_end_matches('/')
            )
        });
        let already = self.quirks().already_in_state_ids;
        let reply = self
            .send(
                Method::POST,
                &target,
                Some(&json!({"ResetType": reset_type})),
                None,
                already,
            )
            .await?;
        if !reply.status.is_success()
            && action.wanted_state().is_some()
            && reply.has_message_id(already)
        {
            return Ok(PowerOutcome::AlreadyInState(
                action.wanted_state().unwrap_or("requested").to_owned(),
            ));
        }
        self.expect_ok(Method::POST, &target, reply)?;
        info!(bmc = %self.base_url(), system, reset_type, "power action accepted");
        let settle = self.quirks().settle_after_power;
        let Some(wanted_state) = action.wanted_state() else {
            tokio::time::sleep(settle).await;
            return Ok(PowerOutcome::Accepted {
                reset_type: reset_type.to_owned(),
            });
        };
        let budget = self
            .opts
            .power_apply_time
            .unwrap_or(self.quirks().power_apply_time);
        let started = tokio::time::Instant::now();
        loop {
            let (sys, _) = self.get::<ComputerSystem>(system).await?;
            let state = sys.power_state.unwrap_or_default();
            if state.eq_ignore_ascii_case(wanted_state) {
                tokio::time::sleep(settle).await;
                return Ok(PowerOutcome::Applied {
                    reset_type: reset_type.to_owned(),
                    power_state: state,
                });
            }
            if started.elapsed() >= budget {
                return Err(RedfishError::PowerNotApplied {
                    system: system.to_owned(),
                    reset_type: reset_type.to_owned(),
                    wanted: wanted_state.to_owned(),
                    observed: if state.is_empty() {
                        "(absent)".into()
                    } else {
                        state
                    },
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(self.opts.poll_interval.min(budget)).await;
        }
    }

    /// Sets a one-time boot override and reads it back.
    pub async fn boot_once(
        &self,
        system: &str,
        target: BootTarget,
    ) -> Result<BootOverride, RedfishError> {
        let wanted = target.as_redfish();
        let (sys, etag) = self.get::<ComputerSystem>(system).await?;
        // Never PATCH a boot override into a system that has no place for it.
        let Some(boot) = sys.boot.clone() else {
            return Err(RedfishError::NoBootOverride {
                system: system.to_owned(),
                what: "Boot object",
            });
        };
        if boot.boot_source_override_target.is_none() && boot.allowed_targets.is_none() {
            return Err(RedfishError::NoBootOverride {
                system: system.to_owned(),
                what: "Boot.BootSourceOverrideTarget property",
            });
        }
        if let Some(allowed) = &boot.allowed_targets
            && !allowed.is_empty()
            && !allowed.iter().any(|a| a == wanted)
        {
            return Err(RedfishError::BootTargetNotAllowed {
                system: system.to_owned(),
                target: wanted.to_owned(),
                allowed: allowed.clone(),
            });
        }
        let mut fields = Map::new();
        fields.insert("BootSourceOverrideTarget".into(), wanted.into());
        fields.insert("BootSourceOverrideEnabled".into(), "Once".into());
        let already_uefi = boot
            .boot_source_override_mode
            .as_deref()
            .is_some_and(|m| m.eq_ignore_ascii_case("UEFI"));
        let mode = match (self.quirks().override_mode, target) {
            (OverrideMode::Forbidden, _) => None,
            // The system reads UEFI already: nothing to change (unless the vendor reverts an omitted mode).
            (OverrideMode::Omit, BootTarget::UefiHttp) if already_uefi => None,
            (_, BootTarget::UefiHttp) => Some("UEFI".to_owned()),
            (OverrideMode::Send, BootTarget::Pxe) => {
                Some(match boot.boot_source_override_mode.as_deref() {
                    Some("Legacy") => "Legacy".to_owned(),
                    _ => "UEFI".to_owned(),
                })
            }
            (OverrideMode::Omit, BootTarget::Pxe) => None,
        };
        let body_of = |fields: &Map<String, Value>| {
            Value::Object(Map::from_iter([(
                "Boot".to_owned(),
                Value::Object(fields.clone()),
            )]))
        };
        let mut mode = mode;
        if let Some(m) = &mode {
            let mut with_mode = fields.clone();
            with_mode.insert("BootSourceOverrideMode".into(), m.clone().into());
            match self
                .patch_with_etag(system, &body_of(&with_mode), etag.clone())
                .await
            {
                Ok(()) => {}
                // Some BMCs take the mode as read-only and refuse the whole PATCH (400): once more without it.
                Err(e) if e.status() == Some(400) => {
                    warn!(bmc = %self.base_url(), system, error = %bc_error_chain::InlineErrorChain::new(&e), "boot override refused with BootSourceOverrideMode; retrying without it");
                    mode = None;
                    self.patch_with_etag(system, &body_of(&fields), etag)
                        .await?;
                }
                Err(e) => return Err(e),
            }
        } else {
            self.patch_with_etag(system, &body_of(&fields), etag)
                .await?;
        }

        let budget = self.opts.boot_readback;
        let started = tokio::time::Instant::now();
        loop {
            let (sys, _) = self.get::<ComputerSystem>(system).await?;
            let b = sys.boot.unwrap_or_default();
            let ok = b.boot_source_override_target.as_deref() == Some(wanted)
                && b.boot_source_override_enabled.as_deref() == Some("Once")
                && mode.as_ref().is_none_or(|m| {
                    b.boot_source_override_mode
                        .as_deref()
                        .is_none_or(|seen| seen == m)
                });
            if ok {
                info!(bmc = %self.base_url(), system, target = wanted, "one-time boot override set");
                return Ok(BootOverride {
                    target: wanted.to_owned(),
                    enabled: "Once".into(),
                    mode: b.boot_source_override_mode,
                });
            }
            if started.elapsed() >= budget {
                return Err(RedfishError::BootOverrideNotApplied {
                    system: system.to_owned(),
                    target: wanted.to_owned(),
                    observed: Box::new(ObservedBoot {
                        target: or_unset(&b.boot_source_override_target),
                        enabled: or_unset(&b.boot_source_override_enabled),
                        mode: or_unset(&b.boot_source_override_mode),
                    }),
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(
                self.opts
                    .poll_interval
                    .min(budget.max(Duration::from_millis(10))),
            )
            .await;
        }
    }

    /// Makes the disk the boot device, persistently (`Target=Hdd, Enabled=Continuous`), and reads it back. This is
    /// how a netboot is ended on a BMC that stores every override as persistent (sushy-tools' libvirt driver keeps
    /// `Once` as `Continuous`: the next reset would netboot again), and how a deployed machine is left booting its
    /// installed system.
    pub async fn restore_disk_boot(&self, system: &str) -> Result<BootOverride, RedfishError> {
        let (_, etag) = self.get::<ComputerSystem>(system).await?;
        let body = json!({"Boot": {"BootSourceOverrideTarget": "Hdd", "BootSourceOverrideEnabled": "Continuous"}});
        self.patch_with_etag(system, &body, etag).await?;
        let budget = self.opts.boot_readback;
        let started = tokio::time::Instant::now();
        loop {
            let (sys, _) = self.get::<ComputerSystem>(system).await?;
            let b = sys.boot.unwrap_or_default();
            if b.boot_source_override_target.as_deref() == Some("Hdd")
                && b.boot_source_override_enabled.as_deref() == Some("Continuous")
            {
                info!(bmc = %self.base_url(), system, "boot device restored to the disk");
                return Ok(BootOverride {
                    target: "Hdd".into(),
                    enabled: "Continuous".into(),
                    mode: b.boot_source_override_mode,
                });
            }
            if started.elapsed() >= budget {
                return Err(RedfishError::DiskBootNotRestored {
                    system: system.to_owned(),
                    observed: Box::new(ObservedBoot {
                        target: or_unset(&b.boot_source_override_target),
                        enabled: or_unset(&b.boot_source_override_enabled),
                        mode: or_unset(&b.boot_source_override_mode),
                    }),
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(
                self.opts
                    .poll_interval
                    .min(budget.max(Duration::from_millis(10))),
            )
            .await;
        }
    }

    /// PATCH with If-Match as the quirks ask; a stale ETag (412) or a missing one (428) gets one fresh read and
    /// one more try.
    async fn patch_with_etag(
        &self,
        path: &str,
        body: &Value,
        etag: Option<String>,
    ) -> Result<(), RedfishError> {
        let pick = |etag: Option<String>| match self.quirks().if_match {
            IfMatch::WhenKnown => etag,
            IfMatch::Always => Some(etag.unwrap_or_else(|| "*".into())),
        };
        let mut if_match = pick(etag);
        let mut refreshed = false;
        loop {
            let reply = self
                .send(Method::PATCH, path, Some(body), if_match.as_deref(), &[])
                .await?;
            let status = reply.status.as_u16();
            let missing = status == 428
                || reply.has_message_id(&["PreconditionHeaderMissing", "PreconditionRequired"]);
            if (status == 412 || missing) && !refreshed {
                refreshed = true;
                let (_, fresh) = self.get::<Value>(path).await?;
                if_match = Some(fresh.unwrap_or_else(|| "*".into()));
                continue;
            }
            if status == 412 {
                return Err(RedfishError::EtagConflict {
                    url: self.url(path),
                    etag: if_match.unwrap_or_default(),
                });
            }
            self.expect_ok(Method::PATCH, path, reply)?;
            return Ok(());
        }
    }
}
