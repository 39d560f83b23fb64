//! bc-telemetry: metrics export for every daemon of the suite (bcd, bcd site, the control plane), never through
//! PostgreSQL or the Session stream.
//!
//! A daemon builds a [`Registry`] (its own counters, gauges and histograms, plus [`Collector`]s such as bcd's GPU
//! and host sampler) and hands it to [`Telemetry::run`] with the validated `[telemetry]` table ([`config`]). Every
//! interval one snapshot is collected, common labels added, the per-node series budget applied ([`budget`]), and
//! the result encoded once per exporter — Prometheus remote write 1.0 ([`remote_write`]: protobuf + snappy, stale
//! markers) and/or OTLP/HTTP ([`otlp`]) — into a bounded disk-backed queue ([`queue`]) that a sender drains with
//! the protocol's retry rules ([`export`]). The same snapshot is served in the text exposition format
//! ([`exposition`]) on an optional loopback `/metrics` ([`serve`]).
//!
//! The codecs, the budget and the retry rules are sans I/O; only [`export::HttpSink`], [`queue`] and [`serve`]
//! touch the network or the disk. It imports bc-proto (for the one backoff and the TLS provider) and no other
//! workspace crate, so the control plane can plug in without depending on bcd. Start at [`Telemetry::run`].

pub mod budget;
pub mod config;
pub mod export;
pub mod exposition;
pub mod model;
pub mod otlp;
pub mod queue;
pub mod registry;
pub mod remote_write;
pub mod serve;

pub use config::{TelemetryConfig, TelemetryWire};
pub use model::{Family, Kind, Labels, Series, Snapshot};
pub use registry::{Collector, Registry};

use budget::SeriesBook;
use export::{ExporterCounters, Outbox, Protocol, Sink};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{Notify, watch};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("the {exporter} queue")]
    Queue {
        exporter: &'static str,
        #[source]
        source: queue::QueueError,
    },
    #[error("the {exporter} endpoint")]
    Sink {
        exporter: &'static str,
        #[source]
        source: export::SinkError,
    },
    #[error("binding /metrics on {addr}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Who is exporting: `job` and `instance` labels on every series (unless `[telemetry.labels]` sets them) and the
/// OTLP resource's `service.name` and `host.name`.
#[derive(Debug, Clone)]
pub struct Origin {
    pub service: String,
    pub instance: String,
}

/// The latest admitted snapshot, as `/metrics` serves it.
#[derive(Debug, Clone, Default)]
pub struct Latest(Arc<Mutex<Arc<Snapshot>>>);

impl Latest {
    pub fn get(&self) -> Arc<Snapshot> {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn set(&self, s: Snapshot) {
        if let Ok(mut g) = self.0.lock() {
            *g = Arc::new(s);
        }
    }
}

/// A configured pipeline, ready to run.
pub struct Telemetry {
    config: TelemetryConfig,
    registry: Registry,
    origin: Origin,
    outboxes: Vec<(Outbox, Arc<dyn Sink>)>,
    latest: Latest,
    metrics_listener: Option<tokio::net::TcpListener>,
}

impl Telemetry {
    /// Opens the queues and endpoints and binds `/metrics`. Fails (naming what) before anything runs.
    pub async fn new(
        config: TelemetryConfig,
        registry: Registry,
        origin: Origin,
    ) -> Result<Telemetry, TelemetryError> {
        let mut endpoints: Vec<(Protocol, Arc<dyn Sink>)> = Vec::new();
        for (protocol, ep) in [
            (Protocol::RemoteWrite, &config.remote_write),
            (Protocol::Otlp, &config.otlp),
        ] {
            if let Some(ep) = ep {
                let sink =
                    export::HttpSink::new(protocol, ep).map_err(|source| TelemetryError::Sink {
                        exporter: protocol.name(),
                        source,
                    })?;
                endpoints.push((protocol, Arc::new(sink)));
            }
        }
        let mut t = Telemetry::with_sinks(config, registry, origin, endpoints)?;
        if let Some(addr) = t.config.metrics_listen {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => t.metrics_listener = Some(l),
                // The default port, taken (a second daemon on the host): no /metrics rather than no daemon.
                Err(e) if t.config.metrics_listen_is_default => tracing::warn!(
                    %addr,
                    error = %e,
                    "/metrics is off: its default address is taken; set telemetry.metrics_listen to another \
                     loopback address:port (or \"off\")"
                ),
                Err(source) => return Err(TelemetryError::Bind { addr, source }),
            }
        }
        Ok(t)
    }

    /// Like [`Telemetry::new`] with the senders given (tests, the bench), and no `/metrics` unless
    /// [`Telemetry::serve_on`] hands it a listener.
    pub fn with_sinks(
        config: TelemetryConfig,
        registry: Registry,
        origin: Origin,
        sinks: Vec<(Protocol, Arc<dyn Sink>)>,
    ) -> Result<Telemetry, TelemetryError> {
        let mut outboxes = Vec::new();
        for (protocol, sink) in sinks {
            let (q, rec) = queue::DiskQueue::open(
                &config.queue_dir.join(protocol.name()),
                config.queue_max_bytes,
            )
            .map_err(|source| TelemetryError::Queue {
                exporter: protocol.name(),
                source,
            })?;
            if rec.batches > 0 || rec.corrupt > 0 {
                tracing::info!(
                    exporter = protocol.name(),
                    batches = rec.batches,
                    samples = rec.samples,
                    discarded = rec.corrupt,
                    "resuming the telemetry queue left by the last run"
                );
            }
            let counters = ExporterCounters::register(&registry, protocol.name());
            counters
                .dropped_unreadable
                .add(u64::from(rec.corrupt as u32));
            outboxes.push((
                Outbox {
                    protocol,
                    queue: Arc::new(Mutex::new(q)),
                    notify: Arc::new(Notify::new()),
                    counters,
                },
                sink,
            ));
        }
        Ok(Telemetry {
            config,
            registry,
            origin,
            outboxes,
            latest: Latest::default(),
            metrics_listener: None,
        })
    }

