//! Loader contents kept in memory between transfers.
//!
//! Every booting machine fetches the same few loaders (undionly.kpxe, snponly.efi, ipxe.efi: 70 KB to 1 MB), so a
//! transfer of a cached file needs no read and no trip to the blocking pool: its blocks are slices of one shared
//! buffer. A copy is used only while the file's length, modification time and inode match the metadata looked up
//! for the request, so a replaced loader is served fresh on the next request. Bounded: files above `max_file` are
//! never cached, and the whole cache is emptied when adding a file would pass `max_total`.

use std::collections::HashMap;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What identifies one version of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Version {
    len: u64,
    mtime_ns: i128,
    ino: u64,
    dev: u64,
}

impl Version {
    fn of(meta: &Metadata) -> Self {
        Version {
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ino: meta.ino(),
            dev: meta.dev(),
        }
    }
}

/// One cached file: the version read and its bytes.
type Entry = (Version, Arc<[u8]>);

/// File contents by canonical path.
#[derive(Debug)]
pub struct FileCache {
    max_file: u64,
    max_total: u64,
    entries: Mutex<HashMap<PathBuf, Entry>>,
}

impl FileCache {
    pub fn new(max_file: u64, max_total: u64) -> Self {
        FileCache {
            max_file,
            max_total,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a file of this size would be kept.
    pub fn admits(&self, meta: &Metadata) -> bool {
        meta.len() <= self.max_file && meta.len() <= self.max_total
    }

    /// The cached contents when they are of the version `meta` describes.
    pub fn get(&self, path: &Path, meta: &Metadata) -> Option<Arc<[u8]>> {
        let entries = self.entries.lock().ok()?;
        let (version, data) = entries.get(path)?;
        (*version == Version::of(meta)).then(|| data.clone())
    }

    /// Keeps `data` as the contents of `path` at the version `meta` describes (read before the contents).
    pub fn put(&self, path: PathBuf, meta: &Metadata, data: Arc<[u8]>) {
        if !self.admits(meta) || data.len() as u64 != meta.len() {
            return;
        }
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        let total: u64 = entries
            .iter()
            .filter(|(p, _)| **p != path)
            .map(|(_, (_, d))| d.len() as u64)
            .sum();
        if total + meta.len() > self.max_total {
            entries.clear();
        }
        entries.insert(path, (Version::of(meta), data));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_only_the_version_it_read() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("snponly.efi");
        std::fs::write(&path, b"one")?;
        let cache = FileCache::new(10, 15);
        let meta = path.metadata()?;
        assert!(cache.get(&path, &meta).is_none());
        cache.put(path.clone(), &meta, Arc::from(&b"one"[..]));
        assert_eq!(cache.get(&path, &meta).as_deref(), Some(&b"one"[..]));
        // Replaced (new inode, new length): the old copy is not used.
        std::fs::remove_file(&path)?;
        std::fs::write(&path, b"second")?;
        let meta2 = path.metadata()?;
        assert!(cache.get(&path, &meta2).is_none());
        // A length that disagrees with the metadata is not kept; too large a file is not admitted.
        cache.put(path.clone(), &meta2, Arc::from(&b"short"[..]));
        assert!(cache.get(&path, &meta2).is_none());
        let big = dir.path().join("big");
        std::fs::write(&big, [0u8; 11])?;
        assert!(!cache.admits(&big.metadata()?));
        Ok(())
    }
}
