//! Node telemetry (feature `telemetry`): the sampler that bc-telemetry exports every interval — GPUs through the
//! [`GpuBackend`] with dcgm-exporter's names ([`gpu`]), the host from procfs with node_exporter's names ([`host`]) —
//! and [`run`], which `bcd run` starts beside the session when bcd.toml has a `[telemetry]` table. Nothing of it
//! passes through the session or the control plane: it reads the booking of each GPU from the desired state the
//! session already wrote (`desired.json` in the state directory) and pushes to the configured receivers itself.

pub mod gpu;
pub mod host;
#[cfg(feature = "site")]
pub mod site;

use crate::gpu::GpuBackend;
use bc_telemetry::registry::CounterVec;
use bc_telemetry::{Collector, Family, Registry};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The node's collector: GPUs, processes on them with their reservations, and the host.
pub struct NodeSampler {
    pub gpu: Option<Arc<dyn GpuBackend>>,
    pub hardware_root: PathBuf,
    /// `<state_dir>/desired.json`, where the session records the bookings.
    pub desired: PathBuf,
    pub hostname: String,
    errors: CounterVec,
}

impl NodeSampler {
    pub fn new(
        registry: &Registry,
        gpu: Option<Arc<dyn GpuBackend>>,
        hardware_root: &Path,
        state_dir: &Path,
    ) -> NodeSampler {
        NodeSampler {
            gpu,
            hardware_root: hardware_root.to_path_buf(),
            desired: state_dir.join("desired.json"),
            hostname: hostname(hardware_root),
            errors: registry.counter(
                "bc_telemetry_collect_errors_total",
                "Collections in which a source failed (the GPU backend), by source.",
            ),
        }
    }
}

