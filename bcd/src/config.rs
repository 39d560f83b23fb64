//! `bcd` configuration (`/etc/bcd/bcd.toml`, written by the install script): where the gateway is and what to
//! trust before the node holds a trust bundle. Command-line flags override the file.
//!
//! The optional `[telemetry]` table is read on its own ([`telemetry_from_file`], bc-telemetry's wire struct) so a
//! bcd built without telemetry (the ramdisk's) still reads a bcd.toml that has one.

use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigWire {
    pub gateway_url: Option<String>,
    /// `sha256:<hex>` of the control-plane CA's SubjectPublicKeyInfo.
    pub ca_pin: Option<String>,
    /// JoinService's HPKE public key (base64url).
    pub join_public_key: Option<String>,
    pub state_dir: Option<PathBuf>,
    /// `nvml` (default where built), or `fixture:<path to JSON>`.
    pub gpu_backend: Option<String>,
    /// Root under which `/sys` and `/proc` are read (tests and containers); default `/`.
    pub hardware_root: Option<PathBuf>,
    /// Where the Container Device Interface spec of this node's bookings is written; default `/etc/cdi`.
    pub cdi_dir: Option<PathBuf>,
    /// `[tunnels] allow = [22, 8888]`: the local ports tunnels may reach; none when absent.
    pub tunnels: Option<crate::tunnel::TunnelsWire>,
}

/// The table of bcd.toml that configures telemetry.
pub const TELEMETRY_TABLE: &str = "telemetry";

