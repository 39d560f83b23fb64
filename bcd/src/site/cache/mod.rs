//! The site agent's artifact cache: artifacts the control plane's netboot table references are fetched over
//! `SiteService.Artifact` into `<artifacts>/sha256/<hex>`, which boot HTTP serves as `/artifacts/sha256/<hex>`.
//! Downloads go through bc-cas's content-addressed writer: hashed while written to a temporary file in the cache
//! directory, fsynced, made `0644` and renamed into place only when length and SHA-256 match what the table
//! promised, so a file under its hash is always complete and verified. A corrupt, short or overlong download is
//! discarded with an error naming the artifact, and fetched again at the agent's next round after a backoff
//! ([`RETRY`]: 1 s doubling to 60 s, jittered). At most `max_concurrent` downloads run at once.
//!
//! Eviction: the cached artifacts (files under `sha256/`, nothing else in the directory) may take `max_bytes`
//! (`[cache] max_bytes` in site.toml, default 20 GiB), counting the downloads the table still needs. Over it, the
//! least recently used artifacts the current netboot table does not reference are deleted ([`evict::plan_eviction`]
//! decides, [`ArtifactCache::evict`] applies). A referenced artifact is never deleted: when the referenced ones alone
//! exceed the cap they are all kept and a warning says so. "Used" is the last time a table referenced the artifact,
//! kept as the file's access time (set at most once a minute while referenced; the modification time, which boot
//! HTTP's ETag is made of, is left alone), so the order survives a restart.

pub mod evict;

pub use bc_cas::is_sha256_hex;
pub use evict::{CachedArtifact, EvictionPlan, plan_eviction};

use bc_backoff::{ExponentialBackoff, Jitter};
use bc_cas::{CasError, Expect, Sha256Hex};
use bc_error_chain::InlineErrorChain;
use bc_proto::v1;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
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
    /// The bytes were refused (length, hash) or could not be stored; nothing was kept.
    #[error("artifact {sha256} not kept (fetched again at the next round)")]
    NotKept {
        sha256: String,
        #[source]
        source: CasError,
    },
    #[error("artifact {sha256}: the write was cut short (the agent is stopping)")]
    Interrupted { sha256: String },
    #[error("artifact reference {0:?} is not 64 lowercase hex characters")]
    BadReference(String),
}

/// Counts for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheCounters {
    pub fetched: u64,
    pub failed: u64,
    pub bytes: u64,
    /// Artifacts deleted by eviction, and their bytes.
    pub evicted: u64,
    pub evicted_bytes: u64,
}

/// Default of `max_bytes` (site.toml `[cache] max_bytes`).
pub const DEFAULT_MAX_BYTES: u64 = bcd_site::serve::DEFAULT_CACHE_MAX_BYTES;

/// What an eviction pass ran for: the referenced hashes and the count of finished downloads.
type EvictionInput = (BTreeSet<String>, u64);

