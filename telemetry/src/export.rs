//! One exporter: drains its [`DiskQueue`] to a receiver, oldest batch first, with the protocol's retry rules.
//!
//! - Prometheus remote write 1.0: 2xx delivered; 5xx and 429 retried with backoff (the spec's "recoverable"
//!   errors); any other 4xx is dropped and counted (retrying a request the receiver refuses cannot succeed).
//! - OTLP/HTTP: 2xx delivered; 429, 502, 503 and 504 retried (the OTLP spec's retryable codes); other codes dropped
//!   and counted.
//! - A transport error (connection refused, timeout) is retried like a 503.
//!
//! Retries back off exponentially with full jitter (bc-backoff's one [`ExponentialBackoff`]), at most
//! [`MAX_BACKOFF`], honouring a `Retry-After` up to that cap. Only the head batch is ever in flight, so order is kept
//! and a delivered batch is never sent again: nothing is lost within the queue's bound and nothing is duplicated.
//! The HTTP side is behind the [`Sink`] trait so the rules are tested with a scripted receiver.

use crate::queue::DiskQueue;
use crate::registry::{Counter, Registry};
use bc_proto::channel::{ExponentialBackoff, Jitter};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

pub const MIN_BACKOFF: Duration = Duration::from_millis(250);
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    RemoteWrite,
    Otlp,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::RemoteWrite => "remote_write",
            Protocol::Otlp => "otlp",
        }
    }
}

/// What to do with a batch after the receiver answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Delivered,
    Retry,
    /// Refused for good: drop and count.
    Drop,
}

/// The protocol's retry rule for an HTTP status (pure).
pub fn classify(protocol: Protocol, status: u16) -> Verdict {
    match (protocol, status) {
        (_, 200..=299) => Verdict::Delivered,
        (_, 429) => Verdict::Retry,
        (Protocol::RemoteWrite, 500..=599) => Verdict::Retry,
        (Protocol::Otlp, 502..=504) => Verdict::Retry,
        _ => Verdict::Drop,
    }
}

/// The receiver's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub retry_after: Option<Duration>,
    /// The start of the body, for the log line of a refusal.
    pub body: String,
}

pub type PostFuture<'a> = Pin<Box<dyn Future<Output = Result<Response, String>> + Send + 'a>>;

/// Sends one request body; `Err` is a transport failure (retried).
pub trait Sink: Send + Sync {
    fn post(&self, body: Vec<u8>) -> PostFuture<'_>;
}

/// Counters of one exporter, registered as `bc_telemetry_*{exporter="…"}`.
#[derive(Debug, Clone)]
pub struct ExporterCounters {
    pub sent: Counter,
    pub requests: Counter,
    pub retries: Counter,
    pub rejected: Counter,
    pub dropped_queue_full: Counter,
    pub dropped_unreadable: Counter,
    pub dropped_write_failed: Counter,
}

/// Names of the exporter's own families (exempt from the series budget).
pub const OWN_FAMILIES: &[&str] = &[
    "bc_telemetry_samples_sent_total",
    "bc_telemetry_requests_total",
    "bc_telemetry_retries_total",
    "bc_telemetry_samples_rejected_total",
    "bc_telemetry_samples_dropped_total",
    "bc_telemetry_queue_bytes",
    "bc_telemetry_queue_batches",
    "bc_telemetry_series",
    "bc_telemetry_series_overflow_total",
    "bc_telemetry_collect_seconds",
];