/// The `[telemetry]` table of `path`, when the file has one (a missing file has none).
#[cfg(feature = "telemetry")]
pub fn telemetry_from_file(
    path: &Path,
) -> Result<Option<bc_telemetry::TelemetryWire>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let parse = |e: String| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e,
    };
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| parse(e.to_string()))?;
    match table.remove(TELEMETRY_TABLE) {
        None => Ok(None),
        Some(t) => t
            .try_into()
            .map(Some)
            .map_err(|e: toml::de::Error| parse(format!("[telemetry]: {e}"))),
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub gateway_url: String,
    pub ca_pin: String,
    pub join_public_key: bc_proto::seal::JoinPublicKey,
    pub state_dir: PathBuf,
    pub gpu_backend: GpuBackendChoice,
    pub hardware_root: PathBuf,
    pub cdi_dir: PathBuf,
    /// The node's own tunnel allowlist (empty refuses every tunnel).
    pub tunnels: crate::tunnel::Allowlist,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuBackendChoice {
    Nvml,
    Fixture(PathBuf),
    None,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{origin}: {field}: {message}")]
    Field {
        origin: String,
        field: &'static str,
        message: String,
    },
}

impl ConfigWire {
    pub fn from_file(path: &Path) -> Result<ConfigWire, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        table.remove(TELEMETRY_TABLE);
        // [vmm] is read on its own too (crate::vmm::config).
        table.remove(crate::vmm::config::TABLE);
        table
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
    }

    pub fn overlay(self, over: ConfigWire) -> ConfigWire {
        ConfigWire {
            gateway_url: over.gateway_url.or(self.gateway_url),
            ca_pin: over.ca_pin.or(self.ca_pin),
            join_public_key: over.join_public_key.or(self.join_public_key),
            state_dir: over.state_dir.or(self.state_dir),
            gpu_backend: over.gpu_backend.or(self.gpu_backend),
            hardware_root: over.hardware_root.or(self.hardware_root),
            cdi_dir: over.cdi_dir.or(self.cdi_dir),
            tunnels: over.tunnels.or(self.tunnels),
        }
    }

    pub fn validate(self, origin: &str) -> Result<Config, ConfigError> {
        let field = |field: &'static str, message: String| ConfigError::Field {
            origin: origin.to_string(),
            field,
            message,
        };
        let gateway_url = self
            .gateway_url
            .ok_or_else(|| field("gateway_url", "is required".into()))?;
        bc_proto::channel::parse_gateway_url(&gateway_url)
            .map_err(|e| field("gateway_url", e.to_string()))?;
        let ca_pin = self
            .ca_pin
            .ok_or_else(|| field("ca_pin", "is required".into()))?;
        let pin_ok = ca_pin
            .strip_prefix("sha256:")
            .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        if !pin_ok {
            return Err(field("ca_pin", "must be sha256:<64 hex characters>".into()));
        }
        let key = self
            .join_public_key
            .ok_or_else(|| field("join_public_key", "is required".into()))?;
        let join_public_key = bc_proto::seal::JoinPublicKey::parse(&key)
            .map_err(|e| field("join_public_key", e.to_string()))?;
        let default_backend = if cfg!(feature = "nvml") {
            "nvml"
        } else {
            "none"
        };
        let gpu_backend = match self.gpu_backend.as_deref().unwrap_or(default_backend) {
            "nvml" => GpuBackendChoice::Nvml,
            "none" => GpuBackendChoice::None,
            other => match other.strip_prefix("fixture:") {
                Some(p) if !p.is_empty() => GpuBackendChoice::Fixture(PathBuf::from(p)),
                _ => {
                    return Err(field(
                        "gpu_backend",
                        "must be nvml, none or fixture:<path>".into(),
                    ));
                }
            },
        };
        let tunnels = self
            .tunnels
            .unwrap_or_default()
            .validate()
            .map_err(|e| field("tunnels.allow", e))?;
        Ok(Config {
            tunnels,
            gateway_url,
            ca_pin,
            join_public_key,
            state_dir: self
                .state_dir
                .unwrap_or_else(|| PathBuf::from("/var/lib/bcd")),
            gpu_backend,
            hardware_root: self.hardware_root.unwrap_or_else(|| PathBuf::from("/")),
            cdi_dir: self.cdi_dir.unwrap_or_else(|| PathBuf::from("/etc/cdi")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_parses() -> Result<(), ConfigError> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples/bcd.toml");
        let c = ConfigWire::from_file(&path)?.validate(&path.display().to_string())?;
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/bcd"));
        Ok(())
    }

    /// The package's /etc/bcd/bcd.toml parses, and until its connection fields are filled in bcd refuses to run
    /// naming the first missing one.
    #[test]
    fn the_packaged_default_parses_and_names_what_is_missing() -> Result<(), ConfigError> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/config/bcd.toml");
        let wire = ConfigWire::from_file(&path)?;
        assert_eq!(wire.state_dir, Some(PathBuf::from("/var/lib/bcd")));
        let e = wire
            .validate(&path.display().to_string())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("gateway_url"), "{e}");
        Ok(())
    }

    #[cfg(feature = "telemetry")]
    #[test]
    fn shipped_telemetry_example_parses_both_ways() -> Result<(), Box<dyn std::error::Error>> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples/bcd-telemetry.toml");
        let c = ConfigWire::from_file(&path)?.validate(&path.display().to_string())?;
        let t = telemetry_from_file(&path)?
            .ok_or("the example has a [telemetry] table")?
            .validate(&path.display().to_string(), c.state_dir.join("telemetry"))?;
        assert_eq!(t.interval, std::time::Duration::from_secs(10));
        assert!(t.remote_write.is_some() && t.otlp.is_some() && t.metrics_listen.is_some());
        assert_eq!(telemetry_from_file(&path.with_file_name("bcd.toml"))?, None);
        let bad = tempfile::NamedTempFile::new()?;
        std::fs::write(bad.path(), "[telemetry]\nintervall = \"1s\"\n")?;
        let e = telemetry_from_file(bad.path())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("intervall"), "{e}");
        Ok(())
    }

    #[test]
    fn missing_and_bad_fields_are_named() {
        let e = ConfigWire::default()
            .validate("f.toml")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("gateway_url"), "{e}");
        let w = ConfigWire {
            gateway_url: Some("https://127.0.0.1:1".into()),
            ca_pin: Some("md5:00".into()),
            ..Default::default()
        };
        let e = w
            .validate("f.toml")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("ca_pin"), "{e}");
    }

    #[test]
    fn tunnels_are_refused_by_default_and_a_bad_port_is_named()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let base = "gateway_url = \"https://127.0.0.1:1\"\nca_pin = \"sha256:15758dce8550fe72396cc031b5213af26ba0c3a6e86b8a0719b00ef71b07ab0b\"\njoin_public_key = \"4-lEiv7ekxsdhWj4jYOVQKzUycFzDf00oYFFpZW3XV8\"\n";
        let path = dir.path().join("bcd.toml");
        std::fs::write(&path, base)?;
        let c = ConfigWire::from_file(&path)?.validate("bcd.toml")?;
        assert_eq!(c.tunnels.ports().count(), 0);
        std::fs::write(&path, format!("{base}[tunnels]\nallow = [22, 8888]\n"))?;
        let c = ConfigWire::from_file(&path)?.validate("bcd.toml")?;
        assert_eq!(c.tunnels.ports().collect::<Vec<_>>(), vec![22, 8888]);
        assert!(c.tunnels.allows(22) && !c.tunnels.allows(23));
        std::fs::write(&path, format!("{base}[tunnels]\nallow = [22, 70000]\n"))?;
        let e = ConfigWire::from_file(&path)?
            .validate("bcd.toml")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("tunnels.allow") && e.contains("70000"), "{e}");
        std::fs::write(&path, format!("{base}[tunnels]\nalow = [22]\n"))?;
        let e = ConfigWire::from_file(&path)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("alow"), "{e}");
        Ok(())
    }
}