#[derive(Clone)]
pub struct ArtifactCache {
    dir: PathBuf,
    permits: Arc<Semaphore>,
    in_flight: Arc<Mutex<HashSet<String>>>,
    /// Failed artifacts: not before when to try again, and how many failures in a row.
    retry: Arc<Mutex<HashMap<String, (Instant, u32)>>>,
    counters: Arc<Mutex<CacheCounters>>,
    max_bytes: u64,
    /// What the last eviction pass saw (referenced set, downloads finished): a pass runs only when either changed.
    evicted_for: Arc<Mutex<Option<EvictionInput>>>,
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
            max_bytes: DEFAULT_MAX_BYTES,
            evicted_for: Arc::default(),
            done: Arc::default(),
        }
    }

    /// The size cap (see the module documentation).
    pub fn with_max_bytes(mut self, max_bytes: u64) -> ArtifactCache {
        self.max_bytes = max_bytes;
        self
    }

    pub fn counters(&self) -> CacheCounters {
        self.counters.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Where a verified artifact lives.
    pub fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join("sha256").join(sha256)
    }

    /// True when the artifact is in the cache with its size; marks it used (its access time) while at it.
    fn cached(&self, a: &v1::NetbootArtifact) -> bool {
        if !is_sha256_hex(&a.sha256) {
            return false;
        }
        let path = self.path(&a.sha256);
        let Ok(meta) = std::fs::metadata(&path) else {
            return false;
        };
        if !(meta.is_file() && meta.len() == a.size) {
            return false;
        }
        let now = SystemTime::now();
        let stale = meta
            .accessed()
            .map_or(true, |t| now.duration_since(t).is_ok_and(|d| d > USE_MARK));
        if stale {
            mark_used(&path, now);
        }
        true
    }

    /// The machines of `table` whose artifacts are all cached; downloads start (in the background, bounded) for
    /// the missing ones, and the machines needing them are left out until they are in. Runs an eviction pass
    /// first when the referenced set or the cache's contents changed since the last one.
    pub fn ready(&self, table: &v1::NetbootResponse, client: &Client) -> v1::NetbootResponse {
        let (ready, missing) = self.split(table);
        let referenced = referenced(table);
        let fetched = self.counters().fetched;
        let changed = self.evicted_for.lock().map_or(true, |last| {
            last.as_ref()
                .is_none_or(|(r, f)| *r != referenced || *f != fetched)
        });
        if changed {
            self.evict(&referenced, &missing);
            if let Ok(mut last) = self.evicted_for.lock() {
                *last = Some((referenced, fetched));
            }
        }
        for a in missing {
            self.start(a, client.clone());
        }
        ready
    }

    /// The verified artifacts in the cache (`sha256/<64 hex>` regular files; anything else there is left alone).
    pub fn scan(&self) -> Vec<CachedArtifact> {
        let Ok(dir) = std::fs::read_dir(self.dir.join("sha256")) else {
            return Vec::new();
        };
        dir.filter_map(Result::ok)
            .filter_map(|e| {
                let sha256 = e
                    .file_name()
                    .to_str()
                    .filter(|n| is_sha256_hex(n))?
                    .to_string();
                let meta = e.metadata().ok().filter(std::fs::Metadata::is_file)?;
                let written = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                let last_used = meta.accessed().map_or(written, |a| a.max(written));
                Some(CachedArtifact {
                    sha256,
                    size: meta.len(),
                    last_used,
                })
            })
            .collect()
    }

    /// One eviction pass: `referenced` are the hashes the current table names, `missing` the ones still to
    /// download (their sizes count against the cap). Deletes what [`plan_eviction`] picks and returns the plan.
    pub fn evict(
        &self,
        referenced: &BTreeSet<String>,
        missing: &[v1::NetbootArtifact],
    ) -> EvictionPlan {
        let incoming = missing
            .iter()
            .map(|a| a.size)
            .fold(0u64, u64::saturating_add);
        let plan = plan_eviction(&self.scan(), referenced, incoming, self.max_bytes);
        for (sha256, size) in &plan.evict {
            let path = self.path(sha256);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(
                        sha256,
                        size,
                        max_bytes = self.max_bytes,
                        "artifact evicted (least recently used, not referenced)"
                    );
                    if let Ok(mut c) = self.counters.lock() {
                        c.evicted += 1;
                        c.evicted_bytes += size;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::error!(sha256, path = %path.display(), error = %bc_error_chain::InlineErrorChain::new(&e), "evicting an artifact failed")
                }
            }
        }
        if plan.over_cap {
            tracing::warn!(
                referenced_bytes = plan.referenced_bytes,
                max_bytes = self.max_bytes,
                "the artifacts the netboot table references exceed [cache] max_bytes: all kept; raise the cap"
            );
        }
        plan
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
        // Prefetched artifacts (an image being deployed) gate no entry: fetched, served once in.
        for a in &table.prefetch {
            if is_sha256_hex(&a.sha256)
                && !self.cached(a)
                && !missing.iter().any(|x| x.sha256 == a.sha256)
            {
                missing.push(a.clone());
            }
        }
        (
            v1::NetbootResponse {
                machines,
                prefetch: table.prefetch.clone(),
                version: table.version.clone(),
            },
            missing,
        )
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
                    let at = Instant::now() + RETRY.delay(failures - 1, rand::random::<f64>());
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
                Err(e) => {
                    tracing::error!(name = a.name, error = %InlineErrorChain::new(&e), "artifact download failed")
                }
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
        let request = client.artifact(v1::ArtifactRequest {
            sha256: a.sha256.clone(),
        });
        let stream = bc_proto::channel::answered_within(
            "opening an artifact download",
            bc_proto::channel::CALL_DEADLINE,
            request,
        )
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

