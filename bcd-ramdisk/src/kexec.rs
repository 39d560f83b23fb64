//! Boot into the installed system: find its root file system on the target disk, and hand over with
//! `kexec_file_load(2)` + `reboot(LINUX_REBOOT_CMD_KEXEC)`; when that fails, the caller reboots instead.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::os::sys;

#[derive(Debug, thiserror::Error)]
pub enum KexecError {
    #[error("opening {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "kexec_file_load of {kernel} (the kernel refused it: unsigned under lockdown, not a bzImage, or no CAP_SYS_BOOT)"
    )]
    Load {
        kernel: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reboot(LINUX_REBOOT_CMD_KEXEC)")]
    Exec(#[source] io::Error),
}

/// Stage `kernel` + `initrd` with `cmdline` (no reboot yet).
pub fn load(kernel: &Path, initrd: Option<&Path>, cmdline: &str) -> Result<(), KexecError> {
    let open = |p: &Path| {
        File::open(p).map_err(|source| KexecError::Open {
            path: p.to_owned(),
            source,
        })
    };
    let k = open(kernel)?;
    let i = initrd.map(open).transpose()?;
    let started = std::time::Instant::now();
    sys::kexec_file_load(k.as_fd(), i.as_ref().map(|f| f.as_fd()), cmdline).map_err(|source| {
        KexecError::Load {
            kernel: kernel.to_owned(),
            source,
        }
    })?;
    info!(kernel = %kernel.display(), initrd = ?initrd, %cmdline, elapsed = ?started.elapsed(), "kexec kernel staged");
    Ok(())
}

/// Jump into the staged kernel. Returns only on failure.
pub fn exec() -> KexecError {
    KexecError::Exec(sys::reboot_kexec())
}

/// Resolve `rel` (e.g. `boot/vmlinuz`) under `root`, following symlinks as the installed system would see them
/// (an absolute link target is taken relative to `root`). At most 8 links.
pub fn resolve_in_root(root: &Path, rel: &str) -> Option<PathBuf> {
    let mut rel = PathBuf::from(rel.trim_start_matches('/'));
    for _ in 0..8 {
        let path = root.join(&rel);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(&path).ok()?;
                rel = if target.is_absolute() {
                    target.strip_prefix("/").ok()?.to_path_buf()
                } else {
                    rel.parent().unwrap_or(Path::new("")).join(target)
                };
            }
            Ok(m) if m.is_file() => return Some(path),
            _ => return None,
        }
    }
    warn!(rel = %rel.display(), "too many symlinks");
    None
}

/// What to boot from an installed root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstalledBoot {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
}

/// The kernel (`boot/vmlinuz`, or `vmlinuz` at the top as Debian links it), initrd (`boot/initrd.img`,
/// `initrd.img`) and command line (`cmdline`, else the root's `etc/kernel/cmdline`) of the system under `root`.
pub fn installed_boot(root: &Path, cmdline: Option<&str>) -> Result<InstalledBoot, String> {
    let kernel = ["boot/vmlinuz", "vmlinuz"]
        .iter()
        .find_map(|p| resolve_in_root(root, p))
        .ok_or_else(|| format!("no boot/vmlinuz or vmlinuz under {}", root.display()))?;
    let initrd = ["boot/initrd.img", "initrd.img"]
        .iter()
        .find_map(|p| resolve_in_root(root, p));
    let cmdline = match cmdline {
        Some(c) => c.to_string(),
        None => std::fs::read_to_string(root.join("etc/kernel/cmdline"))
            .map(|c| c.trim().to_string())
            .map_err(|e| {
                format!("no bc.kexec_cmdline and no etc/kernel/cmdline on the installed root ({e})")
            })?,
    };
    Ok(InstalledBoot {
        kernel,
        initrd,
        cmdline,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_kernel_through_absolute_and_relative_links() {
        let t = tempfile::tempdir().expect("tempdir");
        let r = t.path();
        std::fs::create_dir_all(r.join("boot")).expect("mkdir");
        std::fs::create_dir_all(r.join("etc/kernel")).expect("mkdir");
        std::fs::write(r.join("boot/vmlinuz-6.1.0"), b"k").expect("write");
        std::fs::write(r.join("boot/initrd.img-6.1.0"), b"i").expect("write");
        std::os::unix::fs::symlink("/boot/vmlinuz-6.1.0", r.join("vmlinuz")).expect("link");
        std::os::unix::fs::symlink("boot/initrd.img-6.1.0", r.join("initrd.img")).expect("link");
        std::fs::write(r.join("etc/kernel/cmdline"), "root=LABEL=x ro\n").expect("write");
        let b = installed_boot(r, None).expect("found");
        assert_eq!(b.kernel, r.join("boot/vmlinuz-6.1.0"));
        assert_eq!(b.initrd, Some(r.join("boot/initrd.img-6.1.0")));
        assert_eq!(b.cmdline, "root=LABEL=x ro");
        assert_eq!(
            installed_boot(r, Some("quiet")).expect("found").cmdline,
            "quiet"
        );
    }

    #[test]
    fn clear_error_without_a_kernel() {
        let t = tempfile::tempdir().expect("tempdir");
        let err = installed_boot(t.path(), Some("x")).expect_err("no kernel");
        assert!(err.contains("no boot/vmlinuz"), "{err}");
    }

    #[test]
    fn link_loops_end() {
        let t = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink("a", t.path().join("b")).expect("link");
        std::os::unix::fs::symlink("b", t.path().join("a")).expect("link");
        assert_eq!(resolve_in_root(t.path(), "a"), None);
    }

    #[test]
    fn load_of_a_missing_kernel_names_it() {
        let err = load(Path::new("/nonexistent/vmlinuz"), None, "").expect_err("missing");
        assert!(err.to_string().contains("/nonexistent/vmlinuz"));
    }
}
