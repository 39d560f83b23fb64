//! Inventory parsing against DMTF's public rack-mount mockup (../shared/redfish-mockups/public-rackmount1), served
//! read-only by an axum test server (one index.json per resource path). The mockup advertises a SessionService
//! but, being read-only, cannot create sessions: the client must fall back to Basic and say why.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use bcd_site::redfish::{self, Bmc, BmcOptions, Credentials};
use serde_json::json;

fn mockup_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/redfish-mockups/public-rackmount1")
}

fn creds() -> Credentials {
    Credentials {
        username: "admin".into(),
        password: "secret".into(),
    }
}

#[tokio::test]
async fn reads_the_dmtf_rackmount_inventory() -> Result<()> {
    let dir = mockup_dir();
    if !dir.join("index.json").is_file() {
        bc_testkit::skip!("DMTF mockup not found at {}", dir.display());
    }
    let srv = common::mockup(dir, HashMap::new()).await?;
    let bmc = Bmc::connect(&srv.url, creds(), BmcOptions::default()).await?;
    assert_eq!(bmc.auth_kind(), "basic");
    let reason = bmc.basic_reason().context("reason for Basic")?;
    assert!(reason.contains("HTTP 405"), "{reason}");

    let inv = bmc.inventory().await?;
    let summary = inv.to_string();
    println!("{summary}");
    assert_eq!(inv.redfish_version.as_deref(), Some("1.15.0"));
    assert_eq!(inv.managers.len(), 1);
    assert_eq!(inv.managers[0].model.as_deref(), Some("Joo Janta 200"));
    assert_eq!(inv.chassis.len(), 1);
    assert_eq!(inv.systems.len(), 1);
    let sys = &inv.systems[0];
    assert_eq!(sys.system.id.as_deref(), Some("437XR1138R2"));
    assert_eq!(sys.system.manufacturer.as_deref(), Some("Contoso"));
    assert_eq!(sys.system.power_state.as_deref(), Some("On"));
    let boot = sys.system.boot.clone().context("Boot")?;
    assert_eq!(boot.boot_source_override_target.as_deref(), Some("Pxe"));
    let targets = boot.allowed_targets.clone().unwrap_or_default();
    assert!(
        targets.iter().any(|t| t == "Pxe") && !targets.iter().any(|t| t == "UefiHttp"),
        "{targets:?}"
    );
    let reset = sys.system.actions.reset.clone().context("Reset action")?;
    assert!(
        reset
            .allowed
            .is_some_and(|a| a.iter().any(|t| t == "ForceOff"))
    );

    // CPU2's socket reads `Status.State: Absent`: not a component.
    assert_eq!(sys.cpus().count(), 1);
    assert_eq!(sys.gpus().count(), 0);
    assert_eq!(
        sys.processors.len(),
        2,
        "CPU1 and the FPGA (CPU2 is Absent)"
    );
    assert_eq!(sys.absent.get("CPU sockets"), Some(&1));
    // DIMM4 is an empty slot (Absent): three modules.
    assert_eq!(sys.memory.len(), 3);
    assert_eq!(sys.memory_mib(), 3 * 32768);
    assert_eq!(sys.absent.get("DIMM slots"), Some(&1));
    assert_eq!(
        sys.drives.len(),
        2,
        "SimpleStorage devices that are not Absent"
    );
    // Two NIC ports; VLAN1 (a VLAN) and ToManager (the host interface) are not NICs.
    assert_eq!(sys.nics.len(), 2);
    assert_eq!(sys.other_interfaces.len(), 2);
    assert!(
        sys.nics
            .iter()
            .any(|n| n.mac_address.as_deref() == Some("12:44:6A:3B:04:11"))
    );
    assert!(summary.contains("cpus: 1"), "{summary}");
    assert!(summary.contains("other processor FPGA1"), "{summary}");
    assert!(summary.contains("memory: 3 modules, 96 GiB"), "{summary}");

    // UefiHttp is not among the mockup's allowed targets: refused before any PATCH, naming what is allowed.
    let err = bmc
        .boot_once(&sys.path, redfish::BootTarget::UefiHttp)
        .await
        .err()
        .context("UefiHttp must fail")?;
    assert!(
        matches!(err, redfish::RedfishError::BootTargetNotAllowed { .. }),
        "{err}"
    );
    // Pxe is allowed, but the read-only service refuses the PATCH: the status reaches the operator.
    let err = bmc
        .boot_once(&sys.path, redfish::BootTarget::Pxe)
        .await
        .err()
        .context("PATCH must fail")?;
    assert_eq!(err.status(), Some(405), "{err}");
    bmc.close().await?;
    Ok(())
}

