//! The OS layer: aligned buffers, block-device and NVMe ioctls, the system calls PID 1 needs ([`sys`]: mount,
//! finit_module, kexec_file_load, reboot), a minimal rtnetlink client ([`netlink`]) and the real implementations of
//! [`crate::stream::BlockSink`] and [`crate::wipe::BlockDevice`]. This is the only module where `unsafe` is allowed,
//! and only for system calls that have no safe wrapper; each block carries a `// SAFETY:` comment.
#![allow(unsafe_code)]

mod device;
pub mod netlink;
pub mod nvme;
pub mod sys;

pub use device::{DirectDevice, OpenError};

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Alignment of every buffer handed to an `O_DIRECT` file descriptor. 4096 covers 512- and 4096-byte logical
/// sectors and the page size of every platform we boot.
pub const DIRECT_ALIGN: usize = 4096;

// === impl AlignedBuf ===

/// A zero-initialised byte buffer whose data starts at a [`DIRECT_ALIGN`] boundary, as `O_DIRECT` requires.
///
/// Built without `unsafe`: it over-allocates by one alignment unit and exposes the aligned window, so there is no
/// hand-written allocator code to get wrong. The cost is 4 KiB per buffer.
pub struct AlignedBuf {
    storage: Box<[u8]>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// A buffer of `len` bytes (rounded up to a multiple of [`DIRECT_ALIGN`]), all zero.
    pub fn new(len: usize) -> Self {
        let len = round_up(len as u64, DIRECT_ALIGN as u64) as usize;
        let storage = vec![0u8; len + DIRECT_ALIGN].into_boxed_slice();
        // At run time `align_offset` on a byte pointer is exact (the `usize::MAX` escape hatch applies only to
        // const evaluation); a u8 allocation of len + 4096 always contains a 4096-aligned window of len bytes.
        let start = storage.as_ptr().align_offset(DIRECT_ALIGN);
        assert!(start < DIRECT_ALIGN, "align_offset out of range");
        Self {
            storage,
            start,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

/// `value` rounded up to a multiple of `unit` (which must be non-zero).
pub fn round_up(value: u64, unit: u64) -> u64 {
    value.div_ceil(unit) * unit
}

// === block-device ioctls ===

// Linux's generic ioctl encoding (x86_64, aarch64, riscv64); mips, powerpc and sparc differ and are not targets.
const IOC_NONE: u64 = 0;
const IOC_READ: u64 = 2;

const fn ioc(dir: u64, ty: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (ty << 8) | nr
}

const BLKSSZGET: u64 = ioc(IOC_NONE, 0x12, 104, 0);
const BLKGETSIZE64: u64 = ioc(IOC_READ, 0x12, 114, std::mem::size_of::<usize>() as u64);
const BLKDISCARD: u64 = ioc(IOC_NONE, 0x12, 119, 0);
const BLKSECDISCARD: u64 = ioc(IOC_NONE, 0x12, 125, 0);
const BLKZEROOUT: u64 = ioc(IOC_NONE, 0x12, 127, 0);

/// Size of a block device in bytes (`BLKGETSIZE64`).
pub fn block_size_bytes(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes exactly one u64 through the pointer, which points at a live, writable u64; the
    // descriptor is borrowed and therefore open for the duration of the call.
    let rc = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            BLKGETSIZE64 as libc::Ioctl,
            &mut size as *mut u64,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Logical sector size of a block device (`BLKSSZGET`).
pub fn logical_sector_size(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one c_int through the pointer, which points at a live, writable c_int; the
    // descriptor is borrowed and open.
    let rc = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            BLKSSZGET as libc::Ioctl,
            &mut size as *mut libc::c_int,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(size).map_err(|_| io::Error::other(format!("BLKSSZGET returned {size}")))
}

/// Which range ioctl to issue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeOp {
    /// `BLKDISCARD`: the device may drop the blocks; what they read back as is device-defined.
    Discard,
    /// `BLKSECDISCARD`: discard that also erases every copy the device keeps (rarely supported).
    SecureDiscard,
    /// `BLKZEROOUT`: the blocks read back as zero (write-zeroes or the kernel writing zero pages).
    ZeroOut,
}

/// Issue a range ioctl over `[offset, offset + len)`. Offsets and lengths must be multiples of the logical sector.
pub fn range_ioctl(fd: BorrowedFd<'_>, op: RangeOp, offset: u64, len: u64) -> io::Result<()> {
    let request = match op {
        RangeOp::Discard => BLKDISCARD,
        RangeOp::SecureDiscard => BLKSECDISCARD,
        RangeOp::ZeroOut => BLKZEROOUT,
    };
    let range: [u64; 2] = [offset, len];
    // SAFETY: the three requests read a `uint64_t[2]` {start, length} through the pointer, which points at a live
    // array of two u64 that outlives the call; the descriptor is borrowed and open.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as libc::Ioctl, range.as_ptr()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_linux_headers() {
        // _IO/_IOR values of <linux/fs.h> on x86_64.
        assert_eq!(BLKSSZGET, 0x1268);
        assert_eq!(BLKGETSIZE64, 0x8008_1272);
        assert_eq!(BLKDISCARD, 0x1277);
        assert_eq!(BLKSECDISCARD, 0x127d);
        assert_eq!(BLKZEROOUT, 0x127f);
    }

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        for len in [1, 512, 4096, 4097, 1 << 20] {
            let buf = AlignedBuf::new(len);
            assert_eq!(buf.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
            assert_eq!(buf.len() % DIRECT_ALIGN, 0);
            assert!(buf.len() >= len);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn round_up_works() {
        assert_eq!(round_up(0, 4096), 0);
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_up(4097, 512), 4608);
    }
}
