//! `diag.nvml` reports: what bcd's acceptance check writes (signed into an envelope of type [`PAYLOAD_TYPE`]) and
//! the control plane reads to adopt or fail a node. Each check reports pass, fail or skip with the observed value
//! and the threshold.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The payload type of a signed `diag.nvml` report.
pub const PAYLOAD_TYPE: &str = "application/vnd.bettercompute.diag.nvml+json";
/// The report's `kind`.
pub const KIND: &str = "diag.nvml";

/// The checks of `diag.nvml`, in the order they are reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    Backend,
    DeviceCount,
    RetiredPagesPending,
    RowRemapPending,
    RowRemapFailure,
    VolatileDbe,
    RetiredPages,
    PcieGen,
    PcieWidth,
    Throttle,
    Xid,
    PersistenceMode,
    Mig,
    Nvlink,
    Temperature,
    Power,
    /// A check this build does not know (a newer bcd reports it): read, shown as `unknown`, never a reason to
    /// refuse the whole report.
    #[serde(other)]
    Unknown,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self).ok();
        f.write_str(s.as_ref().and_then(|v| v.as_str()).unwrap_or("?"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

/// The GPU a check is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRef {
    pub index: u32,
    pub uuid: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub check: Check,
    /// None for node-level checks (backend, device count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRef>,
    pub status: Status,
    pub observed: String,
    pub threshold: String,
    /// For fail and skip: one sentence naming the GPU and the check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub pass: u32,
    pub fail: u32,
    pub skip: u32,
}

/// The result of `diag.nvml`. `status` is fail when any check failed, else pass; skips are counted, so the
/// control plane can refuse a report that judged too little.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiagReport {
    pub kind: String,
    pub backend: String,
    pub status: Status,
    pub expected_gpu_count: u32,
    pub observed_gpu_count: u32,
    pub counts: Counts,
    pub checks: Vec<CheckResult>,
}

impl DiagReport {
    /// A report of `checks`: `status` is fail when any check failed, else pass; the counts follow from them.
    pub fn new(
        backend: &str,
        expected_gpu_count: u32,
        observed_gpu_count: u32,
        checks: Vec<CheckResult>,
    ) -> DiagReport {
        let mut counts = Counts::default();
        for c in &checks {
            match c.status {
                Status::Pass => counts.pass += 1,
                Status::Fail => counts.fail += 1,
                Status::Skip => counts.skip += 1,
            }
        }
        DiagReport {
            kind: KIND.to_string(),
            backend: backend.to_string(),
            status: if counts.fail > 0 {
                Status::Fail
            } else {
                Status::Pass
            },
            expected_gpu_count,
            observed_gpu_count,
            counts,
            checks,
        }
    }

    /// Reads a report (the control plane reads a finished check's result with it); another `kind` is refused.
    pub fn from_json(bytes: &[u8]) -> Result<DiagReport, serde_json::Error> {
        let report: DiagReport = serde_json::from_slice(bytes)?;
        report.checked()
    }

    /// [`DiagReport::from_json`] of a value already parsed.
    pub fn from_value(value: serde_json::Value) -> Result<DiagReport, serde_json::Error> {
        let report: DiagReport = serde_json::from_value(value)?;
        report.checked()
    }

    fn checked(self) -> Result<DiagReport, serde_json::Error> {
        if self.kind != KIND {
            return Err(serde::de::Error::custom(format!(
                "kind {:?} is not {KIND}",
                self.kind
            )));
        }
        Ok(self)
    }

    pub fn passed(&self) -> bool {
        self.status == Status::Pass
    }

    pub fn failures(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| c.status == Status::Fail)
    }

    /// The reasons of the failed checks, for node conditions and operator output.
    pub fn failure_reasons(&self) -> Vec<String> {
        self.failures().filter_map(|c| c.reason.clone()).collect()
    }

    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_back_and_another_kind_is_refused() -> Result<(), serde_json::Error> {
        let fail = CheckResult {
            check: Check::DeviceCount,
            gpu: None,
            status: Status::Fail,
            observed: "1".into(),
            threshold: "2".into(),
            reason: Some("1 GPU, 2 expected".into()),
        };
        let r = DiagReport::new("fixture", 2, 1, vec![fail]);
        assert_eq!((r.status, r.counts.fail), (Status::Fail, 1));
        let back = DiagReport::from_json(&r.to_json()?)?;
        assert_eq!(back, r);
        assert_eq!(
            back.failure_reasons(),
            vec!["1 GPU, 2 expected".to_string()]
        );
        assert_eq!(Check::DeviceCount.to_string(), "device_count");
        let mut v = serde_json::to_value(&r)?;
        v["kind"] = serde_json::json!("diag.other");
        let e = DiagReport::from_value(v).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("is not diag.nvml")));
        Ok(())
    }

    #[test]
    fn a_check_this_build_does_not_know_is_read_not_refused() -> Result<(), serde_json::Error> {
        let r = DiagReport::new("fixture", 1, 1, vec![]);
        let mut v = serde_json::to_value(&r)?;
        v["checks"] = serde_json::json!([{"check": "fabric_health", "status": "fail", "observed": "down",
            "threshold": "up", "reason": "GPU 0: fabric down"}]);
        let back = DiagReport::from_value(v)?;
        assert_eq!(back.checks[0].check, Check::Unknown);
        assert_eq!(
            back.failure_reasons(),
            vec!["GPU 0: fabric down".to_string()]
        );
        Ok(())
    }
}
