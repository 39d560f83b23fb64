//! GPU access behind a trait: [`nvml::NvmlBackend`] on real nodes (feature `nvml`, library loaded at run time) and
//! [`fixture::FixtureBackend`] (a JSON file) for tests and demos on machines without GPUs. [`GpuBackend::gpus`]
//! lists GPUs for inventory and join claims; [`GpuBackend::health`] observes what `diag.nvml` judges
//! ([`health::GpuHealth`]); [`GpuBackend::sample`] reads what telemetry exports every interval
//! ([`sample::GpuSample`]).

pub mod fault;
pub mod fixture;
pub mod health;
#[cfg(feature = "nvml")]
pub mod nvml;
pub mod sample;
pub mod watchdog;

pub use health::{GpuHealth, Reading};
pub use sample::{GpuProcess, GpuSample, MigInstance};

/// One GPU as inventory and join claims need it (typed in bc-proto, which the control plane reads it with).
pub use bc_proto::payloads::GpuInfo;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The backend cannot be used on this machine (no driver, no library): a reported condition, not a crash.
    #[error("GPU backend {backend} unavailable: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("GPU backend {backend}: {message}")]
    Query {
        backend: &'static str,
        message: String,
    },
}

pub trait GpuBackend: Send + Sync {
    fn name(&self) -> &'static str;
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError>;

    /// Observed health of every visible GPU. A backend that collects none reports each GPU with every reading
    /// `not_collected`, so the checks skip rather than pass.
    fn health(&self) -> Result<Vec<GpuHealth>, GpuError> {
        let reason = format!("the {} backend collects no GPU health", self.name());
        Ok(self
            .gpus()?
            .into_iter()
            .map(|g| GpuHealth::unobserved(g.index, g.uuid, g.pci_bus_id, &reason))
            .collect())
    }

    /// One telemetry sample of every visible GPU. `at_ms` is the sample's time (Unix milliseconds): a real GPU
    /// ignores it, the fixture computes its time-varying values from it so a test knows what was served. A
    /// backend that samples nothing reports identity with every reading `not_collected`.
    fn sample(&self, at_ms: i64) -> Result<Vec<GpuSample>, GpuError> {
        let _ = at_ms;
        let reason = format!("the {} backend samples no GPU telemetry", self.name());
        Ok(self
            .gpus()?
            .iter()
            .map(|g| GpuSample::unobserved(g, &reason))
            .collect())
    }
}

/// A backend for machines where GPU collection is turned off.
pub struct NoGpus;

impl GpuBackend for NoGpus {
    fn name(&self) -> &'static str {
        "none"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(Vec::new())
    }
}

/// A backend behind [`watchdog::Watchdog`]'s deadline.
fn watched(backend: std::sync::Arc<dyn GpuBackend>) -> Box<dyn GpuBackend> {
    Box::new(watchdog::Watchdog::new(backend, watchdog::CALL_DEADLINE))
}

/// Builds the configured backend, every call into it bounded by [`watchdog::CALL_DEADLINE`]. An NVML that cannot
/// load is returned as an error the caller reports.
pub fn open(choice: &crate::config::GpuBackendChoice) -> Result<Box<dyn GpuBackend>, GpuError> {
    match choice {
        crate::config::GpuBackendChoice::None => Ok(Box::new(NoGpus)),
        crate::config::GpuBackendChoice::Fixture(path) => Ok(watched(std::sync::Arc::new(
            fixture::FixtureBackend::load(path)?,
        ))),
        #[cfg(feature = "nvml")]
        crate::config::GpuBackendChoice::Nvml => {
            Ok(watched(std::sync::Arc::new(nvml::NvmlBackend::init()?)))
        }
        #[cfg(not(feature = "nvml"))]
        crate::config::GpuBackendChoice::Nvml => Err(GpuError::Unavailable {
            backend: "nvml",
            reason: "this bcd was built without the nvml feature".into(),
        }),
    }
}
