//! Hardware claims and the hardware key: the hash of a machine's stable identifiers, which lets a re-joining
//! machine be recognised (reclaim) and stops two nodes from claiming the same hardware.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a node says about its hardware (mirrors `bettercompute.v1.HardwareClaims`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HardwareClaims {
    pub dmi: DmiClaims,
    pub nics: Vec<NicClaim>,
    pub gpus: Vec<GpuClaim>,
    pub hostname: String,
    pub arch: String,
    pub gpu_backend: String,
    pub collection_notes: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmiClaims {
    pub system_uuid: String,
    pub system_serial: String,
    pub board_serial: String,
    pub chassis_serial: String,
    pub vendor: String,
    pub product: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicClaim {
    pub name: String,
    pub mac: String,
    pub driver: String,
    pub pci_address: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuClaim {
    pub index: u32,
    pub uuid: String,
    pub serial: String,
    pub model: String,
    pub pci_bus_id: String,
    pub memory_mib: u64,
}

/// The longest claimed value (a serial, a model, a hostname), in bytes.
pub const MAX_CLAIM: usize = 256;
/// The most NICs, GPUs and collection notes one claim lists.
pub const MAX_NICS: usize = 256;
pub const MAX_GPUS: usize = 64;
pub const MAX_NOTES: usize = 32;

/// Claims refused at the door: the field and the rule (`claims.nics[3].mac must be at most 256 bytes without
/// control characters`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidClaims(pub String);

fn check_value(field: &str, v: &str) -> Result<(), InvalidClaims> {
    if v.len() > MAX_CLAIM || v.chars().any(char::is_control) {
        return Err(InvalidClaims(format!(
            "claims.{field} must be at most {MAX_CLAIM} bytes without control characters"
        )));
    }
    Ok(())
}

impl HardwareClaims {
    /// What a node claims, as it arrives in its join (outside input): lists and values bounded, no control
    /// characters (a value with a line break would otherwise read as two of the hardware key's lines).
    pub fn check(&self) -> Result<(), InvalidClaims> {
        if self.nics.len() > MAX_NICS
            || self.gpus.len() > MAX_GPUS
            || self.collection_notes.len() > MAX_NOTES
        {
            return Err(InvalidClaims(format!(
                "claims list too long: at most {MAX_NICS} nics, {MAX_GPUS} gpus, {MAX_NOTES} notes"
            )));
        }
        let dmi = &self.dmi;
        for (name, v) in [
            ("dmi.system_uuid", &dmi.system_uuid),
            ("dmi.system_serial", &dmi.system_serial),
            ("dmi.board_serial", &dmi.board_serial),
            ("dmi.chassis_serial", &dmi.chassis_serial),
            ("dmi.vendor", &dmi.vendor),
            ("dmi.product", &dmi.product),
            ("hostname", &self.hostname),
            ("arch", &self.arch),
            ("gpu_backend", &self.gpu_backend),
        ] {
            check_value(name, v)?;
        }
        for (i, n) in self.nics.iter().enumerate() {
            for (f, v) in [
                ("name", &n.name),
                ("mac", &n.mac),
                ("driver", &n.driver),
                ("pci_address", &n.pci_address),
            ] {
                check_value(&format!("nics[{i}].{f}"), v)?;
            }
        }
        for (i, g) in self.gpus.iter().enumerate() {
            for (f, v) in [
                ("uuid", &g.uuid),
                ("serial", &g.serial),
                ("model", &g.model),
                ("pci_bus_id", &g.pci_bus_id),
            ] {
                check_value(&format!("gpus[{i}].{f}"), v)?;
            }
        }
        for (i, n) in self.collection_notes.iter().enumerate() {
            check_value(&format!("collection_notes[{i}]"), n)?;
        }
        Ok(())
    }
}

/// Values firmware vendors leave in DMI fields that are not unique to a machine; they never count as identity.
fn is_placeholder(value: &str) -> bool {
    let v = value.trim().to_ascii_lowercase();
    v.is_empty()
        || v.chars().all(|c| c == '0' || c == '-' || c == 'f')
        || [
            "to be filled by o.e.m.",
            "default string",
            "not specified",
            "not applicable",
            "none",
            "system serial number",
            "0123456789",
            "123456789",
            "n/a",
        ]
        .contains(&v.as_str())
}

fn normalise_mac(mac: &str) -> Option<String> {
    let m = mac.trim().to_ascii_lowercase();
    let hex: String = m.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    (hex.len() == 12 && hex != "000000000000" && hex != "ffffffffffff").then_some(hex)
}

/// The canonical lines that feed the hardware key, sorted; empty when the machine has no stable identifier.
pub fn stable_identifiers(claims: &HardwareClaims) -> Vec<String> {
    let mut lines = Vec::new();
    let dmi = &claims.dmi;
    for (name, value) in [
        ("dmi.system_uuid", &dmi.system_uuid),
        ("dmi.system_serial", &dmi.system_serial),
        ("dmi.board_serial", &dmi.board_serial),
        ("dmi.chassis_serial", &dmi.chassis_serial),
    ] {
        if !is_placeholder(value) {
            lines.push(format!("{name}={}", value.trim().to_ascii_lowercase()));
        }
    }
    for nic in &claims.nics {
        if let Some(mac) = normalise_mac(&nic.mac) {
            lines.push(format!("nic.mac={mac}"));
        }
    }
    for gpu in &claims.gpus {
        if !is_placeholder(&gpu.serial) {
            lines.push(format!(
                "gpu.serial={}",
                gpu.serial.trim().to_ascii_lowercase()
            ));
        }
    }
    lines.sort();
    lines.dedup();
    lines
}

/// `hk1:<sha256 hex>` over the canonical stable identifiers, or `None` when there are none (such a machine cannot
/// be reclaimed and is never matched to another).
pub fn hardware_key(claims: &HardwareClaims) -> Option<String> {
    let lines = stable_identifiers(claims);
    if lines.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    for line in &lines {
        h.update(line.as_bytes());
        h.update(b"\n");
    }
    Some(format!("hk1:{}", hex::encode(h.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(uuid: &str, mac: &str) -> HardwareClaims {
        HardwareClaims {
            dmi: DmiClaims {
                system_uuid: uuid.into(),
                system_serial: "To Be Filled By O.E.M.".into(),
                ..Default::default()
            },
            nics: vec![NicClaim {
                name: "eth0".into(),
                mac: mac.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn claims_out_of_bounds_are_refused_naming_the_field() {
        assert_eq!(claims("u", "52:54:00:aa:bb:01").check(), Ok(()));
        // A line break would make one value read as two of the hardware key's lines.
        let mut c = claims("u\ndmi.chassis_serial=x", "52:54:00:aa:bb:01");
        assert_eq!(
            c.check().map_err(|e| e.0),
            Err(
                "claims.dmi.system_uuid must be at most 256 bytes without control characters"
                    .into()
            )
        );
        c.dmi.system_uuid = "u".into();
        c.nics[0].mac = "m".repeat(MAX_CLAIM + 1);
        assert!(
            c.check().is_err_and(|e| e
                .0
                .starts_with("claims.nics[0].mac must be at most 256 bytes")),
            "{c:?}"
        );
        c.nics = vec![NicClaim::default(); MAX_NICS + 1];
        assert!(
            c.check()
                .is_err_and(|e| e.0.starts_with("claims list too long")),
            "too many nics"
        );
    }

    #[test]
    fn key_is_stable_under_order_case_and_noise() {
        let a = claims("4C4C4544-0042", "AA:BB:CC:DD:EE:01");
        let mut b = claims("4c4c4544-0042", "aa:bb:cc:dd:ee:01");
        b.hostname = "renamed".into();
        b.nics.push(NicClaim {
            name: "lo".into(),
            mac: "00:00:00:00:00:00".into(),
            ..Default::default()
        });
        assert_eq!(hardware_key(&a), hardware_key(&b));
        assert_ne!(
            hardware_key(&a),
            hardware_key(&claims("other", "aa:bb:cc:dd:ee:01"))
        );
        assert_eq!(
            stable_identifiers(&a).len(),
            2,
            "placeholder serial must not count"
        );
    }

    #[test]
    fn no_identifiers_no_key() {
        assert_eq!(
            hardware_key(&claims("00000000-0000-0000-0000-000000000000", "")),
            None
        );
    }
}
