//! Unit tests of every check and every fixture fault.

use super::*;
use crate::gpu::fault::{Fault, HealthField};
use crate::gpu::fixture::{self, FixtureFile};
use crate::gpu::health::{MigState, Reading, throttle};

fn fleet(n: u32) -> FixtureFile {
    fixture::parse(&fixture::synthetic(n, "d")).unwrap_or_else(|e| panic!("fixture: {e}"))
}

fn healthy() -> GpuHealth {
    fleet(1).health().remove(0)
}

fn result(report: &DiagReport, check: Check, gpu: u32) -> &CheckResult {
    report
        .checks
        .iter()
        .find(|c| c.check == check && c.gpu.as_ref().is_some_and(|g| g.index == gpu))
        .unwrap_or_else(|| panic!("no {check} result for GPU {gpu}"))
}

/// The checks that failed, as (check, GPU index).
fn failed(report: &DiagReport) -> Vec<(Check, Option<u32>)> {
    report
        .failures()
        .map(|c| (c.check, c.gpu.as_ref().map(|g| g.index)))
        .collect()
}

fn with_fault(fault: Fault) -> DiagReport {
    let mut f = fleet(2);
    f.set_faults(1, vec![fault]);
    check(&f.health(), &DiagPolicy::new(2))
}

#[test]
fn healthy_fleet_passes_every_check() {
    let report = check(&fleet(8).health(), &DiagPolicy::new(8));
    assert!(report.passed(), "{:?}", report.failure_reasons());
    assert_eq!(report.counts.fail, 0);
    assert_eq!(report.counts.skip, 0);
    assert_eq!(report.checks.len(), 1 + 8 * 14);
    assert_eq!(report.observed_gpu_count, 8);
}

#[test]
fn each_fault_fails_its_check_only() {
    let cases = [
        (Fault::Dbe(1), Check::VolatileDbe),
        (Fault::PendingRetirement, Check::RetiredPagesPending),
        (Fault::RetiredPages(63), Check::RetiredPages),
        (Fault::RemapPending, Check::RowRemapPending),
        (Fault::RemapFailure, Check::RowRemapFailure),
        (Fault::PcieDowngrade, Check::PcieWidth),
        (Fault::Throttle(throttle::HW_SLOWDOWN), Check::Throttle),
        (Fault::Xid(79), Check::Xid),
        (Fault::PersistenceOff, Check::PersistenceMode),
        (Fault::MigEnabled, Check::Mig),
        (Fault::NvLinkDown(3), Check::Nvlink),
        (Fault::Hot, Check::Temperature),
        (Fault::PowerOver, Check::Power),
    ];
    for (fault, expected) in cases {
        let report = with_fault(fault);
        assert_eq!(failed(&report), vec![(expected, Some(1))], "fault {fault}");
        let reason = result(&report, expected, 1)
            .reason
            .clone()
            .unwrap_or_default();
        assert!(reason.contains("GPU 1 (GPU-d-0001)"), "{reason}");
        assert!(reason.contains(&expected.to_string()), "{reason}");
    }
}

#[test]
fn missing_gpu_fails_the_device_count() {
    let report = with_fault(Fault::Missing);
    assert_eq!(failed(&report), vec![(Check::DeviceCount, None)]);
    assert_eq!(report.observed_gpu_count, 1);
    let dc = &report.checks[0];
    assert_eq!(
        (dc.observed.as_str(), dc.threshold.as_str()),
        ("1 GPUs", "2 GPUs")
    );
}

#[test]
fn retired_pages_threshold_is_63() {
    assert_eq!(
        result(&with_fault(Fault::RetiredPages(62)), Check::RetiredPages, 1).status,
        Status::Pass
    );
    let r = with_fault(Fault::RetiredPages(63));
    let c = result(&r, Check::RetiredPages, 1);
    assert_eq!(c.status, Status::Fail);
    assert_eq!(c.threshold, "fewer than 63 retired pages");
}

