//! bc-cas: the one content-addressed writer, for the control plane's artifact store (operators' uploads) and the
//! site agent's artifact cache (downloads of what the netboot table references). Content lives at
//! `<root>/sha256/<64 hex>`, mode 0644, and a file under its hash is always complete and verified:
//!
//! - [`Store::begin`] opens a [`Writer`] on a temporary file `<root>/.partial-*` (same file system, never inside
//!   `sha256/`, so a scan of the store never sees a partial file);
//! - [`Writer::write`] hashes every byte as it is written and refuses a byte past the [`Expect`]ed length or the
//!   size cap at once;
//! - [`Writer::commit`] checks the length and the SHA-256 against what was expected, fsyncs the file, renames it
//!   into place and fsyncs the directory;
//! - on any error, dropping the writer removes the temporary file: a failed write leaves nothing behind.
//!
//! The bytes go through a [`Transport`] (after installinator's `WriteTransport`): [`TempFile`] is the real one;
//! tests put a transport in between that writes short or fails at a chosen byte, sync or rename.
//!
//! Synchronous on purpose (std I/O only): an async caller writes its chunks as they arrive and runs
//! [`Writer::commit`], which fsyncs, on a blocking thread. It imports no other crate of the workspace and no
//! runtime: `scripts/check-deps` keeps it a leaf. Start with [`Store::begin`].
//!
//! An upload of unknown content (the control plane's `PUT /api/artifacts`), named by its hash once written:
//!
//! ```
//! # fn main() -> Result<(), bc_cas::CasError> {
//! # let dir = tempfile::tempdir().map_err(|e| bc_cas::CasError::Io { what: "tempdir", path: "/".into(), source: e })?;
//! let store = bc_cas::Store::new(dir.path()); // content at <root>/sha256/<hex>
//! let mut w = store.begin(bc_cas::Expect::upload(Some(5), 1 << 30))?; // announced 5 bytes, cap 1 GiB
//! w.write(b"hel")?; // chunks as they arrive: hashed, counted against the length and the cap
//! w.write(b"lo")?;
//! let stored = w.commit()?; // length and hash checked, fsync, 0644, rename, directory fsync
//! assert_eq!(stored.size, 5);
//! assert!(stored.path.ends_with(format!("sha256/{}", stored.sha256)));
//! # Ok(())
//! # }
//! ```
//!
//! Dropping `w` before [`Writer::commit`] (a body that broke off or stalled) removes its temporary file. A
//! [`CasError::is_content`] error is the sender's (invalid argument, nothing kept); the others are the store's.

#![deny(clippy::disallowed_methods)]

mod writer;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use writer::{TempFile, Transport, Writer};

/// The directory under the store's root that holds the content, by hash.
pub const SHA256_DIR: &str = "sha256";
/// How temporary files in the root begin.
pub const TEMP_PREFIX: &str = ".partial-";

/// True for 64 lowercase hex characters: the only names the store creates.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A SHA-256 as 64 lowercase hex characters: checked when parsed, so it is always safe as a file name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Hex(String);

impl Sha256Hex {
    /// Parses a reference; anything but 64 lowercase hex characters (a path, upper case, a prefix) is refused.
    pub fn parse(s: &str) -> Result<Sha256Hex, CasError> {
        if is_sha256_hex(s) {
            Ok(Sha256Hex(s.to_string()))
        } else {
            Err(CasError::BadDigest(s.to_string()))
        }
    }

    /// The SHA-256 of `bytes`.
    pub fn of(bytes: &[u8]) -> Sha256Hex {
        use sha2::Digest as _;
        Sha256Hex(hex::encode(sha2::Sha256::digest(bytes)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for Sha256Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Sha256Hex {
    type Err = CasError;

    fn from_str(s: &str) -> Result<Sha256Hex, CasError> {
        Sha256Hex::parse(s)
    }
}

/// What the content must be for [`Writer::commit`] to keep it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    /// Its SHA-256, when known in advance (a download); else the content is named by the hash it turns out to have.
    pub sha256: Option<Sha256Hex>,
    /// Its exact length, when known (announced).
    pub size: Option<u64>,
    /// The most bytes accepted whatever was announced (a runaway body does not fill the disk).
    pub max_size: u64,
}

impl Expect {
    /// Content known in advance: exactly `size` bytes hashing to `sha256` (an artifact a netboot table references).
    pub fn exact(sha256: Sha256Hex, size: u64) -> Expect {
        Expect {
            sha256: Some(sha256),
            size: Some(size),
            max_size: size,
        }
    }

    /// An upload, named by its hash once written: at most `max_size` bytes, exactly `declared` when the sender
    /// announced a length.
    pub fn upload(declared: Option<u64>, max_size: u64) -> Expect {
        Expect {
            sha256: None,
            size: declared,
            max_size,
        }
    }
}

/// What [`Writer::commit`] put in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub sha256: Sha256Hex,
    pub size: u64,
    pub path: PathBuf,
}

/// Why content was not stored. The content errors ([`CasError::is_content`]) mean the bytes were wrong, the others
/// that the store could not take them; either way nothing was kept.
#[derive(Debug, thiserror::Error)]
pub enum CasError {
    #[error("{0:?} is not a SHA-256 reference: 64 lowercase hex characters")]
    BadDigest(String),
    #[error("more than the {size} bytes announced")]
    TooLong { size: u64 },
    #[error("larger than the {max} bytes accepted")]
    TooLarge { max: u64 },
    #[error("truncated: {got} of {size} bytes")]
    Truncated { got: u64, size: u64 },
    #[error("content hashes to {got}, not {want} (corrupt or tampered with in transit or at rest)")]
    HashMismatch { want: Sha256Hex, got: Sha256Hex },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl CasError {
    /// True when the bytes themselves were refused (length, size cap, hash, reference), not the store's I/O.
    pub fn is_content(&self) -> bool {
        !matches!(self, CasError::Io { .. })
    }

    fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CasError {
        let path = path.to_path_buf();
        move |source| CasError::Io { what, path, source }
    }
}

/// A content-addressed directory: `<root>/sha256/<hex>`, temporary files in `<root>`.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    pub fn new(root: impl Into<PathBuf>) -> Store {
        Store { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/sha256`.
    pub fn dir(&self) -> PathBuf {
        self.root.join(SHA256_DIR)
    }

    /// Where the content of `sha256` lives (whether or not it is there).
    pub fn path(&self, sha256: &Sha256Hex) -> PathBuf {
        self.dir().join(sha256.as_str())
    }

    /// Opens a writer on a fresh temporary file in the root. Refuses at once an announced size over the cap.
    pub fn begin(&self, expect: Expect) -> Result<Writer<TempFile>, CasError> {
        check_announced(&expect)?;
        let dir = self.dir();
        std::fs::create_dir_all(&dir).map_err(CasError::io("creating", &dir))?;
        let file = TempFile::new_in(&self.root)?;
        Ok(Writer::new(file, dir, expect))
    }

    /// [`Store::begin`] over another transport (tests inject faults with one). The directory `sha256/` is
    /// created all the same.
    pub fn begin_with<T: Transport>(
        &self,
        expect: Expect,
        transport: T,
    ) -> Result<Writer<T>, CasError> {
        check_announced(&expect)?;
        let dir = self.dir();
        std::fs::create_dir_all(&dir).map_err(CasError::io("creating", &dir))?;
        Ok(Writer::new(transport, dir, expect))
    }
}

fn check_announced(expect: &Expect) -> Result<(), CasError> {
    match expect.size {
        Some(size) if size > expect.max_size => Err(CasError::TooLarge {
            max: expect.max_size,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
