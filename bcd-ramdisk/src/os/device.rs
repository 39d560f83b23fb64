//! [`DirectDevice`]: a block device (or, for tests, a regular file) opened with `O_DIRECT`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::nvme;
use super::{
    AlignedBuf, DIRECT_ALIGN, RangeOp, block_size_bytes, logical_sector_size, range_ioctl,
};
use crate::stream::BlockSink;
use crate::wipe::{BlockDevice, FormatSes, SanitizeAction};

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "opening {path} with O_DIRECT (a mounted or otherwise claimed block device is refused)"
    )]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading the size of {path}")]
    Size {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is neither a block device nor a regular file")]
    NotBlockOrFile { path: PathBuf },
    #[error("{path} reports a logical sector of {sector} bytes; 512..=4096 expected")]
    Sector { path: PathBuf, sector: u32 },
}

/// A block device opened read-write with `O_DIRECT` (and `O_EXCL`, so the kernel refuses one that is mounted or
/// claimed by md/dm). A regular file is accepted too (its current length is the capacity) so tests can run on any
/// file system that supports `O_DIRECT`.
///
/// Reads and writes must use 4096-aligned buffers ([`AlignedBuf`]) and offsets and lengths that are multiples of
/// [`DirectDevice::sector`]; the kernel answers `EINVAL` otherwise.
#[derive(Debug)]
pub struct DirectDevice {
    file: File,
    path: PathBuf,
    capacity: u64,
    sector: u32,
    is_block: bool,
}

impl DirectDevice {
    pub fn open(path: &Path) -> Result<Self, OpenError> {
        let meta = std::fs::metadata(path).map_err(|source| OpenError::Open {
            path: path.to_owned(),
            source,
        })?;
        let is_block = meta.file_type().is_block_device();
        if !is_block && !meta.is_file() {
            return Err(OpenError::NotBlockOrFile {
                path: path.to_owned(),
            });
        }
        let mut flags = libc::O_DIRECT | libc::O_CLOEXEC;
        if is_block {
            flags |= libc::O_EXCL;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags)
            .open(path)
            .map_err(|source| OpenError::Open {
                path: path.to_owned(),
                source,
            })?;
        let (capacity, sector) = if is_block {
            let size = block_size_bytes(file.as_fd()).map_err(|source| OpenError::Size {
                path: path.to_owned(),
                source,
            })?;
            let sector = logical_sector_size(file.as_fd()).map_err(|source| OpenError::Size {
                path: path.to_owned(),
                source,
            })?;
            (size, sector)
        } else {
            (meta.len(), DIRECT_ALIGN as u32)
        };
        if !(512..=4096).contains(&sector) || !sector.is_power_of_two() {
            return Err(OpenError::Sector {
                path: path.to_owned(),
                sector,
            });
        }
        Ok(Self {
            file,
            path: path.to_owned(),
            capacity,
            sector,
            is_block,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Logical sector size: the unit of offsets and lengths.
    pub fn sector(&self) -> u32 {
        self.sector
    }

    pub fn is_block_device(&self) -> bool {
        self.is_block
    }

    /// The 4096-byte NVMe Identify Controller page (parse it with
    /// [`crate::wipe::NvmeCapabilities::from_identify_controller`]); `ENOTTY` on a device that is not NVMe.
    pub fn nvme_identify_controller(&self) -> io::Result<Vec<u8>> {
        super::nvme::identify_controller(self.file.as_fd())
    }

    fn require_block(&self, what: &str) -> io::Result<()> {
        if self.is_block {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{what} on a regular file"),
            ))
        }
    }

    fn range(&self, op: RangeOp, offset: u64, len: u64) -> io::Result<()> {
        if self.is_block {
            return range_ioctl(self.file.as_fd(), op, offset, len);
        }
        match op {
            RangeOp::ZeroOut => self.write_zeros(offset, len),
            RangeOp::Discard | RangeOp::SecureDiscard => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "discard on a regular file",
            )),
        }
    }

    fn write_zeros(&self, mut offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let zeros = AlignedBuf::new(1 << 20);
        while offset < end {
            let n = (end - offset).min(zeros.len() as u64) as usize;
            self.file.write_all_at(&zeros.as_slice()[..n], offset)?;
            offset += n as u64;
        }
        Ok(())
    }
}

