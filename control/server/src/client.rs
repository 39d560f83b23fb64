//! The operator CLI's client for the HTTP API.

use serde_json::Value;

/// How long a connection to the API may take to open.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a call may wait for its answer by default (`--timeout`; uploads have none).
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "nothing listens at {url} (connection refused): is the control plane running there? Check --api-url, \
         BC_API_URL or the context's api_url"
    )]
    Refused { url: String },
    #[error(
        "{url} did not accept a connection within {}s (connect timeout): check the address, and that no \
         firewall drops the packets",
        CONNECT_TIMEOUT.as_secs()
    )]
    ConnectTimeout { url: String },
    #[error(
        "{url} accepted the connection but did not answer within {}s (timeout): the control plane may be \
         overloaded or stuck; retry, or raise --timeout",
        after.as_secs_f64()
    )]
    Timeout {
        url: String,
        after: std::time::Duration,
    },
    #[error(
        "{url} answered a TLS handshake in plain text: the API serves plain HTTP there, so use http:// (or put \
         it behind a TLS proxy)"
    )]
    NotTls { url: String },
    #[error("calling {url}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{code}: {message}")]
    Api { code: String, message: String },
    #[error(
        "the answer of {what} is not what this client expects (a control plane of another version?)"
    )]
    Decode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("reading {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Clone)]
pub struct ApiClient {
    base: String,
    key: String,
    http: reqwest::Client,
    timeout: std::time::Duration,
}

impl ApiClient {
    pub fn new(base: &str, key: &str) -> ApiClient {
        ApiClient::with_timeout(base, key, CALL_TIMEOUT)
    }

    /// A client whose calls wait at most `timeout` for their answer (uploads excepted).
    pub fn with_timeout(base: &str, key: &str, timeout: std::time::Duration) -> ApiClient {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            // The API closes a connection idle for its header deadline (30 s): let go of ours first, so a request
            // never goes out on a connection the server is closing.
            .pool_idle_timeout(bc_kernel::serve::HEADER_DEADLINE / 2)
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        ApiClient {
            base: base.trim_end_matches('/').to_string(),
            key: key.to_string(),
            http,
            timeout,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// `POST /api/compute/{group}/{method}`.
    pub async fn call(&self, group: &str, method: &str, body: Value) -> Result<Value, ClientError> {
        let url = format!("{}/api/compute/{group}/{method}", self.base);
        let request = self.http.post(&url).timeout(self.timeout).json(&body);
        self.send(url, request).await
    }

    /// `M` with its typed request and response (`client.method::<RevokeSite>(&req)`).
    pub async fn method<M: bc_kernel::ApiMethod>(
        &self,
        request: &M::Request,
    ) -> Result<M::Response, ClientError> {
        let url = format!("{}/api/compute/{}/{}", self.base, M::GROUP, M::METHOD);
        let request = self.http.post(&url).timeout(self.timeout).json(request);
        let answer = self.send(url, request).await?;
        decode(&format!("{}.{}", M::GROUP, M::METHOD), answer)
    }

    /// `PUT /api/artifacts`: uploads `content` (held in memory), named `name` when given.
    pub async fn put_artifact(
        &self,
        content: Vec<u8>,
        name: Option<&str>,
    ) -> Result<Value, ClientError> {
        let url = format!("{}/api/artifacts", self.base);
        let mut request = self.http.put(&url).body(content);
        if let Some(n) = name {
            request = request.header("x-artifact-name", n);
        }
        self.send(url, request).await
    }

    /// `PUT /api/artifacts` of the file at `path`: streamed from disk with its length in `Content-Length`, never
    /// held in memory whole. A file that changes length during the upload fails it (the control plane keeps
    /// nothing of a short body).
    pub async fn put_artifact_file(
        &self,
        path: &std::path::Path,
        name: Option<&str>,
    ) -> Result<Value, ClientError> {
        let read = |source| ClientError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = tokio::fs::File::open(path).await.map_err(read)?;
        let meta = file.metadata().await.map_err(read)?;
        if !meta.is_file() {
            return Err(read(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            )));
        }
        let url = format!("{}/api/artifacts", self.base);
        let size = meta.len();
        let label = format!(
            "uploading {}",
            name.map_or_else(|| path.display().to_string(), str::to_string)
        );
        let mut request = self
            .http
            .put(&url)
            .header(reqwest::header::CONTENT_LENGTH, size)
            .body(reqwest::Body::wrap_stream(read_with_progress(
                file,
                crate::progress::Progress::start(label, Some(size)),
            )));
        if let Some(n) = name {
            request = request.header("x-artifact-name", n);
        }
        self.send(url, request).await
    }

    /// [`ApiClient::put_artifact_file`], typed.
    pub async fn upload_artifact(
        &self,
        path: &std::path::Path,
        name: Option<&str>,
    ) -> Result<bc_core::api::sites::PutArtifactResponse, ClientError> {
        let answer = self.put_artifact_file(path, name).await?;
        decode("PUT /api/artifacts", answer)
    }

    async fn send(
        &self,
        url: String,
        request: reqwest::RequestBuilder,
    ) -> Result<Value, ClientError> {
        let timeout = self.timeout;
        let http = |source| classify(&url, source, timeout);
        let resp = request.bearer_auth(&self.key).send().await.map_err(http)?;
        let ok = resp.status().is_success();
        let v: Value = resp.json().await.map_err(http)?;
        if ok {
            Ok(v)
        } else {
            // Every error the API answers is `{code, message}`; anything else (a proxy's page) is named as such.
            #[derive(serde::Deserialize)]
            struct ErrorBody {
                code: String,
                message: String,
            }
            let body: ErrorBody = serde_json::from_value(v).unwrap_or_else(|_| ErrorBody {
                code: "UNAVAILABLE".into(),
                message: "the answer is an error without {code, message}".into(),
            });
            Err(ClientError::Api {
                code: body.code,
                message: body.message,
            })
        }
    }
}

/// A transport failure named by its cause, so the operator knows what to check: nothing listening, no connection
/// in time, no answer in time, TLS spoken to the plain API; anything else with its chain.
fn classify(url: &str, e: reqwest::Error, timeout: std::time::Duration) -> ClientError {
    let url = url.to_string();
    let chain = bc_error_chain::InlineErrorChain::new(&e).to_string();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return ClientError::Refused { url };
        }
        source = s.source();
    }
    if e.is_timeout() {
        return if e.is_connect() {
            ClientError::ConnectTimeout { url }
        } else {
            ClientError::Timeout {
                url,
                after: timeout,
            }
        };
    }
    // rustls reads an HTTP answer ("HTTP/1.1 400") where a TLS record should be.
    if url.starts_with("https://") && chain.contains("InvalidContentType") {
        return ClientError::NotTls { url };
    }
    ClientError::Http { url, source: e }
}

/// The chunks of `file` as a body stream, counted into `progress` as they are read (finished at the end).
fn read_with_progress(
    mut file: tokio::fs::File,
    mut progress: crate::progress::Progress,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<bytes::Bytes>> {
    use tokio::io::AsyncReadExt as _;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let mut chunk = vec![0u8; 256 * 1024];
            let read = match file.read(&mut chunk).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            chunk.truncate(read);
            progress.add(read as u64);
            if tx.send(Ok(bytes::Bytes::from(chunk))).await.is_err() {
                // The request is gone (refused or failed): its error is the one reported.
                return;
            }
        }
        progress.finish();
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// An answer as the type its method declares.
pub fn decode<T: serde::de::DeserializeOwned>(what: &str, answer: Value) -> Result<T, ClientError> {
    serde_json::from_value(answer).map_err(|source| ClientError::Decode {
        what: what.to_string(),
        source,
    })
}
