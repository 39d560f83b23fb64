//! Hardware claims: DMI identifiers, NICs and GPUs, read from sysfs/procfs under a root directory (`/` on a real
//! node; a prepared tree in tests, so many simulated nodes can run on one machine).

use crate::gpu::GpuBackend;
use bc_proto::v1;
use std::path::Path;

fn read_trimmed(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn link_name(path: &Path) -> String {
    std::fs::read_link(path)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        .unwrap_or_default()
}

/// Collects claims. A GPU backend failure is recorded in `collection_notes`, not fatal: the control plane decides.
pub fn collect(
    root: &Path,
    gpus: Option<&dyn GpuBackend>,
    gpu_error: Option<String>,
) -> v1::HardwareClaims {
    let dmi_dir = root.join("sys/class/dmi/id");
    let dmi = v1::DmiClaims {
        system_uuid: read_trimmed(&dmi_dir.join("product_uuid")),
        system_serial: read_trimmed(&dmi_dir.join("product_serial")),
        board_serial: read_trimmed(&dmi_dir.join("board_serial")),
        chassis_serial: read_trimmed(&dmi_dir.join("chassis_serial")),
        vendor: read_trimmed(&dmi_dir.join("sys_vendor")),
        product: read_trimmed(&dmi_dir.join("product_name")),
    };
    let mut nics = Vec::new();
    if let Ok(entries) = std::fs::read_dir(root.join("sys/class/net")) {
        for e in entries.flatten() {
            let dir = e.path();
            // Physical NICs have a `device` link; bridges, veths and loopback do not.
            if !dir.join("device").exists() {
                continue;
            }
            nics.push(v1::NicClaim {
                name: e.file_name().to_string_lossy().to_string(),
                mac: read_trimmed(&dir.join("address")),
                driver: link_name(&dir.join("device/driver")),
                pci_address: link_name(&dir.join("device")),
            });
        }
    }
    nics.sort_by(|a, b| a.name.cmp(&b.name));
    let mut notes = Vec::new();
    if let Some(e) = gpu_error {
        notes.push(e);
    }
    let mut gpu_claims = Vec::new();
    let mut backend_name = "none".to_string();
    if let Some(backend) = gpus {
        backend_name = backend.name().to_string();
        match backend.gpus() {
            Ok(list) => {
                gpu_claims = list
                    .into_iter()
                    .map(|g| v1::GpuClaim {
                        index: g.index,
                        uuid: g.uuid,
                        serial: g.serial,
                        model: g.model,
                        pci_bus_id: g.pci_bus_id,
                        memory_mib: g.memory_mib,
                    })
                    .collect()
            }
            Err(e) => notes.push(e.to_string()),
        }
    }
    v1::HardwareClaims {
        dmi: Some(dmi),
        nics,
        gpus: gpu_claims,
        hostname: read_trimmed(&root.join("proc/sys/kernel/hostname")),
        arch: std::env::consts::ARCH.to_string(),
        gpu_backend: backend_name,
        collection_notes: notes,
    }
}
