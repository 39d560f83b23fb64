//! The NVML backend (nvml-wrapper; libnvidia-ml.so.1 is loaded at run time, so a machine without the driver gets
//! a reported condition instead of a crash).

use super::{GpuBackend, GpuError, GpuInfo};
use nvml_wrapper::Nvml;

pub struct NvmlBackend {
    nvml: Nvml,
}

fn query(e: nvml_wrapper::error::NvmlError) -> GpuError {
    GpuError::Query {
        backend: "nvml",
        message: e.to_string(),
    }
}

impl NvmlBackend {
    pub fn init() -> Result<NvmlBackend, GpuError> {
        Nvml::init().map(|nvml| NvmlBackend { nvml }).map_err(|e| GpuError::Unavailable {
            backend: "nvml",
            reason: e.to_string(),
        })
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let count = self.nvml.device_count().map_err(query)?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = self.nvml.device_by_index(index).map_err(query)?;
            out.push(GpuInfo {
                index,
                uuid: d.uuid().map_err(query)?,
                // Consumer boards have no serial; that is not an error.
                serial: d.serial().unwrap_or_default(),
                model: d.name().map_err(query)?,
                pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
                memory_mib: d.memory_info().map(|m| m.total / (1024 * 1024)).unwrap_or_default(),
            });
        }
        Ok(out)
    }
}
