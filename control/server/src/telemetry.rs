//! The control plane's own metrics, exported like every daemon's (bc-telemetry: Prometheus remote write 1.0 and/or
//! OTLP/HTTP through a bounded disk queue, an optional loopback `/metrics`), never through PostgreSQL or a Session.
//!
//! What a process exports depends on its roles:
//! - api: `bc_api_requests_total{group, method, code}` and `bc_api_request_duration_seconds{group, method}` per
//!   `POST /api/compute/{group}/{method}` (`code` is the HTTP status; a call to a method that does not exist, or
//!   from a caller we do not know, counts under `group="unknown"`, so hostile paths cannot grow the series);
//! - gateway: `bc_gateway_sessions{gateway}`, the node sessions this gateway holds, and
//!   `bc_gateway_tls_handshakes_total{gateway, kind}`, its completed TLS handshakes by kind (`full`, `resumed`, and
//!   `resumed_refused`: a resumed session closed because the certificate its ticket holds no longer passes);
//! - scheduler: `bc_placement_duration_seconds`, from admission (the reservation's `created_at`, by the database's
//!   clock) to the commit of its placement;
//! - controllers and scheduler: `bc_shard_leases_held{role}`, the unexpired shard leases this process holds;
//! - controllers: `bc_queue_depth{queue}` for the outbox, due work items, pending reservations and open commands.
//!
//! Configured by a `[telemetry]` table in the server's configuration file (the same table as bcd.toml's:
//! `bc_telemetry::config`).

use bc_store::Store;
use bc_telemetry::registry::{CounterVec, GaugeVec, HistogramVec};
use bc_telemetry::{Registry, TelemetryConfig};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Latency buckets (seconds) for API calls and placements: 1 ms to 10 s.
const LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The queues [`bc_store::gauges::QueueDepths`] reports, by their `queue` label.
const QUEUES: [&str; 4] = [
    "outbox",
    "work_due",
    "reservations_pending",
    "commands_open",
];

/// Where `/metrics` is served when the configuration names no `telemetry.metrics_listen` (loopback only; `"off"`
/// turns it off).
pub const DEFAULT_METRICS_LISTEN: std::net::SocketAddr =
    std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9404);

/// `/metrics`' entry in the API document: it is served on the metrics listener, not the API's.
pub fn api_path() -> (&'static str, serde_json::Value) {
    (
        "/metrics",
        serde_json::json!({
            "servers": [{
                "url": format!("http://{DEFAULT_METRICS_LISTEN}"),
                "description": "The metrics listener (`telemetry.metrics_listen`, loopback only), not the API's",
            }],
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "description": "The process's own metrics in the Prometheus text format 0.0.4 (per role: API calls                     and latency, gateway sessions, placement latency, shard leases, queue depths, and the exporter's                     own counters), on its loopback metrics listener: 127.0.0.1:9404 unless                     `telemetry.metrics_listen` says otherwise (`\"off\"` turns it off). No key: bind it to                     loopback and let a local Prometheus (or agent) scrape it.",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The latest sample.",
                        "content": { "text/plain; version=0.0.4": { "schema": { "type": "string" } } },
                    },
                },
            },
        }),
    )
}

/// The handles every role records into; cheap to clone.
#[derive(Clone)]
pub struct ControlMetrics {
    registry: Registry,
    api_requests: CounterVec,
    api_duration: HistogramVec,
    placement: HistogramVec,
    sessions: GaugeVec,
    handshakes: CounterVec,
    leases: GaugeVec,
    queues: GaugeVec,
}

impl std::fmt::Debug for ControlMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlMetrics").finish_non_exhaustive()
    }
}

impl Default for ControlMetrics {
    fn default() -> Self {
        ControlMetrics::new(Registry::new())
    }
}

