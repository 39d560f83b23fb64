//! Observed GPU health: what a backend reads per GPU for the `diag.nvml` acceptance checks (ECC, page retirement,
//! row remapping, PCIe link, clock throttle reasons, XID errors, persistence mode, MIG, NVLink, temperature, power).
//! Every value is a [`Reading`]: a value, or why there is none (NVML answered NotSupported, the backend does not
//! collect it, or the query failed), so a check can skip with the reason instead of passing on a default.

use serde::{Deserialize, Serialize};

/// One observed value, or why it is absent. JSON: `{"value": 3}`, `"not_supported"`, `{"not_collected": "why"}`,
/// `{"error": "message"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reading<T> {
    Value(T),
    /// The GPU or driver answered that it does not support this query.
    NotSupported,
    /// The backend does not collect this value (with the reason).
    NotCollected(String),
    /// The query failed (GPU lost, driver error): a check treats this as a failure.
    Error(String),
}

impl<T> Reading<T> {
    pub fn value(&self) -> Option<&T> {
        match self {
            Reading::Value(v) => Some(v),
            _ => None,
        }
    }

    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Reading<U> {
        match self {
            Reading::Value(v) => Reading::Value(f(v)),
            Reading::NotSupported => Reading::NotSupported,
            Reading::NotCollected(r) => Reading::NotCollected(r),
            Reading::Error(e) => Reading::Error(e),
        }
    }

    /// Why there is no value, in words; `None` when there is one.
    pub fn absence(&self) -> Option<String> {
        match self {
            Reading::Value(_) => None,
            Reading::NotSupported => Some("not supported on this GPU".into()),
            Reading::NotCollected(r) => Some(format!("not collected: {r}")),
            Reading::Error(e) => Some(format!("query failed: {e}")),
        }
    }
}

/// Pages retired by the driver (pre-Ampere page retirement; Ampere and newer remap rows instead).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPages {
    /// Retired for multiple single-bit ECC errors.
    pub sbe: u64,
    /// Retired for a double-bit ECC error.
    pub dbe: u64,
}

impl RetiredPages {
    pub fn total(&self) -> u64 {
        self.sbe.saturating_add(self.dbe)
    }
}

/// Row remapping state (Ampere and newer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRemap {
    pub correctable: u64,
    pub uncorrectable: u64,
    /// A remap is pending: the GPU needs a reset before the spare row is used.
    pub pending: bool,
    /// A remap failed: no spare row was left.
    pub failure: bool,
}

/// PCIe link: current and maximum generation and width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieLink {
    pub gen_current: u32,
    pub gen_max: u32,
    pub width_current: u32,
    pub width_max: u32,
}

/// MIG mode and the profiles of the MIG devices present (for example `1g.10gb`), sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigState {
    pub enabled: bool,
    /// The mode after the next GPU reset.
    pub pending_enabled: bool,
    #[serde(default)]
    pub layout: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLinkState {
    pub link: u32,
    pub active: bool,
}

/// Everything `diag.nvml` judges about one GPU. (Unknown fields are accepted when reading, so an older reader
/// can take a newer node's observations.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    pub index: u32,
    pub uuid: String,
    #[serde(default)]
    pub pci_bus_id: String,
    /// Uncorrected (double-bit) ECC errors since the last driver load.
    pub ecc_dbe_volatile: Reading<u64>,
    /// Uncorrected (double-bit) ECC errors over the board's life.
    pub ecc_dbe_aggregate: Reading<u64>,
    pub retired_pages: Reading<RetiredPages>,
    pub retired_pages_pending: Reading<bool>,
    pub row_remap: Reading<RowRemap>,
    pub pcie: Reading<PcieLink>,
    /// NVML clock throttle (clocks event) reason bits, see [`throttle_reason_names`].
    pub throttle_reasons: Reading<u64>,
    /// Critical XID errors seen since the previous health query (NVML) or injected (fixture), sorted, distinct.
    pub xid_errors: Reading<Vec<u64>>,
    pub persistence_mode: Reading<bool>,
    pub mig: Reading<MigState>,
    pub nvlink: Reading<Vec<NvLinkState>>,
    pub temperature_c: Reading<u32>,
    /// The temperature at which the GPU starts to slow down.
    pub temperature_slowdown_c: Reading<u32>,
    pub power_draw_mw: Reading<u32>,
    /// The enforced power limit.
    pub power_limit_mw: Reading<u32>,
}