#[test]
fn benign_xid_and_ignored_throttle_pass() {
    assert_eq!(
        result(&with_fault(Fault::Xid(13)), Check::Xid, 1).status,
        Status::Pass
    );
    let mut f = fleet(1);
    f.set_faults(
        0,
        vec![Fault::Throttle(throttle::GPU_IDLE | throttle::SW_POWER_CAP)],
    );
    let mut policy = DiagPolicy::new(1);
    assert_eq!(
        result(&check(&f.health(), &policy), Check::Throttle, 0).status,
        Status::Fail
    );
    policy.throttle_ignore_mask = throttle::SW_POWER_CAP;
    assert_eq!(
        result(&check(&f.health(), &policy), Check::Throttle, 0).status,
        Status::Pass
    );
}

#[test]
fn pcie_gen_downshift_skips_when_idle_and_fails_under_load() {
    let mut g = healthy();
    g.pcie = Reading::Value(crate::gpu::health::PcieLink {
        gen_current: 1,
        gen_max: 5,
        width_current: 16,
        width_max: 16,
    });
    let report = check(std::slice::from_ref(&g), &DiagPolicy::new(1));
    assert_eq!(result(&report, Check::PcieGen, 0).status, Status::Skip);
    g.throttle_reasons = Reading::Value(0);
    let report = check(std::slice::from_ref(&g), &DiagPolicy::new(1));
    assert_eq!(result(&report, Check::PcieGen, 0).status, Status::Fail);
    assert_eq!(
        result(&report, Check::PcieGen, 0).observed,
        "gen 1 of max 5"
    );
}

#[test]
fn pcie_minimums_from_policy() {
    let mut policy = DiagPolicy::new(1);
    policy.pcie_min_gen = Some(6);
    policy.pcie_min_width = Some(32);
    let report = check(&[healthy()], &policy);
    assert_eq!(
        failed(&report),
        vec![(Check::PcieGen, Some(0)), (Check::PcieWidth, Some(0))]
    );
}

#[test]
fn not_supported_skips_with_the_reason_never_passes() {
    let mut f = fleet(1);
    f.gpus[0].not_supported = vec![
        HealthField::RowRemap,
        HealthField::RetiredPages,
        HealthField::Nvlink,
    ];
    let report = check(&f.health(), &DiagPolicy::new(1));
    assert!(report.passed());
    for c in [
        Check::RowRemapPending,
        Check::RowRemapFailure,
        Check::RetiredPages,
        Check::Nvlink,
    ] {
        let r = result(&report, c, 0);
        assert_eq!(r.status, Status::Skip, "{c}");
        assert!(
            r.reason
                .as_deref()
                .is_some_and(|s| s.contains("not supported")),
            "{c}: {:?}",
            r.reason
        );
    }
    assert_eq!(report.counts.skip, 4);
}

#[test]
fn query_error_fails_and_not_collected_skips() {
    let mut g = healthy();
    g.ecc_dbe_volatile = Reading::Error("GPU is lost".into());
    g.xid_errors = Reading::NotCollected("no event set".into());
    let report = check(&[g], &DiagPolicy::new(1));
    assert_eq!(result(&report, Check::VolatileDbe, 0).status, Status::Fail);
    assert!(
        result(&report, Check::VolatileDbe, 0)
            .observed
            .contains("GPU is lost")
    );
    assert_eq!(result(&report, Check::Xid, 0).status, Status::Skip);
}

#[test]
fn temperature_and_power_need_both_readings() {
    let mut g = healthy();
    g.temperature_slowdown_c = Reading::NotSupported;
    g.power_limit_mw = Reading::NotSupported;
    let report = check(&[g], &DiagPolicy::new(1));
    assert_eq!(result(&report, Check::Temperature, 0).status, Status::Skip);
    assert_eq!(result(&report, Check::Power, 0).status, Status::Skip);
}

#[test]
fn temperature_margin_and_power_tolerance() {
    let mut g = healthy();
    g.temperature_c = Reading::Value(80);
    g.power_draw_mw = Reading::Value(720_000);
    let mut policy = DiagPolicy::new(1);
    let report = check(std::slice::from_ref(&g), &policy);
    assert_eq!(result(&report, Check::Temperature, 0).status, Status::Pass);
    assert_eq!(result(&report, Check::Power, 0).status, Status::Pass);
    policy.temperature_margin_c = 10;
    policy.power_tolerance_pct = 0;
    let report = check(&[g], &policy);
    assert_eq!(result(&report, Check::Temperature, 0).status, Status::Fail);
    assert_eq!(result(&report, Check::Power, 0).status, Status::Fail);
}

