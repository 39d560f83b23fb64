//! Artifacts: kernels, initramfs and images kept content-addressed in the state directory
//! (`<state_dir>/artifacts/sha256/<hex>`, 0644), described by `artifacts` rows. Operators upload with
//! `PUT /api/artifacts` (header `x-artifact-name`) (`better-compute artifacts put <file>`, which streams the file):
//! the body is hashed while it is streamed to a temporary file (never held in memory whole), fsynced and renamed
//! into place, so a file under its hash is always complete; a body that breaks off, stalls for 60 s or differs
//! from its `Content-Length` is discarded with its temporary file. Site agents fetch
//! the ones their netboot table references over `SiteService.Artifact` and verify them themselves.
//!
//! A machine's boot names an artifact as `sha256:<hex>` in `kernel` or `initrd`.

use crate::api::{ApiCode, ApiError, ApiState, require};
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
/// An upload that sends nothing for this long is discarded.
pub const UPLOAD_STALL: std::time::Duration = std::time::Duration::from_secs(60);
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

    /// Streams `body` into the store: returns (hash, size). Nothing is left behind on error. `declared` is the
    /// request's `Content-Length`, when it had one: a body of another length is refused.
    pub(crate) async fn write(
        &self,
        mut body: impl tokio_stream::Stream<Item = Result<bytes::Bytes, axum::Error>> + Unpin,
        declared: Option<u64>,
    ) -> Result<(String, u64), ApiError> {
        if declared.is_some_and(|d| d > MAX_ARTIFACT) {
            return Err(ApiError::invalid(format!(
                "artifact is larger than {MAX_ARTIFACT} bytes"
            )));
        }
        let io = |what: &str, e: std::io::Error| {
            tracing::error!(error = %e, "{what}");
            ApiError::new(
                ApiCode::Unavailable,
                format!(
                    "{what} in the control plane's state directory failed; the control plane logged why"
                ),
            )
        };
        let dir = self.root.join("sha256");
        std::fs::create_dir_all(&dir).map_err(|e| io("creating the artifact directory", e))?;
        let tmp = tempfile::Builder::new()
            .prefix(".upload-")
            .tempfile_in(&self.root)
            .map_err(|e| io("creating a temporary artifact file", e))?;
        let mut file = tokio::fs::File::from_std(
            tmp.reopen()
                .map_err(|e| io("opening the temporary artifact file", e))?,
        );
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        loop {
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
        if declared.is_some_and(|d| d != size) {
            return Err(ApiError::invalid(format!(
                "artifact upload ended after {size} bytes of the {} announced; nothing was kept",
                declared.unwrap_or_default()
            )));
        }
        file.flush()
            .await
            .map_err(|e| io("writing the artifact", e))?;
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

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n != "sha256")
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
        assert_eq!(sha, hex::encode(Sha256::digest(vec![7u8; 5 << 20])));
        assert_eq!(std::fs::metadata(dir.path(&sha))?.len(), 5 << 20);

        // Broken off, shorter than announced, announced too large: refused, nothing kept.
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
        let e = format!("{e:?}");
        assert!(e.contains("1048576 bytes of the 3145728 announced"), "{e}");
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
}
