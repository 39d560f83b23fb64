//! The NVML backend (nvml-wrapper; libnvidia-ml.so.1 is loaded at run time, so a machine without the driver gets
//! a reported condition instead of a crash).
//!
//! Health comes from one NVML call per reading; a call NVML answers NotSupported becomes
//! [`Reading::NotSupported`], never a default value. Row remapping is read through NVML field values (the wrapper
//! has no direct call). Critical XID errors come from one NVML event set per GPU, registered at start and drained
//! (without waiting) on every health query: a query reports the XIDs seen since the previous one.

use super::health::{GpuHealth, MigState, NvLinkState, PcieLink, Reading, RetiredPages, RowRemap};
use super::{GpuBackend, GpuError, GpuInfo};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor, TemperatureThreshold,
};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id;
use nvml_wrapper::{Device, EventSet, Nvml};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// NVML allows at most this many NVLinks per GPU (`NVML_NVLINK_MAX_LINKS`).
const MAX_NVLINKS: u32 = 18;
/// Events drained per GPU per query, so a storm cannot stall a health query.
const MAX_EVENTS_PER_QUERY: usize = 1024;

pub struct NvmlBackend {
    /// Initialised once and kept for the life of the process: the XID event sets borrow it.
    nvml: &'static Nvml,
    xids: Mutex<XidWatch>,
}

fn query(e: NvmlError) -> GpuError {
    GpuError::Query {
        backend: "nvml",
        message: e.to_string(),
    }
}

fn reading<T>(r: Result<T, NvmlError>) -> Reading<T> {
    match r {
        Ok(v) => Reading::Value(v),
        Err(NvmlError::NotSupported) => Reading::NotSupported,
        Err(NvmlError::FailedToLoadSymbol(sym)) => {
            Reading::NotCollected(format!("driver lacks {sym}"))
        }
        Err(e) => Reading::Error(e.to_string()),
    }
}

impl NvmlBackend {
    pub fn init() -> Result<NvmlBackend, GpuError> {
        let nvml = Nvml::init().map_err(|e| GpuError::Unavailable {
            backend: "nvml",
            reason: e.to_string(),
        })?;
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let xids = XidWatch::start(nvml);
        Ok(NvmlBackend {
            nvml,
            xids: Mutex::new(xids),
        })
    }

    /// The driver version, for reports.
    pub fn driver_version(&self) -> Result<String, GpuError> {
        self.nvml.sys_driver_version().map_err(query)
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
                memory_mib: d
                    .memory_info()
                    .map(|m| m.total / (1024 * 1024))
                    .unwrap_or_default(),
                // nvml-wrapper 0.13 does not expose nvmlDeviceGetGpuFabricInfo; without it no clique is claimed
                // (a node's GPUs are then bookable as `node` or `any`, not `nvlink`).
                clique: None,
            });
        }
        Ok(out)
    }

    fn health(&self) -> Result<Vec<GpuHealth>, GpuError> {
        let mut seen = match self.xids.lock() {
            Ok(w) => w.drain(),
            Err(poisoned) => poisoned.into_inner().drain(),
        };
        let count = self.nvml.device_count().map_err(query)?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = self.nvml.device_by_index(index).map_err(query)?;
            let uuid = d.uuid().map_err(query)?;
            let xid_errors = seen
                .remove(&uuid)
                .unwrap_or_else(|| Reading::NotCollected("no XID event set for this GPU".into()));
            out.push(device_health(index, uuid, &d, xid_errors));
        }
        Ok(out)
    }
}

fn device_health(
    index: u32,
    uuid: String,
    d: &Device<'_>,
    xid_errors: Reading<Vec<u64>>,
) -> GpuHealth {
    let retired = match (
        d.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
        d.retired_pages(RetirementCause::DoubleBitEccError),
    ) {
        (Ok(sbe), Ok(dbe)) => Reading::Value(RetiredPages {
            sbe: sbe.len() as u64,
            dbe: dbe.len() as u64,
        }),
        (Err(e), _) | (_, Err(e)) => reading(Err(e)),
    };
    let pcie = (|| {
        Ok(PcieLink {
            gen_current: d.current_pcie_link_gen()?,
            gen_max: d.max_pcie_link_gen()?,
            width_current: d.current_pcie_link_width()?,
            width_max: d.max_pcie_link_width()?,
        })
    })();
    GpuHealth {
        index,
        uuid,
        pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
        ecc_dbe_volatile: reading(
            d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
        ),
        ecc_dbe_aggregate: reading(
            d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate),
        ),
        retired_pages: retired,
        retired_pages_pending: reading(d.are_pages_pending_retired()),
        row_remap: row_remap(d),
        pcie: reading(pcie),
        throttle_reasons: reading(d.current_throttle_reasons().map(|r| r.bits())),
        xid_errors,
        persistence_mode: reading(d.is_in_persistent_mode()),
        mig: mig(d),
        nvlink: nvlinks(d),
        temperature_c: reading(d.temperature(TemperatureSensor::Gpu)),
        temperature_slowdown_c: reading(d.temperature_threshold(TemperatureThreshold::Slowdown)),
        power_draw_mw: reading(d.power_usage()),
        power_limit_mw: reading(d.enforced_power_limit()),
    }
}

