//! Faults a fixture GPU can carry (`"faults": ["dbe", "xid:79", …]`) and the fields it can declare unsupported
//! (`"not_supported": ["row_remap", …]`). Both are parsed strictly: an unknown name is an error, not a no-op.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One injected fault. The text form is `name` or `name:argument`; see docs/gpu.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Fault {
    /// `dbe[:n]`: n (default 1) volatile double-bit ECC errors (also added to the aggregate count).
    Dbe(u64),
    /// `pending_retirement`: pages are waiting to be retired.
    PendingRetirement,
    /// `retired_pages:n`: n pages retired for double-bit errors.
    RetiredPages(u64),
    /// `remap_pending`: a row remap waits for a GPU reset.
    RemapPending,
    /// `remap_failure`: a row remap failed.
    RemapFailure,
    /// `pcie_downgrade`: the link trained at gen 4 x8 of gen 5 x16.
    PcieDowngrade,
    /// `throttle[:bits]`: clock throttle reason bits (default hw_slowdown, 0x8); hex with `0x` or decimal.
    Throttle(u64),
    /// `xid:n`: a critical XID error n was seen.
    Xid(u64),
    /// `persistence_off`: persistence mode disabled.
    PersistenceOff,
    /// `mig_enabled`: MIG on with seven 1g.10gb instances.
    MigEnabled,
    /// `nvlink_down[:link]`: an NVLink (default 0) is inactive.
    NvLinkDown(u32),
    /// `hot`: temperature 2 °C above the slowdown threshold.
    Hot,
    /// `power_over`: power draw 10% above the enforced limit.
    PowerOver,
    /// `missing`: the GPU is not visible at all (fallen off the bus).
    Missing,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FaultError {
    #[error(
        "unknown fault {0:?} (known: dbe, pending_retirement, retired_pages:N, remap_pending, remap_failure, pcie_downgrade, throttle, xid:N, persistence_off, mig_enabled, nvlink_down, hot, power_over, missing)"
    )]
    Unknown(String),
    #[error("fault {fault:?}: {argument:?} is not a valid number")]
    Argument { fault: String, argument: String },
    #[error("fault {0:?} needs an argument (`{0}:N`)")]
    MissingArgument(String),
}

fn number(fault: &str, arg: &str) -> Result<u64, FaultError> {
    let bad = || FaultError::Argument {
        fault: fault.to_string(),
        argument: arg.to_string(),
    };
    match arg.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).map_err(|_| bad()),
        None => arg.parse().map_err(|_| bad()),
    }
}

impl FromStr for Fault {
    type Err = FaultError;

    fn from_str(s: &str) -> Result<Fault, FaultError> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let need = || arg.ok_or_else(|| FaultError::MissingArgument(name.to_string()));
        let none = |a: Option<&str>, f: Fault| match a {
            None => Ok(f),
            Some(_) => Err(FaultError::Unknown(s.to_string())),
        };
        match name {
            "dbe" => Ok(Fault::Dbe(
                arg.map(|a| number(name, a)).transpose()?.unwrap_or(1),
            )),
            "pending_retirement" => none(arg, Fault::PendingRetirement),
            "retired_pages" => Ok(Fault::RetiredPages(number(name, need()?)?)),
            "remap_pending" => none(arg, Fault::RemapPending),
            "remap_failure" => none(arg, Fault::RemapFailure),
            "pcie_downgrade" => none(arg, Fault::PcieDowngrade),
            "throttle" => Ok(Fault::Throttle(
                arg.map(|a| number(name, a))
                    .transpose()?
                    .unwrap_or(super::health::throttle::HW_SLOWDOWN),
            )),
            "xid" => Ok(Fault::Xid(number(name, need()?)?)),
            "persistence_off" => none(arg, Fault::PersistenceOff),
            "mig_enabled" => none(arg, Fault::MigEnabled),
            "nvlink_down" => {
                let link = arg.map(|a| number(name, a)).transpose()?.unwrap_or(0);
                let link = u32::try_from(link).map_err(|_| FaultError::Argument {
                    fault: name.to_string(),
                    argument: link.to_string(),
                })?;
                Ok(Fault::NvLinkDown(link))
            }
            "hot" => none(arg, Fault::Hot),
            "power_over" => none(arg, Fault::PowerOver),
            "missing" => none(arg, Fault::Missing),
            _ => Err(FaultError::Unknown(s.to_string())),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Dbe(n) => write!(f, "dbe:{n}"),
            Fault::PendingRetirement => f.write_str("pending_retirement"),
            Fault::RetiredPages(n) => write!(f, "retired_pages:{n}"),
            Fault::RemapPending => f.write_str("remap_pending"),
            Fault::RemapFailure => f.write_str("remap_failure"),
            Fault::PcieDowngrade => f.write_str("pcie_downgrade"),
            Fault::Throttle(bits) => write!(f, "throttle:{bits:#x}"),
            Fault::Xid(n) => write!(f, "xid:{n}"),
            Fault::PersistenceOff => f.write_str("persistence_off"),
            Fault::MigEnabled => f.write_str("mig_enabled"),
            Fault::NvLinkDown(l) => write!(f, "nvlink_down:{l}"),
            Fault::Hot => f.write_str("hot"),
            Fault::PowerOver => f.write_str("power_over"),
            Fault::Missing => f.write_str("missing"),
        }
    }
}

impl TryFrom<String> for Fault {
    type Error = FaultError;
    fn try_from(s: String) -> Result<Fault, FaultError> {
        s.parse()
    }
}

impl From<Fault> for String {
    fn from(f: Fault) -> String {
        f.to_string()
    }
}

/// A [`super::GpuHealth`] field a fixture GPU declares unsupported (NVML would answer NotSupported).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthField {
    EccDbeVolatile,
    EccDbeAggregate,
    RetiredPages,
    RetiredPagesPending,
    RowRemap,
    Pcie,
    ThrottleReasons,
    XidErrors,
    PersistenceMode,
    Mig,
    Nvlink,
    TemperatureC,
    TemperatureSlowdownC,
    PowerDrawMw,
    PowerLimitMw,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_round_trip_through_text() {
        for text in [
            "dbe:2",
            "pending_retirement",
            "retired_pages:63",
            "remap_pending",
            "remap_failure",
            "pcie_downgrade",
            "throttle:0x40",
            "xid:79",
            "persistence_off",
            "mig_enabled",
            "nvlink_down:3",
            "hot",
            "power_over",
            "missing",
        ] {
            let f: Fault = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(f.to_string(), text);
        }
        assert_eq!("dbe".parse::<Fault>(), Ok(Fault::Dbe(1)));
        assert_eq!("throttle".parse::<Fault>(), Ok(Fault::Throttle(0x8)));
        assert_eq!("nvlink_down".parse::<Fault>(), Ok(Fault::NvLinkDown(0)));
    }

    #[test]
    fn bad_faults_are_refused() {
        assert!(matches!(
            "dbee".parse::<Fault>(),
            Err(FaultError::Unknown(_))
        ));
        assert!(matches!(
            "xid".parse::<Fault>(),
            Err(FaultError::MissingArgument(_))
        ));
        assert!(matches!(
            "xid:x".parse::<Fault>(),
            Err(FaultError::Argument { .. })
        ));
        assert!(matches!(
            "hot:1".parse::<Fault>(),
            Err(FaultError::Unknown(_))
        ));
        assert!(matches!(
            "nvlink_down:99999999999".parse::<Fault>(),
            Err(FaultError::Argument { .. })
        ));
    }
}