// === impl BlockSink for DirectDevice ===

impl BlockSink for DirectDevice {
    fn alignment(&self) -> usize {
        self.sector as usize
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.file.write_at(buf, offset)
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_all()
    }

    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.range(RangeOp::ZeroOut, offset, len)
    }
}

// === impl BlockDevice for DirectDevice ===

impl BlockDevice for DirectDevice {
    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn size(&self) -> u64 {
        self.capacity
    }

    fn logical_block_size(&self) -> u32 {
        self.sector
    }

    fn read_exact_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn range_op(&mut self, op: RangeOp, offset: u64, len: u64) -> io::Result<()> {
        self.range(op, offset, len)
    }

    fn nvme_sanitize(&mut self, action: SanitizeAction) -> io::Result<()> {
        self.require_block("NVMe sanitize")?;
        let sanact = match action {
            SanitizeAction::BlockErase => 2,
            SanitizeAction::CryptoErase => 4,
        };
        let fd = self.file.as_fd();
        nvme::sanitize_start(fd, sanact)?;
        // The controller works in the background; poll the sanitize status log (SSTAT bits 2:0).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(4 * 3600);
        loop {
            let log = nvme::get_log_page(fd, nvme::LOG_SANITIZE_STATUS, 0, 512)?;
            match sanitize_state(&log) {
                SanitizeState::InProgress if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(500))
                }
                SanitizeState::InProgress => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "sanitize still running after 4 h",
                    ));
                }
                SanitizeState::Done => return Ok(()),
                SanitizeState::Failed(why) => return Err(io::Error::other(why)),
            }
        }
    }

    fn nvme_format(&mut self, ses: FormatSes) -> io::Result<()> {
        self.require_block("NVMe Format NVM")?;
        let fd = self.file.as_fd();
        let nsid = nvme::namespace_id(fd)?;
        let ns = nvme::identify_namespace(fd, nsid)?;
        // FLBAS: bits 3:0 the format index, bits 6:5 its upper bits; keep the current format.
        let flbas = ns[26];
        let lbaf = (flbas & 0x0f) | (((flbas >> 5) & 0x3) << 4);
        let ses = match ses {
            FormatSes::UserDataErase => 1,
            FormatSes::CryptoErase => 2,
        };
        nvme::format_nvm(fd, nsid, lbaf, ses)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_all()
    }
}

#[derive(Debug, PartialEq, Eq)]
enum SanitizeState {
    InProgress,
    Done,
    Failed(String),
}

/// Decode SSTAT (bytes 2..4) of the Sanitize Status log page.
fn sanitize_state(log: &[u8]) -> SanitizeState {
    let Some(sstat) = log.get(2..4).map(|b| u16::from_le_bytes([b[0], b[1]])) else {
        return SanitizeState::Failed("sanitize status log too short".into());
    };
    match sstat & 0x7 {
        1 | 4 => SanitizeState::Done,
        2 => SanitizeState::InProgress,
        3 => SanitizeState::Failed("the controller reports the sanitize operation failed".into()),
        0 => SanitizeState::Failed("the controller reports no sanitize operation ran".into()),
        other => SanitizeState::Failed(format!("unknown sanitize status {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitize_status_decoding() {
        let log = |s: u16| {
            let mut l = vec![0u8; 512];
            l[2..4].copy_from_slice(&s.to_le_bytes());
            l
        };
        assert_eq!(sanitize_state(&log(0x0101)), SanitizeState::Done);
        assert_eq!(sanitize_state(&log(2)), SanitizeState::InProgress);
        assert!(matches!(sanitize_state(&log(3)), SanitizeState::Failed(_)));
        assert!(matches!(sanitize_state(&log(0)), SanitizeState::Failed(_)));
        assert!(matches!(
            sanitize_state(&[0u8; 2]),
            SanitizeState::Failed(_)
        ));
    }
}