/// A referenced artifact's access time is refreshed when it is older than this.
pub const USE_MARK: Duration = Duration::from_secs(60);

/// Sets the access time only (the modification time is boot HTTP's ETag: it must not move).
fn mark_used(path: &Path, now: SystemTime) {
    let set = std::fs::File::open(path)
        .and_then(|f| f.set_times(std::fs::FileTimes::new().set_accessed(now)));
    if let Err(e) = set {
        tracing::debug!(path = %path.display(), error = %bc_error_chain::InlineErrorChain::new(&e), "marking an artifact used failed");
    }
}

/// The hashes a table references (valid ones; the others are never fetched).
pub fn referenced(table: &v1::NetbootResponse) -> BTreeSet<String> {
    table
        .machines
        .iter()
        .flat_map(|m| &m.artifacts)
        .chain(&table.prefetch)
        .filter(|a| is_sha256_hex(&a.sha256))
        .map(|a| a.sha256.clone())
        .collect()
}

/// A download that delivers nothing for this long is abandoned (it would hold a download slot forever).
pub const STALL: Duration = Duration::from_secs(30);

/// Between tries of an artifact that failed: 1 s doubling to 60 s, each at least 80 % of its ceiling.
pub const RETRY: ExponentialBackoff = ExponentialBackoff::new(
    Duration::from_secs(1),
    Duration::from_secs(60),
    Jitter::Fraction(0.2),
);

