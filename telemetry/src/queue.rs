//! The bounded, disk-backed queue between the sampler and one exporter.
//!
//! Each batch (an encoded request body) is one file `<seq>.batch` in the queue's directory: a 16-byte header
//! (`BCQ1`, sample count u32 LE, body length u64 LE) and the body, written to a temporary name and renamed, so a
//! reader never sees half a batch. A receiver outage therefore loses nothing until the directory holds
//! `max_bytes`; past that the oldest batches are deleted and counted ([`Evicted`]), never the newest. Only the index
//! (sequence, size, sample count per batch) is in memory, so memory stays bounded however long the outage lasts.
//! After a restart the queue resumes from the files; one whose length disagrees with its header is discarded and
//! counted. Files are not fsynced per batch: a power loss can cost the last seconds, a process crash costs nothing.

use std::collections::VecDeque;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"BCQ1";
const HEADER: usize = 16;
const SUFFIX: &str = ".batch";

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("queue directory {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("queue file {path}")]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    seq: u64,
    size: u64,
    samples: u32,
}

/// Batches deleted to stay within the bound (or refused because one alone exceeds it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    pub batches: u64,
    pub samples: u64,
}

/// What [`DiskQueue::open`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    pub batches: u64,
    pub samples: u64,
    /// Files that were not whole batches (discarded).
    pub corrupt: u64,
}

/// A queued batch read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub seq: u64,
    pub body: Vec<u8>,
    pub samples: u32,
}

#[derive(Debug)]
pub struct DiskQueue {
    dir: PathBuf,
    max_bytes: u64,
    entries: VecDeque<Entry>,
    bytes: u64,
    next_seq: u64,
}

fn name(seq: u64) -> String {
    format!("{seq:016x}{SUFFIX}")
}

impl DiskQueue {
    /// Opens (creating) the directory and indexes the batches left from an earlier run.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<(DiskQueue, Recovered), QueueError> {
        let derr = |source| QueueError::Dir {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(derr)?;
        let mut found: Vec<(u64, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(dir).map_err(derr)? {
            let e = e.map_err(derr)?;
            let fname = e.file_name();
            let Some(fname) = fname.to_str() else {
                continue;
            };
            if fname.ends_with(".tmp") {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            if let Some(seq) = fname
                .strip_suffix(SUFFIX)
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            {
                found.push((seq, e.path()));
            }
        }
        found.sort();
        let mut q = DiskQueue {
            dir: dir.to_path_buf(),
            max_bytes,
            entries: VecDeque::new(),
            bytes: 0,
            next_seq: found.last().map_or(0, |(s, _)| s + 1),
        };
        let mut rec = Recovered::default();
        for (seq, path) in found {
            match read_header(&path) {
                Ok(Some((samples, size))) => {
                    q.entries.push_back(Entry { seq, size, samples });
                    q.bytes += size;
                    rec.batches += 1;
                    rec.samples += u64::from(samples);
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                    rec.corrupt += 1;
                }
            }
        }
        Ok((q, rec))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes on disk, headers included.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn samples(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.samples)).sum()
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(name(seq))
    }

    /// Appends a batch, first deleting the oldest while the bound would be exceeded.
    pub fn push(&mut self, body: &[u8], samples: u32) -> Result<Evicted, QueueError> {
        let size = (HEADER + body.len()) as u64;
        let mut ev = Evicted::default();
        if size > self.max_bytes {
            ev.batches = 1;
            ev.samples = u64::from(samples);
            return Ok(ev);
        }
        while self.bytes + size > self.max_bytes {
            let Some(old) = self.entries.pop_front() else {
                break;
            };
            self.bytes -= old.size;
            ev.batches += 1;
            ev.samples += u64::from(old.samples);
            let _ = std::fs::remove_file(self.path(old.seq));
        }
        let seq = self.next_seq;
        let path = self.path(seq);
        let tmp = self.dir.join(format!(".{}.tmp", name(seq)));
        let ferr = |source| QueueError::File {
            path: path.clone(),
            source,
        };
        let mut header = [0u8; HEADER];
        header[..4].copy_from_slice(MAGIC);
        header[4..8].copy_from_slice(&samples.to_le_bytes());
        header[8..].copy_from_slice(&(body.len() as u64).to_le_bytes());
        let write = || -> io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&header)?;
            f.write_all(body)?;
            drop(f);
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(ferr(e));
        }
        self.next_seq += 1;
        self.entries.push_back(Entry { seq, size, samples });
        self.bytes += size;
        Ok(ev)
    }

    /// The oldest batch: its sequence, body and sample count. A batch whose file is gone or damaged is removed and
    /// returned as `Err` with its sample count, so the caller counts it lost and moves on.
    pub fn head(&mut self) -> Option<Result<Batch, u32>> {
        let e = *self.entries.front()?;
        let path = self.path(e.seq);
        match std::fs::read(&path) {
            Ok(data)
                if data.len() as u64 == e.size && data.len() >= HEADER && &data[..4] == MAGIC =>
            {
                Some(Ok(Batch {
                    seq: e.seq,
                    body: data[HEADER..].to_vec(),
                    samples: e.samples,
                }))
            }
            _ => {
                self.remove_front(e.seq);
                Some(Err(e.samples))
            }
        }
    }

    /// Removes the batch `seq` once it was delivered (or refused for good). Only the oldest can be removed.
    pub fn pop(&mut self, seq: u64) {
        if self.entries.front().is_some_and(|e| e.seq == seq) {
            self.remove_front(seq);
        }
    }

    fn remove_front(&mut self, seq: u64) {
        if let Some(e) = self.entries.pop_front() {
            self.bytes -= e.size;
        }
        let _ = std::fs::remove_file(self.path(seq));
    }
}

