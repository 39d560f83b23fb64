//! The device sections: `gpus` (from the GPU backend), `nics` (/sys/class/net) and `disks` (/sys/block).

use super::{link_name, read_attr};
use crate::gpu::GpuBackend;
pub use bc_proto::payloads::GpusSection;
use serde::Serialize;
use std::path::Path;

// === gpus ===

pub fn gpus(backend: Option<&dyn GpuBackend>) -> GpusSection {
    let Some(backend) = backend else {
        return GpusSection {
            backend: "none".into(),
            ..GpusSection::default()
        };
    };
    let mut s = GpusSection {
        backend: backend.name().to_string(),
        ..GpusSection::default()
    };
    match backend.gpus() {
        Ok(mut list) => {
            list.sort_by_key(|g| g.index);
            s.gpus = list;
        }
        Err(e) => s.notes.push(e.to_string()),
    }
    s
}

// === nics ===

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Nic {
    pub name: String,
    pub mac: Option<String>,
    pub driver: Option<String>,
    pub pci_address: Option<String>,
    /// Mb/s; absent while the link is down (the kernel answers EINVAL).
    pub speed_mbps: Option<u32>,
    /// `up`, `down`, … (operstate).
    pub link: Option<String>,
    pub mtu: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NicsSection {
    pub nics: Vec<Nic>,
    pub notes: Vec<String>,
}

/// Physical NICs (those with a `device` link; bridges, veths and loopback have none), sorted by name.
pub fn nics(root: &Path) -> NicsSection {
    let mut s = NicsSection::default();
    let dir = root.join("sys/class/net");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            s.notes.push(format!("reading {}: {e}", dir.display()));
            return s;
        }
    };
    for e in entries.flatten() {
        let path = e.path();
        if !path.join("device").exists() {
            continue;
        }
        s.nics.push(Nic {
            name: e.file_name().to_string_lossy().to_string(),
            mac: read_attr(&path.join("address")),
            driver: link_name(&path.join("device/driver")),
            pci_address: link_name(&path.join("device")),
            speed_mbps: read_attr(&path.join("speed"))
                .and_then(|v| v.parse::<i64>().ok())
                .and_then(|v| u32::try_from(v).ok()),
            link: read_attr(&path.join("operstate")),
            mtu: read_attr(&path.join("mtu")).and_then(|v| v.parse().ok()),
        });
    }
    s.nics.sort_by(|a, b| a.name.cmp(&b.name));
    s
}

// === disks ===

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Disk {
    pub name: String,
    pub size_bytes: u64,
    pub model: Option<String>,
    pub serial: Option<String>,
    pub rotational: bool,
    pub nvme: bool,
    pub removable: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DisksSection {
    pub disks: Vec<Disk>,
    pub notes: Vec<String>,
}

/// Whole physical disks: entries of /sys/block with a `device` link (not loop, ram, zram, dm or md), sorted.
pub fn disks(root: &Path) -> DisksSection {
    let mut s = DisksSection::default();
    let dir = root.join("sys/block");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            s.notes.push(format!("reading {}: {e}", dir.display()));
            return s;
        }
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let path = e.path();
        if ["loop", "ram", "zram"].iter().any(|p| name.starts_with(p))
            || !path.join("device").exists()
        {
            continue;
        }
        let sectors: u64 = read_attr(&path.join("size"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let device = path.join("device");
        // NVMe exposes the serial as an attribute; SCSI/SATA through VPD page 0x80 (binary header, then text).
        let serial =
            read_attr(&device.join("serial")).or_else(|| vpd_serial(&device.join("vpd_pg80")));
        s.disks.push(Disk {
            nvme: name.starts_with("nvme"),
            size_bytes: sectors.saturating_mul(512),
            model: read_attr(&device.join("model")),
            serial,
            rotational: read_attr(&path.join("queue/rotational")).as_deref() == Some("1"),
            removable: read_attr(&path.join("removable")).as_deref() == Some("1"),
            name,
        });
    }
    s.disks.sort_by(|a, b| a.name.cmp(&b.name));
    s
}

/// The unit serial number from a VPD page 0x80 dump: 4 header bytes, then ASCII.
fn vpd_serial(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    let text: String = bytes
        .get(4..)?
        .iter()
        .filter(|b| b.is_ascii_graphic())
        .map(|b| *b as char)
        .collect();
    (!text.is_empty()).then_some(text)
}