fn sample_u64(v: &SampleValue) -> u64 {
    match *v {
        SampleValue::U32(x) => u64::from(x),
        SampleValue::U64(x) => x,
        SampleValue::I64(x) => u64::try_from(x).unwrap_or(0),
        SampleValue::F64(x) if x.is_finite() && x > 0.0 => x as u64,
        SampleValue::F64(_) => 0,
    }
}

/// Row remapping through field values (`NVML_FI_DEV_REMAPPED_{COR,UNC,PENDING,FAILURE}`).
fn row_remap(d: &Device<'_>) -> Reading<RowRemap> {
    let ids = [
        FieldId(field_id::NVML_FI_DEV_REMAPPED_COR),
        FieldId(field_id::NVML_FI_DEV_REMAPPED_UNC),
        FieldId(field_id::NVML_FI_DEV_REMAPPED_PENDING),
        FieldId(field_id::NVML_FI_DEV_REMAPPED_FAILURE),
    ];
    let samples = match d.field_values_for(&ids) {
        Ok(s) => s,
        Err(e) => return reading(Err(e)),
    };
    let mut values = [0u64; 4];
    for (slot, sample) in values.iter_mut().zip(samples) {
        match sample.and_then(|s| s.value) {
            Ok(v) => *slot = sample_u64(&v),
            Err(e) => return reading(Err(e)),
        }
    }
    Reading::Value(RowRemap {
        correctable: values[0],
        uncorrectable: values[1],
        pending: values[2] != 0,
        failure: values[3] != 0,
    })
}

/// MIG mode and the profile of each MIG device (the name's part after "MIG ", e.g. `1g.10gb`).
fn mig(d: &Device<'_>) -> Reading<MigState> {
    let mode = match d.mig_mode() {
        Ok(m) => m,
        Err(e) => return reading(Err(e)),
    };
    let enabled = mode.current == 1;
    let mut layout = Vec::new();
    if enabled {
        let slots = match d.mig_device_count() {
            Ok(n) => n,
            Err(e) => return reading(Err(e)),
        };
        for i in 0..slots {
            match d.mig_device_by_index(i) {
                Ok(m) => {
                    let name = m.name().unwrap_or_default();
                    let profile = name
                        .rsplit_once("MIG ")
                        .map(|(_, p)| p.trim())
                        .unwrap_or(name.as_str());
                    layout.push(profile.to_string());
                }
                // Empty slots answer NotFound or InvalidArg.
                Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => {}
                Err(e) => return reading(Err(e)),
            }
        }
        layout.sort();
    }
    Reading::Value(MigState {
        enabled,
        pending_enabled: mode.pending == 1,
        layout,
    })
}

/// The state of every NVLink the GPU reports; NotSupported when it reports none.
fn nvlinks(d: &Device<'_>) -> Reading<Vec<NvLinkState>> {
    let mut links = Vec::new();
    for link in 0..MAX_NVLINKS {
        match d.link_wrapper_for(link).is_active() {
            Ok(active) => links.push(NvLinkState { link, active }),
            Err(NvmlError::NotSupported) | Err(NvmlError::InvalidArg) => {}
            Err(e) => return reading(Err(e)),
        }
    }
    if links.is_empty() {
        Reading::NotSupported
    } else {
        Reading::Value(links)
    }
}

// === XID events ===

/// One event set per GPU (by UUID) registered for critical XID errors, or the reading to report where there is
/// none (not supported, or registration failed).
struct XidWatch {
    sets: Vec<(String, XidSource)>,
}

type XidSource = Result<EventSet<'static>, Reading<Vec<u64>>>;

impl XidWatch {
    fn start(nvml: &'static Nvml) -> XidWatch {
        let mut sets = Vec::new();
        let count = nvml.device_count().unwrap_or(0);
        for index in 0..count {
            let Ok(d) = nvml.device_by_index(index) else {
                continue;
            };
            let Ok(uuid) = d.uuid() else { continue };
            let set = nvml
                .create_event_set()
                .map_err(|e| Reading::NotCollected(format!("creating an event set: {e}")))
                .and_then(|set| {
                    d.register_events(EventTypes::CRITICAL_XID_ERROR, set)
                        .map_err(|e| match e.error {
                            NvmlError::NotSupported => Reading::NotSupported,
                            other => {
                                Reading::NotCollected(format!("registering XID events: {other}"))
                            }
                        })
                });
            sets.push((uuid, set));
        }
        XidWatch { sets }
    }

    /// XIDs seen per GPU since the last drain (without waiting).
    fn drain(&self) -> BTreeMap<String, Reading<Vec<u64>>> {
        let mut out = BTreeMap::new();
        for (uuid, set) in &self.sets {
            let r = match set {
                Ok(set) => drain_set(set),
                Err(absent) => absent.clone(),
            };
            out.insert(uuid.clone(), r);
        }
        out
    }
}

fn drain_set(set: &EventSet<'static>) -> Reading<Vec<u64>> {
    let mut xids = Vec::new();
    for _ in 0..MAX_EVENTS_PER_QUERY {
        match set.wait(0) {
            Ok(EventData {
                event_data: Some(XidError::Value(x)),
                ..
            }) => xids.push(x),
            Ok(_) => {}
            Err(NvmlError::Timeout) => break,
            Err(e) => return Reading::Error(format!("reading XID events: {e}")),
        }
    }
    xids.sort_unstable();
    xids.dedup();
    Reading::Value(xids)
}
