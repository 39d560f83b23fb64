//! Artifacts: kernels, initramfs and images kept content-addressed in the state directory
//! (`<state_dir>/artifacts/sha256/<hex>`, 0644) by bc-cas, the one content-addressed writer the site agent's cache
//! uses too, and described by `artifacts` rows. Operators upload with `PUT /api/artifacts` (header
//! `x-artifact-name`) (`better-compute artifacts put <file>`, which streams the file): each chunk is hashed and
//! written to a temporary file `artifacts/.partial-*` as it arrives (never held in memory whole), then the length is
//! checked, the file fsynced and renamed into place on a blocking thread, so a file under its hash is always
//! complete; a body that breaks off, stalls for 60 s or differs from its `Content-Length` is discarded with its
//! temporary file. Site agents fetch the ones their netboot table references over `SiteService.Artifact` and verify
//! them themselves.
//!
//! A machine's boot names an artifact as `sha256:<hex>` in `kernel` or `initrd`.

use crate::Sites;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use bc_cas::{CasError, Expect};
use bc_core::api::sites::{Artifact, BootSpec, PutArtifactResponse};
use bc_kernel::{ApiCode, ApiError, Route, RouterState};
use bc_proto::v1;
use bc_store::Store;
use bc_store::artifacts::ArtifactRow;
use std::path::{Path, PathBuf};
use tokio_stream::StreamExt as _;

/// Largest artifact accepted (an OS image fits; a runaway upload does not fill the disk).
pub const MAX_ARTIFACT: u64 = 64 << 30;
/// An upload that sends nothing for this long is discarded.
pub const UPLOAD_STALL: std::time::Duration = std::time::Duration::from_secs(60);
/// Chunk size of `SiteService.Artifact`.
pub const CHUNK: usize = 256 * 1024;
/// How a boot spec names an artifact.
pub const REF_PREFIX: &str = "sha256:";
/// Header naming an uploaded artifact (optional; the hash names it otherwise).
pub const NAME_HEADER: &str = "x-artifact-name";

pub use bc_cas::is_sha256_hex;

/// The hash a boot field references (`sha256:<hex>`), if it references one.
pub fn referenced(field: &str) -> Option<&str> {
    field.strip_prefix(REF_PREFIX)
}

/// The artifact store of a state directory (`<state_dir>/artifacts`).
#[derive(Debug, Clone)]
pub struct ArtifactDir {
    cas: bc_cas::Store,
}

