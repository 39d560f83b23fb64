//! The writer and its transport.

use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::{CasError, Expect, Sha256Hex, Stored, TEMP_PREFIX};

/// Bytes gathered before they go to the transport: small chunks (an HTTP body's) become few large writes. Tests
/// use a smaller one, so small inputs cross its boundary.
pub(crate) const BUFFER: usize = if cfg!(test) { 1 << 14 } else { 1 << 20 };

/// Where a writer's bytes go until they are committed.
pub trait Transport {
    /// Writes a prefix of `buf` and returns its length: a short write is fine (the writer sends the rest), 0 for a
    /// non-empty `buf` is an error.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// Makes everything written durable (fsync).
    fn sync(&mut self) -> io::Result<()>;
    /// Puts the content at `path` atomically (mode 0644, rename over anything there, directory synced). On error
    /// the content is discarded.
    fn persist(self, path: &Path) -> io::Result<()>;
    /// Where the content is meanwhile (for error messages).
    fn temp_path(&self) -> &Path;
}

/// The real transport: a temporary file in the store's root, removed when dropped uncommitted.
#[derive(Debug)]
pub struct TempFile {
    file: tempfile::NamedTempFile,
}

impl TempFile {
    pub fn new_in(dir: &Path) -> Result<TempFile, CasError> {
        let file = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(dir)
            .map_err(CasError::io("creating a temporary file in", dir))?;
        Ok(TempFile { file })
    }
}

impl Transport for TempFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.as_file_mut().write(buf)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.as_file().sync_all()
    }

    fn persist(self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        self.file
            .as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))?;
        // On error the temporary file comes back inside the error and is removed when it drops.
        self.file.persist(path).map_err(|e| e.error)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    fn temp_path(&self) -> &Path {
        self.file.path()
    }
}

/// One piece of content on its way into the store. Dropping it uncommitted (after an error, or to give up)
/// discards what was written.
#[derive(Debug)]
pub struct Writer<T: Transport> {
    transport: T,
    dir: PathBuf,
    expect: Expect,
    hasher: Sha256,
    received: u64,
    buffer: Vec<u8>,
}

impl<T: Transport> Writer<T> {
    pub(crate) fn new(transport: T, dir: PathBuf, expect: Expect) -> Writer<T> {
        Writer {
            transport,
            dir,
            expect,
            hasher: Sha256::new(),
            received: 0,
            buffer: Vec::new(),
        }
    }

    /// Bytes accepted so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// What the content must be.
    pub fn expect(&self) -> &Expect {
        &self.expect
    }

    /// Hashes `data` and writes it. A byte past the expected length ([`CasError::TooLong`]) or the cap
    /// ([`CasError::TooLarge`]) is refused before anything of `data` is written; drop the writer on any error.
    pub fn write(&mut self, data: &[u8]) -> Result<(), CasError> {
        let after = self.received.saturating_add(data.len() as u64);
        if let Some(size) = self.expect.size
            && after > size
        {
            return Err(CasError::TooLong { size });
        }
        if after > self.expect.max_size {
            return Err(CasError::TooLarge {
                max: self.expect.max_size,
            });
        }
        self.hasher.update(data);
        self.received = after;
        if self.buffer.len() + data.len() <= BUFFER {
            self.buffer.extend_from_slice(data);
            return Ok(());
        }
        self.drain()?;
        if data.len() >= BUFFER {
            send(&mut self.transport, data)
        } else {
            self.buffer.extend_from_slice(data);
            Ok(())
        }
    }

    fn drain(&mut self) -> Result<(), CasError> {
        let buffer = std::mem::take(&mut self.buffer);
        let sent = send(&mut self.transport, &buffer);
        self.buffer = buffer;
        self.buffer.clear();
        sent
    }

    /// Checks the length and the hash, fsyncs, and renames the content to `sha256/<its hash>`. Blocks on the
    /// fsync: an async caller runs it on a blocking thread.
    pub fn commit(mut self) -> Result<Stored, CasError> {
        self.drain()?;
        if let Some(size) = self.expect.size
            && self.received != size
        {
            return Err(CasError::Truncated {
                got: self.received,
                size,
            });
        }
        let got = Sha256Hex(hex::encode(self.hasher.finalize_reset()));
        if let Some(want) = &self.expect.sha256
            && *want != got
        {
            return Err(CasError::HashMismatch {
                want: want.clone(),
                got,
            });
        }
        self.transport
            .sync()
            .map_err(CasError::io("syncing", self.transport.temp_path()))?;
        let path = self.dir.join(got.as_str());
        self.transport
            .persist(&path)
            .map_err(CasError::io("moving into place", &path))?;
        Ok(Stored {
            sha256: got,
            size: self.received,
            path,
        })
    }
}

/// Writes all of `data`, however short the transport's writes.
fn send<T: Transport>(transport: &mut T, mut data: &[u8]) -> Result<(), CasError> {
    while !data.is_empty() {
        match transport.write(data) {
            Ok(0) => {
                return Err(CasError::Io {
                    what: "writing",
                    path: transport.temp_path().to_path_buf(),
                    source: io::Error::from(io::ErrorKind::WriteZero),
                });
            }
            Ok(n) => data = &data[n.min(data.len())..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(CasError::Io {
                    what: "writing",
                    path: transport.temp_path().to_path_buf(),
                    source,
                });
            }
        }
    }
    Ok(())
}
