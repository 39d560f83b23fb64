//! Actions on a system: power and the one-time boot override. Both read back what the BMC did: an accepted
//! request whose effect never shows is an error ([`RedfishError::PowerNotApplied`],
//! [`RedfishError::BootOverrideNotApplied`]), never a success.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Map, Value, json};
use tracing::info;

use super::client::Bmc;
use super::error::{ObservedBoot, RedfishError};
use super::models::{ActionInfo, Collection, ComputerSystem};
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

fn or_unset(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "(absent)".into())
}

impl Bmc {
    /// The systems' paths (`/redfish/v1/Systems/<id>`).
    pub async fn systems(&self) -> Result<Vec<String>, RedfishError> {
        let path = self
            .service_root()
            .systems
            .as_ref()
            .map_or("/redfish/v1/Systems".to_owned(), |l| l.odata_id.clone());
        let (collection, _) = self.get::<Collection>(&path).await?;
        Ok(collection.members.into_iter().map(|l| l.odata_id).collect())
    }

    /// The path of system `id` (its Id or last path segment), or of the only system when `id` is `None`.
    pub async fn system_path(&self, id: Option<&str>) -> Result<String, RedfishError> {
        let systems = self.systems().await?;
        let found = match id {
            Some(id) => systems
                .iter()
                .find(|p| p.trim_end_matches('/').rsplit('/').next() == Some(id)),
            None if systems.len() == 1 => systems.first(),
            None => {
                return Err(RedfishError::NotFound {
                    url: self.base_url().to_owned(),
                    what: format!(
                        "a single system (the BMC has {}: name one of {systems:?})",
                        systems.len()
                    ),
                });
            }
        };
        found.cloned().ok_or_else(|| RedfishError::NotFound {
            url: self.base_url().to_owned(),
            what: format!("system {} (systems: {systems:?})", id.unwrap_or("")),
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
        let reset = sys.actions.reset.clone().unwrap_or_default();
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
        let boot = sys.boot.clone().unwrap_or_default();
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
        let mode = match (self.quirks().override_mode, target) {
            (OverrideMode::Forbidden, _) => None,
            (_, BootTarget::UefiHttp) => Some("UEFI".to_owned()),
            (OverrideMode::Send, BootTarget::Pxe) => {
                Some(match boot.boot_source_override_mode.as_deref() {
                    Some("Legacy") => "Legacy".to_owned(),
                    _ => "UEFI".to_owned(),
                })
            }
            (OverrideMode::Omit, BootTarget::Pxe) => None,
        };
        if let Some(mode) = &mode {
            fields.insert("BootSourceOverrideMode".into(), mode.clone().into());
        }
        let body = Value::Object(Map::from_iter([("Boot".to_owned(), Value::Object(fields))]));
        self.patch_with_etag(system, &body, etag).await?;

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
