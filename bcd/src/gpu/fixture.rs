//! The fixture backend: GPUs described by a JSON file, `{"gpus": [{"uuid": …, "model": …}, …]}`. Fault injection
//! fields arrive with the acceptance checks; unknown fields are refused so a typo is not silently ignored.

use super::{GpuBackend, GpuError, GpuInfo};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FixtureFile {
    gpus: Vec<GpuInfo>,
}

pub struct FixtureBackend {
    path: PathBuf,
}

impl FixtureBackend {
    pub fn load(path: &Path) -> Result<FixtureBackend, GpuError> {
        let backend = FixtureBackend {
            path: path.to_path_buf(),
        };
        backend.read()?;
        Ok(backend)
    }

    /// Re-read on every query, so a test can change the fixture under a running daemon.
    fn read(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| GpuError::Unavailable {
            backend: "fixture",
            reason: format!("reading {}: {e}", self.path.display()),
        })?;
        let file: FixtureFile = serde_json::from_str(&text).map_err(|e| GpuError::Query {
            backend: "fixture",
            message: format!("{}: {e}", self.path.display()),
        })?;
        Ok(file.gpus)
    }
}

impl GpuBackend for FixtureBackend {
    fn name(&self) -> &'static str {
        "fixture"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.read()
    }
}

/// A fixture of `n` H100-like GPUs with serials derived from `seed` (tests and the demo).
pub fn synthetic(n: u32, seed: &str) -> String {
    let gpus: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            serde_json::json!({
                "index": i,
                "uuid": format!("GPU-{seed}-{i:04}"),
                "serial": format!("{seed}{i:04}"),
                "model": "NVIDIA H100 80GB HBM3",
                "pci_bus_id": format!("0000:{:02x}:00.0", 0x18 + i * 0x10),
                "memory_mib": 81559,
            })
        })
        .collect();
    serde_json::json!({ "gpus": gpus }).to_string()
}
