//! The fixture backend: GPUs described by a JSON file, for tests and demos on machines without GPUs.
//!
//! `{"gpus": [{"index": 0, "uuid": "GPU-…", "model": "…", "faults": ["dbe", "xid:79"], "not_supported": ["nvlink"]}]}`.
//! A GPU without faults is a healthy H100-like board; each fault (see [`Fault`]) changes the health it reports and
//! `missing` hides it. Unknown fields and unknown faults are refused so a typo is not silently ignored. The file is
//! re-read on every query, so a test can inject or clear a fault under a running daemon. See docs/gpu.md.
//!
//! Telemetry values vary with time: [`FixtureGpu::sample`] is a pure function of the sample time (and the GPU's
//! index, faults and `processes`), so a test recomputes exactly what was served at any timestamp a database
//! returns. `mig_enabled` turns the GPU into seven `1g.10gb` instances (GPU instance ids 7–13) without
//! utilisation fields, as NVML reports a MIG-enabled GPU.

use super::fault::{Fault, HealthField};
use super::health::{
    GpuHealth, MigState, NvLinkState, PcieLink, Reading, RetiredPages, RowRemap, throttle,
};
use super::sample::{GpuProcess, GpuSample, MigInstance};
use super::{GpuBackend, GpuError, GpuInfo};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The fixture file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureFile {
    pub gpus: Vec<FixtureGpu>,
}

/// One GPU of the fixture: identity, injected faults and fields to report as not supported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureGpu {
    pub index: u32,
    pub uuid: String,
    #[serde(default)]
    pub serial: String,
    pub model: String,
    #[serde(default)]
    pub pci_bus_id: String,
    #[serde(default)]
    pub memory_mib: u64,
    /// NVLink fabric clique, as NVML's GPU fabric info would report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clique: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<Fault>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_supported: Vec<HealthField>,
    /// Processes using the GPU, as NVML would list them (telemetry labels them with the booking's reservation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<FixtureProcess>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureProcess {
    pub pid: u32,
    pub used_mib: u64,
}

/// Number of NVLinks of a fixture GPU (an H100 SXM has 18).
pub const NVLINKS: u32 = 18;
const SLOWDOWN_C: u32 = 87;
const POWER_LIMIT_MW: u32 = 700_000;

/// Parses a fixture document (sans I/O; the fuzz target drives this).
pub fn parse(text: &str) -> Result<FixtureFile, serde_json::Error> {
    serde_json::from_str(text)
}

// === impl FixtureFile ===

impl FixtureFile {
    fn visible(&self) -> impl Iterator<Item = &FixtureGpu> {
        self.gpus
            .iter()
            .filter(|g| !g.faults.contains(&Fault::Missing))
    }

    /// The GPUs a backend would list (a `missing` GPU is absent).
    pub fn infos(&self) -> Vec<GpuInfo> {
        self.visible().map(FixtureGpu::info).collect()
    }

    /// The health a backend would observe.
    pub fn health(&self) -> Vec<GpuHealth> {
        self.visible().map(FixtureGpu::health).collect()
    }

    /// The telemetry sample a backend would read at `at_ms`.
    pub fn sample(&self, at_ms: i64) -> Vec<GpuSample> {
        self.visible().map(|g| g.sample(at_ms)).collect()
    }

    /// Sets the faults of the GPU with `index`; false when there is none.
    pub fn set_faults(&mut self, index: u32, faults: Vec<Fault>) -> bool {
        match self.gpus.iter_mut().find(|g| g.index == index) {
            Some(g) => {
                g.faults = faults;
                true
            }
            None => false,
        }
    }
}

// === impl FixtureGpu ===

impl FixtureGpu {
    pub fn info(&self) -> GpuInfo {
        GpuInfo {
            index: self.index,
            uuid: self.uuid.clone(),
            serial: self.serial.clone(),
            model: self.model.clone(),
            pci_bus_id: self.pci_bus_id.clone(),
            memory_mib: self.memory_mib,
            clique: self.clique.clone(),
        }
    }