impl ExporterCounters {
    pub fn register(r: &Registry, exporter: &str) -> ExporterCounters {
        let e = [("exporter", exporter)];
        let dropped = r.counter(
            "bc_telemetry_samples_dropped_total",
            "Samples lost before delivery: queue_full (oldest dropped past the queue bound), unreadable, write_failed.",
        );
        ExporterCounters {
            sent: r
                .counter("bc_telemetry_samples_sent_total", "Samples the receiver accepted.")
                .with(&e),
            requests: r
                .counter("bc_telemetry_requests_total", "Requests sent to the receiver, retries included.")
                .with(&e),
            retries: r
                .counter("bc_telemetry_retries_total", "Requests retried (5xx, 429, transport errors).")
                .with(&e),
            rejected: r
                .counter(
                    "bc_telemetry_samples_rejected_total",
                    "Samples dropped because the receiver refused them for good (4xx other than 429).",
                )
                .with(&e),
            dropped_queue_full: dropped.with(&[("exporter", exporter), ("reason", "queue_full")]),
            dropped_unreadable: dropped.with(&[("exporter", exporter), ("reason", "unreadable")]),
            dropped_write_failed: dropped.with(&[("exporter", exporter), ("reason", "write_failed")]),
        }
    }
}

/// One exporter's queue, shared by the sampler (pushes) and the sender (drains).
#[derive(Debug, Clone)]
pub struct Outbox {
    pub protocol: Protocol,
    pub queue: Arc<Mutex<DiskQueue>>,
    pub notify: Arc<Notify>,
    pub counters: ExporterCounters,
}

impl Outbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, DiskQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a body; drops and counts the oldest batches past the bound.
    pub fn push(&self, body: &[u8], samples: u32) {
        let result = self.lock().push(body, samples);
        match result {
            Ok(ev) => {
                if ev.samples > 0 {
                    self.counters.dropped_queue_full.add(ev.samples);
                    tracing::warn!(
                        exporter = self.protocol.name(),
                        batches = ev.batches,
                        samples = ev.samples,
                        "telemetry queue full: dropped the oldest batches (the receiver is down or too slow)"
                    );
                }
            }
            Err(e) => {
                self.counters.dropped_write_failed.add(u64::from(samples));
                tracing::warn!(exporter = self.protocol.name(), error = %bc_error_chain::InlineErrorChain::new(&e), "telemetry queue write failed; batch dropped");
            }
        }
        self.notify.notify_one();
    }

    pub fn depth(&self) -> (usize, u64) {
        let q = self.lock();
        (q.len(), q.bytes())
    }

    /// Sends until `shutdown` turns true. `jitter` gives uniform numbers in [0, 1) for the backoff.
    pub async fn run(
        self,
        sink: Arc<dyn Sink>,
        mut jitter: impl FnMut() -> f64 + Send,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut backoff =
            ExponentialBackoff::new(MIN_BACKOFF, MAX_BACKOFF, Jitter::Fraction(1.0)).start();
        let name = self.protocol.name();
        let mut failing_since: Option<tokio::time::Instant> = None;
        loop {
            if *shutdown.borrow() {
                return;
            }
            let head = self.lock().head();
            let crate::queue::Batch { seq, body, samples } = match head {
                None => {
                    tokio::select! {
                        _ = self.notify.notified() => continue,
                        _ = shutdown.changed() => return,
                    }
                }
                Some(Err(samples)) => {
                    self.counters.dropped_unreadable.add(u64::from(samples));
                    tracing::warn!(
                        exporter = name,
                        samples,
                        "a queued telemetry batch could not be read; dropped"
                    );
                    continue;
                }
                Some(Ok(h)) => h,
            };
            self.counters.requests.inc();
            let answer = tokio::select! {
                a = sink.post(body) => a,
                _ = shutdown.changed() => return,
            };
            let (verdict, retry_after, why) = match answer {
                Ok(r) => (
                    classify(self.protocol, r.status),
                    r.retry_after,
                    format!("HTTP {}: {}", r.status, r.body),
                ),
                Err(e) => (Verdict::Retry, None, e),
            };
            match verdict {
                Verdict::Delivered => {
                    self.lock().pop(seq);
                    self.counters.sent.add(u64::from(samples));
                    backoff.reset();
                    if let Some(t) = failing_since.take() {
                        tracing::info!(exporter = name, after = ?t.elapsed(), "telemetry receiver accepts again");
                    }
                }
                Verdict::Drop => {
                    self.lock().pop(seq);
                    self.counters.rejected.add(u64::from(samples));
                    backoff.reset();
                    tracing::warn!(
                        exporter = name,
                        samples,
                        answer = %why,
                        "the telemetry receiver refused a batch for good; dropped (check the endpoint, auth and labels)"
                    );
                }
                Verdict::Retry => {
                    self.counters.retries.inc();
                    let wait = backoff
                        .next_delay(jitter())
                        .max(retry_after.unwrap_or_default().min(MAX_BACKOFF));
                    if failing_since.is_none() {
                        failing_since = Some(tokio::time::Instant::now());
                        tracing::warn!(exporter = name, answer = %why, "telemetry receiver unavailable; queueing and retrying");
                    } else {
                        tracing::debug!(exporter = name, answer = %why, ?wait, "retrying");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.changed() => return,
                    }
                }
            }
        }
    }
}

