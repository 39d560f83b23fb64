//! Artifacts: kernels, initramfs and images kept content-addressed in the state directory
//! (`<state_dir>/artifacts/sha256/<hex>`, 0644), described by `artifacts` rows. Operators upload with
//! `PUT /api/artifacts` (header `x-artifact-name`) (`better-compute artifacts put <file>`): the body is hashed while it is written to
//! a temporary file, fsynced and renamed into place, so a file under its hash is always complete. Site agents fetch
//! the ones their netboot table references over `SiteService.Artifact` and verify them themselves.
//!
//! A machine's boot names an artifact as `sha256:<hex>` in `kernel` or `initrd`.

use crate::api::{ApiError, ApiState, require};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use bc_proto::v1;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use std::path::{Path, PathBuf};
use tokio::io::AsyncWriteExt as _;
use tokio_stream::StreamExt as _;

/// Largest artifact accepted (an OS image fits; a runaway upload does not fill the disk).
pub const MAX_ARTIFACT: u64 = 64 << 30;
/// Chunk size of `SiteService.Artifact`.
pub const CHUNK: usize = 256 * 1024;
/// How a boot spec names an artifact.
pub const REF_PREFIX: &str = "sha256:";

/// True for 64 lowercase hex characters.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The hash a boot field references (`sha256:<hex>`), if it references one.
pub fn referenced(field: &str) -> Option<&str> {
    field.strip_prefix(REF_PREFIX)
}

/// The artifact directory of a state directory.
#[derive(Debug, Clone)]
pub struct ArtifactDir {
    root: PathBuf,
}

impl ArtifactDir {
    pub fn new(state_dir: &Path) -> ArtifactDir {
        ArtifactDir {
            root: state_dir.join("artifacts"),
        }
    }

    /// Where the content of `sha256` lives (the caller checked it is 64 hex).
    pub fn path(&self, sha256: &str) -> PathBuf {
        self.root.join("sha256").join(sha256)
    }

    /// Streams `body` into the store: returns (hash, size). Nothing is left behind on error.
    async fn write(
        &self,
        mut body: impl tokio_stream::Stream<Item = Result<bytes::Bytes, axum::Error>> + Unpin,
    ) -> Result<(String, u64), ApiError> {
        let io = |what: &str, e: std::io::Error| {
            tracing::error!(error = %e, "{what}");
            ApiError::new(
                "UNAVAILABLE",
                format!(
                    "{what} in the control plane's state directory failed; the control plane logged why"
                ),
            )
        };
        let dir = self.root.join("sha256");
        std::fs::create_dir_all(&dir).map_err(|e| io("creating the artifact directory", e))?;
        let tmp = tempfile::NamedTempFile::new_in(&self.root)
            .map_err(|e| io("creating a temporary artifact file", e))?;
        let mut file = tokio::fs::File::from_std(
            tmp.reopen()
                .map_err(|e| io("opening the temporary artifact file", e))?,
        );
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!("artifact upload broke off after {size} bytes: {e}"))
            })?;
            size += chunk.len() as u64;
            if size > MAX_ARTIFACT {
                return Err(ApiError::invalid(format!(
                    "artifact is larger than {MAX_ARTIFACT} bytes"
                )));
            }
            hasher.update(&chunk);
            file.write_all(&chunk)
                .await
                .map_err(|e| io("writing the artifact", e))?;
        }
        file.sync_all()
            .await
            .map_err(|e| io("syncing the artifact", e))?;
        drop(file);
        let sha = hex::encode(hasher.finalize());
        set_public(tmp.path()).map_err(|e| io("setting the artifact's mode", e))?;
        tmp.persist(self.path(&sha))
            .map_err(|e| io("moving the artifact into place", e.error))?;
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok((sha, size))
    }
}

fn set_public(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
}

/// Header naming an uploaded artifact (optional; the hash names it otherwise).
pub const NAME_HEADER: &str = "x-artifact-name";

/// `PUT /api/artifacts` with header `x-artifact-name: <name>`: the body is the artifact.
pub(crate) async fn put(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let p = crate::api::authenticate(&state.store, &state.principals, &headers).await?;
    require(&p, "compute:artifacts:put", "artifacts")?;
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
    let (sha, size) = state.artifacts.write(body.into_data_stream()).await?;
    let name = if name.is_empty() { sha.clone() } else { name };
    let size = i64::try_from(size).map_err(|_| ApiError::invalid("artifact too large"))?;
    let row = state
        .store
        .put_artifact(&sha, &name, size, &format!("principal/{}", p.id))
        .await?;
    tracing::info!(sha256 = sha, name = row.name, size, "artifact stored");
    Ok(Json(
        json!({ "artifact": row, "reference": format!("{REF_PREFIX}{sha}") }),
    ))
}

/// `artifacts.list`.
pub(crate) async fn list(
    state: &ApiState,
    p: &bc_store::iam::Principal,
) -> Result<Json<Value>, ApiError> {
    require(p, "compute:artifacts:list", "artifacts")?;
    Ok(Json(
        json!({ "artifacts": state.store.list_artifacts().await? }),
    ))
}

/// Checks that every `sha256:` reference of a boot names a stored artifact.
pub(crate) async fn check_references(
    state: &ApiState,
    boot: &crate::site::BootSpec,
) -> Result<(), ApiError> {
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
        if state.store.artifact(sha).await?.is_none() {
            return Err(ApiError::new(
                "NOT_FOUND",
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
