//! The operator CLI's client for the HTTP API.

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
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
}

impl ApiClient {
    pub fn new(base: &str, key: &str) -> ApiClient {
        ApiClient {
            base: base.trim_end_matches('/').to_string(),
            key: key.to_string(),
            http: reqwest::Client::new(),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// `POST /api/compute/{group}/{method}`.
    pub async fn call(&self, group: &str, method: &str, body: Value) -> Result<Value, ClientError> {
        let url = format!("{}/api/compute/{group}/{method}", self.base);
        let request = self.http.post(&url).json(&body);
        self.send(url, request).await
    }

    /// `M` with its typed request and response (`client.method::<RevokeSite>(&req)`).
    pub async fn method<M: bc_kernel::ApiMethod>(
        &self,
        request: &M::Request,
    ) -> Result<M::Response, ClientError> {
        let url = format!("{}/api/compute/{}/{}", self.base, M::GROUP, M::METHOD);
        let request = self.http.post(&url).json(request);
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
        let mut request = self
            .http
            .put(&url)
            .header(reqwest::header::CONTENT_LENGTH, meta.len())
            .body(reqwest::Body::from(file));
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
        let http = |source| ClientError::Http {
            url: url.clone(),
            source,
        };
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

/// An answer as the type its method declares.
pub fn decode<T: serde::de::DeserializeOwned>(what: &str, answer: Value) -> Result<T, ClientError> {
    serde_json::from_value(answer).map_err(|source| ClientError::Decode {
        what: what.to_string(),
        source,
    })
}
