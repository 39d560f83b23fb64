//! The NVML backend (nvml-wrapper; libnvidia-ml.so.1 is loaded at run time, so a machine without the driver gets
//! a reported condition instead of a crash).
//!
//! Health comes from one NVML call per reading; a call NVML answers NotSupported becomes
//! [`Reading::NotSupported`], never a default value. Row remapping is read through NVML field values (the wrapper
//! has no direct call). Critical XID errors come from one NVML event set per GPU, registered at start and drained
//! (without waiting) on every health and telemetry query: a health query reports the XIDs seen since the previous
//! health query, a telemetry sample the last XID seen.
//!
//! Telemetry ([`GpuBackend::sample`]) reads utilisation, memory, power, energy, temperature, clocks, PCIe replays,
//! ECC counters and row remaps per GPU; on a MIG-enabled GPU the utilisation fields are not read (NVML does not
//! support them there) and each MIG device's memory is read with its GPU instance id; running compute processes
//! come with their memory and, where the driver keeps them, SM utilisation samples.

use super::health::{GpuHealth, MigState, NvLinkState, PcieLink, Reading, RetiredPages, RowRemap};
use super::sample::{GpuProcess, GpuSample, MigInstance};
use super::{GpuBackend, GpuError, GpuInfo};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor, TemperatureThreshold,
};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::device::UsedGpuMemory;
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
    /// Per GPU (UUID), the newest process-utilisation sample already read (NVML timestamps, µs).
    process_samples_since: Mutex<BTreeMap<String, u64>>,
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
            process_samples_since: Mutex::new(BTreeMap::new()),
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
            Ok(mut w) => w.take_for_health(),
            Err(poisoned) => poisoned.into_inner().take_for_health(),
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

    fn sample(&self, _at_ms: i64) -> Result<Vec<GpuSample>, GpuError> {
        let last_xids = match self.xids.lock() {
            Ok(mut w) => w.last_seen(),
            Err(poisoned) => poisoned.into_inner().last_seen(),
        };
        let count = self.nvml.device_count().map_err(query)?;
        let mut out = Vec::with_capacity(count as usize);
        let mut since = match self.process_samples_since.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for index in 0..count {
            let d = self.nvml.device_by_index(index).map_err(query)?;
            let uuid = d.uuid().map_err(query)?;
            let last_xid = last_xids
                .get(&uuid)
                .cloned()
                .unwrap_or_else(|| Reading::NotCollected("no XID event set for this GPU".into()));
            let last_seen = since.get(&uuid).copied();
            let (s, newest) = device_sample(index, uuid.clone(), &d, last_xid, last_seen);
            if let Some(t) = newest {
                since.insert(uuid, t);
            }
            out.push(s);
        }
        Ok(out)
    }
}

/// One GPU's telemetry; also the newest process-utilisation timestamp seen (the next query asks from there).
fn device_sample(
    index: u32,
    uuid: String,
    d: &Device<'_>,
    last_xid: Reading<u64>,
    process_since: Option<u64>,
) -> (GpuSample, Option<u64>) {
    let mig_enabled = d.mig_mode().map(|m| m.current == 1).unwrap_or(false);
    let (gpu_util_pct, mem_copy_util_pct) = if mig_enabled {
        (Reading::NotSupported, Reading::NotSupported)
    } else {
        pair(d.utilization_rates().map(|u| (u.gpu, u.memory)))
    };
    let mib = |b: u64| b / (1024 * 1024);
    let (fb_used_mib, fb_free_mib) = pair(d.memory_info().map(|m| (mib(m.used), mib(m.free))));
    let ecc = |kind, counter| reading(d.total_ecc_errors(kind, counter));
    let mig = if mig_enabled {
        mig_instances(d)
    } else {
        Vec::new()
    };
    let (processes, newest) = processes(d, process_since);
    let sample = GpuSample {
        index,
        uuid,
        model: d.name().unwrap_or_default(),
        pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
        minor: d.minor_number().ok(),
        gpu_util_pct,
        mem_copy_util_pct,
        fb_used_mib,
        fb_free_mib,
        power_mw: reading(d.power_usage()),
        energy_mj: reading(d.total_energy_consumption()),
        temperature_c: reading(d.temperature(TemperatureSensor::Gpu)),
        sm_clock_mhz: reading(d.clock_info(Clock::SM)),
        mem_clock_mhz: reading(d.clock_info(Clock::Memory)),
        last_xid,
        pcie_replay: reading(d.pcie_replay_counter().map(u64::from)),
        ecc_sbe_volatile: ecc(MemoryError::Corrected, EccCounter::Volatile),
        ecc_dbe_volatile: ecc(MemoryError::Uncorrected, EccCounter::Volatile),
        ecc_sbe_aggregate: ecc(MemoryError::Corrected, EccCounter::Aggregate),
        ecc_dbe_aggregate: ecc(MemoryError::Uncorrected, EccCounter::Aggregate),
        row_remap: row_remap(d),
        mig_enabled,
        mig,
        processes,
    };
    (sample, newest)
}

/// Two readings from one NVML call (utilisation gpu/memory, memory used/free): both values, or both absent for the
/// same reason.
fn pair<A, B>(r: Result<(A, B), NvmlError>) -> (Reading<A>, Reading<B>) {
    match r {
        Ok((a, b)) => (Reading::Value(a), Reading::Value(b)),
        Err(e) => {
            let why: Reading<()> = reading(Err(e));
            (absent(&why), absent(&why))
        }
    }
}

