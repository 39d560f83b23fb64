//! What can go wrong talking to a BMC, worded for the operator: which request, what the BMC said (HTTP status and
//! its `@Message.ExtendedInfo` text), and for actions the BMC accepted but did not carry out, what was read back.

use std::time::Duration;

fn said(message: &Option<String>) -> String {
    message
        .as_deref()
        .map(|m| format!(": {m}"))
        .unwrap_or_default()
}

/// The boot override as read back; `(absent)` for a property the BMC did not report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedBoot {
    pub target: String,
    pub enabled: String,
    pub mode: String,
}

impl std::fmt::Display for ObservedBoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Target={}, Enabled={}, Mode={}",
            self.target, self.enabled, self.mode
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RedfishError {
    #[error("invalid BMC URL {url:?}: {why}")]
    Url { url: String, why: &'static str },

    #[error(
        "the BMC linked to {url}, outside its own address {base}: not followed (requests carry the BMC's credentials); a BMC whose links name another host for itself needs to be enrolled under that address"
    )]
    Foreign { url: String, base: String },

    #[error("building the HTTPS client for {url}")]
    Client {
        url: String,
        #[source]
        source: reqwest::Error,
    },

    #[error("TLS setup for {url}: {why}")]
    Tls { url: String, why: String },

    #[error("{method} {url}: no answer from the BMC")]
    Transport {
        method: String,
        url: String,
        #[source]
        source: reqwest::Error,
    },

    #[error("{method} {url}: HTTP {status}{}", said(message))]
    Status {
        method: String,
        url: String,
        status: u16,
        message: Option<String>,
    },

    #[error(
        "{method} {url}: the BMC was still busy after {attempts} attempts (last HTTP {status}{}); retry later",
        said(message)
    )]
    Busy {
        method: String,
        url: String,
        attempts: u32,
        status: u16,
        message: Option<String>,
    },

    #[error(
        "{url}: the BMC rejected the credentials (HTTP {status}{}); check the BMC user and password",
        said(message)
    )]
    AuthRejected {
        url: String,
        status: u16,
        message: Option<String>,
    },

    #[error(
        "{url}: no Redfish session could be opened (HTTP {status}{}) and Basic auth {basic}; free sessions on the BMC (web UI or reset of the BMC) or enable Basic auth",
        said(message)
    )]
    NoSession {
        url: String,
        status: u16,
        message: Option<String>,
        basic: String,
    },

    #[error("{url}: the BMC answered with an undecodable {what}")]
    Decode {
        url: String,
        what: &'static str,
        #[source]
        source: super::decode::DecodeError,
    },

    /// A 2xx answer whose body is a Redfish error (`{"error": …}`), not the resource.
    #[error("{url}: the BMC answered with an error instead of the resource: {message}")]
    ErrorBody { url: String, message: String },

    #[error(
        "{url}: the BMC has {} systems ({}); name one with --system <Id or @odata.id>",
        ids.len(),
        ids.join(", ")
    )]
    SeveralSystems { url: String, ids: Vec<String> },

    #[error(
        "{url}: the systems could not all be listed ({why}); refusing to pick a system from an incomplete list: name one with --system <Id or @odata.id>"
    )]
    SystemsIncomplete { url: String, why: String },

    #[error(
        "{url}: the BMC lists no system with Id or @odata.id {wanted:?} (it has: {})",
        have.join(", ")
    )]
    NoSuchSystem {
        url: String,
        wanted: String,
        have: Vec<String>,
    },

    #[error(
        "{system}: the system exposes no {what}, so the BMC cannot take a one-time boot override there; nothing was sent"
    )]
    NoBootOverride { system: String, what: &'static str },

    #[error(
        "{system}: the system advertises no #ComputerSystem.Reset action; the power action {action} was not sent"
    )]
    NoResetAction { system: String, action: String },

    #[error("interrupted: the operation was stopped before it finished ({state})")]
    Interrupted { state: String },

    #[error("{url}: not found on the BMC (HTTP 404 for {what})")]
    NotFound { url: String, what: String },

    #[error(
        "{system}: the BMC offers no reset type for {action} (wanted one of {wanted:?}, it allows {allowed:?})"
    )]
    ResetNotAllowed {
        system: String,
        action: String,
        wanted: Vec<String>,
        allowed: Vec<String>,
    },

    #[error("{system}: the BMC does not offer boot target {target} (it allows {allowed:?})")]
    BootTargetNotAllowed {
        system: String,
        target: String,
        allowed: Vec<String>,
    },

    #[error(
        "{system}: the BMC accepted Reset {reset_type} but PowerState reads {observed} after {waited:?} (wanted {wanted}): the power action was not applied"
    )]
    PowerNotApplied {
        system: String,
        reset_type: String,
        wanted: String,
        observed: String,
        waited: Duration,
    },

    #[error(
        "{system}: the BMC accepted the one-time boot override to {target} but reads back {observed} after {waited:?}: the override was not applied, the machine would not netboot"
    )]
    BootOverrideNotApplied {
        system: String,
        target: String,
        observed: Box<ObservedBoot>,
        waited: Duration,
    },

    #[error(
        "{system}: the BMC accepted boot from the disk (Hdd, Continuous) but reads back {observed} after {waited:?}: the machine may netboot again at its next reset; set the boot device on the BMC by hand"
    )]
    DiskBootNotRestored {
        system: String,
        observed: Box<ObservedBoot>,
        waited: Duration,
    },

    #[error(
        "{url}: the BMC rejected If-Match {etag} again after a fresh read: the resource is being changed by someone else; retry later"
    )]
    EtagConflict { url: String, etag: String },
}

impl RedfishError {
    /// The HTTP status the BMC answered, where there was one.
    pub fn status(&self) -> Option<u16> {
        match self {
            RedfishError::Status { status, .. }
            | RedfishError::Busy { status, .. }
            | RedfishError::AuthRejected { status, .. }
            | RedfishError::NoSession { status, .. } => Some(*status),
            RedfishError::NotFound { .. } => Some(404),
            _ => None,
        }
    }
}
