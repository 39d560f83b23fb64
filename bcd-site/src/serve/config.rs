//! `site.toml`: the wire struct serde reads, and the validated [`SiteConfig`] it converts into. Every error names
//! the file and the field (`site.toml: machine[2].cmdline: ...`), so an operator knows what to fix.
//!
//! Directories are checked when the services start ([`super::run`]), not here: a config can be validated on a
//! machine that does not hold the files yet (and the shipped example is parsed by a test).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::Netboot;
use crate::dhcp::{BootFiles, MacAddr, OfferStyle};
use crate::http::{DesiredBoot, render_script};
use crate::tftp::Limits;

/// The file as written. Unknown fields are errors (a misspelt key must not be silently ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteConfigWire {
    pub boot: Option<BootWire>,
    #[serde(default)]
    pub tftp: TftpWire,
    #[serde(default)]
    pub dhcp: DhcpWire,
    #[serde(default)]
    pub cache: CacheWire,
    /// `[[machine]]`: the local netboot table (MAC → desired boot).
    #[serde(default)]
    pub machine: Vec<MachineWire>,
    /// `[telemetry]`: read by `bcd site serve` (bcd's telemetry table: exporters and `metrics_listen`); not
    /// validated here.
    pub telemetry: Option<toml::Table>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootWire {
    /// The boot-segment interface: DHCP sockets bind to it (SO_BINDTODEVICE).
    pub interface: Option<String>,
    /// This host's address on the boot segment: siaddr, option 54, TFTP and HTTP listen address, URL host.
    pub server_ip: Option<String>,
    /// Directory served read-only over TFTP (and under `/ipxe/` over HTTP): the iPXE loaders.
    pub tftp_root: Option<PathBuf>,
    /// Directory served under `/artifacts/`: kernels, initrds, images.
    pub artifacts: Option<PathBuf>,
    pub http_port: Option<u16>,
    pub tftp_port: Option<u16>,
    pub dhcp_port: Option<u16>,
    pub pxe_port: Option<u16>,
    /// Listen on the client port (68) for other servers offering PXE boot (default true).
    pub watch_rogues: Option<bool>,
    /// Seconds between counter reports in the log (default 60; 0 disables all but the final one).
    pub report_interval_s: Option<u64>,
    #[serde(default)]
    pub loaders: LoadersWire,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadersWire {
    pub bios: Option<String>,
    pub x64_uefi: Option<String>,
    pub arm64_uefi: Option<String>,
    pub arm32_uefi: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DhcpWire {
    /// What port-67 OFFERs carry for PXE firmware: `"bootfile"` (default: the file, no port 4011) or
    /// `"boot-server"` (a boot-server menu: the firmware asks port 4011 for the file).
    pub offer: Option<String>,
}

/// `[cache]`: the artifact cache `bcd site run` fills from the control plane (`boot.artifacts/sha256/`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheWire {
    /// Bytes the cached artifacts may take (default 20 GiB); beyond it the least recently used artifacts the
    /// netboot table does not reference are deleted.
    pub max_bytes: Option<u64>,
}

/// Default of `[cache] max_bytes`.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 20 << 30;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TftpWire {
    pub max_transfers: Option<usize>,
    pub max_blksize: Option<u16>,
    pub max_windowsize: Option<u16>,
    pub timeout_s: Option<u64>,
    /// Longest retransmit timeout a client may ask for (default 5 s; longer asks are declined).
    pub max_client_timeout_s: Option<u64>,
    /// Longest one transfer may run (default 600 s).
    pub max_transfer_s: Option<u64>,
    /// Transfers one client address may run at once (default 8).
    pub max_per_client: Option<usize>,
    pub max_retries: Option<u32>,
    /// Microseconds each ACK is awaited awake before sleeping (default 100; 0 never spins).
    pub ack_spin_us: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineWire {
    pub mac: Option<String>,
    /// Path in the artifact directory, or an `http(s)://` URL.
    pub kernel: Option<String>,
    pub initrd: Option<String>,
    #[serde(default)]
    pub cmdline: String,
}

/// What `bcd site serve` runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteConfig {
    pub interface: String,
    pub server_ip: Ipv4Addr,
    pub tftp_root: PathBuf,
    pub artifacts: PathBuf,
    pub http_port: u16,
    pub tftp_port: u16,
    pub dhcp_port: u16,
    pub pxe_port: u16,
    pub watch_rogues: bool,
    /// `None`: only the final report at shutdown.
    pub report_interval: Option<Duration>,
    pub loaders: BootFiles,
    /// `[dhcp] offer`.
    pub offer: OfferStyle,
    pub tftp: Limits,
    /// `[cache] max_bytes`: size cap of the control-plane artifacts in `artifacts/sha256/`.
    pub cache_max_bytes: u64,
    /// The table from the file: the initial contents of the netboot channel.
    pub netboot: Netboot,
}