impl ControlMetrics {
    pub fn new(registry: Registry) -> ControlMetrics {
        ControlMetrics {
            api_requests: registry.counter(
                "bc_api_requests_total",
                "API calls answered, by group, method and HTTP status.",
            ),
            api_duration: registry.histogram(
                "bc_api_request_duration_seconds",
                "Time from receiving an API call to its response, by group and method.",
                LATENCY_BOUNDS,
            ),
            placement: registry.histogram(
                "bc_placement_duration_seconds",
                "Time from a reservation's admission to the commit of its placement.",
                LATENCY_BOUNDS,
            ),
            sessions: registry.gauge(
                "bc_gateway_sessions",
                "Node sessions this gateway holds.",
                "",
            ),
            handshakes: registry.counter(
                "bc_gateway_tls_handshakes_total",
                "TLS handshakes this gateway completed, by kind: full, resumed (a session ticket), resumed_refused.",
            ),
            leases: registry.gauge(
                "bc_shard_leases_held",
                "Unexpired shard leases this process holds, by role.",
                "",
            ),
            queues: registry.gauge(
                "bc_queue_depth",
                "Work waiting, by queue (outbox, work_due, reservations_pending, commands_open).",
                "",
            ),
            registry,
        }
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// One answered API call. `group` and `method` are taken as labels only when the call reached a method
    /// (`known`); otherwise the call counts under `unknown`.
    pub fn observe_api(
        &self,
        group: &str,
        method: &str,
        known: bool,
        status: u16,
        elapsed: Duration,
    ) {
        let (group, method) = if known {
            (group, method)
        } else {
            ("unknown", "unknown")
        };
        let code = status.to_string();
        self.api_requests
            .with(&[("group", group), ("method", method), ("code", &code)])
            .inc();
        self.api_duration
            .with(&[("group", group), ("method", method)])
            .observe(elapsed.as_secs_f64());
    }

    /// One committed placement, `latency` after its admission.
    pub fn observe_placement(&self, latency: Duration) {
        self.placement.with(&[]).observe(latency.as_secs_f64());
    }
}

/// axum middleware: times and counts every API call into [`ControlMetrics`].
pub async fn count_api(
    axum::extract::State(metrics): axum::extract::State<ControlMetrics>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let started = Instant::now();
    let path = req.uri().path().to_owned();
    let resp = next.run(req).await;
    let status = resp.status();
    let (group, method) = api_method(&path).unwrap_or(("", ""));
    // A 404 is a method (or route) that does not exist, a 401 a caller we do not know (answered before the method is
    // looked at): in both the names are the caller's, not ours, and must not become series. An authenticated caller
    // can still name a method that does not exist with a body that fails to parse (400 before the method is
    // matched); the series budget bounds that.
    // TODO(t12-kernel): label only methods in the kernel's registry once dispatch goes through it.
    let known = !group.is_empty()
        && status != axum::http::StatusCode::NOT_FOUND
        && status != axum::http::StatusCode::UNAUTHORIZED;
    metrics.observe_api(group, method, known, status.as_u16(), started.elapsed());
    resp
}

/// `(group, method)` of an API path `/api/compute/{group}/{method}`.
fn api_method(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/api/compute/")?;
    let (group, method) = rest.split_once('/')?;
    if group.is_empty() || method.is_empty() || method.contains('/') {
        return None;
    }
    Some((group, method))
}

/// What the sampler reads each interval, per the process's roles.
pub struct Sources {
    pub store: Store,
    /// The worker id the process's controllers and scheduler hold leases under.
    pub worker: String,
    /// The gateway's id and its sessions, when this process runs the gateway role.
    pub gateway: Option<(String, bc_gateway::session::Registry)>,
    /// The gateway's TLS handshakes, when this process runs the gateway role.
    pub handshakes: Option<std::sync::Arc<bc_gateway::tls::HandshakeCounts>>,
    /// The lease roles this process runs (`controllers`, `scheduler`).
    pub lease_roles: Vec<&'static str>,
    /// Whether to report queue depths (the controllers role does; one such process per deployment suffices, and
    /// every one reports the same figures under its own `instance`).
    pub queues: bool,
}

/// Brings the handshake counters up to the gateway's counts.
fn handshakes(metrics: &ControlMetrics, gateway: &str, counts: &bc_gateway::tls::HandshakeCounts) {
    use std::sync::atomic::Ordering::Relaxed;
    for (kind, n) in [
        ("full", counts.full.load(Relaxed)),
        ("resumed", counts.resumed.load(Relaxed)),
        ("resumed_refused", counts.resumed_refused.load(Relaxed)),
    ] {
        let counter = metrics
            .handshakes
            .with(&[("gateway", gateway), ("kind", kind)]);
        counter.add(n.saturating_sub(counter.get()));
    }
}

/// Refreshes the gauges every `interval` until `stop` is set. A failed query leaves the last values and logs once
/// per failure streak.
pub async fn sample(
    metrics: ControlMetrics,
    sources: Sources,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut failing = false;
    loop {
        if let Some((id, sessions)) = &sources.gateway {
            metrics
                .sessions
                .with(&[("gateway", id.as_str())])
                .set(sessions.len() as f64);
            if let Some(counts) = &sources.handshakes {
                handshakes(&metrics, id, counts);
            }
        }
        let read = async {
            if !sources.lease_roles.is_empty() {
                let held = sources.store.leases_held(&sources.worker).await?;
                for role in &sources.lease_roles {
                    let n = held.iter().find(|(r, _)| r == role).map_or(0, |(_, n)| *n);
                    metrics.leases.with(&[("role", role)]).set(n as f64);
                }
            }
            if sources.queues {
                let d = sources.store.queue_depths().await?;
                let values = [
                    d.outbox,
                    d.work_due,
                    d.reservations_pending,
                    d.commands_open,
                ];
                for (queue, v) in QUEUES.iter().zip(values) {
                    metrics.queues.with(&[("queue", queue)]).set(v as f64);
                }
            }
            Ok::<(), bc_store::StoreError>(())
        };
        match read.await {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "control-plane metrics: reading the database failed; the gauges keep their last values");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The exporter for this process's `[telemetry]` table.
pub async fn pipeline(
    config: &TelemetryConfig,
    metrics: &ControlMetrics,
    instance: &str,
) -> Result<bc_telemetry::Telemetry, bc_telemetry::TelemetryError> {
    let origin = bc_telemetry::Origin {
        service: "better-compute".into(),
        instance: instance.to_string(),
    };
    bc_telemetry::Telemetry::new(config.clone(), metrics.registry.clone(), origin).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_method_paths_name_a_method() {
        assert_eq!(
            api_method("/api/compute/nodes/list"),
            Some(("nodes", "list"))
        );
        for p in [
            "/api/compute/nodes",
            "/api/compute//list",
            "/api/compute/nodes/",
            "/api/compute/a/b/c",
            "/api/artifacts",
            "/healthz",
        ] {
            assert_eq!(api_method(p), None, "{p}");
        }
    }

    #[test]
    fn calls_that_reach_no_method_share_one_series() {
        let m = ControlMetrics::default();
        for i in 0..50 {
            m.observe_api(
                "nodes",
                &format!("x{i}"),
                false,
                404,
                Duration::from_millis(1),
            );
        }
        m.observe_api("nodes", "list", true, 200, Duration::from_millis(3));
        let fams = m.registry().collect(0);
        let req = fams
            .iter()
            .find(|f| f.name == "bc_api_requests_total")
            .expect("family");
        assert_eq!(req.series.len(), 2, "{:?}", req.series);
        let unknown = req
            .series
            .iter()
            .find(|s| s.labels.get("method") == Some("unknown"))
            .expect("unknown series");
        assert_eq!(unknown.value, 50.0);
    }
}
