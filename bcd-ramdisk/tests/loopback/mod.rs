//! A real loop device over a sparse file in a temp dir, shared by the loop-device tests (`loopdev.rs`) and the
//! session-command tests (`agent_commands.rs`). Attaching says why it cannot (not root, no loop driver, no
//! losetup) so the caller prints a SKIP; the device is detached on drop, also when the test panics.
#![allow(dead_code)]

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use bcd_ramdisk::os::{AlignedBuf, DirectDevice};
use bcd_ramdisk::stream::BlockSink as _;

/// The backing file's size.
pub const SIZE: u64 = 64 << 20;

pub struct Loop {
    pub dev: PathBuf,
    _dir: tempfile::TempDir,
}

impl Loop {
    /// Attach a sparse file of [`SIZE`] bytes beginning with `fill` (if any), or say why not.
    pub fn attach(fill: Option<&[u8]>) -> Result<Self, String> {
        let uid = std::fs::metadata("/proc/self")
            .map(|m| m.uid())
            .map_err(|e| format!("no /proc: {e}"))?;
        if uid != 0 {
            return Err(format!("not root (uid {uid})"));
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let backing = dir.path().join("disk.img");
        let mut f = std::fs::File::create(&backing).map_err(|e| e.to_string())?;
        f.set_len(SIZE).map_err(|e| e.to_string())?;
        if let Some(data) = fill {
            f.write_all(data).map_err(|e| e.to_string())?;
        }
        f.sync_all().map_err(|e| e.to_string())?;
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&backing)
            .output()
            .map_err(|e| format!("losetup not runnable: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "losetup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Ok(Self { dev, _dir: dir })
    }

    /// The device's name under /dev (`loop3`).
    pub fn name(&self) -> String {
        self.dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Its directory under /sys/class/block.
    pub fn sysfs(&self) -> PathBuf {
        Path::new("/sys/class/block").join(self.name())
    }

    /// The first `len` bytes, read with O_DIRECT (past the page cache).
    pub fn read(&self, len: u64) -> Vec<u8> {
        let mut dev = DirectDevice::open(&self.dev).expect("open O_DIRECT");
        let mut out = Vec::with_capacity(len as usize);
        let mut buf = AlignedBuf::new(1 << 20);
        while (out.len() as u64) < len {
            let n = dev
                .read_at(buf.as_mut_slice(), out.len() as u64)
                .expect("O_DIRECT read");
            assert!(n > 0, "device ended early");
            out.extend_from_slice(&buf.as_slice()[..n]);
        }
        out.truncate(len as usize);
        out
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        match Command::new("losetup").arg("-d").arg(&self.dev).status() {
            Ok(s) if s.success() => {}
            other => eprintln!(
                "WARNING: detaching {} failed: {other:?}",
                self.dev.display()
            ),
        }
    }
}