/// A config that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SiteConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {field}: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
}

impl SiteConfig {
    /// Reads, parses and validates `path`.
    pub fn from_file(path: &Path) -> Result<SiteConfig, SiteConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| SiteConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses and validates `text`; `path` is only used to name the origin in errors.
    pub fn from_toml(text: &str, path: &Path) -> Result<SiteConfig, SiteConfigError> {
        let wire: SiteConfigWire = toml::from_str(text).map_err(|e| SiteConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        wire.validate(path)
    }
}

impl SiteConfigWire {
    /// The `TryFrom` of the style guide, with the origin path carried for the error messages.
    pub fn validate(self, path: &Path) -> Result<SiteConfig, SiteConfigError> {
        let field = |field: &str, message: &str| SiteConfigError::Field {
            path: path.to_owned(),
            field: field.to_owned(),
            message: message.to_owned(),
        };
        let boot = self
            .boot
            .ok_or_else(|| field("boot", "the [boot] section is required"))?;
        let interface = boot
            .interface
            .filter(|i| !i.is_empty())
            .ok_or_else(|| field("boot.interface", "is required (the boot-segment NIC)"))?;
        if interface.len() > 15 || interface.contains(['/', ' ']) {
            return Err(field(
                "boot.interface",
                "is not a Linux interface name (at most 15 characters, no '/' or space)",
            ));
        }
        let server_ip: Ipv4Addr = boot
            .server_ip
            .as_deref()
            .ok_or_else(|| {
                field(
                    "boot.server_ip",
                    "is required (this host's IPv4 address on the boot segment)",
                )
            })?
            .parse()
            .map_err(|_| field("boot.server_ip", "is not an IPv4 address"))?;
        if server_ip.is_unspecified() || server_ip.is_broadcast() || server_ip.is_multicast() {
            return Err(field(
                "boot.server_ip",
                "must be a unicast address clients can reach",
            ));
        }
        let dir = |name: &str, v: Option<PathBuf>| {
            v.filter(|p| !p.as_os_str().is_empty())
                .ok_or_else(|| field(name, "is required (a directory)"))
        };
        let tftp_root = dir("boot.tftp_root", boot.tftp_root)?;
        let artifacts = dir("boot.artifacts", boot.artifacts)?;

        let defaults = BootFiles::default();
        let loader = |name: &str,
                      v: Option<String>,
                      default: Option<String>|
         -> Result<Option<String>, SiteConfigError> {
            let Some(v) = v.or(default) else {
                return Ok(None);
            };
            if v.is_empty()
                || v.starts_with('/')
                || v.split('/').any(|c| c == "..")
                || v.chars().any(char::is_control)
            {
                return Err(field(
                    name,
                    "must be a relative file name in boot.tftp_root",
                ));
            }
            Ok(Some(v))
        };
        let loaders = BootFiles {
            bios: loader("boot.loaders.bios", boot.loaders.bios, defaults.bios)?,
            x64_uefi: loader(
                "boot.loaders.x64_uefi",
                boot.loaders.x64_uefi,
                defaults.x64_uefi,
            )?,
            arm64_uefi: loader(
                "boot.loaders.arm64_uefi",
                boot.loaders.arm64_uefi,
                defaults.arm64_uefi,
            )?,
            arm32_uefi: loader(
                "boot.loaders.arm32_uefi",
                boot.loaders.arm32_uefi,
                defaults.arm32_uefi,
            )?,
        };

        let offer = match self.dhcp.offer.as_deref() {
            None | Some("bootfile") => OfferStyle::Bootfile,
            Some("boot-server") => OfferStyle::BootServer,
            Some(_) => {
                return Err(field(
                    "dhcp.offer",
                    "must be \"bootfile\" (the boot file in the port-67 offer) or \"boot-server\" (PXE firmware asks port 4011)",
                ));
            }
        };

        let mut tftp = Limits::default();
        let t = self.tftp;
        if let Some(n) = t.max_transfers {
            if n == 0 {
                return Err(field("tftp.max_transfers", "must be at least 1"));
            }
            tftp.max_transfers = n;
        }
        if let Some(b) = t.max_blksize {
            if !(512..=65464).contains(&b) {
                return Err(field("tftp.max_blksize", "must be within 512..=65464"));
            }
            tftp.max_blksize = b;
        }
        if let Some(w) = t.max_windowsize {
            if w == 0 {
                return Err(field("tftp.max_windowsize", "must be at least 1"));
            }
            tftp.max_windowsize = w;
        }
        if let Some(s) = t.timeout_s {
            if !(1..=255).contains(&s) {
                return Err(field("tftp.timeout_s", "must be within 1..=255 (RFC 2349)"));
            }
            tftp.timeout = Duration::from_secs(s);
        }
        if let Some(s) = t.max_client_timeout_s {
            if !(1..=255).contains(&s) {
                return Err(field(
                    "tftp.max_client_timeout_s",
                    "must be within 1..=255 (RFC 2349)",
                ));
            }
            tftp.max_client_timeout = Duration::from_secs(s);
        }
        if let Some(s) = t.max_transfer_s {
            if !(1..=86_400).contains(&s) {
                return Err(field(
                    "tftp.max_transfer_s",
                    "must be within 1..=86400 (a day)",
                ));
            }
            tftp.max_transfer_time = Duration::from_secs(s);
        }
        if let Some(n) = t.max_per_client {
            if n == 0 {
                return Err(field("tftp.max_per_client", "must be at least 1"));
            }
            tftp.max_per_client = n;
        }
        if let Some(r) = t.max_retries {
            tftp.max_retries = r;
        }
        if let Some(us) = t.ack_spin_us {
            if us > 1000 {
                return Err(field(
                    "tftp.ack_spin_us",
                    "must be at most 1000 (a longer spin only burns CPU)",
                ));
            }
            tftp.ack_spin = Duration::from_micros(us);
        }

        let cache_max_bytes = self.cache.max_bytes.unwrap_or(DEFAULT_CACHE_MAX_BYTES);
        if cache_max_bytes == 0 {
            return Err(field(
                "cache.max_bytes",
                "must be at least 1 (bytes the cached artifacts may take)",
            ));
        }

        let mut machines = BTreeMap::new();
        for (i, m) in self.machine.into_iter().enumerate() {
            let name = |f: &str| format!("machine[{i}].{f}");
            let at = |f: &str, message: String| SiteConfigError::Field {
                path: path.to_owned(),
                field: name(f),
                message,
            };
            let mac: MacAddr = m
                .mac
                .as_deref()
                .ok_or_else(|| at("mac", "is required".into()))?
                .parse()
                .map_err(|e: crate::dhcp::MacParseError| at("mac", e.to_string()))?;
            let boot = DesiredBoot {
                kernel: m.kernel.ok_or_else(|| at("kernel", "is required".into()))?,
                initrd: m.initrd,
                cmdline: m.cmdline,
            };
            // Render once now: a boot the HTTP server would refuse is a config error, named by its field.
            render_script(&mac, &boot).map_err(|e| at(e.field, e.why.to_owned()))?;
            if machines.insert(mac, boot).is_some() {
                return Err(at("mac", format!("{mac} is listed twice")));
            }
        }

        Ok(SiteConfig {
            interface,
            server_ip,
            tftp_root,
            artifacts,
            http_port: boot.http_port.unwrap_or(80),
            tftp_port: boot.tftp_port.unwrap_or(69),
            dhcp_port: boot.dhcp_port.unwrap_or(67),
            pxe_port: boot.pxe_port.unwrap_or(4011),
            watch_rogues: boot.watch_rogues.unwrap_or(true),
            report_interval: match boot.report_interval_s.unwrap_or(60) {
                0 => None,
                s => Some(Duration::from_secs(s)),
            },
            loaders,
            offer,
            tftp,
            cache_max_bytes,
            netboot: Netboot::from_machines(machines),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[boot]
interface = "eth1"
server_ip = "10.0.0.2"
tftp_root = "/srv/tftp"
artifacts = "/srv/artifacts"
"#;

    fn err(text: &str) -> String {
        match SiteConfig::from_toml(text, Path::new("site.toml")) {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn shipped_example_parses() -> Result<(), SiteConfigError> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples/site.toml");
        let c = SiteConfig::from_file(&path)?;
        assert_eq!(c.interface, "eno2");
        assert_eq!(c.netboot.len(), 2);
        assert_eq!(c.tftp.max_blksize, 1468);
        assert_eq!(c.cache_max_bytes, 20 << 30);
        Ok(())
    }

    #[test]
    fn minimal_config_takes_defaults() -> Result<(), SiteConfigError> {
        let c = SiteConfig::from_toml(MINIMAL, Path::new("site.toml"))?;
        assert_eq!(
            (c.http_port, c.tftp_port, c.dhcp_port, c.pxe_port),
            (80, 69, 67, 4011)
        );
        assert_eq!(c.loaders, BootFiles::default());
        assert_eq!(c.offer, OfferStyle::Bootfile);
        assert!(c.watch_rogues);
        assert!(c.netboot.is_empty());
        assert_eq!(c.cache_max_bytes, DEFAULT_CACHE_MAX_BYTES);
        let capped = SiteConfig::from_toml(
            &format!("{MINIMAL}\n[cache]\nmax_bytes = 1048576\n"),
            Path::new("site.toml"),
        )?;
        assert_eq!(capped.cache_max_bytes, 1 << 20);
        assert_eq!(
            err(&format!("{MINIMAL}\n[cache]\nmax_bytes = 0\n")),
            "site.toml: cache.max_bytes: must be at least 1 (bytes the cached artifacts may take)"
        );
        assert!(err(&format!("{MINIMAL}\n[cache]\nmax_bytes = -1\n")).contains("max_bytes"));
        Ok(())
    }

    #[test]
    fn errors_name_file_and_field() {
        assert_eq!(err(""), "site.toml: boot: the [boot] section is required");
        assert!(
            err("[boot]\ninterfce = 1").starts_with("site.toml: "),
            "{}",
            err("[boot]\ninterfce = 1")
        );
        assert!(err("[boot]\ninterfce = 1").contains("interfce"));
        let bad_ip = MINIMAL.replace("10.0.0.2", "10.0.0");
        assert_eq!(
            err(&bad_ip),
            "site.toml: boot.server_ip: is not an IPv4 address"
        );
        let machine = |body: &str| {
            format!(
                "{MINIMAL}\n[[machine]]\nmac = \"52:54:00:00:00:01\"\nkernel = \"k\"\n\n[[machine]]\n{body}\n"
            )
        };
        assert_eq!(
            err(&machine("mac = \"52:54:00:00:00:0g\"\nkernel = \"k\""))
                .split(" (")
                .next(),
            Some(
                "site.toml: machine[1].mac: invalid MAC \"52:54:00:00:00:0g\": expected hex bytes separated by ':' or '-'"
            )
        );
        assert_eq!(
            err(&machine("mac = \"52:54:00:00:00:02\"")),
            "site.toml: machine[1].kernel: is required"
        );
        assert_eq!(
            err(&machine(
                "mac = \"52:54:00:00:00:02\"\nkernel = \"k\"\ncmdline = \"a\\nshell\""
            )),
            "site.toml: machine[1].cmdline: contains a control character (newline?)"
        );
        assert_eq!(
            err(&machine("mac = \"52:54:00:00:00:01\"\nkernel = \"k\"")),
            "site.toml: machine[1].mac: 52:54:00:00:00:01 is listed twice"
        );
        let offer = |v: &str| {
            SiteConfig::from_toml(
                &format!("{MINIMAL}\n[dhcp]\noffer = \"{v}\"\n"),
                Path::new("site.toml"),
            )
            .map(|c| c.offer)
            .map_err(|e| e.to_string())
        };
        assert_eq!(offer("boot-server").as_ref(), Ok(&OfferStyle::BootServer));
        assert_eq!(offer("bootfile").as_ref(), Ok(&OfferStyle::Bootfile));
        assert_eq!(
            offer("4011"),
            Err("site.toml: dhcp.offer: must be \"bootfile\" (the boot file in the port-67 offer) or \"boot-server\" (PXE firmware asks port 4011)".to_owned())
        );
        let spin = format!("{MINIMAL}\n[tftp]\nack_spin_us = 5000\n");
        assert_eq!(
            err(&spin),
            "site.toml: tftp.ack_spin_us: must be at most 1000 (a longer spin only burns CPU)"
        );
        let t = format!("{MINIMAL}\n[tftp]\ntimeout_s = 0\n");
        assert_eq!(
            err(&t),
            "site.toml: tftp.timeout_s: must be within 1..=255 (RFC 2349)"
        );
        for (key, why) in [
            (
                "max_client_timeout_s = 300",
                "tftp.max_client_timeout_s: must be within 1..=255 (RFC 2349)",
            ),
            (
                "max_transfer_s = 0",
                "tftp.max_transfer_s: must be within 1..=86400 (a day)",
            ),
            (
                "max_per_client = 0",
                "tftp.max_per_client: must be at least 1",
            ),
        ] {
            let t = format!("{MINIMAL}\n[tftp]\n{key}\n");
            assert_eq!(err(&t), format!("site.toml: {why}"));
        }
        let t = format!(
            "{MINIMAL}\n[tftp]\nmax_client_timeout_s = 3\nmax_transfer_s = 60\nmax_per_client = 2\n"
        );
        let c = SiteConfig::from_toml(&t, Path::new("site.toml")).expect("valid limits");
        assert_eq!(
            (
                c.tftp.max_client_timeout,
                c.tftp.max_transfer_time,
                c.tftp.max_per_client
            ),
            (Duration::from_secs(3), Duration::from_secs(60), 2)
        );
        let l = MINIMAL.replace("[boot]", "[boot]\nloaders.bios = \"../x\"");
        assert_eq!(
            err(&l),
            "site.toml: boot.loaders.bios: must be a relative file name in boot.tftp_root"
        );
    }
}
