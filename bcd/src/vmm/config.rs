//! The `[vmm]` table of bcd.toml: whether this node runs VPS instances, and how (QEMU binaries, accelerator, disk
//! bus, the pool's networking, state paths). Read on its own like `[telemetry]`, so a bcd built without the VMM
//! still reads a bcd.toml that has one. A node without the table runs no instances and refuses a desired state that
//! lists some.
//!
//! ```toml
//! [vmm]
//! state_dir = "/var/lib/bcd/vmm"      # default: <bcd state_dir>/vmm
//! accel = "auto"                      # auto (KVM if a probe boot works, else TCG) | kvm | tcg
//! disk_bus = "nvme"                   # nvme | virtio
//! stop_timeout_s = 60                 # graceful stop (ACPI) before QEMU is told to quit
//! [vmm.network]
//! mode = "bridge"                     # bridge (a tap per VM on `bridge`) | user (QEMU's user-mode NAT: the lab)
//! bridge = "br-vps"
//! ```

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The table of bcd.toml that configures the VMM.
pub const TABLE: &str = "vmm";

/// How many bytes of a Unix socket path the kernel takes (sun_path without its NUL).
const SUN_PATH_MAX: usize = 107;

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmmWire {
    pub state_dir: Option<PathBuf>,
    pub qemu: Option<PathBuf>,
    pub qemu_img: Option<PathBuf>,
    pub accel: Option<String>,
    pub disk_bus: Option<String>,
    pub stop_timeout_s: Option<u64>,
    pub console_max_bytes: Option<u64>,
    /// PEM file of the CAs image URLs are verified against (default: the system's roots).
    pub image_ca_file: Option<PathBuf>,
    /// Where sysfs is (default `/sys`): GPU passthrough reads and writes PCI devices there.
    pub sysfs_root: Option<PathBuf>,
    #[serde(default)]
    pub network: NetworkWire,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkWire {
    pub mode: Option<String>,
    pub bridge: Option<String>,
}

/// Which accelerator to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccelChoice {
    /// KVM when the probe boot succeeds, else TCG.
    Auto,
    Kvm,
    Tcg,
}

/// How the instance's disk and seed are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskBus {
    /// NVMe controllers: every current cloud image boots from one (EC2's Nitro instances do), and kernels that have
    /// it built in need no initramfs to find their root.
    Nvme,
    /// virtio-blk.
    Virtio,
}

/// The pool's networking for instances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Network {
    /// QEMU's user-mode NAT (slirp): outbound only, no host setup; for labs and tests.
    User,
    /// A tap per VM (`bc<hash>`) enslaved to this bridge, which the node's network setup provides.
    Bridge(String),
}

/// The validated `[vmm]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmConfig {
    pub state_dir: PathBuf,
    pub qemu: PathBuf,
    pub qemu_img: PathBuf,
    pub accel: AccelChoice,
    pub disk_bus: DiskBus,
    pub stop_timeout: Duration,
    pub console_max_bytes: u64,
    pub image_ca_file: Option<PathBuf>,
    pub sysfs_root: PathBuf,
    pub network: Network,
}

#[derive(Debug, thiserror::Error)]
pub enum VmmConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: [vmm]: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{origin}: [vmm] {field}: {message}")]
    Field {
        origin: String,
        field: &'static str,
        message: String,
    },
}

/// The `[vmm]` table of `path`, when the file has one (a missing file has none).
pub fn from_file(path: &Path) -> Result<Option<VmmWire>, VmmConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(VmmConfigError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let parse = |message: String| VmmConfigError::Parse {
        path: path.to_path_buf(),
        message,
    };
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| parse(e.to_string()))?;
    match table.remove(TABLE) {
        None => Ok(None),
        Some(t) => t
            .try_into()
            .map(Some)
            .map_err(|e: toml::de::Error| parse(e.to_string())),
    }
}

