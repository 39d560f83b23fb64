//! HTTP(S) source: a download task that resumes with `Range` after a broken connection, within a retry budget
//! with capped, jittered backoff, feeding the synchronous pipeline through a bounded chunk queue.
//!
//! The decisions (which request next, is this response a valid continuation) are in [`super::range`]; this module
//! only does the I/O.

use bc_backoff::{ExponentialBackoff, Jitter};
use std::io::{self, BufRead, Read};
use std::sync::Arc;
use std::time::Duration;

use reqwest::{Client, Response, Url};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::range::{BodyPlan, RangeError, ResponseHead, ResumeState};
use super::{
    BlockSink, Progress, StreamError, StreamFailure, StreamReport, StreamSpec, write_image,
};

/// Retry budget and limits of a download.
#[derive(Clone, Debug)]
pub struct FetchPolicy {
    /// Consecutive failed attempts (connections that delivered nothing) before giving up; any progress resets it.
    pub max_retries: u32,
    /// Delays between attempts: [`IMAGE_RETRY`] unless a test shortens them.
    pub retry: ExponentialBackoff,
    /// A connection that delivers nothing for this long counts as broken.
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
    /// Chunks queued between the download task and the pipeline (each at most a few hundred KiB).
    pub queue_chunks: usize,
    /// When the whole download must be over (the command's deadline, after which the control plane has given up
    /// on it and may ask again): past it the download stops with [`HttpError::Deadline`], and the pipeline zeroes
    /// what it wrote. `None`: only the retry budget and idle timeout bound it.
    pub deadline: Option<std::time::Instant>,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        Self {
            max_retries: 6,
            retry: IMAGE_RETRY,
            idle_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            queue_chunks: 16,
            deadline: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("building the TLS configuration")]
    Tls(#[source] rustls::Error),
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    #[error("request to {url}")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("response from {url} cannot be used")]
    Response {
        url: String,
        #[source]
        source: RangeError,
    },
    #[error("no data from {url} for {idle:?}")]
    Idle { url: String, idle: Duration },
    #[error("{url} ended at byte {received} of {total}")]
    Incomplete {
        url: String,
        received: u64,
        total: u64,
    },
    #[error("gave up on {url} after {attempts} consecutive attempts without progress")]
    RetriesExhausted {
        url: String,
        attempts: u32,
        #[source]
        last: Box<HttpError>,
    },
    #[error("the image pipeline stopped reading")]
    ConsumerGone,
    #[error(
        "the command's deadline passed after {received} bytes of {url} (the control plane has given up on this \
         stream and may ask again)"
    )]
    Deadline { url: String, received: u64 },
}

impl HttpError {
    fn is_retryable(&self) -> bool {
        match self {
            // A TLS failure (unknown CA, wrong name) will not fix itself: fail fast with the real cause.
            Self::Request { source, .. } => !is_tls_failure(source),
            Self::Idle { .. } | Self::Incomplete { .. } => true,
            Self::Response { source, .. } => source.is_retryable(),
            _ => false,
        }
    }
}

