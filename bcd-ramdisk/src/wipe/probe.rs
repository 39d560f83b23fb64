//! Probing: block-device facts from sysfs, NVMe capabilities from an Identify Controller page.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::DeviceCapabilities;

/// What an NVMe controller says about erase support (NVMe Base Specification 2.0, Identify Controller).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvmeCapabilities {
    /// False when Identify Controller could not be read: nothing below is known.
    pub identified: bool,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    /// SANICAP bit 0 (CES).
    pub sanitize_crypto: bool,
    /// SANICAP bit 1 (BES).
    pub sanitize_block: bool,
    /// SANICAP bit 2 (OWS).
    pub sanitize_overwrite: bool,
    /// OACS bit 1: Format NVM supported.
    pub format_supported: bool,
    /// FNA bit 2: cryptographic erase supported as a Format NVM secure erase setting.
    pub format_crypto: bool,
    /// FNA bit 1: a secure-erase format applies to all namespaces.
    pub format_erase_all_namespaces: bool,
    /// NN: namespaces the controller supports.
    pub namespaces: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentifyError {
    #[error("Identify Controller data is {0} bytes, 4096 expected")]
    Length(usize),
}

impl NvmeCapabilities {
    /// Parse a 4096-byte Identify Controller data structure (CNS 01h).
    pub fn from_identify_controller(data: &[u8]) -> Result<Self, IdentifyError> {
        if data.len() != 4096 {
            return Err(IdentifyError::Length(data.len()));
        }
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&data[r])
                .trim_matches(|c: char| c == '\0' || c.is_whitespace())
                .to_string()
        };
        let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]);
        let u32_at =
            |o: usize| u32::from_le_bytes([data[o], data[o + 1], data[o + 2], data[o + 3]]);
        let oacs = u16_at(256);
        let sanicap = u32_at(328);
        let nn = u32_at(516);
        let fna = data[524];
        Ok(Self {
            identified: true,
            serial: text(4..24),
            model: text(24..64),
            firmware: text(64..72),
            sanitize_crypto: sanicap & 1 != 0,
            sanitize_block: sanicap & 2 != 0,
            sanitize_overwrite: sanicap & 4 != 0,
            format_supported: oacs & 2 != 0,
            format_crypto: fna & 4 != 0,
            format_erase_all_namespaces: fna & 2 != 0,
            namespaces: nn,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} holds {value:?}, a number was expected")]
    Parse { path: PathBuf, value: String },
}

/// Facts about the block device whose sysfs directory is `dir` (e.g. `/sys/class/block/nvme0n1`); `mountinfo` is
/// the text of `/proc/self/mountinfo`, used to refuse a device with a mounted partition. NVMe capabilities are left
/// unidentified; the caller fills them from Identify Controller.
pub fn probe_sysfs(dir: &Path, mountinfo: &str) -> Result<DeviceCapabilities, ProbeError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let sectors = read_u64(&dir.join("size"))?;
    let read_only = read_u64(&dir.join("ro"))? != 0;
    let logical_block_size = read_u64(&dir.join("queue/logical_block_size"))?;
    let rotational = read_u64_or(&dir.join("queue/rotational"), 0)? != 0;
    let discard_max_bytes = read_u64_or(&dir.join("queue/discard_max_bytes"), 0)?;
    let write_zeroes_max_bytes = read_u64_or(&dir.join("queue/write_zeroes_max_bytes"), 0)?;
    let in_use = usage(dir, mountinfo)?;
    let nvme = name.starts_with("nvme").then(NvmeCapabilities::default);
    Ok(DeviceCapabilities {
        size_bytes: sectors.saturating_mul(512),
        logical_block_size: u32::try_from(logical_block_size).unwrap_or(0),
        name,
        read_only,
        in_use,
        rotational,
        nvme,
        discard_max_bytes,
        write_zeroes_max_bytes,
        secure_discard: None,
    })
}

/// Probe `/dev/<name>` on this machine: sysfs facts, mounts from `/proc/self/mountinfo`, and for an NVMe namespace
/// its controller's Identify data (left unidentified, with a warning, when the admin command fails, so the planner
/// says why NVMe methods were skipped).
pub fn probe_device(name: &str) -> Result<DeviceCapabilities, ProbeError> {
    let mountinfo_path = Path::new("/proc/self/mountinfo");
    let mountinfo = fs::read_to_string(mountinfo_path).map_err(|source| ProbeError::Read {
        path: mountinfo_path.to_owned(),
        source,
    })?;
    let mut caps = probe_sysfs(&Path::new("/sys/class/block").join(name), &mountinfo)?;
    if caps.nvme.is_some() {
        let dev = Path::new("/dev").join(name);
        let identify = fs::File::open(&dev).and_then(|f| {
            use std::os::fd::AsFd;
            crate::os::nvme::identify_controller(f.as_fd())
        });
        match identify.map(|data| NvmeCapabilities::from_identify_controller(&data)) {
            Ok(Ok(nvme)) => caps.nvme = Some(nvme),
            Ok(Err(e)) => {
                tracing::warn!(device = %dev.display(), error = %bc_error_chain::InlineErrorChain::new(&e), "NVMe identify data unusable")
            }
            Err(e) => {
                tracing::warn!(device = %dev.display(), error = %bc_error_chain::InlineErrorChain::new(&e), "NVMe Identify Controller failed")
            }
        }
    }
    Ok(caps)
}

