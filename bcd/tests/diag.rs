//! diag.nvml end to end over the fixture backend: the file is re-read on every query, so a fault injected or
//! cleared under a running backend changes the next report; reports sign into a verifiable envelope.

use anyhow::Result;
use bcd::diag::{self, Check, DiagPolicy, Status};
use bcd::gpu::fault::Fault;
use bcd::gpu::fixture::{self, FixtureBackend, FixtureFile};
use bcd::gpu::{GpuBackend, GpuError, GpuInfo};
use std::path::Path;

fn write_fleet(path: &Path, n: u32, faults: &[(u32, Vec<Fault>)]) -> Result<()> {
    let mut f: FixtureFile = fixture::parse(&fixture::synthetic(n, "node7"))?;
    for (index, list) in faults {
        assert!(f.set_faults(*index, list.clone()));
    }
    std::fs::write(path, serde_json::to_vec_pretty(&f)?)?;
    Ok(())
}

#[test]
fn dbe_on_one_of_eight_fails_naming_gpu_and_check_then_clears() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gpus.json");
    write_fleet(&path, 8, &[])?;
    let backend = FixtureBackend::load(&path)?;
    let policy = DiagPolicy::new(8);

    let report = diag::run(&backend, &policy);
    assert!(report.passed(), "{:?}", report.failure_reasons());
    assert_eq!(report.backend, "fixture");

    write_fleet(&path, 8, &[(5, vec![Fault::Dbe(1)])])?;
    let report = diag::run(&backend, &policy);
    assert_eq!(report.status, Status::Fail);
    let reasons = report.failure_reasons();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains("GPU 5 (GPU-node7-0005)"),
        "{}",
        reasons[0]
    );
    assert!(reasons[0].contains("volatile_dbe"), "{}", reasons[0]);
    let failed = report
        .failures()
        .next()
        .map(|c| (c.check, c.observed.clone(), c.threshold.clone()));
    assert_eq!(
        failed,
        Some((
            Check::VolatileDbe,
            "1 volatile double-bit ECC errors (1 aggregate)".to_string(),
            "0 volatile double-bit ECC errors".to_string()
        ))
    );

    // Clearing the fault under the same backend: the next run passes.
    write_fleet(&path, 8, &[])?;
    let report = diag::run(&backend, &policy);
    assert!(report.passed(), "{:?}", report.failure_reasons());
    Ok(())
}

#[test]
fn every_fault_from_a_file_fails_the_node() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gpus.json");
    let faults = [
        "dbe",
        "pending_retirement",
        "remap_failure",
        "remap_pending",
        "pcie_downgrade",
        "throttle",
        "xid:79",
        "missing",
        "retired_pages:63",
        "persistence_off",
        "mig_enabled",
        "nvlink_down",
        "hot",
        "power_over",
    ];
    for text in faults {
        let doc = fixture::synthetic(8, "f").replacen(
            r#""index":2,"#,
            &format!(r#""index":2,"faults":["{text}"],"#),
            1,
        );
        std::fs::write(&path, &doc)?;
        let backend = FixtureBackend::load(&path)?;
        let report = diag::run(&backend, &DiagPolicy::new(8));
        assert_eq!(
            report.counts.fail,
            1,
            "{text}: {:?}",
            report.failure_reasons()
        );
        let reason = &report.failure_reasons()[0];
        let names_gpu = reason.contains("GPU 2 (GPU-f-0002)")
            || (text == "missing" && reason.contains("7 GPUs"));
        assert!(names_gpu, "{text}: {reason}");
    }
    Ok(())
}

#[test]
fn unreadable_fixture_fails_the_backend_check() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gpus.json");
    write_fleet(&path, 2, &[])?;
    let backend = FixtureBackend::load(&path)?;
    std::fs::write(
        &path,
        r#"{"gpus": [{"index": 0, "uuid": "u", "model": "m", "faults": ["melted"]}]}"#,
    )?;
    let report = diag::run(&backend, &DiagPolicy::new(2));
    let failed: Vec<Check> = report.failures().map(|c| c.check).collect();
    assert_eq!(failed, vec![Check::Backend, Check::DeviceCount]);
    assert!(
        report.failure_reasons()[0].contains("melted"),
        "{:?}",
        report.failure_reasons()
    );
    Ok(())
}

/// A backend that lists GPUs but observes no health: every check skips, none passes.
struct ListOnly;

impl GpuBackend for ListOnly {
    fn name(&self) -> &'static str {
        "list-only"
    }
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(vec![GpuInfo {
            index: 0,
            uuid: "GPU-x".into(),
            serial: String::new(),
            model: "m".into(),
            pci_bus_id: String::new(),
            memory_mib: 0,
            clique: None,
        }])
    }
}

#[test]
fn backend_without_health_skips_rather_than_passes() {
    let report = diag::run(&ListOnly, &DiagPolicy::new(1));
    assert_eq!(report.counts.pass, 1, "only the device count can pass");
    assert_eq!(report.counts.skip, 14);
    assert!(
        report
            .checks
            .iter()
            .filter(|c| c.status == Status::Skip)
            .all(|c| {
                c.reason
                    .as_deref()
                    .is_some_and(|r| r.contains("collects no GPU health"))
            })
    );
}

#[test]
fn no_gpus_expected_none_passes_and_expected_some_fails() {
    assert!(diag::run(&bcd::gpu::NoGpus, &DiagPolicy::new(0)).passed());
    let report = diag::run(&bcd::gpu::NoGpus, &DiagPolicy::new(8));
    assert_eq!(
        report.failure_reasons(),
        vec!["device_count: 0 GPUs visible, 8 expected".to_string()]
    );
}

#[test]
fn report_signs_into_a_verifiable_envelope() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gpus.json");
    write_fleet(&path, 8, &[(1, vec![Fault::Xid(79)])])?;
    let report = diag::run(&FixtureBackend::load(&path)?, &DiagPolicy::new(8));

    let key = rcgen::KeyPair::generate()?;
    let signer_id = "spiffe://test.example/node/n1".to_string();
    let signer = bc_proto::envelope::EnvelopeSigner::new(&key.serialize_der(), signer_id.clone())?;
    let env = diag::sign(&report, &signer)?;
    assert_eq!(env.payload_type, diag::PAYLOAD_TYPE);
    bc_proto::envelope::verify(&env, signer.public_key(), &signer_id)?;
    let back: diag::DiagReport = serde_json::from_slice(&env.payload)?;
    assert_eq!(back, report);
    assert_eq!(back.status, Status::Fail);
    Ok(())
}