/// Whether a rustls error is anywhere in the chain. tokio-rustls wraps it in `io::Error`s, and `io::Error::source()`
/// skips the error it wraps, so the walk descends through `get_ref` there.
fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(e);
    while let Some(err) = current {
        if err.is::<rustls::Error>() {
            return true;
        }
        current = match err.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            Some(wrapped) => Some(wrapped as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    false
}

/// An HTTP(S) client that trusts only `roots` (the control plane's CA in the ramdisk), with ring as the rustls
/// provider whatever else is in the process, and no proxy from the environment.
pub fn client(roots: rustls::RootCertStore, policy: &FetchPolicy) -> Result<Client, HttpError> {
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(HttpError::Tls)?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Client::builder()
        .tls_backend_preconfigured(tls)
        .no_proxy()
        .connect_timeout(policy.connect_timeout)
        .build()
        .map_err(HttpError::Client)
}

/// Between attempts to open or resume an image download: 0.25 s doubling to 15 s, equal jitter (at least half of
/// each step, so a broken mirror is not hammered, and machines that lost it together spread out).
pub const IMAGE_RETRY: ExponentialBackoff = ExponentialBackoff::new(
    Duration::from_millis(250),
    Duration::from_secs(15),
    Jitter::Fraction(0.5),
);

/// A successful download-and-write.
#[derive(Clone, Debug)]
pub struct UrlStreamReport {
    pub stream: StreamReport,
    /// Connection attempts after the first one (resumes and retries of a failed connect).
    pub resumes: u32,
}

/// Download `url` and write it through the pipeline onto `sink`; gives the sink back on success.
pub async fn stream_url<S: BlockSink + 'static>(
    client: &Client,
    url: Url,
    sink: S,
    mut spec: StreamSpec,
    policy: &FetchPolicy,
    mut progress: Box<dyn FnMut(&Progress) + Send>,
) -> Result<(S, UrlStreamReport), StreamFailure> {
    let fail = |error| StreamFailure {
        error,
        bytes_submitted: 0,
        scrub: super::Scrub::NotNeeded,
    };
    let mut state = ResumeState::new();
    let mut resumes = 0u32;
    let first = within_deadline(
        policy,
        &url,
        open_with_retries(client, &url, &mut state, policy, &mut resumes),
    )
    .await
    .map_err(|e| fail(StreamError::Http(e)))?;
    spec.source_size = state.total();
    info!(%url, total = ?state.total(), "image download started");

    let (tx, rx) = mpsc::channel(policy.queue_chunks.max(1));
    let pump = tokio::spawn({
        let (client, url, policy) = (client.clone(), url.clone(), policy.clone());
        async move {
            let mut state = state;
            let result = within_deadline(
                &policy,
                &url,
                pump(&client, &url, first, &mut state, &policy, &tx, &mut resumes),
            )
            .await
            .map_err(|e| match e {
                HttpError::Deadline { url, .. } => HttpError::Deadline {
                    url,
                    received: state.received(),
                },
                other => other,
            });
            if result.is_err() {
                // Wake the pipeline with an error rather than a clean end of stream.
                let _ = tx.send(Err(())).await;
            }
            result.map(|()| resumes)
        }
    });
    let mut sink = sink;
    let written = tokio::task::spawn_blocking(move || {
        let reader = ChunkReader {
            rx,
            current: bytes::Bytes::new(),
        };
        let result = write_image(reader, &mut sink, &spec, &mut *progress);
        (sink, result)
    })
    .await;
    let download = pump.await;
    let (sink, result) = written.map_err(|_| fail(StreamError::WriterPanicked))?;
    match (result, download) {
        (Ok(stream), Ok(Ok(resumes))) => Ok((sink, UrlStreamReport { stream, resumes })),
        // The download's own error explains a pipeline source failure better than "source read failed".
        (Err(mut failure), Ok(Err(e))) if matches!(failure.error, StreamError::Source(_)) => {
            failure.error = StreamError::Http(e);
            Err(failure)
        }
        (Err(failure), _) => Err(failure),
        (Ok(_), Ok(Err(e))) => Err(fail(StreamError::Http(e))),
        (Ok(_), Err(_)) => Err(fail(StreamError::WriterPanicked)),
    }
}

/// `f`, given up at `policy.deadline` as [`HttpError::Deadline`] (with 0 bytes received: the caller that knows
/// how many sets them).
async fn within_deadline<T>(
    policy: &FetchPolicy,
    url: &Url,
    f: impl std::future::Future<Output = Result<T, HttpError>>,
) -> Result<T, HttpError> {
    let Some(deadline) = policy.deadline else {
        return f.await;
    };
    tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), f)
        .await
        .unwrap_or_else(|_| {
            Err(HttpError::Deadline {
                url: url.to_string(),
                received: 0,
            })
        })
}

/// Open (or reopen) the download at `state`'s position, retrying connection failures within the budget.
async fn open_with_retries(
    client: &Client,
    url: &Url,
    state: &mut ResumeState,
    policy: &FetchPolicy,
    resumes: &mut u32,
) -> Result<(Response, BodyPlan), HttpError> {
    let mut failures = 0u32;
    loop {
        match open(client, url, state, policy.idle_timeout).await {
            Ok(opened) => return Ok(opened),
            Err(e) if e.is_retryable() && failures < policy.max_retries => {
                let delay = policy.retry.delay(failures, rand::random());
                warn!(%url, error = %bc_error_chain::InlineErrorChain::new(&e), attempt = failures + 1, ?delay, "opening the download failed; retrying");
                failures += 1;
                *resumes += 1;
                tokio::time::sleep(delay).await;
            }
            Err(e) if e.is_retryable() => {
                return Err(HttpError::RetriesExhausted {
                    url: url.to_string(),
                    attempts: failures + 1,
                    last: Box::new(e),
                });
            }
            Err(e) => return Err(e),
        }
    }
}