#[test]
fn mig_layout_against_expectation() {
    let mut g = healthy();
    g.mig = Reading::Value(MigState {
        enabled: true,
        pending_enabled: true,
        layout: vec!["3g.40gb".into(), "1g.10gb".into()],
    });
    let mut policy = DiagPolicy::new(1);
    let status = |p: &DiagPolicy, g: &GpuHealth| {
        result(&check(std::slice::from_ref(g), p), Check::Mig, 0).status
    };
    assert_eq!(status(&policy, &g), Status::Fail);
    policy.mig = MigExpectation::Enabled {
        layout: vec!["1g.10gb".into(), "3g.40gb".into()],
    };
    assert_eq!(status(&policy, &g), Status::Pass);
    policy.mig = MigExpectation::Enabled {
        layout: vec!["7g.80gb".into()],
    };
    assert_eq!(status(&policy, &g), Status::Fail);
    policy.mig = MigExpectation::Enabled { layout: vec![] };
    assert_eq!(status(&policy, &g), Status::Pass);
    policy.mig = MigExpectation::Any;
    assert_eq!(status(&policy, &g), Status::Pass);
    // A mode change waiting for a reset is not settled.
    policy.mig = MigExpectation::Disabled;
    g.mig = Reading::Value(MigState {
        enabled: false,
        pending_enabled: true,
        layout: vec![],
    });
    let report = check(std::slice::from_ref(&g), &policy);
    assert_eq!(
        result(&report, Check::Mig, 0).observed,
        "MIG disabled, enabled after reset"
    );
    assert_eq!(status(&policy, &g), Status::Fail);
}

#[test]
fn policy_can_waive_persistence_and_nvlink() {
    let mut f = fleet(1);
    f.set_faults(0, vec![Fault::PersistenceOff, Fault::NvLinkDown(0)]);
    let mut policy = DiagPolicy::new(1);
    assert_eq!(check(&f.health(), &policy).counts.fail, 2);
    policy.require_persistence_mode = false;
    policy.require_nvlink_up = false;
    let report = check(&f.health(), &policy);
    assert!(report.passed());
    assert_eq!(
        result(&report, Check::PersistenceMode, 0).status,
        Status::Skip
    );
    assert_eq!(result(&report, Check::Nvlink, 0).status, Status::Skip);
}

#[test]
fn policy_json_defaults_and_strictness() {
    let p: DiagPolicy =
        serde_json::from_str(r#"{"expected_gpu_count": 8}"#).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p, DiagPolicy::new(8));
    let p: DiagPolicy = serde_json::from_str(
        r#"{"expected_gpu_count": 8, "mig": {"mode": "enabled", "layout": ["7g.80gb"]}}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        p.mig,
        MigExpectation::Enabled {
            layout: vec!["7g.80gb".into()]
        }
    );
    assert!(
        serde_json::from_str::<DiagPolicy>(r#"{"expected_gpu_count": 8, "retired_pages": 1}"#)
            .is_err()
    );
}

#[test]
fn report_round_trips_through_json() {
    let report = with_fault(Fault::Dbe(2));
    let bytes = report.to_json().unwrap_or_else(|e| panic!("{e}"));
    let back: DiagReport = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, report);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(v["kind"], "diag.nvml");
    assert_eq!(v["status"], "fail");
    assert_eq!(v["checks"][0]["check"], "device_count");
}

#[test]
fn gpus_are_reported_in_index_order() {
    let mut gpus = fleet(3).health();
    gpus.reverse();
    let report = check(&gpus, &DiagPolicy::new(3));
    let order: Vec<u32> = report
        .checks
        .iter()
        .filter_map(|c| c.gpu.as_ref().map(|g| g.index))
        .collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]));
}
