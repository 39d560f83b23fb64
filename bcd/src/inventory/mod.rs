//! Node inventory: the sections `system` (DMI), `cpu`, `memory`, `gpus`, `nics` and `disks`, each a JSON payload
//! with a SHA-256 content hash so the control plane is sent only what changed ([`changed`]).
//!
//! Everything is read under a root directory (`/` on a node, a prepared tree in tests), from procfs and sysfs; GPUs
//! come from the [`GpuBackend`]. A section holds only slowly changing facts (memory total, not free memory), so its
//! hash is stable while the hardware is; a value that cannot be read is left empty and noted in the section's
//! `notes`, never fatal. Parsers of file contents are pure ([`host::parse_cpuinfo`], [`host::parse_meminfo`]).
//! Start with [`collect`].

pub mod devices;
pub mod host;

use crate::gpu::GpuBackend;
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;

/// Section names, in the order they are collected.
pub const SECTIONS: [&str; 6] = ["system", "cpu", "memory", "gpus", "nics", "disks"];

/// One inventory section as sent in `InventorySection{name, hash, payload}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    /// SHA-256 of `payload`.
    pub hash: [u8; 32],
    /// The section's JSON document.
    pub payload: Vec<u8>,
}

impl Section {
    /// Serialises `value` and hashes the bytes.
    pub fn new(name: &str, value: &impl Serialize) -> Section {
        // Serialising these plain structs cannot fail; if it ever did, the section says so instead of vanishing.
        let payload = serde_json::to_vec(value).unwrap_or_else(|e| {
            serde_json::json!({ "notes": [format!("encoding failed: {e}")] })
                .to_string()
                .into()
        });
        Section {
            name: name.to_string(),
            hash: bc_proto::sha256(&payload),
            payload,
        }
    }

    pub fn hash_hex(&self) -> String {
        hex::encode(self.hash)
    }
}

/// Collects one section by name; `None` for an unknown name.
pub fn section(root: &Path, gpus: Option<&dyn GpuBackend>, name: &str) -> Option<Section> {
    Some(match name {
        "system" => Section::new(name, &host::system(root)),
        "cpu" => Section::new(name, &host::cpu(root)),
        "memory" => Section::new(name, &host::memory(root)),
        "gpus" => Section::new(name, &devices::gpus(gpus)),
        "nics" => Section::new(name, &devices::nics(root)),
        "disks" => Section::new(name, &devices::disks(root)),
        _ => return None,
    })
}

/// Every section.
pub fn collect(root: &Path, gpus: Option<&dyn GpuBackend>) -> Vec<Section> {
    SECTIONS
        .iter()
        .filter_map(|n| section(root, gpus, n))
        .collect()
}

/// The named sections (all of them when `names` is empty); unknown names are skipped.
pub fn collect_sections(
    root: &Path,
    gpus: Option<&dyn GpuBackend>,
    names: &[String],
) -> Vec<Section> {
    if names.is_empty() {
        return collect(root, gpus);
    }
    SECTIONS
        .iter()
        .filter(|n| names.iter().any(|want| want == *n))
        .filter_map(|n| section(root, gpus, n))
        .collect()
}

/// The sections whose hash differs from what the control plane holds (`known`: name → hash), or that it lacks.
pub fn changed<'a>(sections: &'a [Section], known: &HashMap<String, [u8; 32]>) -> Vec<&'a Section> {
    sections
        .iter()
        .filter(|s| known.get(&s.name) != Some(&s.hash))
        .collect()
}

/// Reads a sysfs/procfs attribute, trimmed; `None` when absent, unreadable or empty.
pub(crate) fn read_attr(path: &Path) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// The file name a symlink points to (`device/driver` → `nvme`).
pub(crate) fn link_name(path: &Path) -> Option<String> {
    std::fs::read_link(path)
        .ok()?
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_returns_new_and_different_sections() {
        let a = Section::new("cpu", &serde_json::json!({"model": "x"}));
        let b = Section::new("memory", &serde_json::json!({"total_bytes": 1}));
        let sections = vec![a.clone(), b.clone()];
        let mut known = HashMap::new();
        assert_eq!(changed(&sections, &known).len(), 2);
        known.insert("cpu".to_string(), a.hash);
        known.insert("memory".to_string(), [0u8; 32]);
        let out: Vec<&str> = changed(&sections, &known)
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(out, vec!["memory"]);
        known.insert("memory".to_string(), b.hash);
        assert!(changed(&sections, &known).is_empty());
    }

    #[test]
    fn hash_is_sha256_of_payload() {
        let s = Section::new("cpu", &serde_json::json!({"a": 1}));
        assert_eq!(s.payload, br#"{"a":1}"#.to_vec());
        assert_eq!(s.hash, bc_proto::sha256(br#"{"a":1}"#));
        assert_eq!(s.hash_hex().len(), 64);
    }
}
