//! GPU metrics with dcgm-exporter's names and labels (`gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`,
//! `Hostname`), from [`GpuSample`]s. A reading the GPU does not support is left out, never exported as zero.
//!
//! Under MIG (as dcgm-exporter does) the framebuffer is reported per GPU instance with `GPU_I_ID` and
//! `GPU_I_PROFILE`, and no `*_UTIL` series exists for the GPU; the device-wide fields (power, temperature, clocks,
//! energy, ECC, XID, PCIe) stay on the GPU. Processes using a GPU are exported as
//! `bc_gpu_process_memory_used_bytes` and `bc_gpu_process_sm_util` (dcgm-exporter has no per-process metrics),
//! labelled with `pid` and the `reservation` whose booking holds the GPU.

use crate::gpu::{GpuSample, Reading};
use bc_telemetry::{Family, Kind, Labels};
use std::collections::HashMap;

struct Field {
    name: &'static str,
    kind: Kind,
    unit: &'static str,
    help: &'static str,
    value: fn(&GpuSample) -> Option<f64>,
}

fn v<T: Copy + Into<f64>>(r: &Reading<T>) -> Option<f64> {
    r.value().map(|x| (*x).into())
}

fn v64(r: &Reading<u64>) -> Option<f64> {
    r.value().map(|x| *x as f64)
}

/// The device-wide fields, in dcgm-exporter's default-counters order.
const FIELDS: &[Field] = &[
    Field {
        name: "DCGM_FI_DEV_SM_CLOCK",
        kind: Kind::Gauge,
        unit: "MHz",
        help: "SM clock frequency (in MHz).",
        value: |s| v(&s.sm_clock_mhz),
    },
    Field {
        name: "DCGM_FI_DEV_MEM_CLOCK",
        kind: Kind::Gauge,
        unit: "MHz",
        help: "Memory clock frequency (in MHz).",
        value: |s| v(&s.mem_clock_mhz),
    },
    Field {
        name: "DCGM_FI_DEV_GPU_TEMP",
        kind: Kind::Gauge,
        unit: "Cel",
        help: "GPU temperature (in C).",
        value: |s| v(&s.temperature_c),
    },
    Field {
        name: "DCGM_FI_DEV_POWER_USAGE",
        kind: Kind::Gauge,
        unit: "W",
        help: "Power draw (in W).",
        value: |s| v(&s.power_mw).map(|mw| mw / 1000.0),
    },
    Field {
        name: "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        kind: Kind::Counter,
        unit: "mJ",
        help: "Total energy consumption since boot (in mJ).",
        value: |s| v64(&s.energy_mj),
    },
    Field {
        name: "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        kind: Kind::Counter,
        unit: "1",
        help: "Total number of PCIe retries.",
        value: |s| v64(&s.pcie_replay),
    },
    Field {
        name: "DCGM_FI_DEV_GPU_UTIL",
        kind: Kind::Gauge,
        unit: "%",
        help: "GPU utilization (in %).",
        value: |s| v(&s.gpu_util_pct),
    },
    Field {
        name: "DCGM_FI_DEV_MEM_COPY_UTIL",
        kind: Kind::Gauge,
        unit: "%",
        help: "Memory utilization (in %).",
        value: |s| v(&s.mem_copy_util_pct),
    },
    Field {
        name: "DCGM_FI_DEV_XID_ERRORS",
        kind: Kind::Gauge,
        unit: "1",
        help: "Value of the last XID error encountered.",
        value: |s| v64(&s.last_xid),
    },
    Field {
        name: "DCGM_FI_DEV_FB_FREE",
        kind: Kind::Gauge,
        unit: "MiBy",
        help: "Framebuffer memory free (in MiB).",
        value: |s| {
            if s.mig_enabled {
                None
            } else {
                v64(&s.fb_free_mib)
            }
        },
    },
    Field {
        name: "DCGM_FI_DEV_FB_USED",
        kind: Kind::Gauge,
        unit: "MiBy",
        help: "Framebuffer memory used (in MiB).",
        value: |s| {
            if s.mig_enabled {
                None
            } else {
                v64(&s.fb_used_mib)
            }
        },
    },
    Field {
        name: "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        kind: Kind::Counter,
        unit: "1",
        help: "Total number of single-bit volatile ECC errors.",
        value: |s| v64(&s.ecc_sbe_volatile),
    },
    Field {
        name: "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        kind: Kind::Counter,
        unit: "1",
        help: "Total number of double-bit volatile ECC errors.",
        value: |s| v64(&s.ecc_dbe_volatile),
    },
    Field {
        name: "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        kind: Kind::Counter,
        unit: "1",
        help: "Total number of single-bit persistent ECC errors.",
        value: |s| v64(&s.ecc_sbe_aggregate),
    },
    Field {
        name: "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        kind: Kind::Counter,
        unit: "1",
        help: "Total number of double-bit persistent ECC errors.",
        value: |s| v64(&s.ecc_dbe_aggregate),
    },
    Field {
        name: "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        kind: Kind::Counter,
        unit: "1",
        help: "Number of remapped rows for correctable errors.",
        value: |s| s.row_remap.value().map(|r| r.correctable as f64),
    },
    Field {
        name: "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        kind: Kind::Counter,
        unit: "1",
        help: "Number of remapped rows for uncorrectable errors.",
        value: |s| s.row_remap.value().map(|r| r.uncorrectable as f64),
    },
    Field {
        name: "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        kind: Kind::Gauge,
        unit: "1",
        help: "Whether remapping of rows has failed.",
        value: |s| {
            s.row_remap
                .value()
                .map(|r| if r.failure { 1.0 } else { 0.0 })
        },
    },
];