/// The node's hostname (`proc/sys/kernel/hostname` under the root).
pub fn hostname(root: &Path) -> String {
    std::fs::read_to_string(root.join("proc/sys/kernel/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// GPU UUID → reservation, from the desired state's bookings (none when there is no desired state yet).
pub fn reservations(desired: &Path) -> HashMap<String, String> {
    let Ok(text) = std::fs::read(desired) else {
        return HashMap::new();
    };
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return HashMap::new();
    };
    let spec = doc.get("spec").cloned().unwrap_or_default();
    crate::cdi::bookings(&spec)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|b| b.gpus.into_iter().map(move |g| (g, b.reservation.clone())))
        .collect()
}

impl Collector for NodeSampler {
    fn collect(&self, at_ms: i64, out: &mut Vec<Family>) {
        if let Some(g) = &self.gpu {
            match g.sample(at_ms) {
                Ok(samples) => {
                    gpu::families(&samples, &self.hostname, &reservations(&self.desired), out)
                }
                Err(e) => {
                    self.errors.with(&[("source", "gpu")]).inc();
                    tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "GPU telemetry sample failed");
                }
            }
        }
        host::families(&self.hardware_root, out);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryStartError {
    #[error("telemetry configuration")]
    Config(#[from] crate::config::ConfigError),
    #[error("telemetry configuration")]
    Invalid(#[from] bc_telemetry::config::TelemetryConfigError),
    #[error("starting telemetry")]
    Start(#[from] bc_telemetry::TelemetryError),
}

/// The pipeline for a site agent (`bcd site run`): the boot services' and BMC counters plus the host, exported as
/// `agent_config`'s `[telemetry]` table says, and on `/metrics` ([`SITE_METRICS_LISTEN`] unless it says otherwise)
/// with or without a table.
#[cfg(feature = "site")]
pub async fn build_site(
    agent_config: &Path,
    config: &crate::config::Config,
    counters: bcd_site::serve::SiteCounters,
) -> Result<Option<bc_telemetry::Telemetry>, TelemetryStartError> {
    // No table: no exporter, /metrics on its default address.
    let wire = crate::config::telemetry_from_file(agent_config)?.unwrap_or_default();
    let t = wire.validate_with(
        &agent_config.display().to_string(),
        config.state_dir.join("telemetry"),
        Some(SITE_METRICS_LISTEN),
    )?;
    let registry = Registry::new();
    let host = NodeSampler::new(&registry, None, &config.hardware_root, &config.state_dir);
    let origin = bc_telemetry::Origin {
        service: "bcd-site".into(),
        instance: host.hostname.clone(),
    };
    registry.register(Arc::new(site::SiteSampler { counters }));
    registry.register(Arc::new(host));
    Ok(Some(
        bc_telemetry::Telemetry::new(t, registry, origin).await?,
    ))
}

/// The pipeline for `bcd site serve` (file-fed, no agent): the boot services' counters and the host, exported as
/// `site_config`'s own `[telemetry]` table says (spooling under `state_dir`), and on `/metrics`
/// ([`SITE_METRICS_LISTEN`] unless the table says otherwise) with or without a table.
#[cfg(feature = "site")]
pub async fn build_site_serve(
    site_config: &Path,
    state_dir: &Path,
    counters: bcd_site::serve::SiteCounters,
) -> Result<bc_telemetry::Telemetry, TelemetryStartError> {
    let wire = crate::config::telemetry_from_file(site_config)?.unwrap_or_default();
    let t = wire.validate_with(
        &site_config.display().to_string(),
        state_dir.join("telemetry"),
        Some(SITE_METRICS_LISTEN),
    )?;
    let registry = Registry::new();
    let host = NodeSampler::new(&registry, None, Path::new("/"), state_dir);
    let origin = bc_telemetry::Origin {
        service: "bcd-site".into(),
        instance: host.hostname.clone(),
    };
    registry.register(Arc::new(site::SiteSampler { counters }));
    registry.register(Arc::new(host));
    Ok(bc_telemetry::Telemetry::new(t, registry, origin).await?)
}

/// Where `bcd run` serves `/metrics` unless `telemetry.metrics_listen` says otherwise (`"off"` turns it off).
pub const NODE_METRICS_LISTEN: std::net::SocketAddr =
    std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9402);

/// Where `bcd site run` serves `/metrics` unless `telemetry.metrics_listen` in its agent config says otherwise.
pub const SITE_METRICS_LISTEN: std::net::SocketAddr =
    std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9403);

/// What [`build`] does for a configuration without a `[telemetry]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WithoutTable {
    /// `bcd run`: no exporter, `/metrics` on [`NODE_METRICS_LISTEN`].
    MetricsOnly,
    /// `bcd telemetry` (an exporter-only bcd): nothing (the caller says the table is missing).
    Nothing,
}

/// The pipeline for this node: the `[telemetry]` table's exporters and `/metrics` (on [`NODE_METRICS_LISTEN`]
/// unless it says otherwise); without a table, what `without_table` says.
pub async fn build(
    config_path: &Path,
    config: &crate::config::Config,
    gpu: Option<Arc<dyn GpuBackend>>,
    without_table: WithoutTable,
) -> Result<Option<bc_telemetry::Telemetry>, TelemetryStartError> {
    let wire = match crate::config::telemetry_from_file(config_path)? {
        Some(wire) => wire,
        // `bcd run` without a table: no exporter, /metrics on its default address.
        None if without_table == WithoutTable::MetricsOnly => Default::default(),
        None => return Ok(None),
    };
    let t = wire.validate_with(
        &config_path.display().to_string(),
        config.state_dir.join("telemetry"),
        Some(NODE_METRICS_LISTEN),
    )?;
    let registry = Registry::new();
    let sampler = NodeSampler::new(&registry, gpu, &config.hardware_root, &config.state_dir);
    let origin = bc_telemetry::Origin {
        service: "bcd".into(),
        instance: sampler.hostname.clone(),
    };
    registry.register(Arc::new(sampler));
    Ok(Some(
        bc_telemetry::Telemetry::new(t, registry, origin).await?,
    ))
}