/// One request: its response head within `idle` (a server that accepts and then says nothing is a broken
/// connection, like a body that stops: [`HttpError::Idle`], retried).
async fn open(
    client: &Client,
    url: &Url,
    state: &mut ResumeState,
    idle: Duration,
) -> Result<(Response, BodyPlan), HttpError> {
    let mut request = client.get(url.clone());
    for (name, value) in state.request_headers() {
        request = request.header(name, value);
    }
    let response = tokio::time::timeout(idle, request.send())
        .await
        .map_err(|_| HttpError::Idle {
            url: url.to_string(),
            idle,
        })?
        .map_err(|source| HttpError::Request {
            url: url.to_string(),
            source,
        })?;
    let headers = response.headers();
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let head = ResponseHead {
        status: response.status().as_u16(),
        content_length: get("content-length"),
        content_range: get("content-range"),
        etag: get("etag"),
        last_modified: get("last-modified"),
    };
    let plan = state.accept(&head).map_err(|source| HttpError::Response {
        url: url.to_string(),
        source,
    })?;
    Ok((response, plan))
}

type Chunk = Result<bytes::Bytes, ()>;

async fn pump(
    client: &Client,
    url: &Url,
    first: (Response, BodyPlan),
    state: &mut ResumeState,
    policy: &FetchPolicy,
    tx: &mpsc::Sender<Chunk>,
    resumes: &mut u32,
) -> Result<(), HttpError> {
    let (mut response, mut plan) = first;
    let mut failures = 0u32;
    let mut chunks = 0u64;
    loop {
        let before = state.received();
        let error = match body(url, &mut response, plan, state, policy, tx, &mut chunks).await {
            Ok(()) => match state.total() {
                Some(total) if state.received() < total => HttpError::Incomplete {
                    url: url.to_string(),
                    received: state.received(),
                    total,
                },
                _ => {
                    info!(%url, bytes = state.received(), chunks, resumes = *resumes, "image download complete");
                    return Ok(());
                }
            },
            Err(e) if e.is_retryable() => e,
            Err(e) => return Err(e),
        };
        if state.received() > before {
            failures = 0;
        }
        if failures >= policy.max_retries {
            return Err(HttpError::RetriesExhausted {
                url: url.to_string(),
                attempts: failures + 1,
                last: Box::new(error),
            });
        }
        let delay = policy.retry.delay(failures, rand::random());
        warn!(%url, error = %bc_error_chain::InlineErrorChain::new(&error), received = state.received(), ?delay, "download broke; resuming with Range");
        failures += 1;
        *resumes += 1;
        tokio::time::sleep(delay).await;
        (response, plan) = open_with_retries(client, url, state, policy, resumes).await?;
    }
}

/// Pass one response body to the pipeline, dropping `plan.skip` leading bytes.
async fn body(
    url: &Url,
    response: &mut Response,
    plan: BodyPlan,
    state: &mut ResumeState,
    policy: &FetchPolicy,
    tx: &mpsc::Sender<Chunk>,
    chunks: &mut u64,
) -> Result<(), HttpError> {
    let mut skip = plan.skip;
    loop {
        let chunk = match tokio::time::timeout(policy.idle_timeout, response.chunk()).await {
            Err(_) => {
                return Err(HttpError::Idle {
                    url: url.to_string(),
                    idle: policy.idle_timeout,
                });
            }
            Ok(Err(source)) => {
                return Err(HttpError::Request {
                    url: url.to_string(),
                    source,
                });
            }
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(chunk))) => chunk,
        };
        let mut chunk = chunk;
        if skip > 0 {
            let drop = (chunk.len() as u64).min(skip) as usize;
            skip -= drop as u64;
            chunk = chunk.slice(drop..);
        }
        if chunk.is_empty() {
            continue;
        }
        state
            .on_data(chunk.len() as u64)
            .map_err(|source| HttpError::Response {
                url: url.to_string(),
                source,
            })?;
        *chunks += 1;
        tx.send(Ok(chunk))
            .await
            .map_err(|_| HttpError::ConsumerGone)?;
    }
}

/// The pipeline's view of the download: a blocking `Read` over the chunk queue.
struct ChunkReader {
    rx: mpsc::Receiver<Chunk>,
    current: bytes::Bytes,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let n = buf.len().min(available.len());
        buf[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for ChunkReader {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(chunk)) => self.current = chunk,
                Some(Err(())) => return Err(io::Error::other("download failed")),
                None => break,
            }
        }
        Ok(&self.current)
    }

    fn consume(&mut self, n: usize) {
        let n = n.min(self.current.len());
        bytes::Buf::advance(&mut self.current, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_retries_keep_at_least_half_of_each_step_up_to_fifteen_seconds() {
        let r = IMAGE_RETRY;
        assert_eq!(r.delay(0, 0.0), Duration::from_millis(125));
        assert_eq!(r.delay(0, 1.0), Duration::from_millis(250));
        assert_eq!(r.delay(3, 0.0), Duration::from_secs(1));
        assert_eq!(r.delay(10, 1.0), Duration::from_secs(15));
        assert_eq!(r.delay(u32::MAX, 0.0), Duration::from_millis(7500));
    }
}
