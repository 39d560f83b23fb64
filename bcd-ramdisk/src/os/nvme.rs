//! NVMe admin commands through `NVME_IOCTL_ADMIN_CMD` (linux/nvme_ioctl.h). Only Identify Controller (read-only)
//! is issued today; sanitize and format are planned by [`crate::wipe`] but not executed yet.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::AlignedBuf;

/// `struct nvme_passthru_cmd` (a.k.a. `nvme_admin_cmd`), 72 bytes.
#[repr(C)]
#[derive(Debug, Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}

/// `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
const NVME_IOCTL_ADMIN_CMD: u64 =
    (3 << 30) | ((std::mem::size_of::<PassthruCmd>() as u64) << 16) | (0x4e << 8) | 0x41;

const OPC_IDENTIFY: u8 = 0x06;
const CNS_CONTROLLER: u32 = 0x01;

/// Read the 4096-byte Identify Controller data structure of the controller behind `fd` (an NVMe namespace block
/// device or controller character device). Needs CAP_SYS_ADMIN. A non-NVMe device answers `ENOTTY`.
pub fn identify_controller(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut buf = AlignedBuf::new(4096);
    let mut cmd = PassthruCmd {
        opcode: OPC_IDENTIFY,
        addr: buf.as_mut_slice().as_mut_ptr() as u64,
        data_len: 4096,
        cdw10: CNS_CONTROLLER,
        timeout_ms: 10_000,
        ..Default::default()
    };
    // SAFETY: `cmd` is a live, correctly laid out `nvme_passthru_cmd` (size checked by a test) that the kernel reads
    // and updates (`result`). `addr` points at `buf`, which is 4096 writable bytes that outlive the call, and
    // `data_len` is 4096, so the controller's DMA stays inside it. The descriptor is borrowed and open.
    let rc = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            NVME_IOCTL_ADMIN_CMD as libc::Ioctl,
            &mut cmd as *mut PassthruCmd,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if rc > 0 {
        return Err(io::Error::other(format!(
            "NVMe Identify Controller failed with status {rc:#x}"
        )));
    }
    Ok(buf.as_slice()[..4096].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn passthru_layout_matches_the_kernel() {
        assert_eq!(size_of::<PassthruCmd>(), 72);
        assert_eq!(offset_of!(PassthruCmd, nsid), 4);
        assert_eq!(offset_of!(PassthruCmd, metadata), 16);
        assert_eq!(offset_of!(PassthruCmd, addr), 24);
        assert_eq!(offset_of!(PassthruCmd, data_len), 36);
        assert_eq!(offset_of!(PassthruCmd, cdw10), 40);
        assert_eq!(offset_of!(PassthruCmd, timeout_ms), 64);
        assert_eq!(offset_of!(PassthruCmd, result), 68);
        assert_eq!(NVME_IOCTL_ADMIN_CMD, 0xC048_4E41);
    }

    #[test]
    fn non_nvme_file_is_refused_cleanly() {
        let f = tempfile::tempfile().expect("tempfile");
        use std::os::fd::AsFd;
        let err = identify_controller(f.as_fd()).expect_err("a regular file is not an NVMe device");
        assert!(
            matches!(err.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)),
            "{err}"
        );
    }
}
