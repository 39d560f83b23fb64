//! What telemetry samples from a GPU every interval ([`GpuSample`]): utilisation, framebuffer, power, energy,
//! temperature, clocks, the last XID, PCIe replays, ECC and row-remap counters, MIG instances and the processes
//! using the GPU. Every value is a [`Reading`], so a field the GPU does not support is left out of the export
//! instead of being exported as zero.
//!
//! Under MIG the device-wide utilisation fields are not supported (NVML answers NotSupported, DCGM documents the
//! `*_UTIL` fields as unsupported in MIG mode): a backend reports them [`Reading::NotSupported`] and lists the GPU
//! instances with their own framebuffer use.

use super::health::{Reading, RowRemap};
use serde::{Deserialize, Serialize};

/// One GPU instance of a MIG-enabled GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    /// The GPU instance id (DCGM's `GPU_I_ID`).
    pub gpu_instance_id: u32,
    /// The profile, e.g. `1g.10gb` (DCGM's `GPU_I_PROFILE`).
    pub profile: String,
    pub fb_used_mib: Reading<u64>,
    pub fb_free_mib: Reading<u64>,
}

/// A process using the GPU, as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    /// GPU memory the process holds (None where the driver does not say, e.g. without privilege).
    pub used_mib: Option<u64>,
    /// SM utilisation of the process over the last sample period, percent.
    pub sm_util_pct: Option<u32>,
}

/// One sample of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub pci_bus_id: String,
    /// The device minor (`/dev/nvidia<minor>`), for DCGM's `device` label.
    pub minor: Option<u32>,
    pub gpu_util_pct: Reading<u32>,
    pub mem_copy_util_pct: Reading<u32>,
    pub fb_used_mib: Reading<u64>,
    pub fb_free_mib: Reading<u64>,
    pub power_mw: Reading<u32>,
    /// Energy since the driver loaded, millijoules.
    pub energy_mj: Reading<u64>,
    pub temperature_c: Reading<u32>,
    pub sm_clock_mhz: Reading<u32>,
    pub mem_clock_mhz: Reading<u32>,
    /// The last critical XID seen (0: none since the daemon started).
    pub last_xid: Reading<u64>,
    pub pcie_replay: Reading<u64>,
    pub ecc_sbe_volatile: Reading<u64>,
    pub ecc_dbe_volatile: Reading<u64>,
    pub ecc_sbe_aggregate: Reading<u64>,
    pub ecc_dbe_aggregate: Reading<u64>,
    pub row_remap: Reading<RowRemap>,
    pub mig_enabled: bool,
    pub mig: Vec<MigInstance>,
    pub processes: Reading<Vec<GpuProcess>>,
}

impl GpuSample {
    /// A GPU of which only identity is known.
    pub fn unobserved(info: &super::GpuInfo, reason: &str) -> GpuSample {
        fn nc<T>(reason: &str) -> Reading<T> {
            Reading::NotCollected(reason.to_string())
        }
        GpuSample {
            index: info.index,
            uuid: info.uuid.clone(),
            model: info.model.clone(),
            pci_bus_id: info.pci_bus_id.clone(),
            minor: None,
            gpu_util_pct: nc(reason),
            mem_copy_util_pct: nc(reason),
            fb_used_mib: nc(reason),
            fb_free_mib: nc(reason),
            power_mw: nc(reason),
            energy_mj: nc(reason),
            temperature_c: nc(reason),
            sm_clock_mhz: nc(reason),
            mem_clock_mhz: nc(reason),
            last_xid: nc(reason),
            pcie_replay: nc(reason),
            ecc_sbe_volatile: nc(reason),
            ecc_dbe_volatile: nc(reason),
            ecc_sbe_aggregate: nc(reason),
            ecc_dbe_aggregate: nc(reason),
            row_remap: nc(reason),
            mig_enabled: false,
            mig: Vec::new(),
            processes: nc(reason),
        }
    }
}
