//! Disk wipe by probed capability.
//!
//! [`probe`] turns sysfs (and, for NVMe, Identify Controller) into [`DeviceCapabilities`]; [`plan`] decides, purely,
//! which erase methods to try in order and why the others were skipped; [`execute`] runs the plan on a
//! [`BlockDevice`], verifies each method by sampled read-back, wipes the metadata areas, and returns
//! [`WipeEvidence`]. A device where no method both ran and verified is reported as failed, never as wiped.

mod exec;
mod plan;
mod probe;

pub use exec::{Attempt, AttemptResult, SampleCheck, WipeEvidence, WipeOutcome, execute};
pub use plan::{plan, plan_with, sample_offsets};
pub use probe::{IdentifyError, NvmeCapabilities, ProbeError, probe_device, probe_sysfs};

use std::io;

use crate::os::RangeOp;

/// Erase methods, strongest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WipeMethod {
    /// NVMe Sanitize, crypto erase: the media encryption key is replaced (whole controller, all namespaces).
    NvmeSanitizeCrypto,
    /// NVMe Sanitize, block erase: every block is erased (whole controller).
    NvmeSanitizeBlock,
    /// NVMe Format NVM with Secure Erase Setting 2 (cryptographic erase).
    NvmeFormatCrypto,
    /// NVMe Format NVM with Secure Erase Setting 1 (user data erase).
    NvmeFormatUserData,
    /// `BLKSECDISCARD`.
    SecureDiscard,
    /// `BLKDISCARD`, accepted only if the sampled blocks then read as zeros.
    Discard,
    /// `BLKZEROOUT`: write-zeroes offloaded to the device, or zero pages written by the kernel.
    ZeroOut,
    /// Zeros written from user space with `O_DIRECT`; always possible, slowest.
    Overwrite,
}

impl WipeMethod {
    pub const ALL: [WipeMethod; 8] = [
        Self::NvmeSanitizeCrypto,
        Self::NvmeSanitizeBlock,
        Self::NvmeFormatCrypto,
        Self::NvmeFormatUserData,
        Self::SecureDiscard,
        Self::Discard,
        Self::ZeroOut,
        Self::Overwrite,
    ];
}

/// What sampled blocks must look like after a method ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expectation {
    /// Every sampled byte is zero.
    Zeroes,
    /// Every sampled block that held data before differs from what it held (crypto/block erase may read back as
    /// noise or as zeros, depending on the drive).
    Changed,
}

/// NVMe Sanitize actions we use (overwrite sanitize is left out: it takes hours and block erase covers it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SanitizeAction {
    CryptoErase,
    BlockErase,
}

/// NVMe Format NVM Secure Erase Settings we use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatSes {
    /// SES 2.
    CryptoErase,
    /// SES 1.
    UserDataErase,
}

/// What was learned about a device before deciding how to wipe it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCapabilities {
    pub name: String,
    pub size_bytes: u64,
    pub logical_block_size: u32,
    pub read_only: bool,
    /// Why the device must not be touched (mounted, held by md/dm, ...), if so.
    pub in_use: Option<String>,
    pub rotational: bool,
    /// `None` for devices that are not NVMe namespaces.
    pub nvme: Option<NvmeCapabilities>,
    /// `queue/discard_max_bytes`; 0 means no discard.
    pub discard_max_bytes: u64,
    /// `queue/write_zeroes_max_bytes`; 0 means `BLKZEROOUT` falls back to writing zero pages.
    pub write_zeroes_max_bytes: u64,
    /// Whether `BLKSECDISCARD` works, when known (Linux does not advertise it; it is learned by trying).
    pub secure_discard: Option<bool>,
}

/// Knobs of the planner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WipePolicy {
    /// Methods that may be used; the rest are skipped "by policy" (tests force a method this way).
    pub allowed: Vec<WipeMethod>,
    /// Random sample positions verified after the erase (plus the first and the last block).
    pub verify_samples: u32,
    /// Bytes per sample; a multiple of 4096.
    pub sample_len: u32,
}

impl Default for WipePolicy {
    fn default() -> Self {
        Self {
            allowed: WipeMethod::ALL.to_vec(),
            verify_samples: 64,
            sample_len: 4096,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedStep {
    pub method: WipeMethod,
    pub expect: Expectation,
    /// Why this method is applicable.
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub method: WipeMethod,
    pub reason: String,
}

/// A byte range zeroed by the metadata wipe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetadataArea {
    pub offset: u64,
    pub len: u64,
    pub what: &'static str,
}

/// The planner's decision for one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WipePlan {
    pub device: String,
    pub size_bytes: u64,
    pub logical_block_size: u32,
    /// Set when the device must not be wiped at all; `steps` is then empty.
    pub refused: Option<String>,
    /// Methods to try in order; the first that runs and verifies wins.
    pub steps: Vec<PlannedStep>,
    pub skipped: Vec<Skipped>,
    /// Zeroed after the data erase whatever method won (partition tables, RAID and file-system signatures).
    pub metadata: Vec<MetadataArea>,
    pub verify_samples: u32,
    pub sample_len: u32,
}

/// A device the executor can wipe. Buffers passed to reads and writes are 4096-aligned ([`crate::os::AlignedBuf`])
/// and offsets and lengths are multiples of the logical block size, so an `O_DIRECT` implementation works.
pub trait BlockDevice {
    fn name(&self) -> String;
    fn size(&self) -> u64;
    fn logical_block_size(&self) -> u32;
    fn read_exact_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// `BLKDISCARD` / `BLKSECDISCARD` / `BLKZEROOUT`. `ErrorKind::Unsupported` or `EOPNOTSUPP` means "not here".
    fn range_op(&mut self, op: RangeOp, offset: u64, len: u64) -> io::Result<()>;
    /// Start an NVMe sanitize and wait for it to finish.
    fn nvme_sanitize(&mut self, action: SanitizeAction) -> io::Result<()>;
    fn nvme_format(&mut self, ses: FormatSes) -> io::Result<()>;
    fn sync(&mut self) -> io::Result<()>;
}