/// Writes `stream` through bc-cas's writer into `dir` (`dir/sha256/<sha256>`, 0644), checking length and SHA-256 as
/// it goes; on any error nothing is kept. A stream that sends nothing for [`STALL`] is abandoned.
pub async fn write_verified(
    dir: &Path,
    sha256: &str,
    size: u64,
    mut stream: impl tokio_stream::Stream<Item = Result<v1::ArtifactChunk, tonic::Status>> + Unpin,
) -> Result<PathBuf, FetchError> {
    let want =
        Sha256Hex::parse(sha256).map_err(|_| FetchError::BadReference(sha256.to_string()))?;
    let not_kept = |source| FetchError::NotKept {
        sha256: sha256.to_string(),
        source,
    };
    let mut writer = bc_cas::Store::new(dir)
        .begin(Expect::exact(want, size))
        .map_err(not_kept)?;
    loop {
        let Ok(next) = tokio::time::timeout(STALL, stream.next()).await else {
            return Err(FetchError::Stalled {
                sha256: sha256.to_string(),
                got: writer.received(),
                size,
                secs: STALL.as_secs(),
            });
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|s| FetchError::Broken {
            sha256: sha256.to_string(),
            got: writer.received(),
            size,
            code: s.code(),
            message: s.message().to_string(),
        })?;
        writer.write(&chunk.data).map_err(not_kept)?;
    }
    // The fsync of a large image must not hold a runtime thread.
    let stored = tokio::task::spawn_blocking(move || writer.commit())
        .await
        .map_err(|_| FetchError::Interrupted {
            sha256: sha256.to_string(),
        })?
        .map_err(not_kept)?;
    Ok(stored.path)
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
        assert_eq!(RETRY.delay(0, 1.0), Duration::from_secs(1));
        assert_eq!(RETRY.delay(2, 1.0), Duration::from_secs(4));
        assert_eq!(RETRY.delay(39, 1.0), Duration::from_secs(60));
        assert_eq!(RETRY.delay(39, 0.0), Duration::from_secs(48));
        assert!(RETRY.delay(1, 0.0) < RETRY.delay(1, 1.0));
    }

    #[tokio::test]
    async fn verified_content_lands_and_anything_else_is_discarded()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let content = b"kernel bytes".repeat(1000);
        let sha = Sha256Hex::of(&content).into_string();
        let size = content.len() as u64;
        let (a, b) = content.split_at(5000);

        let mut tampered = content.clone();
        tampered[7] ^= 1;
        let (ta, tb) = tampered.split_at(5000);
        let e = write_verified(dir.path(), &sha, size, chunks(&[ta, tb])).await;
        assert!(
            matches!(
                e,
                Err(FetchError::NotKept {
                    source: CasError::HashMismatch { .. },
                    ..
                })
            ),
            "{e:?}"
        );
        let e = write_verified(dir.path(), &sha, size, chunks(&[a])).await;
        assert!(
            matches!(
                e,
                Err(FetchError::NotKept {
                    source: CasError::Truncated { got: 5000, .. },
                    ..
                })
            ),
            "{e:?}"
        );
        let e = write_verified(dir.path(), &sha, size, chunks(&[a, b, b"x"])).await;
        assert!(
            matches!(
                e,
                Err(FetchError::NotKept {
                    source: CasError::TooLong { .. },
                    ..
                })
            ),
            "{e:?}"
        );
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
    fn put(dir: &Path, content: &[u8], used: SystemTime) -> Result<String, std::io::Error> {
        let sha = Sha256Hex::of(content).into_string();
        let path = dir.join("sha256").join(&sha);
        std::fs::create_dir_all(dir.join("sha256"))?;
        std::fs::write(&path, content)?;
        let f = std::fs::File::options().write(true).open(&path)?;
        f.set_times(
            std::fs::FileTimes::new()
                .set_accessed(used)
                .set_modified(used),
        )?;
        Ok(sha)
    }

    fn artifact(sha: &str, size: usize) -> v1::NetbootArtifact {
        v1::NetbootArtifact {
            sha256: sha.to_string(),
            size: size as u64,
            name: String::new(),
        }
    }

    #[test]
    fn eviction_deletes_only_unreferenced_cache_files() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let t = |s: u64| SystemTime::now() - Duration::from_secs(3600 * s);
        let old = put(dir.path(), &[1u8; 4000], t(5))?;
        let older = put(dir.path(), &[2u8; 3000], t(9))?;
        let referenced_oldest = put(dir.path(), &[3u8; 2000], t(20))?;
        let recent = put(dir.path(), &[4u8; 1000], t(1))?;
        // Not the cache's: an operator's file beside sha256/, and a non-hash name inside it.
        std::fs::create_dir_all(dir.path().join("ramdisk"))?;
        std::fs::write(dir.path().join("ramdisk/vmlinuz"), [0u8; 9000])?;
        std::fs::write(dir.path().join("sha256/README"), [0u8; 9000])?;

        let cache = ArtifactCache::new(dir.path(), 1).with_max_bytes(5000);
        assert_eq!(cache.scan().len(), 4);
        let referenced: BTreeSet<String> = [referenced_oldest.clone()].into();
        // 10000 bytes, cap 5000: 'older' (9 h) then 'old' (5 h) go; the referenced one (20 h) and 'recent' stay.
        let plan = cache.evict(&referenced, &[]);
        assert_eq!(
            plan.evict
                .iter()
                .map(|(s, _)| s.as_str())
                .collect::<Vec<_>>(),
            vec![older.as_str(), old.as_str()]
        );
        for (sha, kept) in [
            (&older, false),
            (&old, false),
            (&referenced_oldest, true),
            (&recent, true),
        ] {
            assert_eq!(cache.path(sha).exists(), kept, "{sha}");
        }
        assert!(dir.path().join("ramdisk/vmlinuz").exists());
        assert!(dir.path().join("sha256/README").exists());
        let c = cache.counters();
        assert_eq!((c.evicted, c.evicted_bytes), (2, 7000));

        // A download of 4500 bytes still to come makes room for itself: 'recent' goes, the referenced one stays
        // and, with the download, exceeds the cap (reported, kept).
        let plan = cache.evict(&referenced, &[artifact(&"9".repeat(64), 4500)]);
        assert_eq!(plan.evict, vec![(recent.clone(), 1000)]);
        assert!(plan.over_cap);
        assert!(cache.path(&referenced_oldest).exists());

        // Being referenced marks an artifact used (access time) without moving its modification time (the ETag).
        let before = std::fs::metadata(cache.path(&referenced_oldest))?;
        assert!(cache.cached(&artifact(&referenced_oldest, 2000)));
        let after = std::fs::metadata(cache.path(&referenced_oldest))?;
        assert_eq!(before.modified()?, after.modified()?);
        assert!(after.accessed()? > before.accessed()? + Duration::from_secs(3600));
        assert!(
            !cache.cached(&artifact(&referenced_oldest, 1999)),
            "wrong size"
        );
        Ok(())
    }
}