/// Why the device (or one of its partitions) is in use: mounted, or held by md/dm/bcache.
fn usage(dir: &Path, mountinfo: &str) -> Result<Option<String>, ProbeError> {
    let mut nodes = vec![dir.to_path_buf()];
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.path().join("partition").exists() {
                nodes.push(entry.path());
            }
        }
    }
    for node in nodes {
        let node_name = node
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Ok(holders) = fs::read_dir(node.join("holders")) {
            let held: Vec<String> = holders
                .flatten()
                .map(|h| h.file_name().to_string_lossy().into_owned())
                .collect();
            if !held.is_empty() {
                return Ok(Some(format!("{node_name} is held by {}", held.join(", "))));
            }
        }
        let dev_path = node.join("dev");
        let dev = fs::read_to_string(&dev_path).map_err(|source| ProbeError::Read {
            path: dev_path,
            source,
        })?;
        let dev = dev.trim();
        // mountinfo field 3 is "major:minor" of the mounted device.
        if mountinfo
            .lines()
            .any(|line| line.split(' ').nth(2) == Some(dev))
        {
            return Ok(Some(format!("{node_name} ({dev}) is mounted")));
        }
    }
    Ok(None)
}

fn read_u64(path: &Path) -> Result<u64, ProbeError> {
    let text = fs::read_to_string(path).map_err(|source| ProbeError::Read {
        path: path.to_owned(),
        source,
    })?;
    text.trim().parse().map_err(|_| ProbeError::Parse {
        path: path.to_owned(),
        value: text.trim().to_string(),
    })
}

fn read_u64_or(path: &Path, default: u64) -> Result<u64, ProbeError> {
    if path.exists() {
        read_u64(path)
    } else {
        Ok(default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identify(oacs: u16, sanicap: u32, fna: u8) -> Vec<u8> {
        let mut d = vec![0u8; 4096];
        d[4..12].copy_from_slice(b"SN123   ");
        d[24..36].copy_from_slice(b"QEMU NVMe Ct");
        d[256..258].copy_from_slice(&oacs.to_le_bytes());
        d[328..332].copy_from_slice(&sanicap.to_le_bytes());
        d[516..520].copy_from_slice(&1u32.to_le_bytes());
        d[524] = fna;
        d
    }

    #[test]
    fn parses_identify_controller_fields() {
        let caps = NvmeCapabilities::from_identify_controller(&identify(0x0002, 0b011, 0b100))
            .expect("4096 bytes");
        assert!(caps.identified && caps.format_supported && caps.format_crypto);
        assert!(caps.sanitize_crypto && caps.sanitize_block && !caps.sanitize_overwrite);
        assert_eq!(caps.model, "QEMU NVMe Ct");
        assert_eq!(caps.serial, "SN123");
        let none =
            NvmeCapabilities::from_identify_controller(&identify(0, 0, 0)).expect("4096 bytes");
        assert!(!none.format_supported && !none.sanitize_crypto && !none.format_crypto);
        assert_eq!(
            NvmeCapabilities::from_identify_controller(&[0; 10]),
            Err(IdentifyError::Length(10))
        );
    }

    fn fake_sysfs(root: &Path, name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = root.join(name);
        for (file, value) in files {
            let p = dir.join(file);
            fs::create_dir_all(p.parent().expect("has parent")).expect("mkdir");
            fs::write(p, value).expect("write");
        }
        dir
    }

    #[test]
    fn probes_a_fake_sysfs_tree() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = fake_sysfs(
            tmp.path(),
            "nvme0n1",
            &[
                ("size", "2097152\n"),
                ("ro", "0\n"),
                ("dev", "259:0\n"),
                ("queue/logical_block_size", "512\n"),
                ("queue/rotational", "0\n"),
                ("queue/discard_max_bytes", "2199023255040\n"),
                ("queue/write_zeroes_max_bytes", "0\n"),
                ("nvme0n1p1/partition", "1\n"),
                ("nvme0n1p1/dev", "259:1\n"),
            ],
        );
        fs::create_dir_all(dir.join("holders")).expect("holders");
        let caps = probe_sysfs(&dir, "").expect("probe");
        assert_eq!(caps.size_bytes, 1 << 30);
        assert_eq!(caps.logical_block_size, 512);
        assert_eq!(caps.discard_max_bytes, 2_199_023_255_040);
        assert!(caps.nvme.as_ref().is_some_and(|n| !n.identified));
        assert_eq!(caps.in_use, None);

        let mounted = "36 25 259:1 / /boot rw,relatime shared:1 - vfat /dev/nvme0n1p1 rw\n";
        let caps = probe_sysfs(&dir, mounted).expect("probe");
        assert_eq!(caps.in_use.as_deref(), Some("nvme0n1p1 (259:1) is mounted"));

        fs::create_dir_all(dir.join("holders/md0")).expect("holder");
        let caps = probe_sysfs(&dir, "").expect("probe");
        assert_eq!(caps.in_use.as_deref(), Some("nvme0n1 is held by md0"));
    }

    #[test]
    fn garbage_in_sysfs_is_an_error_not_a_panic() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = fake_sysfs(tmp.path(), "sda", &[("size", "lots"), ("ro", "0")]);
        assert!(matches!(
            probe_sysfs(&dir, ""),
            Err(ProbeError::Parse { .. })
        ));
    }
}