    /// Serves `/metrics` on this (already bound, loopback) listener.
    pub fn serve_on(&mut self, listener: tokio::net::TcpListener) {
        self.metrics_listener = Some(listener);
    }

    /// The address `/metrics` is served on, when it is.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// The latest snapshot (what `/metrics` serves), shared.
    pub fn latest(&self) -> Latest {
        self.latest.clone()
    }

    /// Samples every interval and exports until `shutdown` resolves. Queued batches stay on disk for the next run.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let Telemetry {
            config,
            registry,
            origin,
            outboxes,
            latest,
            metrics_listener,
        } = self;
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for (outbox, sink) in &outboxes {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_os_rng();
            let jitter = move || rand::Rng::random::<f64>(&mut rng);
            tasks.push(tokio::spawn(outbox.clone().run(
                sink.clone(),
                jitter,
                stop_rx.clone(),
            )));
        }
        if let Some(l) = metrics_listener {
            let latest = latest.clone();
            let mut rx = stop_rx.clone();
            tasks.push(tokio::spawn(async move {
                serve::run(l, latest, async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
            }));
        }
        let mut common = config.labels.clone();
        common.merge_missing(
            &Labels::new()
                .with("job", &origin.service)
                .with("instance", &origin.instance),
        );
        let otlp_origin = otlp::Origin {
            resource: Labels::new()
                .with("service.name", &origin.service)
                .with("host.name", &origin.instance),
            start_unix_nano: unix_nanos(),
        };
        let series = registry
            .gauge(
                "bc_telemetry_series",
                "Series exported at the last sample.",
                "1",
            )
            .with(&[]);
        let overflow = registry
            .counter(
                "bc_telemetry_series_overflow_total",
                "Samples of new series refused because the node's series budget (telemetry.max_series) was full.",
            )
            .with(&[]);
        let collect_time = registry
            .gauge(
                "bc_telemetry_collect_seconds",
                "Time the last collection took.",
                "s",
            )
            .with(&[]);
        let depth_batches = registry.gauge(
            "bc_telemetry_queue_batches",
            "Batches waiting in the queue.",
            "1",
        );
        let depth_bytes = registry.gauge(
            "bc_telemetry_queue_bytes",
            "Bytes waiting in the queue.",
            "By",
        );
        let mut book = SeriesBook::new(config.max_series);
        let mut ticker = tokio::time::interval(config.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        tracing::info!(
            interval = ?config.interval,
            max_series = config.max_series,
            exporters = ?outboxes.iter().map(|(o, _)| o.protocol.name()).collect::<Vec<_>>(),
            "telemetry sampling"
        );
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = ticker.tick() => {}
            }
            for (o, _) in &outboxes {
                let (b, by) = o.depth();
                depth_batches
                    .with(&[("exporter", o.protocol.name())])
                    .set(b as f64);
                depth_bytes
                    .with(&[("exporter", o.protocol.name())])
                    .set(by as f64);
            }
            let started = std::time::Instant::now();
            let timestamp_ms = unix_millis();
            let reg = registry.clone();
            // Collectors make blocking calls (NVML, procfs): off the async workers.
            let families = match tokio::task::spawn_blocking(move || reg.collect(timestamp_ms))
                .await
            {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "telemetry collection failed; skipping this sample");
                    continue;
                }
            };
            collect_time.set(started.elapsed().as_secs_f64());
            let snapshot = with_common_labels(
                Snapshot {
                    timestamp_ms,
                    families,
                },
                &common,
            );
            let admitted = book.admit(snapshot, export::OWN_FAMILIES);
            overflow.add(admitted.overflow);
            series.set(book.live() as f64);
            let samples = u32::try_from(admitted.sample_count()).unwrap_or(u32::MAX);
            for (o, _) in &outboxes {
                let body = match o.protocol {
                    Protocol::RemoteWrite => {
                        remote_write::encode(&remote_write::request(&admitted))
                    }
                    Protocol::Otlp => otlp::encode(&otlp::request(&admitted, &otlp_origin)),
                };
                o.push(&body, samples);
            }
            latest.set(admitted.snapshot);
        }
        let _ = stop_tx.send(true);
        for t in tasks {
            let _ = t.await;
        }
        tracing::info!("telemetry stopped");
    }
}

/// Adds the common labels to every series (a collector's own label of the same name wins).
fn with_common_labels(mut s: Snapshot, common: &Labels) -> Snapshot {
    if common.is_empty() {
        return s;
    }
    for f in &mut s.families {
        for series in &mut f.series {
            series.labels.merge_missing(common);
        }
    }
    s
}

fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The interval as a Duration (re-exported for daemons that print it).
pub fn default_interval() -> Duration {
    config::DEFAULT_INTERVAL
}
