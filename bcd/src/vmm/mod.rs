//! VPS instances on this node: the node side of `instances.*`. The control plane lists the instances it wants in
//! the node's desired state ([`spec`]); bcd runs each as a QEMU process it supervises but does not own: QEMU is
//! daemonized with a pidfile and a QMP socket under the VMM's state directory, so VMs outlive a bcd restart and a
//! restarted bcd re-adopts them through their sockets.
//!
//! Pieces, each small and behind its own seam:
//! - [`spec`]: the strict parse of the desired `instances` list (pure; fuzzed).
//! - [`plan`]: what to do next for one instance given what is wanted and what is observed (pure).
//! - [`Vmm`]: the VMM trait (create, start, stop with a deadline then force, reboot, delete, status, console); the
//!   product implementation is [`qemu::Qemu`] (QMP through the `qapi` crate; KVM when a probe boot proves it
//!   usable, else TCG). Feature `vmm`.
//! - [`image`]: the image artifact fetched over HTTP(S) and kept only if its SHA-256 matches (the site agent's
//!   verified writer), and the qcow2 overlay on it. Feature `vmm`.
//! - [`seed`]: the cloud-init NoCloud `cidata` volume (golden-file tested).
//! - [`vfio`]: GPU passthrough (whole IOMMU groups to vfio-pci and back) behind the narrow `PciSysfs` trait.
//! - [`supervisor`]: the executor: applies plans, keeps the status table, writes `status.json`, answers the
//!   session ([`InstanceHost`]). Feature `vmm`.
//!
//! Status is reported as the inventory section `instances` (sent when the gateway asks for it by name, then
//! pushed whenever it changes) and in `<state_dir>/status.json`; the console log is a bounded file per instance,
//! read with the `instance.console` command. See docs/instances.md. Start with [`plan::decide`].

pub mod config;
pub mod console;
pub mod plan;
pub mod seed;
pub mod spec;
pub mod vfio;

#[cfg(feature = "vmm")]
pub mod accel;
#[cfg(feature = "vmm")]
pub mod host;
#[cfg(feature = "vmm")]
pub mod image;
#[cfg(feature = "vmm")]
pub mod qemu;
#[cfg(feature = "vmm")]
pub mod supervisor;

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use spec::{InstanceSpec, Power};

/// True for 64 lowercase hex characters.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The name of the inventory section that carries instance status.
pub const SECTION: &str = "instances";
/// The command kind that returns the tail of an instance's console log.
pub const CONSOLE_COMMAND: &str = "instance.console";

/// What the node reports for an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceState {
    /// Being prepared (image fetch, disk, seed) or launched.
    Starting,
    Running,
    /// A graceful stop is under way (ACPI power button, then forced at the deadline).
    Stopping,
    Stopped,
    /// The last step failed; `reason` says why. Retried with backoff, at once when a new generation comes.
    Failed,
    /// Being deleted (VM killed, disk and seed removed).
    Deleting,
}

/// One instance's status as reported (inventory section `instances`, `status.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceStatus {
    pub id: String,
    /// The generation of the instance's desired state this status is about.
    pub generation: u64,
    pub state: InstanceState,
    /// Why the instance failed, or a condition worth knowing while it runs (e.g. a change that cannot apply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// QEMU's process id while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// `kvm` or `tcg` while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<Accel>,
    /// cloud-init reported done on the console in the current boot.
    #[serde(default)]
    pub cloud_init_done: bool,
    /// PCI addresses passed through (the booked GPUs' IOMMU groups).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passthrough: Vec<String>,
}

/// The accelerator a VM runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    /// The CPU model a VM under this accelerator gets (QEMU's `-cpu`), None for QEMU's default. The KVM probe boots
    /// with the same model: on a nested host where KVM runs a plain guest, `-cpu host` may still fail to start.
    pub fn cpu(self) -> Option<&'static str> {
        match self {
            Accel::Kvm => Some("host"),
            Accel::Tcg => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// What a VMM observes of one instance's VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmStatus {
    /// No process (the instance may still have a disk).
    Stopped,
    /// QEMU runs; `run_state` is QMP's (`running`, `paused`, `shutdown`, …); `None` when QMP did not answer.
    Running { pid: u32, run_state: Option<String> },
}