/// The store's I/O failed: UNAVAILABLE, the cause in the log.
fn unavailable(what: &str, e: &(dyn std::error::Error + 'static)) -> ApiError {
    tracing::error!(error = %bc_error_chain::InlineErrorChain::new(e), "{what}");
    ApiError::new(
        ApiCode::Unavailable,
        format!(
            "{what} in the control plane's state directory failed; the control plane logged why"
        ),
    )
}

/// Why the content of an upload was refused (nothing was kept), as the sender is told.
fn refused(e: &CasError) -> ApiError {
    let why = match e {
        CasError::TooLarge { max } => format!("artifact is larger than {max} bytes"),
        CasError::TooLong { size } => format!(
            "artifact upload sent more than the {size} bytes its Content-Length announced; nothing was kept"
        ),
        CasError::Truncated { got, size } => format!(
            "artifact upload ended after {got} bytes of the {size} announced; nothing was kept"
        ),
        other => format!("artifact refused: {other}; nothing was kept"),
    };
    ApiError::invalid(why)
}

/// A bc-cas error of an upload: the sender's (INVALID_ARGUMENT) or the store's (UNAVAILABLE).
fn upload_error(what: &str, e: CasError) -> ApiError {
    if e.is_content() {
        refused(&e)
    } else {
        unavailable(what, &e)
    }
}

impl ArtifactDir {
    pub fn new(state_dir: &Path) -> ArtifactDir {
        ArtifactDir {
            cas: bc_cas::Store::new(state_dir.join("artifacts")),
        }
    }

    /// Where the content of `sha256` lives (the caller checked it is 64 hex).
    pub fn path(&self, sha256: &str) -> PathBuf {
        self.cas.dir().join(sha256)
    }

    /// Streams `body` into the store: returns (hash, size). Nothing is left behind on error. `declared` is the
    /// request's `Content-Length`, when it had one: a body of another length is refused.
    pub async fn write(
        &self,
        mut body: impl tokio_stream::Stream<Item = Result<bytes::Bytes, axum::Error>> + Unpin,
        declared: Option<u64>,
    ) -> Result<(String, u64), ApiError> {
        let mut writer = self
            .cas
            .begin(Expect::upload(declared, MAX_ARTIFACT))
            .map_err(|e| upload_error("creating a temporary artifact file", e))?;
        loop {
            let size = writer.received();
            let Ok(next) = tokio::time::timeout(UPLOAD_STALL, body.next()).await else {
                tracing::warn!(size, "artifact upload stalled; discarded");
                return Err(ApiError::invalid(format!(
                    "artifact upload sent nothing for {} s after {size} bytes; discarded",
                    UPLOAD_STALL.as_secs()
                )));
            };
            let Some(chunk) = next else { break };
            let chunk = chunk.map_err(|e| {
                tracing::warn!(size, error = %e, "artifact upload broke off; discarded");
                ApiError::invalid(format!(
                    "artifact upload broke off after {size} bytes ({e}); nothing was kept"
                ))
            })?;
            writer
                .write(&chunk)
                .map_err(|e| upload_error("writing the artifact", e))?;
        }
        let stored = tokio::task::spawn_blocking(move || writer.commit())
            .await
            .map_err(|e| unavailable("storing the artifact", &e))?
            .map_err(|e| upload_error("storing the artifact", e))?;
        Ok((stored.sha256.into_string(), stored.size))
    }
}

/// `PUT /api/artifacts`, with the permission it checks.
pub(crate) fn route() -> Route {
    Route::new("/api/artifacts", "PUT", axum::routing::put(put))
        .permission("compute:artifacts:put")
        .answers::<PutArtifactResponse>()
        .doc(serde_json::json!({
            "operationId": "artifacts.put",
            "summary": "Upload an artifact",
            "description": "The body is the artifact, streamed (any size; `Content-Length` is checked when sent). It is \
                hashed as it is written and stored content-addressed; the answer names it `sha256:<hex>`. Needs \
                `compute:artifacts:put` on `artifacts`.",
            "x-scope": "artifacts",
            "parameters": [{
                "name": NAME_HEADER,
                "in": "header",
                "required": false,
                "description": "A name for people (at most 255 visible ASCII characters); the digest is the reference.",
                "schema": { "type": "string", "maxLength": 255 },
            }],
            "requestBody": {
                "required": true,
                "content": { "application/octet-stream": { "schema": { "type": "string", "contentMediaType": "application/octet-stream" } } },
            },
        }))
}

/// `PUT /api/artifacts` with header `x-artifact-name: <name>`: the body is the artifact.
async fn put(
    State(router): State<RouterState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<PutArtifactResponse>, ApiError> {
    let caller = router.authenticate(&headers).await?;
    if !caller.allows("compute:artifacts:put", "artifacts") {
        return Err(ApiError::denied(format!(
            "principal {} lacks compute:artifacts:put on artifacts; ask an administrator for that grant",
            caller.id
        )));
    }
    let state = router.resources().require::<Sites>()?.clone();
    let name = match headers.get(NAME_HEADER) {
        None => String::new(),
        Some(v) => v
            .to_str()
            .ok()
            .filter(|n| n.len() <= 255)
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "{NAME_HEADER} must be at most 255 visible ASCII characters"
                ))
            })?
            .to_string(),
    };
    let declared = match headers.get(axum::http::header::CONTENT_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| ApiError::invalid("Content-Length is not a number"))?,
        ),
    };
    let (sha, size) = state
        .artifacts
        .write(body.into_data_stream(), declared)
        .await?;
    let name = if name.is_empty() { sha.clone() } else { name };
    let size = i64::try_from(size).map_err(|_| ApiError::invalid("artifact too large"))?;
    let row = state
        .store
        .put_artifact(&sha, &name, size, &caller.actor())
        .await?;
    tracing::info!(sha256 = sha, name = row.name, size, "artifact stored");
    Ok(Json(PutArtifactResponse {
        artifact: artifact_of(row),
        reference: format!("{REF_PREFIX}{sha}"),
    }))
}

/// An artifact row as the API shows it.
pub(crate) fn artifact_of(a: ArtifactRow) -> Artifact {
    Artifact {
        sha256: a.sha256,
        name: a.name,
        size: a.size,
        created_by: a.created_by,
        created_at_ms: a.created_at_ms,
    }
}

/// Checks that every `sha256:` reference of a boot names a stored artifact.
pub(crate) async fn check_references(store: &Store, boot: &BootSpec) -> Result<(), ApiError> {
    for (field, v) in [
        ("boot.kernel", Some(&boot.kernel)),
        ("boot.initrd", boot.initrd.as_ref()),
    ] {
        let Some(sha) = v.and_then(|v| referenced(v)) else {
            continue;
        };
        if !is_sha256_hex(sha) {
            return Err(ApiError::invalid(format!(
                "{field}: {REF_PREFIX} must be followed by 64 lowercase hex characters"
            )));
        }
        if store.artifact(sha).await?.is_none() {
            return Err(ApiError::new(
                ApiCode::NotFound,
                format!(
                    "{field}: no artifact {sha}: upload it first with `better-compute artifacts put <file>`"
                ),
            ));
        }
    }
    Ok(())
}