    /// A healthy board with this GPU's faults applied, then its unsupported fields blanked.
    pub fn health(&self) -> GpuHealth {
        let mut dbe = 0u64;
        let mut retired = RetiredPages::default();
        let mut pending = false;
        let mut remap = RowRemap::default();
        let mut pcie = PcieLink {
            gen_current: 5,
            gen_max: 5,
            width_current: 16,
            width_max: 16,
        };
        let mut throttle_bits = throttle::GPU_IDLE;
        let mut xids: Vec<u64> = Vec::new();
        let mut persistence = true;
        let mut mig = MigState::default();
        let mut links: Vec<NvLinkState> = (0..NVLINKS)
            .map(|link| NvLinkState { link, active: true })
            .collect();
        let mut temperature = 34;
        let mut power = 72_000;
        for fault in &self.faults {
            match *fault {
                Fault::Dbe(n) => dbe = dbe.saturating_add(n),
                Fault::PendingRetirement => pending = true,
                Fault::RetiredPages(n) => retired.dbe = retired.dbe.saturating_add(n),
                Fault::RemapPending => remap.pending = true,
                Fault::RemapFailure => remap.failure = true,
                Fault::PcieDowngrade => {
                    pcie.gen_current = 4;
                    pcie.width_current = 8;
                }
                Fault::Throttle(bits) => throttle_bits = bits,
                Fault::Xid(x) => xids.push(x),
                Fault::PersistenceOff => persistence = false,
                Fault::MigEnabled => {
                    mig = MigState {
                        enabled: true,
                        pending_enabled: true,
                        layout: vec!["1g.10gb".to_string(); 7],
                    }
                }
                Fault::NvLinkDown(l) => {
                    if let Some(s) = links.iter_mut().find(|s| s.link == l) {
                        s.active = false;
                    }
                }
                Fault::Hot => temperature = SLOWDOWN_C + 2,
                Fault::PowerOver => power = POWER_LIMIT_MW + POWER_LIMIT_MW / 10,
                Fault::Missing => {}
            }
        }
        xids.sort_unstable();
        xids.dedup();
        let mut h = GpuHealth {
            index: self.index,
            uuid: self.uuid.clone(),
            pci_bus_id: self.pci_bus_id.clone(),
            ecc_dbe_volatile: Reading::Value(dbe),
            ecc_dbe_aggregate: Reading::Value(dbe),
            retired_pages: Reading::Value(retired),
            retired_pages_pending: Reading::Value(pending),
            row_remap: Reading::Value(remap),
            pcie: Reading::Value(pcie),
            throttle_reasons: Reading::Value(throttle_bits),
            xid_errors: Reading::Value(xids),
            persistence_mode: Reading::Value(persistence),
            mig: Reading::Value(mig),
            nvlink: Reading::Value(links),
            temperature_c: Reading::Value(temperature),
            temperature_slowdown_c: Reading::Value(SLOWDOWN_C),
            power_draw_mw: Reading::Value(power),
            power_limit_mw: Reading::Value(POWER_LIMIT_MW),
        };
        for field in &self.not_supported {
            match field {
                HealthField::EccDbeVolatile => h.ecc_dbe_volatile = Reading::NotSupported,
                HealthField::EccDbeAggregate => h.ecc_dbe_aggregate = Reading::NotSupported,
                HealthField::RetiredPages => h.retired_pages = Reading::NotSupported,
                HealthField::RetiredPagesPending => h.retired_pages_pending = Reading::NotSupported,
                HealthField::RowRemap => h.row_remap = Reading::NotSupported,
                HealthField::Pcie => h.pcie = Reading::NotSupported,
                HealthField::ThrottleReasons => h.throttle_reasons = Reading::NotSupported,
                HealthField::XidErrors => h.xid_errors = Reading::NotSupported,
                HealthField::PersistenceMode => h.persistence_mode = Reading::NotSupported,
                HealthField::Mig => h.mig = Reading::NotSupported,
                HealthField::Nvlink => h.nvlink = Reading::NotSupported,
                HealthField::TemperatureC => h.temperature_c = Reading::NotSupported,
                HealthField::TemperatureSlowdownC => {
                    h.temperature_slowdown_c = Reading::NotSupported
                }
                HealthField::PowerDrawMw => h.power_draw_mw = Reading::NotSupported,
                HealthField::PowerLimitMw => h.power_limit_mw = Reading::NotSupported,
            }
        }
        h
    }
}

/// Framebuffer of one `1g.10gb` MIG instance, MiB.
pub const MIG_INSTANCE_MIB: u64 = 9856;
/// Framebuffer the driver keeps for itself, MiB (used + free + this = total, as on a real board).
pub const FB_RESERVED_MIB: u64 = 512;
const DEFAULT_MEMORY_MIB: u64 = 81559;

/// The fixture's utilisation at `at_ms`: a sawtooth 0–100 % stepping once a second, offset per GPU.
pub fn utilization_at(index: u32, at_ms: i64) -> u32 {
    (at_ms.div_euclid(1000).rem_euclid(101) as u32 + 13 * index) % 101
}