fn absent<T>(r: &Reading<()>) -> Reading<T> {
    match r {
        Reading::NotSupported => Reading::NotSupported,
        Reading::NotCollected(m) => Reading::NotCollected(m.clone()),
        Reading::Error(m) => Reading::Error(m.clone()),
        Reading::Value(()) => Reading::Error("no value".into()),
    }
}

/// The GPU instances of a MIG-enabled GPU with their memory, by GPU instance id.
fn mig_instances(d: &Device<'_>) -> Vec<MigInstance> {
    let slots = d.mig_device_count().unwrap_or(0);
    let mut out = Vec::new();
    for i in 0..slots {
        let Ok(m) = d.mig_device_by_index(i) else {
            continue;
        };
        let Some(gpu_instance_id) = gpu_instance_id(&m) else {
            continue;
        };
        let name = m.name().unwrap_or_default();
        let profile = name
            .rsplit_once("MIG ")
            .map(|(_, p)| p.trim().to_string())
            .unwrap_or(name);
        let mib = |b: u64| b / (1024 * 1024);
        let (fb_used_mib, fb_free_mib) =
            pair(m.memory_info().map(|mem| (mib(mem.used), mib(mem.free))));
        out.push(MigInstance {
            gpu_instance_id,
            profile,
            fb_used_mib,
            fb_free_mib,
        });
    }
    out.sort_by_key(|m| m.gpu_instance_id);
    out
}

/// `nvmlDeviceGetGpuInstanceId` of a MIG device handle (nvml-wrapper 0.13 has no safe wrapper for it).
#[allow(unsafe_code)]
fn gpu_instance_id(m: &Device<'_>) -> Option<u32> {
    let f = m.nvml().lib().nvmlDeviceGetGpuInstanceId.as_ref().ok()?;
    let mut id: std::os::raw::c_uint = 0;
    // SAFETY: `m` is a live MIG device handle obtained from this NVML instance (which outlives it), and `id` is a
    // valid, writable c_uint for the duration of the call; the symbol has the C signature bindgen recorded.
    let rc = unsafe { f(m.handle(), &mut id) };
    (rc == 0).then_some(id)
}

/// Running compute processes with their memory and SM utilisation (samples newer than `since`, µs).
fn processes(d: &Device<'_>, since: Option<u64>) -> (Reading<Vec<GpuProcess>>, Option<u64>) {
    let procs = match d.running_compute_processes() {
        Ok(p) => p,
        Err(e) => return (reading(Err(e)), None),
    };
    let util = d.process_utilization_stats(since).unwrap_or_default();
    let newest = util.iter().map(|u| u.timestamp).max();
    let mut out: Vec<GpuProcess> = procs
        .into_iter()
        .map(|p| GpuProcess {
            pid: p.pid,
            used_mib: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b / (1024 * 1024)),
                UsedGpuMemory::Unavailable => None,
            },
            sm_util_pct: util
                .iter()
                .filter(|u| u.pid == p.pid)
                .max_by_key(|u| u.timestamp)
                .map(|u| u.sm_util),
        })
        .collect();
    out.sort_by_key(|p| p.pid);
    out.dedup_by_key(|p| p.pid);
    (Reading::Value(out), newest)
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
    /// Drained but not yet reported to a health query, per GPU.
    pending: BTreeMap<String, Vec<u64>>,
    /// The last XID drained per GPU (telemetry's `DCGM_FI_DEV_XID_ERRORS`).
    last: BTreeMap<String, u64>,
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
        XidWatch {
            sets,
            pending: BTreeMap::new(),
            last: BTreeMap::new(),
        }
    }

    /// Drains every event set (without waiting) into `pending` and `last`; the reading of a GPU whose set is
    /// absent or failed to drain.
    fn poll(&mut self) -> BTreeMap<String, Reading<Vec<u64>>> {
        let mut failed = BTreeMap::new();
        for (uuid, set) in &self.sets {
            let r = match set {
                Ok(set) => drain_set(set),
                Err(absent) => absent.clone(),
            };
            match r {
                Reading::Value(xids) => {
                    if let Some(x) = xids.last() {
                        self.last.insert(uuid.clone(), *x);
                    }
                    let p = self.pending.entry(uuid.clone()).or_default();
                    p.extend(xids);
                    p.sort_unstable();
                    p.dedup();
                }
                other => {
                    failed.insert(uuid.clone(), other);
                }
            }
        }
        failed
    }

    /// XIDs seen per GPU since the last health query.
    fn take_for_health(&mut self) -> BTreeMap<String, Reading<Vec<u64>>> {
        let mut out = self.poll();
        for (uuid, _) in &self.sets {
            if !out.contains_key(uuid) {
                let xids = self.pending.remove(uuid).unwrap_or_default();
                out.insert(uuid.clone(), Reading::Value(xids));
            }
        }
        out
    }

    /// The last XID seen per GPU (0 when none was).
    fn last_seen(&mut self) -> BTreeMap<String, Reading<u64>> {
        let failed = self.poll();
        self.sets
            .iter()
            .map(|(uuid, _)| {
                let r = match failed.get(uuid) {
                    Some(f) => f.clone().map(|_| 0),
                    None => Reading::Value(self.last.get(uuid).copied().unwrap_or(0)),
                };
                (uuid.clone(), r)
            })
            .collect()
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
