//! The site agent's artifact cache (feature `site`): artifacts the control plane's netboot table references are
//! fetched over `SiteService.Artifact` into `<artifacts>/sha256/<hex>`, which boot HTTP serves as
//! `/artifacts/sha256/<hex>`. Each download is hashed while it is written to a temporary file in the cache
//! directory; only when its length and SHA-256 match what the table promised is it fsynced, made `0644` and renamed
//! into place, so a file under its hash is always complete and verified. A corrupt, short or overlong download is
//! discarded with an error naming the artifact, and fetched again at the agent's next round after a backoff (1 s
//! doubling to 60 s, with jitter). At most
//! `max_concurrent` downloads run at once. Nothing is evicted yet: the cache only grows.

use bc_proto::v1;
use sha2::{Digest as _, Sha256};
use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_stream::StreamExt as _;

type Client = v1::site_service_client::SiteServiceClient<tonic::transport::Channel>;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("artifact {sha256}: the control plane refused it ({code:?}): {message}")]
    Refused {
        sha256: String,
        code: tonic::Code,
        message: String,
    },
    #[error(
        "artifact {sha256}: the stream broke off after {got} of {size} bytes ({code:?}: {message})"
    )]
    Broken {
        sha256: String,
        got: u64,
        size: u64,
        code: tonic::Code,
        message: String,
    },
    #[error(
        "artifact {sha256}: no data for {secs} s after {got} of {size} bytes; discarded, fetched again later"
    )]
    Stalled {
        sha256: String,
        got: u64,
        size: u64,
        secs: u64,
    },
    #[error(
        "artifact {sha256}: truncated: {got} of {size} bytes; discarded, fetched again at the next round"
    )]
    Truncated { sha256: String, got: u64, size: u64 },
    #[error(
        "artifact {sha256}: more than the {size} bytes announced; discarded, fetched again at the next round"
    )]
    TooLong { sha256: String, size: u64 },
    #[error(
        "artifact {sha256}: content hashes to {got} (corrupt or tampered in transit or at rest); discarded, \
         fetched again at the next round"
    )]
    HashMismatch { sha256: String, got: String },
    #[error("artifact {sha256}: {what} {path}")]
    Io {
        sha256: String,
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("artifact reference {0:?} is not 64 lowercase hex characters")]
    BadReference(String),
}

/// True for 64 lowercase hex characters (the only names the cache creates).
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Counts for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheCounters {
    pub fetched: u64,
    pub failed: u64,
    pub bytes: u64,
}

#[derive(Clone)]
pub struct ArtifactCache {
    dir: PathBuf,
    permits: Arc<Semaphore>,
    in_flight: Arc<Mutex<HashSet<String>>>,
    /// Failed artifacts: not before when to try again, and how many failures in a row.
    retry: Arc<Mutex<HashMap<String, (Instant, u32)>>>,
    counters: Arc<Mutex<CacheCounters>>,
    /// Woken when a download finishes, so the agent publishes at once instead of at its next round.
    pub done: Arc<Notify>,
}

impl ArtifactCache {
    pub fn new(dir: &Path, max_concurrent: usize) -> ArtifactCache {
        ArtifactCache {
            dir: dir.to_path_buf(),
            permits: Arc::new(Semaphore::new(max_concurrent.max(1))),
            in_flight: Arc::default(),
            retry: Arc::default(),
            counters: Arc::default(),
            done: Arc::default(),
        }
    }

    pub fn counters(&self) -> CacheCounters {
        self.counters.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Where a verified artifact lives.
    pub fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join("sha256").join(sha256)
    }

    fn cached(&self, a: &v1::NetbootArtifact) -> bool {
        is_sha256_hex(&a.sha256)
            && std::fs::metadata(self.path(&a.sha256))
                .is_ok_and(|m| m.is_file() && m.len() == a.size)
    }

    /// The machines of `table` whose artifacts are all cached; downloads start (in the background, bounded) for
    /// the missing ones, and the machines needing them are left out until they are in.
    pub fn ready(&self, table: &v1::NetbootResponse, client: &Client) -> v1::NetbootResponse {
        let (ready, missing) = self.split(table);
        for a in missing {
            self.start(a, client.clone());
        }
        ready
    }

    /// Splits `table` into the machines whose artifacts are all cached and the artifacts still missing (each once;
    /// references that are not a SHA-256 are logged and never fetched, and their machines never published).
    pub fn split(
        &self,
        table: &v1::NetbootResponse,
    ) -> (v1::NetbootResponse, Vec<v1::NetbootArtifact>) {
        let mut machines = Vec::new();
        let mut missing: Vec<v1::NetbootArtifact> = Vec::new();
        for m in &table.machines {
            let mut complete = true;
            for a in &m.artifacts {
                if self.cached(a) {
                    continue;
                }
                complete = false;
                if !is_sha256_hex(&a.sha256) {
                    tracing::warn!(mac = m.mac, error = %FetchError::BadReference(a.sha256.clone()), "netboot entry left out");
                } else if !missing.iter().any(|x| x.sha256 == a.sha256) {
                    missing.push(a.clone());
                }
            }
            if complete {
                machines.push(m.clone());
            } else {
                tracing::debug!(mac = m.mac, "netboot entry waits for its artifacts");
            }
        }
        (v1::NetbootResponse { machines }, missing)
    }

