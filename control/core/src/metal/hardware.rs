//! Inspection (the BMC's Redfish inventory) against diagnose (what the ramdisk sees in-band) against the
//! operator's expected hardware. A disagreement between the first two is a condition (a BMC's summary is often
//! incomplete); an expected-hardware violation fails the machine with the difference.

use serde::{Deserialize, Serialize};

/// The counts the flow compares. `None`: not reported by that source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct HardwareSummary {
    pub cpus: Option<u32>,
    pub memory_mib: Option<u64>,
    pub gpus: Option<u32>,
    pub disks: Option<u32>,
    /// Lower case.
    pub macs: Vec<String>,
}

/// What the operator expects the machine to have.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ExpectedHardware {
    pub cpus: Option<u32>,
    /// At least this much.
    pub memory_mib: Option<u64>,
    pub gpus: Option<u32>,
    /// At least this many.
    pub disks: Option<u32>,
    /// Each must be present.
    pub macs: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Comparison {
    /// Inspection and diagnose disagree: shown, not fatal.
    pub conditions: Vec<String>,
    /// The machine lacks what was expected: the machine fails with these.
    pub violations: Vec<String>,
}

/// Memory the OS sees is a little less than what the BMC reports (firmware reservations); less than this share
/// of it is a real difference (a DIMM missing).
const MEMORY_SHARE: f64 = 0.9;

/// Compares what the BMC reported, what the ramdisk saw and what was expected.
pub fn compare(
    inspection: Option<&HardwareSummary>,
    diagnosis: &HardwareSummary,
    expected: Option<&ExpectedHardware>,
) -> Comparison {
    let mut c = Comparison::default();
    if let Some(i) = inspection {
        let mut differ = |what: &str, bmc: Option<u64>, seen: Option<u64>| {
            if let (Some(b), Some(s)) = (bmc, seen)
                && b != s
            {
                c.conditions
                    .push(format!("{what}: the BMC reports {b}, the ramdisk sees {s}"));
            }
        };
        differ("CPUs", i.cpus.map(u64::from), diagnosis.cpus.map(u64::from));
        differ("GPUs", i.gpus.map(u64::from), diagnosis.gpus.map(u64::from));
        differ(
            "disks",
            i.disks.map(u64::from),
            diagnosis.disks.map(u64::from),
        );
        if let (Some(b), Some(s)) = (i.memory_mib, diagnosis.memory_mib)
            && (s as f64) < (b as f64) * MEMORY_SHARE
        {
            c.conditions.push(format!(
                "memory: the BMC reports {b} MiB, the ramdisk sees {s} MiB (DIMMs missing?)"
            ));
        }
        for mac in &i.macs {
            if !diagnosis.macs.iter().any(|m| m.eq_ignore_ascii_case(mac)) {
                c.conditions.push(format!(
                    "NIC {mac}: the BMC reports it, the ramdisk does not see it"
                ));
            }
        }
    }
    if let Some(e) = expected {
        let found = |v: Option<u64>| v.map_or("none reported".to_owned(), |v| v.to_string());
        if let Some(want) = e.cpus
            && diagnosis.cpus != Some(want)
        {
            c.violations.push(format!(
                "CPUs: expected {want}, found {}",
                found(diagnosis.cpus.map(u64::from))
            ));
        }
        if let Some(want) = e.gpus
            && diagnosis.gpus != Some(want)
        {
            c.violations.push(format!(
                "GPUs: expected {want}, found {}",
                found(diagnosis.gpus.map(u64::from))
            ));
        }
        if let Some(want) = e.memory_mib
            && diagnosis
                .memory_mib
                .is_none_or(|m| (m as f64) < want as f64 * MEMORY_SHARE)
        {
            c.violations.push(format!(
                "memory: expected at least {want} MiB, found {}",
                diagnosis
                    .memory_mib
                    .map_or("none reported".to_owned(), |m| format!("{m} MiB"))
            ));
        }
        if let Some(want) = e.disks
            && diagnosis.disks.is_none_or(|d| d < want)
        {
            c.violations.push(format!(
                "disks: expected at least {want}, found {}",
                found(diagnosis.disks.map(u64::from))
            ));
        }
        for mac in &e.macs {
            if !diagnosis.macs.iter().any(|m| m.eq_ignore_ascii_case(mac)) {
                c.violations.push(format!("NIC {mac}: expected, not found"));
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hw(cpus: u32, mem: u64, gpus: u32) -> HardwareSummary {
        HardwareSummary {
            cpus: Some(cpus),
            memory_mib: Some(mem),
            gpus: Some(gpus),
            disks: Some(2),
            macs: vec!["52:54:00:78:01:01".into()],
        }
    }

    #[test]
    fn agreeing_sources_have_no_findings() {
        let c = compare(
            Some(&hw(2, 65_536, 8)),
            &hw(2, 63_000, 8),
            Some(&ExpectedHardware {
                cpus: Some(2),
                memory_mib: Some(65_536),
                gpus: Some(8),
                disks: Some(1),
                macs: vec!["52:54:00:78:01:01".into()],
            }),
        );
        assert_eq!(c, Comparison::default());
    }

    #[test]
    fn a_missing_gpu_or_dimm_is_a_condition_without_expectations() {
        let c = compare(Some(&hw(2, 65_536, 8)), &hw(2, 32_768, 7), None);
        assert!(c.violations.is_empty());
        assert_eq!(
            c.conditions,
            vec![
                "GPUs: the BMC reports 8, the ramdisk sees 7".to_owned(),
                "memory: the BMC reports 65536 MiB, the ramdisk sees 32768 MiB (DIMMs missing?)"
                    .to_owned()
            ]
        );
    }

    #[test]
    fn an_expected_hardware_violation_names_the_difference() {
        let mut seen = hw(2, 65_536, 7);
        seen.macs.clear();
        let c = compare(
            None,
            &seen,
            Some(&ExpectedHardware {
                gpus: Some(8),
                memory_mib: Some(131_072),
                macs: vec!["52:54:00:78:01:01".into()],
                ..ExpectedHardware::default()
            }),
        );
        assert_eq!(
            c.violations,
            vec![
                "GPUs: expected 8, found 7".to_owned(),
                "memory: expected at least 131072 MiB, found 65536 MiB".to_owned(),
                "NIC 52:54:00:78:01:01: expected, not found".to_owned(),
            ]
        );
    }

    #[test]
    fn what_a_source_does_not_report_is_not_compared_but_is_missing_when_expected() {
        let c = compare(
            Some(&HardwareSummary::default()),
            &HardwareSummary::default(),
            Some(&ExpectedHardware {
                gpus: Some(1),
                ..ExpectedHardware::default()
            }),
        );
        assert!(c.conditions.is_empty());
        assert_eq!(c.violations, vec!["GPUs: expected 1, found none reported"]);
    }
}