/// The chunks of an open artifact file, read on a task so a slow reader holds no more than a few chunks.
pub fn stream_file(file: std::fs::File) -> bc_gateway::site::ArtifactStream {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<v1::ArtifactChunk, tonic::Status>>(4);
    tokio::task::spawn_blocking(move || {
        use std::io::Read as _;
        let mut file = file;
        loop {
            let mut buf = vec![0u8; CHUNK];
            let n = match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(error = %e, "reading an artifact");
                    let _ = tx.blocking_send(Err(tonic::Status::unavailable(
                        "reading the artifact failed; the control plane logged why",
                    )));
                    return;
                }
            };
            buf.truncate(n);
            if tx
                .blocking_send(Ok(v1::ArtifactChunk { data: buf }))
                .is_err()
            {
                return;
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the artifact root holds beside `sha256/` (a temporary `.partial-*` left behind would show here).
    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n != bc_cas::SHA256_DIR)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn body(
        parts: Vec<Result<bytes::Bytes, axum::Error>>,
    ) -> impl tokio_stream::Stream<Item = Result<bytes::Bytes, axum::Error>> + Unpin {
        tokio_stream::iter(parts)
    }

    #[tokio::test]
    async fn uploads_stream_to_disk_and_partial_ones_leave_nothing()
    -> Result<(), Box<dyn std::error::Error>> {
        let state = tempfile::tempdir()?;
        let dir = ArtifactDir::new(state.path());
        // Several chunks of 1 MiB: hashed and written as they come.
        let chunk = bytes::Bytes::from(vec![7u8; 1 << 20]);
        let parts = (0..5).map(|_| Ok(chunk.clone())).collect();
        let (sha, size) = dir
            .write(body(parts), Some(5 << 20))
            .await
            .map_err(|e| format!("{e:?}"))?;
        assert_eq!(size, 5 << 20);
        assert_eq!(
            sha,
            bc_cas::Sha256Hex::of(&vec![7u8; 5 << 20]).into_string()
        );
        assert_eq!(std::fs::metadata(dir.path(&sha))?.len(), 5 << 20);
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(dir.path(&sha))?.permissions().mode() & 0o777,
            0o644
        );

        // Broken off, shorter or longer than announced, announced too large: refused, nothing kept.
        let broken = vec![
            Ok(chunk.clone()),
            Err(axum::Error::new(std::io::Error::other("connection reset"))),
        ];
        let e = dir.write(body(broken), None).await.expect_err("broken");
        let e = format!("{e:?}");
        assert!(e.contains("broke off after 1048576 bytes"), "{e}");
        let e = dir
            .write(body(vec![Ok(chunk.clone())]), Some(3 << 20))
            .await
            .expect_err("short");
        assert_eq!(e.code(), ApiCode::InvalidArgument);
        let e = format!("{e:?}");
        assert!(e.contains("1048576 bytes of the 3145728 announced"), "{e}");
        let e = dir
            .write(
                body(vec![Ok(chunk.clone()), Ok(chunk.clone())]),
                Some(1 << 20),
            )
            .await
            .expect_err("long");
        assert_eq!(e.code(), ApiCode::InvalidArgument);
        assert!(
            format!("{e:?}").contains("more than the 1048576 bytes"),
            "{e:?}"
        );
        let e = dir
            .write(body(vec![]), Some(MAX_ARTIFACT + 1))
            .await
            .expect_err("too large");
        let e = format!("{e:?}");
        assert!(e.contains("larger than"), "{e}");
        assert_eq!(
            leftovers(&state.path().join("artifacts")),
            Vec::<String>::new()
        );
        assert_eq!(
            std::fs::read_dir(state.path().join("artifacts/sha256"))?.count(),
            1
        );
        Ok(())
    }

    /// A half-written upload whose sender stops sending (stalls) is dropped with its `.partial-*` file.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_upload_leaves_no_partial_file() -> Result<(), Box<dyn std::error::Error>> {
        let state = tempfile::tempdir()?;
        let dir = ArtifactDir::new(state.path());
        let first = tokio_stream::iter(vec![Ok(bytes::Bytes::from(vec![1u8; 4096]))]);
        let stalled = first.chain(tokio_stream::pending());
        let e = dir
            .write(Box::pin(stalled), Some(8192))
            .await
            .expect_err("stalled");
        assert!(
            format!("{e:?}").contains("sent nothing for 60 s after 4096 bytes"),
            "{e:?}"
        );
        assert_eq!(
            leftovers(&state.path().join("artifacts")),
            Vec::<String>::new()
        );
        Ok(())
    }
}