    fn start(&self, a: v1::NetbootArtifact, mut client: Client) {
        if let Ok(retry) = self.retry.lock()
            && retry
                .get(&a.sha256)
                .is_some_and(|(at, _)| Instant::now() < *at)
        {
            return;
        }
        let Ok(mut in_flight) = self.in_flight.lock() else {
            return;
        };
        if !in_flight.insert(a.sha256.clone()) {
            return;
        }
        drop(in_flight);
        let cache = self.clone();
        tokio::spawn(async move {
            let _permit = cache.permits.clone().acquire_owned().await;
            let started = tokio::time::Instant::now();
            let result = cache.fetch(&mut client, &a).await;
            if let Ok(mut c) = cache.counters.lock() {
                match &result {
                    Ok(_) => {
                        c.fetched += 1;
                        c.bytes += a.size;
                    }
                    Err(_) => c.failed += 1,
                }
            }
            let failed = result.is_err();
            if let Ok(mut retry) = cache.retry.lock() {
                if failed {
                    let failures = retry.get(&a.sha256).map_or(0, |(_, n)| *n) + 1;
                    let at = Instant::now() + retry_delay(failures, rand::random::<f64>());
                    retry.insert(a.sha256.clone(), (at, failures));
                } else {
                    retry.remove(&a.sha256);
                }
            }
            match result {
                Ok(path) => tracing::info!(
                    sha256 = a.sha256,
                    name = a.name,
                    size = a.size,
                    path = %path.display(),
                    ms = started.elapsed().as_millis() as u64,
                    "artifact cached (verified)"
                ),
                Err(e) => tracing::error!(name = a.name, error = %e, "artifact download failed"),
            }
            if let Ok(mut f) = cache.in_flight.lock() {
                f.remove(&a.sha256);
            }
            if !failed {
                cache.done.notify_one();
            }
        });
    }

    /// Downloads one artifact and puts it in place once verified.
    pub async fn fetch(
        &self,
        client: &mut Client,
        a: &v1::NetbootArtifact,
    ) -> Result<PathBuf, FetchError> {
        if !is_sha256_hex(&a.sha256) {
            return Err(FetchError::BadReference(a.sha256.clone()));
        }
        let stream = client
            .artifact(v1::ArtifactRequest {
                sha256: a.sha256.clone(),
            })
            .await
            .map_err(|s| FetchError::Refused {
                sha256: a.sha256.clone(),
                code: s.code(),
                message: s.message().to_string(),
            })?
            .into_inner();
        write_verified(&self.dir, &a.sha256, a.size, stream).await
    }
}

/// A download that delivers nothing for this long is abandoned (it would hold a download slot forever).
pub const STALL: Duration = Duration::from_secs(30);

/// Delay before the next try after `failures` failures in a row: 1 s doubling to 60 s, ±20% jitter from `unit`
/// (0..1).
pub fn retry_delay(failures: u32, unit: f64) -> Duration {
    let base =
        Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60));
    base.mul_f64(0.8 + 0.4 * unit.clamp(0.0, 1.0))
}