impl FixtureGpu {
    /// The telemetry this GPU serves at `at_ms` (pure: see the module docs).
    pub fn sample(&self, at_ms: i64) -> GpuSample {
        let health = self.health();
        let util = utilization_at(self.index, at_ms);
        let total = if self.memory_mib == 0 {
            DEFAULT_MEMORY_MIB
        } else {
            self.memory_mib
        };
        let used = (total - FB_RESERVED_MIB) * u64::from(util) / 100;
        let at = u64::try_from(at_ms).unwrap_or(0);
        let mig_enabled = self.faults.contains(&Fault::MigEnabled);
        let power = match health.power_draw_mw {
            Reading::Value(p) if p > POWER_LIMIT_MW => Reading::Value(p),
            Reading::Value(p) => Reading::Value(p + util * 5_000),
            other => other,
        };
        let temperature = match health.temperature_c {
            Reading::Value(t) if t > SLOWDOWN_C => Reading::Value(t),
            Reading::Value(t) => Reading::Value(t + util / 10),
            other => other,
        };
        let last_xid = match &health.xid_errors {
            Reading::Value(x) => Reading::Value(x.iter().copied().max().unwrap_or(0)),
            other => other.clone().map(|_| 0),
        };
        let (gpu_util, mem_util) = if mig_enabled {
            (Reading::NotSupported, Reading::NotSupported)
        } else {
            (Reading::Value(util), Reading::Value(util / 2))
        };
        let mig = if mig_enabled {
            (7..14u32)
                .map(|gi| {
                    let u = utilization_at(self.index + gi, at_ms);
                    let used = MIG_INSTANCE_MIB * u64::from(u) / 100;
                    MigInstance {
                        gpu_instance_id: gi,
                        profile: "1g.10gb".into(),
                        fb_used_mib: Reading::Value(used),
                        fb_free_mib: Reading::Value(MIG_INSTANCE_MIB - used),
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        let processes = self
            .processes
            .iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used_mib: Some(p.used_mib),
                sm_util_pct: (!mig_enabled).then_some(util),
            })
            .collect();
        GpuSample {
            index: self.index,
            uuid: self.uuid.clone(),
            model: self.model.clone(),
            pci_bus_id: self.pci_bus_id.clone(),
            minor: Some(self.index),
            gpu_util_pct: gpu_util,
            mem_copy_util_pct: mem_util,
            fb_used_mib: Reading::Value(used),
            fb_free_mib: Reading::Value(total - FB_RESERVED_MIB - used),
            power_mw: power,
            // 72 W idle for as long as the Unix epoch: large, exact in an f64, and only ever growing.
            energy_mj: Reading::Value(at.saturating_mul(72)),
            temperature_c: temperature,
            sm_clock_mhz: Reading::Value(345 + util * 16),
            mem_clock_mhz: Reading::Value(2619),
            last_xid,
            // One replay every ten minutes of wall-clock time.
            pcie_replay: Reading::Value(at / 600_000),
            ecc_sbe_volatile: Reading::Value(0),
            ecc_dbe_volatile: health.ecc_dbe_volatile,
            ecc_sbe_aggregate: Reading::Value(0),
            ecc_dbe_aggregate: health.ecc_dbe_aggregate,
            row_remap: health.row_remap,
            mig_enabled,
            mig,
            processes: Reading::Value(processes),
        }
    }
}

// === impl FixtureBackend ===

pub struct FixtureBackend {
    path: PathBuf,
}

impl FixtureBackend {
    pub fn load(path: &Path) -> Result<FixtureBackend, GpuError> {
        let backend = FixtureBackend {
            path: path.to_path_buf(),
        };
        backend.read()?;
        Ok(backend)
    }

    /// Re-read on every query, so a test can change the fixture under a running daemon.
    pub fn read(&self) -> Result<FixtureFile, GpuError> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| GpuError::Unavailable {
            backend: "fixture",
            reason: format!("reading {}: {e}", self.path.display()),
        })?;
        parse(&text).map_err(|e| GpuError::Query {
            backend: "fixture",
            message: format!("{}: {e}", self.path.display()),
        })
    }
}

impl GpuBackend for FixtureBackend {
    fn name(&self) -> &'static str {
        "fixture"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(self.read()?.infos())
    }

    fn health(&self) -> Result<Vec<GpuHealth>, GpuError> {
        Ok(self.read()?.health())
    }

    fn sample(&self, at_ms: i64) -> Result<Vec<GpuSample>, GpuError> {
        Ok(self.read()?.sample(at_ms))
    }
}