/// The BMC's word is outside input: a link to another host (an absolute `@odata.id`) or a redirect is not
/// followed, so the BMC's credentials never leave for an address nobody enrolled; and memory sizes whose sum
/// overflows give a saturated total, not a panic or a wrapped figure.
#[tokio::test]
async fn links_elsewhere_are_not_followed_and_sizes_do_not_overflow() -> Result<()> {
    let dir = mockup_dir();
    if !dir.join("index.json").is_file() {
        bc_testkit::skip!("DMTF mockup not found at {}", dir.display());
    }
    let (away, seen) = common::elsewhere().await?;
    let sys = "/redfish/v1/Systems/437XR1138R2";
    let dimm = |id: &str| json!({"Id": id, "CapacityMiB": u64::MAX, "Status": {"State": "Enabled", "Health": "OK"}});
    let overlay = HashMap::from([
        (
            "/redfish/v1/Systems".to_owned(),
            json!({"Members": [{"@odata.id": format!("{}{sys}", away.url)}]}),
        ),
        (format!("{sys}/Memory/DIMM1"), dimm("DIMM1")),
        (format!("{sys}/Memory/DIMM2"), dimm("DIMM2")),
        (
            "/redfish/v1/Chassis".to_owned(),
            json!({"$redirect": format!("{}/redfish/v1/Chassis", away.url)}),
        ),
    ]);
    let srv = common::mockup(dir, overlay).await?;
    let bmc = Bmc::connect(&srv.url, creds(), BmcOptions::default()).await?;

    // The listing names a system on another host: it is left out with a warning, and fetching it fails.
    let inv = bmc.inventory().await?;
    assert!(inv.systems.is_empty(), "{inv}");
    assert!(
        inv.warnings.iter().any(|w| w.contains("not followed")),
        "{:?}",
        inv.warnings
    );
    let err = bmc
        .fetch::<serde_json::Value>(&format!("{}{sys}", away.url))
        .await
        .err()
        .context("a foreign link must fail")?;
    assert!(
        matches!(err, redfish::RedfishError::Foreign { .. }),
        "{err}"
    );
    let err = bmc
        .list("/redfish/v1/Chassis")
        .await
        .err()
        .context("a redirect must fail")?;
    assert_eq!(err.status(), Some(307), "{err}");
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(seen.is_empty(), "requests went to another host: {seen:?}");

    // The system at its own address: two modules of u64::MAX MiB each and a third of 32 GiB.
    let inv = bmc.inventory_of(sys).await?;
    let s = &inv.systems[0];
    assert_eq!(s.memory.len(), 3);
    assert_eq!(s.memory_mib(), u64::MAX);
    println!("{inv}");
    bmc.close().await?;
    Ok(())
}

#[tokio::test]
async fn lists_gpus_and_chassis_pcie_devices() -> Result<()> {
    let dir = mockup_dir();
    if !dir.join("index.json").is_file() {
        bc_testkit::skip!("DMTF mockup not found at {}", dir.display());
    }
    // The mockup has no GPU and no PCIe devices: add a GPU processor and a chassis PCIe collection on top.
    let procs = "/redfish/v1/Systems/437XR1138R2/Processors";
    let overlay = HashMap::from([
        (
            procs.to_owned(),
            json!({"Members": [
            {"@odata.id": format!("{procs}/CPU1")}, {"@odata.id": format!("{procs}/GPU0")}, {"@odata.id": format!("{procs}/GPU1")}]}),
        ),
        (
            format!("{procs}/GPU0"),
            json!({"Id": "GPU0", "ProcessorType": "GPU", "Manufacturer": "NVIDIA",
            "Model": "H100 80GB HBM3", "SerialNumber": "1650123456789", "Status": {"State": "Enabled", "Health": "OK"}}),
        ),
        (
            format!("{procs}/GPU1"),
            json!({"Id": "GPU1", "ProcessorType": "GPU", "Manufacturer": "NVIDIA",
            "Model": "H100 80GB HBM3", "SerialNumber": null, "Status": null}),
        ),
        (
            "/redfish/v1/Chassis/1U".to_owned(),
            json!({"Id": "1U", "PCIeDevices": {"@odata.id": "/redfish/v1/Chassis/1U/PCIeDevices"}}),
        ),
        (
            "/redfish/v1/Chassis/1U/PCIeDevices".to_owned(),
            json!({"Members": [{"@odata.id": "/redfish/v1/Chassis/1U/PCIeDevices/NIC"}], "Members@odata.count": 1}),
        ),
        (
            "/redfish/v1/Chassis/1U/PCIeDevices/NIC".to_owned(),
            json!({"Id": "NIC", "Manufacturer": "Mellanox", "Model": "ConnectX-7",
            "DeviceType": "MultiFunction", "PCIeInterface": {"PCIeType": "Gen5", "LanesInUse": 16}}),
        ),
    ]);
    let srv = common::mockup(dir, overlay).await?;
    let inv = redfish::inspect(&srv.url, creds(), BmcOptions::default()).await?;
    let sys = &inv.systems[0];
    let gpus: Vec<_> = sys.gpus().collect();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].model.as_deref(), Some("H100 80GB HBM3"));
    assert_eq!(sys.cpus().count(), 1);
    assert_eq!(sys.pcie_devices.len(), 1);
    assert_eq!(
        sys.pcie_devices[0]
            .pcie_interface
            .as_ref()
            .and_then(|p| p.lanes_in_use),
        Some(16)
    );
    let summary = inv.to_string();
    assert!(summary.contains("gpus: 2"), "{summary}");
    assert!(
        summary.contains("GPU0: NVIDIA H100 80GB HBM3 serial 1650123456789 OK"),
        "{summary}"
    );
    Ok(())
}

/// The fuzz target's entry point over every resource of the mockup: real documents through every model.
#[test]
fn every_mockup_document_goes_through_every_model() -> Result<()> {
    let dir = mockup_dir();
    if !dir.join("index.json").is_file() {
        bc_testkit::skip!("DMTF mockup not found at {}", dir.display());
    }
    let mut stack = vec![dir];
    let mut seen = 0;
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n == "index.json") {
                redfish::models::decode_all(&std::fs::read(&path)?);
                seen += 1;
            }
        }
    }
    assert!(seen > 200, "{seen} documents");
    Ok(())
}