/// dcgm-exporter's labels of one GPU.
pub fn gpu_labels(s: &GpuSample, hostname: &str) -> Labels {
    Labels::new()
        .with("gpu", s.index.to_string())
        .with("UUID", &s.uuid)
        .with("pci_bus_id", &s.pci_bus_id)
        .with("device", format!("nvidia{}", s.minor.unwrap_or(s.index)))
        .with("modelName", &s.model)
        .with("Hostname", hostname)
}

/// The GPU families of one sample. `reservations` maps a GPU UUID to the reservation booked on it.
pub fn families(
    samples: &[GpuSample],
    hostname: &str,
    reservations: &HashMap<String, String>,
    out: &mut Vec<Family>,
) {
    let labels: Vec<Labels> = samples.iter().map(|s| gpu_labels(s, hostname)).collect();
    for field in FIELDS {
        let mut f = Family::new(field.name, field.kind, field.unit, field.help);
        for (s, l) in samples.iter().zip(&labels) {
            if let Some(v) = (field.value)(s) {
                f.push(l.clone(), v);
            }
        }
        // MIG instances: their own framebuffer, with the instance labels.
        if matches!(field.name, "DCGM_FI_DEV_FB_FREE" | "DCGM_FI_DEV_FB_USED") {
            for (s, l) in samples.iter().zip(&labels) {
                for m in &s.mig {
                    let r = if field.name == "DCGM_FI_DEV_FB_FREE" {
                        &m.fb_free_mib
                    } else {
                        &m.fb_used_mib
                    };
                    if let Some(v) = r.value() {
                        let il = l
                            .clone()
                            .with("GPU_I_ID", m.gpu_instance_id.to_string())
                            .with("GPU_I_PROFILE", &m.profile);
                        f.push(il, *v as f64);
                    }
                }
            }
        }
        if !f.series.is_empty() {
            out.push(f);
        }
    }
    let mut mem = Family::new(
        "bc_gpu_process_memory_used_bytes",
        Kind::Gauge,
        "By",
        "GPU memory held by a process, labelled with the reservation booked on the GPU.",
    );
    let mut sm = Family::new(
        "bc_gpu_process_sm_util",
        Kind::Gauge,
        "%",
        "SM utilisation of a process over the last sample period (in %), labelled with the reservation booked on the GPU.",
    );
    for (s, l) in samples.iter().zip(&labels) {
        let Reading::Value(procs) = &s.processes else {
            continue;
        };
        for p in procs {
            let mut pl = l.clone().with("pid", p.pid.to_string());
            if let Some(r) = reservations.get(&s.uuid) {
                pl.set("reservation", r);
            }
            if let Some(m) = p.used_mib {
                mem.push(pl.clone(), (m * 1024 * 1024) as f64);
            }
            if let Some(u) = p.sm_util_pct {
                sm.push(pl, f64::from(u));
            }
        }
    }
    for f in [mem, sm] {
        if !f.series.is_empty() {
            out.push(f);
        }
    }
}