// === impl HttpSink ===

/// The real sink: an HTTP(S) POST with the protocol's headers, bearer token (re-read from its file on every request,
/// so a rotated token is picked up) or mTLS.
pub struct HttpSink {
    client: reqwest::Client,
    url: String,
    protocol: Protocol,
    bearer_token_file: Option<std::path::PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("reading {what} {path}")]
    Read {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path}: {message}")]
    Pem {
        what: &'static str,
        path: std::path::PathBuf,
        message: String,
    },
    #[error("building the TLS configuration: {0}")]
    Tls(String),
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
}

fn read_pem(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, SinkError> {
    std::fs::read(path).map_err(|source| SinkError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn tls_config(ep: &crate::config::Endpoint) -> Result<rustls::ClientConfig, SinkError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    match &ep.ca_file {
        Some(path) => {
            let pem = read_pem("ca_file", path)?;
            for c in CertificateDer::pem_slice_iter(&pem) {
                let c = c.map_err(|e| SinkError::Pem {
                    what: "ca_file",
                    path: path.clone(),
                    message: e.to_string(),
                })?;
                roots.add(c).map_err(|e| SinkError::Tls(e.to_string()))?;
            }
        }
        None => {
            for c in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(c);
            }
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(bc_proto::tls_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| SinkError::Tls(e.to_string()))?
        .with_root_certificates(roots);
    match &ep.client_cert {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let cpem = read_pem("cert_file", cert)?;
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cpem)
                .collect::<Result<_, _>>()
                .map_err(|e| SinkError::Pem {
                    what: "cert_file",
                    path: cert.clone(),
                    message: e.to_string(),
                })?;
            let kpem = read_pem("key_file", key)?;
            let key_der = PrivateKeyDer::from_pem_slice(&kpem).map_err(|e| SinkError::Pem {
                what: "key_file",
                path: key.clone(),
                message: e.to_string(),
            })?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| SinkError::Tls(e.to_string()))
        }
    }
}

