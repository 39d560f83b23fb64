//! Image stream: source bytes → (compressed digest) → decompress → (image digest) → aligned blocks → device,
//! then fsync and read-back of the written range checked against the digest.
//!
//! The pipeline ([`write_image`]) takes any `BufRead` and any [`BlockSink`], so it is tested without a network or a
//! disk; [`http`] supplies a `BufRead` fed by an HTTP(S) download that resumes with Range requests, and
//! [`crate::os::DirectDevice`] is the `O_DIRECT` sink. Memory is bounded by `buffers × buffer_size` plus the HTTP
//! chunk queue, whatever the image size.

mod decode;
mod digest;
pub mod http;
mod pipeline;
mod progress;
pub mod range;

pub use decode::{Compression, CompressionChoice, Decoder, MAGIC_LEN, detect};
pub use digest::{DigestAlgo, DigestOver, DigestParseError, ExpectedDigest, Hasher, digest_of};
pub use pipeline::write_image;
pub use progress::{Progress, ProgressMeter};

#[cfg(test)]
pub(crate) use decode::test_support;

use std::io;
use std::time::Duration;

/// Where the image goes. Offsets and lengths passed by the pipeline are multiples of [`BlockSink::alignment`] and
/// buffers start at a 4096-byte boundary, so an `O_DIRECT` descriptor accepts them.
pub trait BlockSink: Send {
    /// The unit of offsets and lengths (the logical sector size for a block device).
    fn alignment(&self) -> usize;
    /// Bytes the sink can hold; the pipeline never writes past it.
    fn capacity(&self) -> u64;
    /// Write some prefix of `buf` at `offset`; may return fewer bytes than asked (the pipeline continues).
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// Read some prefix of `buf` from `offset`.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Make everything written durable (fsync).
    fn sync(&mut self) -> io::Result<()>;
    /// Make `[offset, offset + len)` read as zeros (used to scrub a failed write).
    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()>;
}

/// What to stream and how to check it.
#[derive(Clone, Debug)]
pub struct StreamSpec {
    pub compression: CompressionChoice,
    pub digest: ExpectedDigest,
    /// Length of the decompressed image when the request states it: fewer bytes is a truncation error, more is an
    /// over-long error (stopped as soon as it is exceeded).
    pub image_size: Option<u64>,
    /// Length of the source (compressed) bytes when known, e.g. from HTTP; a mismatch is an error.
    pub source_size: Option<u64>,
    /// Read the written range back with `O_DIRECT` and check it against the image digest.
    pub read_back: bool,
    /// On any failure after the first write, zero the written range so a half-written image cannot boot.
    pub scrub_on_failure: bool,
    /// Size of each block buffer (a multiple of 4096).
    pub buffer_size: usize,
    /// Number of block buffers in flight between the decoder and the writer.
    pub buffers: usize,
    pub progress_interval: Duration,
}

impl StreamSpec {
    pub fn new(digest: ExpectedDigest) -> Self {
        Self {
            compression: CompressionChoice::Auto,
            digest,
            image_size: None,
            source_size: None,
            read_back: true,
            scrub_on_failure: true,
            buffer_size: 4 << 20,
            buffers: 4,
            progress_interval: Duration::from_secs(1),
        }
    }
}

/// Evidence of a successful stream.
#[derive(Clone, Debug)]
pub struct StreamReport {
    pub compression: Compression,
    /// Decompressed image bytes.
    pub image_bytes: u64,
    /// Source (compressed) bytes consumed.
    pub source_bytes: u64,
    /// Bytes written to the device: the image padded to the sink's alignment with zeros.
    pub written_bytes: u64,
    pub algo: DigestAlgo,
    /// The digest that matched the request (over the bytes the request named).
    pub digest: Vec<u8>,
    /// Digest of the decompressed image (equal to `digest` when the request covers decompressed bytes).
    pub image_digest: Option<Vec<u8>>,
    pub read_back_verified: bool,
    /// From the first source byte to the end of the fsync (includes `sync_elapsed`).
    pub stream_elapsed: Duration,
    /// The final fsync alone.
    pub sync_elapsed: Duration,
    pub read_back_elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("invalid stream request: {0}")]
    Invalid(String),
    #[error("reading the image source")]
    Source(#[source] io::Error),
    #[error("decompressing the {compression:?} stream")]
    Decode {
        compression: Compression,
        #[source]
        source: io::Error,
    },
    #[error("data follows the end of the {compression:?} stream (over-long or corrupt source)")]
    TrailingData { compression: Compression },
    #[error("source delivered {got} bytes, {expected} expected")]
    SourceLength { expected: u64, got: u64 },
    #[error("image is {got} bytes, {expected} expected (truncated)")]
    Truncated { expected: u64, got: u64 },
    #[error("image exceeds the expected {expected} bytes (over-long)")]
    OverLong { expected: u64 },
    #[error("image needs {needed} bytes, the device holds {capacity}")]
    TooLarge { needed: u64, capacity: u64 },
    #[error("{algo} mismatch over the {over:?} bytes: expected {expected}, got {actual}")]
    DigestMismatch {
        algo: &'static str,
        over: DigestOver,
        expected: String,
        actual: String,
    },
    #[error("writing {len} bytes at offset {offset}")]
    Write {
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("flushing the device")]
    Sync(#[source] io::Error),
    #[error("reading back {len} bytes at offset {offset}")]
    ReadBack {
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error(
        "the device does not hold what was written: {algo} of the first {len} bytes is {actual}, expected {expected}"
    )]
    ReadBackMismatch {
        algo: &'static str,
        len: u64,
        expected: String,
        actual: String,
    },
    #[error("downloading the image")]
    Http(#[source] http::HttpError),
    #[error("the writer thread panicked")]
    WriterPanicked,
}

/// What happened to the device after a failed stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scrub {
    /// Nothing had been written.
    NotNeeded,
    /// Scrubbing was turned off in the request; the device holds a partial image.
    Disabled,
    /// The written range now reads as zeros.
    Zeroed { bytes: u64 },
    /// Zeroing failed: the device may hold a partial image.
    Failed(String),
}

impl std::fmt::Display for Scrub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotNeeded => write!(f, "nothing was written"),
            Self::Disabled => write!(f, "device left with a partial image (scrub disabled)"),
            Self::Zeroed { bytes } => write!(f, "written range of {bytes} bytes zeroed"),
            Self::Failed(why) => write!(
                f,
                "zeroing the written range failed ({why}); device may hold a partial image"
            ),
        }
    }
}

/// A failed stream: the cause and what was done about the device.
#[derive(Debug, thiserror::Error)]
#[error("image stream failed after {bytes_submitted} bytes were submitted to the device; {scrub}")]
pub struct StreamFailure {
    #[source]
    pub error: StreamError,
    pub bytes_submitted: u64,
    pub scrub: Scrub,
}