/// A fixture of `n` H100-like GPUs with serials derived from `seed` (tests and the demo).
pub fn synthetic(n: u32, seed: &str) -> String {
    let gpus: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            serde_json::json!({
                "index": i,
                "uuid": format!("GPU-{seed}-{i:04}"),
                "serial": format!("{seed}{i:04}"),
                "model": "NVIDIA H100 80GB HBM3",
                "pci_bus_id": format!("0000:{:02x}:00.0", 0x18 + i * 0x10),
                "memory_mib": 81559,
            })
        })
        .collect();
    serde_json::json!({ "gpus": gpus }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(n: u32) -> FixtureFile {
        parse(&synthetic(n, "t")).unwrap_or_else(|e| panic!("synthetic fixture parses: {e}"))
    }

    #[test]
    fn synthetic_is_healthy_and_complete() {
        let f = fixture(8);
        assert_eq!(f.infos().len(), 8);
        let h = f.health();
        assert_eq!(h.len(), 8);
        assert_eq!(h[3].ecc_dbe_volatile, Reading::Value(0));
        assert_eq!(h[3].nvlink.value().map(Vec::len), Some(NVLINKS as usize));
    }

    #[test]
    fn faults_change_health() {
        let mut f = fixture(2);
        assert!(f.set_faults(
            1,
            vec![
                Fault::Dbe(2),
                Fault::Xid(79),
                Fault::Xid(79),
                Fault::PcieDowngrade
            ]
        ));
        let h = f.health();
        assert_eq!(h[1].ecc_dbe_volatile, Reading::Value(2));
        assert_eq!(h[1].xid_errors, Reading::Value(vec![79]));
        assert_eq!(h[1].pcie.value().map(|p| p.width_current), Some(8));
        assert_eq!(h[0].ecc_dbe_volatile, Reading::Value(0));
        assert!(!f.set_faults(9, vec![]));
    }

    #[test]
    fn missing_gpu_is_hidden_everywhere() {
        let mut f = fixture(8);
        f.set_faults(5, vec![Fault::Missing]);
        assert_eq!(f.infos().len(), 7);
        assert!(f.health().iter().all(|g| g.index != 5));
    }

    #[test]
    fn unknown_fields_and_faults_are_refused() {
        assert!(parse(r#"{"gpus":[{"index":0,"uuid":"u","model":"m","fautls":[]}]}"#).is_err());
        assert!(
            parse(r#"{"gpus":[{"index":0,"uuid":"u","model":"m","faults":["dbx"]}]}"#).is_err()
        );
        assert!(
            parse(r#"{"gpus":[{"index":0,"uuid":"u","model":"m","not_supported":["nvlinks"]}]}"#)
                .is_err()
        );
        assert!(parse(r#"{"gpus":[],"extra":1}"#).is_err());
    }

    #[test]
    fn samples_vary_with_time_and_mig_has_no_utilisation() {
        let mut f = fixture(2);
        let a = f.sample(1_000_000);
        let b = f.sample(1_005_000);
        assert_ne!(a[0].gpu_util_pct, b[0].gpu_util_pct);
        assert_eq!(
            a[0].gpu_util_pct,
            Reading::Value(utilization_at(0, 1_000_000))
        );
        assert_eq!(f.sample(1_000_000), a, "a pure function of time");
        let (Reading::Value(used), Reading::Value(free)) = (&a[1].fb_used_mib, &a[1].fb_free_mib)
        else {
            panic!("fb readings")
        };
        assert_eq!(used + free + FB_RESERVED_MIB, 81559);
        f.set_faults(1, vec![Fault::MigEnabled]);
        let m = &f.sample(1_000_000)[1];
        assert!(m.mig_enabled);
        assert_eq!(m.gpu_util_pct, Reading::NotSupported);
        assert_eq!(m.mem_copy_util_pct, Reading::NotSupported);
        assert_eq!(m.mig.len(), 7);
        assert!(m.mig.iter().all(|i| i.profile == "1g.10gb"));
    }

    #[test]
    fn not_supported_fields_read_as_not_supported() {
        let f = parse(r#"{"gpus":[{"index":0,"uuid":"u","model":"m","not_supported":["row_remap","nvlink"]}]}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        let h = &f.health()[0];
        assert_eq!(h.row_remap, Reading::NotSupported);
        assert_eq!(h.nvlink, Reading::NotSupported);
        assert!(h.pcie.value().is_some());
    }
}