/// How a stop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopOutcome {
    /// The guest powered off within the deadline.
    Graceful,
    /// The deadline passed: QEMU was told to quit (or killed).
    Forced,
    /// It was not running.
    NotRunning,
}

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("instance {id}: {what} {path}")]
    Io {
        id: String,
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("instance {id}: starting QEMU failed: {message}")]
    Launch { id: String, message: String },
    #[error("instance {id}: QMP {what}: {message}")]
    Qmp {
        id: String,
        what: &'static str,
        message: String,
    },
    #[error("instance {id}: {message}")]
    Disk { id: String, message: String },
    #[error("instance {id}: seed")]
    Seed {
        id: String,
        #[source]
        source: seed::SeedError,
    },
    #[error("instance {id}: GPU passthrough")]
    Vfio {
        id: String,
        #[source]
        source: vfio::VfioError,
    },
    #[error("instance {id}: {message}")]
    Held { id: String, message: String },
    #[error("instance {id}: network: {message}")]
    Network { id: String, message: String },
}

/// The VMM: one implementation per hypervisor (QEMU is the product's). Every method is idempotent and bounded in
/// time; the supervisor never calls two methods for the same instance at once.
pub trait Vmm: Send + Sync + 'static {
    /// The accelerator its VMs run with.
    fn accel(&self) -> Accel;
    /// Makes the instance's disk (a qcow2 overlay of `disk_gib` on the verified `image`) and its NoCloud seed. An
    /// instance already created is left as it is.
    fn create(
        &self,
        spec: &InstanceSpec,
        image: &Path,
    ) -> impl Future<Output = Result<(), VmmError>> + Send;
    /// Launches the VM (vCPUs, memory and `passthrough` devices from this call, so they may change between
    /// starts). Returns QEMU's PID once QMP answers.
    fn start(
        &self,
        spec: &InstanceSpec,
        passthrough: &[String],
    ) -> impl Future<Output = Result<u32, VmmError>> + Send;
    /// ACPI power button, then at `deadline` QMP `quit`, then SIGKILL.
    fn stop(
        &self,
        id: &str,
        deadline: std::time::Duration,
    ) -> impl Future<Output = Result<StopOutcome, VmmError>> + Send;
    /// Resets the running VM (QMP `system_reset`).
    fn reboot(&self, id: &str) -> impl Future<Output = Result<(), VmmError>> + Send;
    /// Kills the VM if it runs and removes everything of the instance (disk, seed, console, sockets).
    fn delete(&self, id: &str) -> impl Future<Output = Result<(), VmmError>> + Send;
    /// What runs now (pidfile checked against the process's command line, then QMP `query-status`).
    fn status(&self, id: &str) -> impl Future<Output = Result<VmStatus, VmmError>> + Send;
    /// The last `max_bytes` of the console log.
    fn console(&self, id: &str, max_bytes: usize) -> Result<Vec<u8>, VmmError>;
}

/// What the session needs of the instances part: hand it the desired list, read status for the inventory. The
/// supervisor implements it (feature `vmm`); a bcd without it has none and refuses a desired state with instances.
pub trait InstanceHost: Send + Sync {
    /// Replaces the desired instances (those of desired-state generation `generation`). Fails only for what is
    /// wrong with the request on this node (a GPU it does not have); VM work happens afterwards, reported in the
    /// status.
    fn apply(
        &self,
        generation: u64,
        instances: Vec<InstanceSpec>,
        gpus: &[LocalGpu],
    ) -> Result<(), String>;
    /// The status of every instance, as the inventory section's JSON.
    fn section(&self) -> serde_json::Value;
    /// Changes whenever the status does.
    fn subscribe(&self) -> tokio::sync::watch::Receiver<u64>;
}

/// A GPU of this node as the GPU backend reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalGpu {
    pub uuid: String,
    pub pci_bus_id: String,
}

/// The directory of one instance under the VMM's state directory.
pub fn instance_dir(state_dir: &Path, id: &str) -> PathBuf {
    state_dir.join("instances").join(id)
}

/// The QMP socket of an instance: `<state_dir>/qmp/<16 hex of sha256(id)>.sock`, short enough for a Unix socket
/// path whatever the id's length (108 bytes at most, checked when the configuration is validated).
pub fn qmp_socket(state_dir: &Path, id: &str) -> PathBuf {
    let h = hex::encode(bc_proto::sha256(id.as_bytes()));
    state_dir.join("qmp").join(format!("{}.sock", &h[..16]))
}

/// The tap device of an instance on a bridge: `bc` + 12 hex of sha256(id) (an interface name has at most 15).
pub fn tap_name(id: &str) -> String {
    let h = hex::encode(bc_proto::sha256(id.as_bytes()));
    format!("bc{}", &h[..12])
}

/// A stable locally administered MAC for the instance's NIC (52:54:00 is QEMU's prefix).
pub fn mac_address(id: &str) -> String {
    let h = bc_proto::sha256(id.as_bytes());
    format!("52:54:00:{:02x}:{:02x}:{:02x}", h[0], h[1], h[2])
}