impl VmmWire {
    /// Validates the table; `bcd_state_dir` is the daemon's state directory (the default parent).
    pub fn validate(self, origin: &str, bcd_state_dir: &Path) -> Result<VmmConfig, VmmConfigError> {
        let field = |field: &'static str, message: String| VmmConfigError::Field {
            origin: origin.to_string(),
            field,
            message,
        };
        let state_dir = self.state_dir.unwrap_or_else(|| bcd_state_dir.join("vmm"));
        if !state_dir.is_absolute() {
            return Err(field("state_dir", "must be an absolute path".into()));
        }
        // <state_dir>/qmp/<16 hex>.sock must fit a Unix socket address.
        let longest = state_dir.as_os_str().len() + "/qmp/".len() + 16 + ".sock".len();
        if longest > SUN_PATH_MAX {
            return Err(field(
                "state_dir",
                format!(
                    "{} is too long: QMP socket paths under it would exceed the {SUN_PATH_MAX} bytes of a Unix \
                     socket address; use a path of at most {} bytes",
                    state_dir.display(),
                    SUN_PATH_MAX - (longest - state_dir.as_os_str().len())
                ),
            ));
        }
        let accel = match self.accel.as_deref().unwrap_or("auto") {
            "auto" => AccelChoice::Auto,
            "kvm" => AccelChoice::Kvm,
            "tcg" => AccelChoice::Tcg,
            other => {
                return Err(field(
                    "accel",
                    format!("{other:?}: must be auto, kvm or tcg"),
                ));
            }
        };
        let disk_bus = match self.disk_bus.as_deref().unwrap_or("nvme") {
            "nvme" => DiskBus::Nvme,
            "virtio" => DiskBus::Virtio,
            other => {
                return Err(field(
                    "disk_bus",
                    format!("{other:?}: must be nvme or virtio"),
                ));
            }
        };
        let stop_timeout = Duration::from_secs(self.stop_timeout_s.unwrap_or(60));
        if stop_timeout.is_zero() || stop_timeout > Duration::from_secs(3600) {
            return Err(field("stop_timeout_s", "must be 1..=3600 seconds".into()));
        }
        let console_max_bytes = self.console_max_bytes.unwrap_or(1 << 20);
        if !(4096..=1 << 30).contains(&console_max_bytes) {
            return Err(field(
                "console_max_bytes",
                "must be 4096..=1073741824".into(),
            ));
        }
        let network = match (self.network.mode.as_deref(), self.network.bridge) {
            (Some("user"), None) => Network::User,
            (Some("user"), Some(_)) => {
                return Err(field(
                    "network.bridge",
                    "is only for mode = \"bridge\"".into(),
                ));
            }
            (Some("bridge"), Some(b)) => {
                let ok = !b.is_empty()
                    && b.len() <= 15
                    && b.bytes()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
                if !ok {
                    return Err(field(
                        "network.bridge",
                        format!("{b:?} is not an interface name (1–15 of A-Z a-z 0-9 - _ .)"),
                    ));
                }
                Network::Bridge(b)
            }
            (Some("bridge"), None) => {
                return Err(field(
                    "network.bridge",
                    "is required with mode = \"bridge\" (the bridge the node's taps join)".into(),
                ));
            }
            (None, _) => {
                return Err(field(
                    "network.mode",
                    "is required: \"bridge\" (with bridge = \"<name>\") or \"user\" (QEMU's NAT, for labs)"
                        .into(),
                ));
            }
            (Some(other), _) => {
                return Err(field(
                    "network.mode",
                    format!("{other:?}: must be bridge or user"),
                ));
            }
        };
        Ok(VmmConfig {
            state_dir,
            qemu: self
                .qemu
                .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64")),
            qemu_img: self.qemu_img.unwrap_or_else(|| PathBuf::from("qemu-img")),
            accel,
            disk_bus,
            stop_timeout,
            console_max_bytes,
            image_ca_file: self.image_ca_file,
            sysfs_root: self.sysfs_root.unwrap_or_else(|| PathBuf::from("/sys")),
            network,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_parses() -> Result<(), Box<dyn std::error::Error>> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples/bcd-vmm.toml");
        let c = from_file(&path)?
            .ok_or("the example has a [vmm] table")?
            .validate(&path.display().to_string(), Path::new("/var/lib/bcd"))?;
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/bcd/vmm"));
        assert_eq!(c.network, Network::Bridge("br-vps".into()));
        assert_eq!(c.disk_bus, DiskBus::Nvme);
        // The rest of the file is bcd's own configuration, which ignores [vmm].
        crate::config::ConfigWire::from_file(&path)?.validate("example")?;
        assert_eq!(from_file(&path.with_file_name("bcd.toml"))?, None);
        Ok(())
    }

    #[test]
    fn bad_values_name_their_field() {
        let user = NetworkWire {
            mode: Some("user".into()),
            bridge: None,
        };
        let cases = [
            (
                VmmWire {
                    accel: Some("hvf".into()),
                    network: user.clone(),
                    ..Default::default()
                },
                "accel",
            ),
            (VmmWire::default(), "network.mode"),
            (
                VmmWire {
                    network: NetworkWire {
                        mode: Some("bridge".into()),
                        bridge: None,
                    },
                    ..Default::default()
                },
                "network.bridge",
            ),
            (
                VmmWire {
                    state_dir: Some(PathBuf::from(format!("/{}", "x".repeat(90)))),
                    network: user.clone(),
                    ..Default::default()
                },
                "state_dir",
            ),
            (
                VmmWire {
                    stop_timeout_s: Some(0),
                    network: user.clone(),
                    ..Default::default()
                },
                "stop_timeout_s",
            ),
        ];
        for (wire, want) in cases {
            let e = wire
                .validate("f.toml", Path::new("/var/lib/bcd"))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(&format!("[vmm] {want}:")), "{want}: {e}");
        }
    }
}
