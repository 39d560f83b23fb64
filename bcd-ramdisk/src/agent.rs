//! Agent mode (`bc.mode=agent`): join the control plane as the machine's node with the one-use boot token, then keep
//! a session and answer commands — with bcd's own join and session code (NVML and site features off), not a copy.
//!
//! The ramdisk adds only what is its own: the configuration from the kernel command line ([`config_from_params`]),
//! hardware claims read from its own `/sys` and `/proc`, and the command kinds the node daemon does not have,
//! plugged into bcd's session as a [`CommandHook`] ([`RamdiskCommands`]): `ramdisk.diagnose`, `ramdisk.wipe`,
//! `ramdisk.stream` and `ramdisk.kexec` (arguments and safety rules in [`crate::commands`]). The session runs each
//! command as its own task and signs every result with the node key, so the control plane verifies it against the
//! key it recorded at join; progress (a stream's bytes, rate and ETA) goes to the session too.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bc_proto::v1;
use bcd::config::{Config, ConfigWire};
use bcd::session::{CommandHook, CommandOutput, Daemon, ProgressReporter};
use serde::Serialize;

use crate::cmdline::RamdiskParams;
use crate::diagnose::{self, NvmeAdmin};

pub use crate::commands::{DIAGNOSE_KIND, KEXEC_KIND, STREAM_KIND, WIPE_KIND};
/// The payload type of its signed result (a JSON [`diagnose::DiagnoseReport`]).
pub const DIAGNOSE_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.ramdisk-diagnose+json";
/// Where the node key, certificate and identity live: tmpfs, gone at power-off (a ramdisk boot is one join).
pub const STATE_DIR: &str = "/run/bcd";
/// Join attempts while the gateway is unreachable (backoff 0.25 s doubling to a 10 s cap: about 5 minutes).
pub const JOIN_ATTEMPTS: u32 = 32;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent mode needs {what} on the kernel command line")]
    Missing { what: &'static str },
    #[error("agent configuration from the kernel command line")]
    Config(#[source] bcd::config::ConfigError),
    #[error("joining the control plane as this machine's node")]
    Join(#[source] bcd::join::JoinError),
    #[error("the session with the control plane ended for good")]
    Session(#[source] bcd::session::RunError),
}

/// bcd's configuration from the kernel command line: gateway URL, CA pin and JoinService key; no GPU backend;
/// hardware read under `/`; state in `state_dir`.
pub fn config_from_params(params: &RamdiskParams, state_dir: &Path) -> Result<Config, AgentError> {
    let url = params
        .control_url
        .as_ref()
        .ok_or(AgentError::Missing { what: "bc.url" })?;
    let pin = params
        .ca_pin
        .ok_or(AgentError::Missing { what: "bc.ca_pin" })?;
    let key = params.join_key.as_ref().ok_or(AgentError::Missing {
        what: "bc.join_key",
    })?;
    ConfigWire {
        gateway_url: Some(url.as_str().trim_end_matches('/').to_string()),
        ca_pin: Some(format!("sha256:{}", hex::encode(pin.0))),
        join_public_key: Some(key.0.clone()),
        state_dir: Some(state_dir.to_path_buf()),
        gpu_backend: Some("none".into()),
        hardware_root: Some(PathBuf::from("/")),
        cdi_dir: Some(state_dir.join("cdi")),
        tunnels: None,
    }
    .validate("kernel command line")
    .map_err(AgentError::Config)
}

// === impl RamdiskCommands ===

/// Sees (kind, command id, outcome) after each command, e.g. to print a console line.
pub type OnCommandDone = Box<dyn Fn(&str, &str, &Result<CommandOutput, String>) + Send + Sync>;

/// The ramdisk's command kinds for bcd's session.
pub struct RamdiskCommands {
    root: PathBuf,
    nvme: Arc<dyn NvmeAdmin + Send + Sync>,
    on_done: OnCommandDone,
    stream_progress_interval: Duration,
    /// The node's state directory, whose trust bundle (from join) https image servers must chain to.
    state_dir: Option<PathBuf>,
    /// Staged kexecs waiting for their answer to leave, by command id.
    handovers: std::sync::Mutex<std::collections::HashMap<String, std::sync::mpsc::Sender<()>>>,
    /// The control plane this ramdisk joined: the installed system joins it too (its seed's bcd.toml).
    control: Option<crate::seed::ControlPlane>,
    /// Wipe, stream and kexec take turns on the disks ([`crate::disk_gate`]).
    disks: crate::disk_gate::DiskGate,
}

impl RamdiskCommands {
    /// Commands over the machine under `root` (`/`) with NVMe admin commands through `nvme`.
    pub fn new(
        root: PathBuf,
        nvme: Arc<dyn NvmeAdmin + Send + Sync>,
        on_done: OnCommandDone,
    ) -> Self {
        Self {
            root,
            nvme,
            on_done,
            stream_progress_interval: Duration::from_secs(1),
            state_dir: None,
            handovers: std::sync::Mutex::default(),
            control: None,
            disks: crate::disk_gate::DiskGate::default(),
        }
    }

    /// The control plane the installed system joins after a kexec (this ramdisk's own).
    pub fn with_control_plane(mut self, config: &Config) -> Self {
        self.control = Some(crate::seed::ControlPlane {
            gateway_url: config.gateway_url.clone(),
            ca_pin: config.ca_pin.clone(),
            join_public_key: config.join_public_key.encode(),
        });
        self
    }

    /// Trust the CAs of the join's trust bundle in `state_dir` for https image URLs.
    pub fn with_state_dir(mut self, state_dir: PathBuf) -> Self {
        self.state_dir = Some(state_dir);
        self
    }

    /// How often a stream reports progress (1 s; the session still sends at most its own rate per command).
    pub fn with_stream_progress_interval(mut self, every: Duration) -> Self {
        self.stream_progress_interval = every;
        self
    }

    fn execute(
        &self,
        command: &v1::Command,
        progress: &ProgressReporter,
    ) -> Result<CommandOutput, String> {
        use crate::commands::{self, RamdiskCommand};
        let json = |payload_type: &str, v: &dyn erased::Json| {
            v.to_vec()
                .map(|payload| CommandOutput {
                    payload_type: payload_type.into(),
                    payload,
                })
                .map_err(|e| format!("encoding the result: {e}"))
        };
        let parsed = commands::parse(&command.kind, &command.args)?;
        // The control plane gives up on the command at its deadline: nothing is started after it.
        let deadline = bcd::commands::deadline_of(command);
        let _disks = match parsed {
            RamdiskCommand::Diagnose => None,
            _ => Some(
                self.disks
                    .enter(&format!("{} {}", command.kind, command.id), deadline)?,
            ),
        };
        match parsed {
            // Arguments are not used (the report is always whole); anything sent is ignored, not parsed.
            RamdiskCommand::Diagnose => {
                let report = diagnose::collect(&self.root, self.nvme.as_ref());
                json(DIAGNOSE_PAYLOAD_TYPE, &report)
            }
            RamdiskCommand::Wipe(args) => {
                let r = commands::wipe(&self.root, &args, deadline, &|v| progress.report(v))?;
                json(commands::WIPE_PAYLOAD_TYPE, &r)
            }
            RamdiskCommand::Stream(args) => {
                let p = progress.clone();
                // The bundle is read per command: a renewal or rejoin may have replaced it.
                let trust = match &self.state_dir {
                    Some(dir) => bcd::state::StateDir::open(dir)
                        .and_then(|s| s.trust_bundle())
                        .map_err(|e| format!("the control plane's trust bundle: {e}"))?,
                    None => Vec::new(),
                };
                let view = commands::stream(
                    &args,
                    self.stream_progress_interval,
                    trust,
                    deadline,
                    Box::new(move |v| p.report(v)),
                )?;
                json(commands::STREAM_PAYLOAD_TYPE, &view)
            }
            RamdiskCommand::Kexec(args) => {
                let r = commands::kexec(&args, self.control.clone())?;
                let out = json(commands::KEXEC_PAYLOAD_TYPE, &r)?;
                // Staged: jump once the session has sent this answer (see `delivered`).
                let (tx, rx) = std::sync::mpsc::channel();
                if let Ok(mut h) = self.handovers.lock() {
                    h.insert(command.id.clone(), tx);
                }
                commands::hand_over_once_delivered(rx);
                Ok(out)
            }
        }
    }
}

/// Serialize any of the results without naming each type.
mod erased {
    pub trait Json {
        fn to_vec(&self) -> serde_json::Result<Vec<u8>>;
    }
    impl<T: serde::Serialize> Json for T {
        fn to_vec(&self) -> serde_json::Result<Vec<u8>> {
            serde_json::to_vec(self)
        }
    }
}

impl CommandHook for RamdiskCommands {
    fn handles(&self, kind: &str) -> bool {
        crate::commands::KINDS.contains(&kind)
    }

    fn run(
        &self,
        command: &v1::Command,
        progress: &ProgressReporter,
    ) -> Result<CommandOutput, String> {
        let out = self.execute(command, progress);
        (self.on_done)(&command.kind, &command.id, &out);
        out
    }

    fn delivered(&self, id: &str) {
        if let Some(tx) = self.handovers.lock().ok().and_then(|mut h| h.remove(id)) {
            let _ = tx.send(());
        }
    }
}

/// What the join did, as reported on the console.
#[derive(Clone, Debug, Serialize)]
pub struct JoinView {
    pub node_id: String,
    pub spiffe_id: String,
    pub pool: String,
    pub replayed: bool,
    pub reclaimed: bool,
    pub elapsed_ms: u64,
}

/// Joins as this machine's node with `token` (claims from `config.hardware_root`, no GPU backend), then keeps
/// the session until `shutdown` resolves or the control plane refuses the node. `joined` sees the join's outcome
/// before the first session.
pub async fn run(
    config: Config,
    token: &str,
    hook: Arc<dyn CommandHook>,
    joined: impl FnOnce(&JoinView),
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    let started = Instant::now();
    let claims = bcd::hardware::collect(&config.hardware_root, None, None);
    let outcome = bcd::join::join(
        &config,
        token,
        bcd::join::JoinOptions {
            attempts: JOIN_ATTEMPTS,
            claims,
        },
    )
    .await
    .map_err(AgentError::Join)?;
    joined(&JoinView {
        node_id: outcome.identity.node_id.clone(),
        spiffe_id: outcome.identity.spiffe_id.clone(),
        pool: outcome.identity.pool.clone(),
        replayed: outcome.replayed,
        reclaimed: outcome.reclaimed,
        elapsed_ms: started.elapsed().as_millis() as u64,
    });
    let mut daemon = Daemon::new(config, None);
    daemon.hook = Some(hook);
    daemon.run(shutdown).await.map_err(AgentError::Session)
}

/// PID 1's agent mode after the network is up: join and keep the session on a small runtime. Returns only with
/// an error (the caller prints it and powers off).
pub fn run_pid1(params: &RamdiskParams) -> Result<(), String> {
    let token = params
        .boot_token
        .as_ref()
        .filter(|t| t.is_join_token())
        .ok_or("agent mode needs bc.boot_token=bcjt_… (a one-use join token)")?;
    let config =
        config_from_params(params, Path::new(STATE_DIR)).map_err(|e| bc_error_chain::chain(&e))?;
    bc_proto::install_crypto_provider();
    let rt = bc_proto::runtime::build(Some(2)).map_err(|e| format!("starting the runtime: {e}"))?;
    let hook = Arc::new(
        RamdiskCommands::new(
            PathBuf::from("/"),
            Arc::new(diagnose::RealNvme),
            Box::new(|kind, id, out| {
                #[derive(Serialize)]
                struct Done<'a> {
                    kind: &'a str,
                    id: &'a str,
                    ok: bool,
                    error: Option<&'a str>,
                }
                crate::init::report(
                    "command",
                    &Done {
                        kind,
                        id,
                        ok: out.is_ok(),
                        error: out.as_ref().err().map(String::as_str),
                    },
                );
            }),
        )
        .with_state_dir(config.state_dir.clone())
        .with_control_plane(&config),
    );
    let result = rt.block_on(run(
        config,
        &token.0,
        hook,
        |j| crate::init::report("join", j),
        std::future::pending(),
    ));
    // Give in-flight tasks a moment; PID 1 goes on to print the error and power off.
    rt.shutdown_timeout(Duration::from_secs(1));
    result.map_err(|e| bc_error_chain::chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_becomes_bcds_configuration() {
        let key = bc_proto::seal::generate_join_keypair().1.encode();
        let pin = "ab".repeat(32);
        let token = "bcjt_0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
        let params = crate::cmdline::parse(&format!(
            "bc.url=https://10.99.0.1:8443/ bc.ca_pin={pin} bc.join_key={key} bc.boot_token={token}"
        ))
        .expect("agent parameters");
        let c = config_from_params(&params, Path::new("/run/bcd")).expect("config");
        assert_eq!(c.gateway_url, "https://10.99.0.1:8443");
        assert_eq!(
            c.ca_pin,
            format!("sha256:{pin}"),
            "bare hex becomes bcd's pin form"
        );
        assert_eq!(c.join_public_key.encode(), key);
        assert_eq!(c.gpu_backend, bcd::config::GpuBackendChoice::None);
        assert_eq!(c.state_dir, Path::new("/run/bcd"));
        let diagnose_only = crate::cmdline::parse("bc.mode=diagnose").expect("diagnose");
        let err = config_from_params(&diagnose_only, Path::new("/run/bcd"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("bc.url"), "{err}");
    }

    #[test]
    fn the_hook_answers_the_ramdisk_kinds_and_parses_arguments_strictly() {
        struct NoNvme;
        impl NvmeAdmin for NoNvme {
            fn identify(&self, _: &str) -> std::io::Result<diagnose::NvmeIdentity> {
                Err(std::io::Error::other("no NVMe here"))
            }
            fn smart(&self, _: &str) -> std::io::Result<diagnose::SmartHealth> {
                Err(std::io::Error::other("no NVMe here"))
            }
        }
        let root = tempfile::tempdir().expect("tempdir");
        let hook = RamdiskCommands::new(
            root.path().to_path_buf(),
            Arc::new(NoNvme),
            Box::new(|_, _, _| {}),
        );
        assert!(hook.handles(DIAGNOSE_KIND));
        for kind in [WIPE_KIND, STREAM_KIND, KEXEC_KIND] {
            assert!(hook.handles(kind), "{kind}");
        }
        assert!(!hook.handles("diag.nvml"), "bcd answers its own kinds");
        let command = |kind: &str| v1::Command {
            id: "c1".into(),
            kind: kind.into(),
            args: b"not json at all".to_vec(),
            deadline_unix_ms: 0,
        };
        let none = ProgressReporter::discard();
        let out = hook.run(&command(DIAGNOSE_KIND), &none).expect("report");
        assert_eq!(out.payload_type, DIAGNOSE_PAYLOAD_TYPE);
        let report: serde_json::Value = serde_json::from_slice(&out.payload).expect("JSON");
        assert!(
            report["problems"].as_array().is_some_and(|p| !p.is_empty()),
            "an empty root is reported as problems, not a failure: {report}"
        );
        assert!(hook.run(&command("ramdisk.other"), &none).is_err());
        let e = hook.run(&command(WIPE_KIND), &none).expect_err("not JSON");
        assert!(e.starts_with("ramdisk.wipe arguments"), "{e}");
    }
}