fn read_header(path: &Path) -> io::Result<Option<(u32, u64)>> {
    use std::io::Read as _;
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut h = [0u8; HEADER];
    if f.read_exact(&mut h).is_err() || &h[..4] != MAGIC {
        return Ok(None);
    }
    let samples = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let body = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
    Ok((body + HEADER as u64 == len).then_some((samples, len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn fifo_survives_a_restart() -> Result<(), QueueError> {
        let d = dir();
        let (mut q, _) = DiskQueue::open(d.path(), 1 << 20)?;
        q.push(b"one", 1)?;
        q.push(b"two", 2)?;
        drop(q);
        let (mut q, rec) = DiskQueue::open(d.path(), 1 << 20)?;
        assert_eq!(
            rec,
            Recovered {
                batches: 2,
                samples: 3,
                corrupt: 0
            }
        );
        let Some(Ok(b)) = q.head() else {
            panic!("no head")
        };
        assert_eq!((b.body.as_slice(), b.samples), (&b"one"[..], 1));
        q.pop(b.seq);
        q.push(b"three", 3)?;
        let Some(Ok(b)) = q.head() else {
            panic!("no head")
        };
        assert_eq!(b.body, b"two");
        q.pop(b.seq);
        let Some(Ok(b)) = q.head() else {
            panic!("no head")
        };
        assert_eq!(b.body, b"three");
        Ok(())
    }

    #[test]
    fn the_bound_drops_oldest_first_and_counts() -> Result<(), QueueError> {
        let d = dir();
        // Room for three 100-byte bodies with headers.
        let (mut q, _) = DiskQueue::open(d.path(), 3 * (HEADER as u64 + 100))?;
        for i in 0..10u8 {
            let ev = q.push(&[i; 100], 5)?;
            if i < 3 {
                assert_eq!(ev, Evicted::default());
            } else {
                assert_eq!(
                    ev,
                    Evicted {
                        batches: 1,
                        samples: 5
                    }
                );
            }
            assert!(q.bytes() <= q.max_bytes());
        }
        assert_eq!(q.len(), 3);
        let Some(Ok(b)) = q.head() else {
            panic!("no head")
        };
        assert_eq!(b.body[0], 7);
        assert_eq!(
            std::fs::read_dir(d.path()).map(|r| r.count()).unwrap_or(0),
            3
        );
        // One batch larger than the whole bound is refused and counted.
        let ev = q.push(&[0; 1000], 9)?;
        assert_eq!(
            ev,
            Evicted {
                batches: 1,
                samples: 9
            }
        );
        Ok(())
    }

    #[test]
    fn damaged_files_are_discarded_and_counted() -> Result<(), QueueError> {
        let d = dir();
        let (mut q, _) = DiskQueue::open(d.path(), 1 << 20)?;
        q.push(b"whole", 1)?;
        q.push(b"cut short", 2)?;
        drop(q);
        let second = d.path().join(name(1));
        let data = std::fs::read(&second).unwrap_or_default();
        std::fs::write(&second, &data[..data.len() - 3]).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(d.path().join("junk.batch"), b"x").unwrap_or_else(|e| panic!("{e}"));
        let (q, rec) = DiskQueue::open(d.path(), 1 << 20)?;
        assert_eq!(rec.batches, 1);
        assert_eq!(rec.corrupt, 1);
        assert_eq!(q.len(), 1);
        Ok(())
    }
}
