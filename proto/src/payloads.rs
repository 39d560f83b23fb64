//! The JSON payloads one side writes and the other reads, typed once for both: the daemon writes an inventory
//! section or a diag report and the control plane reads it; the control plane seals secret claims and the site
//! agent opens them. Each reader parses with these types (an unknown or missing field is a clear error, never a
//! key read that silently yields null).

use serde::{Deserialize, Serialize};

pub mod diag;

/// What a secret JWE carries (its claims also hold `sub` = the site and `aud` = the asking agent).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretClaims {
    pub name: String,
    pub value: String,
}

impl std::fmt::Debug for SecretClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretClaims")
            .field("name", &self.name)
            .field("value", &"<redacted>")
            .finish()
    }
}

/// One GPU as inventory and join claims carry it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    #[serde(default)]
    pub serial: String,
    pub model: String,
    #[serde(default)]
    pub pci_bus_id: String,
    #[serde(default)]
    pub memory_mib: u64,
    /// NVLink clique (fabric cluster UUID + clique id) where the GPU reports one; GPUs that share it are NVLink
    /// peers, possibly across nodes. The placer honours it for `topology: nvlink` requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clique: Option<String>,
}

/// The `gpus` inventory section: the GPU backend's name, its GPUs by index, and notes (why a list is empty).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpusSection {
    #[serde(default)]
    pub backend: String,
    #[serde(default)]
    pub gpus: Vec<GpuInfo>,
    #[serde(default)]
    pub notes: Vec<String>,
}

/// The name of the GPU inventory section.
pub const GPUS_SECTION: &str = "gpus";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpus_section_reads_back_and_names_what_is_wrong() -> Result<(), serde_json::Error> {
        let s: GpusSection = serde_json::from_str(
            r#"{"backend":"fixture","gpus":[{"index":0,"uuid":"GPU-1","model":"H100","clique":"c/1"}],"notes":[]}"#,
        )?;
        assert_eq!(s.gpus[0].uuid, "GPU-1");
        assert_eq!(s.gpus[0].clique.as_deref(), Some("c/1"));
        let e = serde_json::from_str::<GpusSection>(r#"{"gpus":[{"index":"zero"}]}"#)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("index") || e.contains("invalid type"), "{e}");
        Ok(())
    }

    #[test]
    fn secret_claims_never_print_their_value() {
        let c = SecretClaims {
            name: "bmc/a".into(),
            value: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