/// Writes `stream` to a temporary file in `dir`, checking length and SHA-256 as it goes; renames it to
/// `dir/sha256/<sha256>` (0644) only when both match. On any error the temporary file is removed.
pub async fn write_verified(
    dir: &Path,
    sha256: &str,
    size: u64,
    mut stream: impl tokio_stream::Stream<Item = Result<v1::ArtifactChunk, tonic::Status>> + Unpin,
) -> Result<PathBuf, FetchError> {
    if !is_sha256_hex(sha256) {
        return Err(FetchError::BadReference(sha256.to_string()));
    }
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        let sha256 = sha256.to_string();
        move |source| FetchError::Io {
            sha256,
            what,
            path,
            source,
        }
    };
    let final_dir = dir.join("sha256");
    std::fs::create_dir_all(&final_dir).map_err(io("creating", &final_dir))?;
    let tmp = tempfile::Builder::new()
        .prefix(".partial-")
        .tempfile_in(dir)
        .map_err(io("creating a temporary file in", dir))?;
    let mut hasher = Sha256::new();
    let mut got = 0u64;
    {
        let mut file = std::io::BufWriter::with_capacity(1 << 20, tmp.as_file());
        loop {
            let Ok(next) = tokio::time::timeout(STALL, stream.next()).await else {
                return Err(FetchError::Stalled {
                    sha256: sha256.to_string(),
                    got,
                    size,
                    secs: STALL.as_secs(),
                });
            };
            let Some(chunk) = next else { break };
            let chunk = chunk.map_err(|s| FetchError::Broken {
                sha256: sha256.to_string(),
                got,
                size,
                code: s.code(),
                message: s.message().to_string(),
            })?;
            got += chunk.data.len() as u64;
            if got > size {
                return Err(FetchError::TooLong {
                    sha256: sha256.to_string(),
                    size,
                });
            }
            hasher.update(&chunk.data);
            file.write_all(&chunk.data)
                .map_err(io("writing", tmp.path()))?;
        }
        file.flush().map_err(io("writing", tmp.path()))?;
    }
    if got != size {
        return Err(FetchError::Truncated {
            sha256: sha256.to_string(),
            got,
            size,
        });
    }
    let digest = hex::encode(hasher.finalize());
    if digest != sha256 {
        return Err(FetchError::HashMismatch {
            sha256: sha256.to_string(),
            got: digest,
        });
    }
    tmp.as_file()
        .sync_all()
        .map_err(io("syncing", tmp.path()))?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o644))
            .map_err(io("setting the mode of", tmp.path()))?;
    }
    let path = final_dir.join(sha256);
    tmp.persist(&path)
        .map_err(|e| io("moving into place", &path)(e.error))?;
    if let Ok(d) = std::fs::File::open(&final_dir) {
        let _ = d.sync_all();
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(
        parts: &[&[u8]],
    ) -> impl tokio_stream::Stream<Item = Result<v1::ArtifactChunk, tonic::Status>> + Unpin {
        let v: Vec<_> = parts
            .iter()
            .map(|p| Ok(v1::ArtifactChunk { data: p.to_vec() }))
            .collect();
        tokio_stream::iter(v)
    }

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

    #[test]
    fn retries_back_off_to_a_cap() {
        assert_eq!(retry_delay(1, 0.5), Duration::from_secs(1));
        assert_eq!(retry_delay(3, 0.5), Duration::from_secs(4));
        assert_eq!(retry_delay(40, 0.5), Duration::from_secs(60));
        assert!(retry_delay(2, 0.0) < retry_delay(2, 1.0));
    }

    #[tokio::test]
    async fn verified_content_lands_and_anything_else_is_discarded()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let content = b"kernel bytes".repeat(1000);
        let sha = hex::encode(Sha256::digest(&content));
        let size = content.len() as u64;
        let (a, b) = content.split_at(5000);

        let mut tampered = content.clone();
        tampered[7] ^= 1;
        let (ta, tb) = tampered.split_at(5000);
        let e = write_verified(dir.path(), &sha, size, chunks(&[ta, tb])).await;
        assert!(matches!(e, Err(FetchError::HashMismatch { .. })), "{e:?}");
        let e = write_verified(dir.path(), &sha, size, chunks(&[a])).await;
        assert!(
            matches!(e, Err(FetchError::Truncated { got: 5000, .. })),
            "{e:?}"
        );
        let e = write_verified(dir.path(), &sha, size, chunks(&[a, b, b"x"])).await;
        assert!(matches!(e, Err(FetchError::TooLong { .. })), "{e:?}");
        let broken = tokio_stream::iter(vec![
            Ok(v1::ArtifactChunk { data: a.to_vec() }),
            Err(tonic::Status::unavailable("gateway went away")),
        ]);
        let e = write_verified(dir.path(), &sha, size, broken).await;
        assert!(
            matches!(e, Err(FetchError::Broken { got: 5000, .. })),
            "{e:?}"
        );
        // A stream that stops sending without ending is abandoned after STALL (time is paused: no real wait).
        tokio::time::pause();
        let stalled = tokio_stream::iter(vec![Ok(v1::ArtifactChunk { data: a.to_vec() })])
            .chain(tokio_stream::pending());
        let e = write_verified(dir.path(), &sha, size, Box::pin(stalled)).await;
        assert!(
            matches!(e, Err(FetchError::Stalled { got: 5000, .. })),
            "{e:?}"
        );
        tokio::time::resume();
        let e = write_verified(dir.path(), "../../etc/passwd", size, chunks(&[a])).await;
        assert!(matches!(e, Err(FetchError::BadReference(_))), "{e:?}");
        assert!(!dir.path().join("sha256").join(&sha).exists());
        assert_eq!(
            leftovers(dir.path()),
            Vec::<String>::new(),
            "temporary files left behind"
        );

        let path = write_verified(dir.path(), &sha, size, chunks(&[a, b])).await?;
        assert_eq!(std::fs::read(&path)?, content);
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&path)?.permissions().mode() & 0o777,
            0o644
        );
        assert_eq!(leftovers(dir.path()), Vec::<String>::new());
        Ok(())
    }
}
