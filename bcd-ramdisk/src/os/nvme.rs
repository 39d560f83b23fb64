//! NVMe admin commands through `NVME_IOCTL_ADMIN_CMD` (linux/nvme_ioctl.h): Identify (controller, namespace),
//! Get Log Page (SMART / health, sanitize status), Format NVM and Sanitize. Decoding of the returned pages is pure
//! and lives with its users ([`crate::wipe`], [`crate::diagnose`]).

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

/// `_IO('N', 0x40)`: the namespace id of a namespace block device.
const NVME_IOCTL_ID: u64 = (0x4e << 8) | 0x40;

const OPC_GET_LOG_PAGE: u8 = 0x02;
const OPC_IDENTIFY: u8 = 0x06;
const OPC_FORMAT_NVM: u8 = 0x80;
const OPC_SANITIZE: u8 = 0x84;
const CNS_NAMESPACE: u32 = 0x00;
const CNS_CONTROLLER: u32 = 0x01;
/// Log page identifiers.
pub const LOG_SMART: u8 = 0x02;
pub const LOG_SANITIZE_STATUS: u8 = 0x81;
/// All namespaces.
pub const NSID_ALL: u32 = 0xffff_ffff;

/// Issue one admin command with an optional data buffer the controller reads or writes.
fn admin(
    fd: BorrowedFd<'_>,
    mut cmd: PassthruCmd,
    data: Option<&mut AlignedBuf>,
) -> io::Result<u32> {
    if let Some(buf) = data {
        cmd.addr = buf.as_mut_slice().as_mut_ptr() as u64;
        cmd.data_len =
            u32::try_from(buf.len()).map_err(|_| io::Error::other("admin buffer too large"))?;
    } else {
        cmd.addr = 0;
        cmd.data_len = 0;
    }
    // SAFETY: `cmd` is a live, correctly laid out `nvme_passthru_cmd` (size checked by a test) that the kernel
    // reads and updates (`result`). `addr`/`data_len` describe `buf`, a live writable buffer of exactly that many
    // bytes that outlives the call (or are 0/0), so the controller's DMA stays inside it. The descriptor is
    // borrowed and open.
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
        let status = rc as u32;
        // Invalid Opcode / Invalid Field in Command: the controller does not do this.
        let kind = if matches!(status & 0x7ff, 0x01 | 0x02) {
            io::ErrorKind::Unsupported
        } else {
            io::ErrorKind::Other
        };
        return Err(io::Error::new(
            kind,
            format!(
                "NVMe admin command {:#04x} failed with status {status:#x}",
                cmd.opcode
            ),
        ));
    }
    Ok(cmd.result)
}

/// The namespace id of an NVMe namespace block device (`NVME_IOCTL_ID`).
pub fn namespace_id(fd: BorrowedFd<'_>) -> io::Result<u32> {
    // SAFETY: NVME_IOCTL_ID takes no argument; the descriptor is borrowed and open.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), NVME_IOCTL_ID as libc::Ioctl, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(rc).map_err(|_| io::Error::other("negative namespace id"))
}

/// The 4096-byte Identify Namespace data structure of `nsid`.
pub fn identify_namespace(fd: BorrowedFd<'_>, nsid: u32) -> io::Result<Vec<u8>> {
    let mut buf = AlignedBuf::new(4096);
    let cmd = PassthruCmd {
        opcode: OPC_IDENTIFY,
        nsid,
        cdw10: CNS_NAMESPACE,
        timeout_ms: 10_000,
        ..Default::default()
    };
    admin(fd, cmd, Some(&mut buf))?;
    Ok(buf.as_slice()[..4096].to_vec())
}

/// Get Log Page `lid` (`len` bytes, a multiple of 4 up to 4096) for `nsid`.
pub fn get_log_page(fd: BorrowedFd<'_>, lid: u8, nsid: u32, len: usize) -> io::Result<Vec<u8>> {
    if len == 0 || !len.is_multiple_of(4) || len > 4096 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "log length must be 4..=4096, multiple of 4",
        ));
    }
    let mut buf = AlignedBuf::new(len);
    let numd = (len / 4 - 1) as u32;
    let cmd = PassthruCmd {
        opcode: OPC_GET_LOG_PAGE,
        nsid,
        cdw10: u32::from(lid) | ((numd & 0xffff) << 16),
        cdw11: numd >> 16,
        timeout_ms: 10_000,
        ..Default::default()
    };
    admin(fd, cmd, Some(&mut buf))?;
    Ok(buf.as_slice()[..len].to_vec())
}

/// Format NVM of namespace `nsid` keeping LBA format `lbaf`, with Secure Erase Setting `ses` (1 user data, 2
/// crypto). Blocks until the controller completes it (the kernel re-reads the namespace afterwards).
pub fn format_nvm(fd: BorrowedFd<'_>, nsid: u32, lbaf: u8, ses: u8) -> io::Result<()> {
    let cmd = PassthruCmd {
        opcode: OPC_FORMAT_NVM,
        nsid,
        cdw10: u32::from(lbaf & 0x0f)
            | (u32::from((lbaf >> 4) & 0x3) << 12)
            | (u32::from(ses & 0x7) << 9),
        timeout_ms: 600_000,
        ..Default::default()
    };
    admin(fd, cmd, None).map(|_| ())
}

/// Start a Sanitize (`sanact` 2 block erase, 4 crypto erase). Completion is polled through
/// [`LOG_SANITIZE_STATUS`].
pub fn sanitize_start(fd: BorrowedFd<'_>, sanact: u8) -> io::Result<()> {
    let cmd = PassthruCmd {
        opcode: OPC_SANITIZE,
        cdw10: u32::from(sanact & 0x7),
        timeout_ms: 60_000,
        ..Default::default()
    };
    admin(fd, cmd, None).map(|_| ())
}

/// Read the 4096-byte Identify Controller data structure of the controller behind `fd` (an NVMe namespace block
/// device or controller character device). Needs CAP_SYS_ADMIN. A non-NVMe device answers `ENOTTY`.
pub fn identify_controller(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut buf = AlignedBuf::new(4096);
    let cmd = PassthruCmd {
        opcode: OPC_IDENTIFY,
        cdw10: CNS_CONTROLLER,
        timeout_ms: 10_000,
        ..Default::default()
    };
    admin(fd, cmd, Some(&mut buf))?;
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
        assert_eq!(NVME_IOCTL_ID, 0x4E40);
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