impl HttpSink {
    pub fn new(protocol: Protocol, ep: &crate::config::Endpoint) -> Result<HttpSink, SinkError> {
        let client = reqwest::Client::builder()
            .timeout(ep.timeout)
            .connect_timeout(ep.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(1)
            .user_agent(concat!("bc-telemetry/", env!("CARGO_PKG_VERSION")))
            .tls_backend_preconfigured(tls_config(ep)?)
            .build()
            .map_err(SinkError::Client)?;
        Ok(HttpSink {
            client,
            url: ep.url.clone(),
            protocol,
            bearer_token_file: ep.bearer_token_file.clone(),
        })
    }
}

/// At most this much of a refusal's body is kept for the log line.
const BODY_EXCERPT: usize = 512;

impl Sink for HttpSink {
    fn post(&self, body: Vec<u8>) -> PostFuture<'_> {
        Box::pin(async move {
            let mut req = self.client.post(&self.url).body(body);
            req = match self.protocol {
                Protocol::RemoteWrite => req
                    .header("Content-Type", crate::remote_write::CONTENT_TYPE)
                    .header("Content-Encoding", crate::remote_write::CONTENT_ENCODING)
                    .header(
                        crate::remote_write::VERSION_HEADER,
                        crate::remote_write::VERSION,
                    ),
                Protocol::Otlp => req.header("Content-Type", crate::otlp::CONTENT_TYPE),
            };
            if let Some(path) = &self.bearer_token_file {
                let token = std::fs::read_to_string(path)
                    .map_err(|e| format!("reading bearer_token_file {}: {e}", path.display()))?;
                req = req.bearer_auth(token.trim());
            }
            let resp = req.send().await.map_err(|e| bc_error_chain::chain(&e))?;
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            let mut text = String::new();
            if !resp.status().is_success() {
                // Bounded read: a receiver cannot make the daemon buffer a large error page.
                let mut resp = resp;
                let mut buf = Vec::new();
                while let Ok(Some(chunk)) = resp.chunk().await {
                    buf.extend_from_slice(&chunk[..chunk.len().min(BODY_EXCERPT - buf.len())]);
                    if buf.len() >= BODY_EXCERPT {
                        break;
                    }
                }
                text = String::from_utf8_lossy(&buf).trim().to_string();
            }
            Ok(Response {
                status,
                retry_after,
                body: text,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_rules_follow_each_spec() {
        use Protocol::*;
        assert_eq!(classify(RemoteWrite, 204), Verdict::Delivered);
        assert_eq!(classify(RemoteWrite, 503), Verdict::Retry);
        assert_eq!(classify(RemoteWrite, 500), Verdict::Retry);
        assert_eq!(classify(RemoteWrite, 429), Verdict::Retry);
        assert_eq!(classify(RemoteWrite, 400), Verdict::Drop);
        assert_eq!(classify(RemoteWrite, 401), Verdict::Drop);
        assert_eq!(classify(Otlp, 200), Verdict::Delivered);
        assert_eq!(classify(Otlp, 503), Verdict::Retry);
        assert_eq!(classify(Otlp, 429), Verdict::Retry);
        assert_eq!(classify(Otlp, 500), Verdict::Drop);
        assert_eq!(classify(Otlp, 400), Verdict::Drop);
    }

    /// Answers from a script, then 200; records every body it was given.
    struct Scripted {
        answers: Mutex<std::collections::VecDeque<Result<u16, String>>>,
        seen: Mutex<Vec<Vec<u8>>>,
    }

    impl Sink for Scripted {
        fn post(&self, body: Vec<u8>) -> PostFuture<'_> {
            let a = self
                .answers
                .lock()
                .map(|mut q| q.pop_front())
                .ok()
                .flatten()
                .unwrap_or(Ok(200));
            Box::pin(async move {
                let status = a?;
                if let Ok(mut s) = self.seen.lock()
                    && (200..300).contains(&status)
                {
                    s.push(body);
                }
                Ok(Response {
                    status,
                    retry_after: None,
                    body: String::new(),
                })
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retries_keep_order_and_drops_are_counted() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (q, _) = DiskQueue::open(dir.path(), 1 << 20)?;
        let r = Registry::new();
        let out = Outbox {
            protocol: Protocol::RemoteWrite,
            queue: Arc::new(Mutex::new(q)),
            notify: Arc::new(Notify::new()),
            counters: ExporterCounters::register(&r, "remote_write"),
        };
        for i in 0..4u8 {
            out.push(&[i], 10);
        }
        let sink = Arc::new(Scripted {
            // batch 0: 503, 503, transport error, then 200; batch 1: 400 (dropped); 2 and 3: 200.
            answers: Mutex::new([Ok(503), Ok(503), Err("refused".into()), Ok(200), Ok(400)].into()),
            seen: Mutex::new(Vec::new()),
        });
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(out.clone().run(sink.clone(), || 0.5, stop_rx));
        for _ in 0..100 {
            if out.depth().0 == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = stop_tx.send(true);
        task.await?;
        let seen = sink.seen.lock().map(|s| s.clone()).unwrap_or_default();
        assert_eq!(seen, vec![vec![0u8], vec![2], vec![3]]);
        assert_eq!(out.counters.sent.get(), 30);
        assert_eq!(out.counters.rejected.get(), 10);
        assert_eq!(out.counters.retries.get(), 3);
        assert_eq!(out.counters.requests.get(), 7);
        Ok(())
    }
}