impl GpuHealth {
    /// A GPU of which nothing but identity is known (for backends that collect no health).
    pub fn unobserved(index: u32, uuid: String, pci_bus_id: String, reason: &str) -> GpuHealth {
        let nc = || reason.to_string();
        GpuHealth {
            index,
            uuid,
            pci_bus_id,
            ecc_dbe_volatile: Reading::NotCollected(nc()),
            ecc_dbe_aggregate: Reading::NotCollected(nc()),
            retired_pages: Reading::NotCollected(nc()),
            retired_pages_pending: Reading::NotCollected(nc()),
            row_remap: Reading::NotCollected(nc()),
            pcie: Reading::NotCollected(nc()),
            throttle_reasons: Reading::NotCollected(nc()),
            xid_errors: Reading::NotCollected(nc()),
            persistence_mode: Reading::NotCollected(nc()),
            mig: Reading::NotCollected(nc()),
            nvlink: Reading::NotCollected(nc()),
            temperature_c: Reading::NotCollected(nc()),
            temperature_slowdown_c: Reading::NotCollected(nc()),
            power_draw_mw: Reading::NotCollected(nc()),
            power_limit_mw: Reading::NotCollected(nc()),
        }
    }
}

// === throttle reasons ===

/// NVML `nvmlClocksEventReason*` bits.
pub mod throttle {
    pub const GPU_IDLE: u64 = 0x1;
    pub const APPLICATIONS_CLOCKS_SETTING: u64 = 0x2;
    pub const SW_POWER_CAP: u64 = 0x4;
    pub const HW_SLOWDOWN: u64 = 0x8;
    pub const SYNC_BOOST: u64 = 0x10;
    pub const SW_THERMAL_SLOWDOWN: u64 = 0x20;
    pub const HW_THERMAL_SLOWDOWN: u64 = 0x40;
    pub const HW_POWER_BRAKE_SLOWDOWN: u64 = 0x80;
    pub const DISPLAY_CLOCK_SETTING: u64 = 0x100;
}

const THROTTLE_NAMES: [(u64, &str); 9] = [
    (throttle::GPU_IDLE, "gpu_idle"),
    (
        throttle::APPLICATIONS_CLOCKS_SETTING,
        "applications_clocks_setting",
    ),
    (throttle::SW_POWER_CAP, "sw_power_cap"),
    (throttle::HW_SLOWDOWN, "hw_slowdown"),
    (throttle::SYNC_BOOST, "sync_boost"),
    (throttle::SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
    (throttle::HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
    (throttle::HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake_slowdown"),
    (throttle::DISPLAY_CLOCK_SETTING, "display_clock_setting"),
];

/// Names of the set bits; unknown bits appear as hex.
pub fn throttle_reason_names(bits: u64) -> Vec<String> {
    let mut names: Vec<String> = THROTTLE_NAMES
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| (*name).to_string())
        .collect();
    let known = THROTTLE_NAMES.iter().fold(0u64, |acc, (bit, _)| acc | bit);
    if bits & !known != 0 {
        names.push(format!("{:#x}", bits & !known));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_json_shapes() {
        let v: Reading<u64> = Reading::Value(3);
        assert_eq!(
            serde_json::to_string(&v).ok().as_deref(),
            Some(r#"{"value":3}"#)
        );
        let n: Reading<u64> = Reading::NotSupported;
        assert_eq!(
            serde_json::to_string(&n).ok().as_deref(),
            Some(r#""not_supported""#)
        );
        let back: Result<Reading<u64>, _> = serde_json::from_str(r#"{"not_collected":"why"}"#);
        assert!(matches!(back, Ok(Reading::NotCollected(r)) if r == "why"));
    }

    #[test]
    fn throttle_names_include_unknown_bits() {
        assert_eq!(throttle_reason_names(0x9), vec!["gpu_idle", "hw_slowdown"]);
        assert_eq!(throttle_reason_names(0x1000), vec!["0x1000"]);
        assert!(throttle_reason_names(0).is_empty());
    }
}
