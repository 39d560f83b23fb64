//! System calls PID 1 needs that std does not wrap: mounts, module loading, kexec, reboot/power-off, reaping, and
//! re-reading a partition table.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cstring(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in argument"))
}

/// `mount(2)`. `data` is the file-system specific option string.
pub fn mount(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = cstring(source.as_bytes())?;
    let target = cstring(target.as_os_str().as_bytes())?;
    let fstype = cstring(fstype.as_bytes())?;
    let data = data.map(|d| cstring(d.as_bytes())).transpose()?;
    // SAFETY: every pointer is a NUL-terminated string owned by this frame (or null for `data`), alive for the
    // whole call; mount(2) only reads them.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `umount2(2)`.
pub fn umount(target: &Path) -> io::Result<()> {
    let target = cstring(target.as_os_str().as_bytes())?;
    // SAFETY: `target` is a NUL-terminated string alive for the call; umount2 only reads it.
    let rc = unsafe { libc::umount2(target.as_ptr(), 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `finit_module(2)` with empty parameters. `EEXIST` (already loaded or built in) is success.
pub fn finit_module(fd: BorrowedFd<'_>) -> io::Result<()> {
    let params = c"";
    // SAFETY: the descriptor is borrowed and open; `params` is a static NUL-terminated string; flags 0.
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, fd.as_raw_fd(), params.as_ptr(), 0) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(err);
    }
    Ok(())
}

/// `kexec_file_load(2)`: stage `kernel` (a bzImage) with `initrd` and `cmdline` for a later
/// [`reboot_kexec`]. Needs CAP_SYS_BOOT.
pub fn kexec_file_load(
    kernel: BorrowedFd<'_>,
    initrd: Option<BorrowedFd<'_>>,
    cmdline: &str,
) -> io::Result<()> {
    let cmdline = cstring(cmdline.as_bytes())?;
    let len = cmdline.as_bytes_with_nul().len();
    let (initrd_fd, flags) = match initrd {
        Some(fd) => (fd.as_raw_fd(), 0u64),
        // KEXEC_FILE_NO_INITRAMFS
        None => (-1, 4u64),
    };
    // SAFETY: both descriptors are borrowed and open (or -1 with KEXEC_FILE_NO_INITRAMFS); `cmdline` is a
    // NUL-terminated string of exactly `len` bytes including the NUL, alive for the call; the kernel only reads it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_kexec_file_load,
            kernel.as_raw_fd(),
            initrd_fd,
            len,
            cmdline.as_ptr(),
            flags,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn reboot(cmd: libc::c_int) -> io::Error {
    // SAFETY: reboot(2) takes no pointers; on success it does not return (or returns 0 for the kexec command when
    // nothing is loaded, handled by the caller through the returned error).
    let rc = unsafe { libc::reboot(cmd) };
    if rc < 0 {
        io::Error::last_os_error()
    } else {
        io::Error::other("reboot(2) returned")
    }
}

/// Flush file systems, then `reboot(LINUX_REBOOT_CMD_KEXEC)`. Returns only on failure.
pub fn reboot_kexec() -> io::Error {
    sync();
    reboot(libc::LINUX_REBOOT_CMD_KEXEC)
}

/// Flush file systems, then power off. Returns only on failure.
pub fn power_off() -> io::Error {
    sync();
    reboot(libc::RB_POWER_OFF)
}

/// Flush file systems, then reboot. Returns only on failure.
pub fn restart() -> io::Error {
    sync();
    reboot(libc::RB_AUTOBOOT)
}

pub fn sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() }
}

/// Reap every exited child without blocking; returns how many were reaped.
pub fn reap_children() -> usize {
    let mut n = 0;
    loop {
        let mut status = 0;
        // SAFETY: `status` is a live, writable c_int; WNOHANG keeps the call from blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return n;
        }
        n += 1;
    }
}

/// Block until a child exits and reap it. `ECHILD` when there is none.
pub fn wait_any_child() -> io::Result<libc::pid_t> {
    let mut status = 0;
    // SAFETY: `status` is a live, writable c_int.
    let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pid)
}

/// `BLKRRPART`: make the kernel re-read the partition table of a whole-disk device.
pub fn reread_partitions(fd: BorrowedFd<'_>) -> io::Result<()> {
    const BLKRRPART: u64 = super::ioc(super::IOC_NONE, 0x12, 95, 0);
    // SAFETY: BLKRRPART takes no argument; the descriptor is borrowed and open.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), BLKRRPART as libc::Ioctl, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Make `path` (e.g. `/dev/console`) the process's stdin, stdout and stderr.
pub fn redirect_stdio(path: &Path) -> io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    for target in 0..3 {
        // SAFETY: dup2 on an open descriptor we own onto the standard descriptors; no memory is involved.
        let rc = unsafe { libc::dup2(file.as_raw_fd(), target) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blkrrpart_number() {
        assert_eq!(
            super::super::ioc(super::super::IOC_NONE, 0x12, 95, 0),
            0x125f
        );
    }

    #[test]
    fn reap_without_children_is_zero() {
        assert_eq!(reap_children(), 0);
    }

    #[test]
    fn finit_module_on_a_regular_file_fails_cleanly() {
        use std::os::fd::AsFd;
        let f = tempfile::tempfile().expect("tempfile");
        // EPERM without CAP_SYS_MODULE, ENOEXEC/EINVAL on an empty file with it: never a crash.
        assert!(finit_module(f.as_fd()).is_err());
    }
}
