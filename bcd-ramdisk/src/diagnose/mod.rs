//! Diagnose: what the machine is made of, as one JSON report — system (DMI), CPU, memory, PCI devices (GPUs by
//! PCI vendor 10de and display class), disks (size, model, serial; NVMe Identify and SMART / health log through the
//! admin passthrough) and NIC links.
//!
//! [`collect`] reads a procfs/sysfs tree under a root directory (`/` in production, a fixture tree in tests) and
//! never fails as a whole: what cannot be read becomes an entry in [`DiagnoseReport::problems`]. NVMe admin
//! commands go through [`NvmeAdmin`], whose real implementation opens `/dev/<name>`.

mod nvme;

pub use nvme::{NvmeAdmin, NvmeIdentity, RealNvme, SmartHealth};

use std::fs;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

/// PCI vendor id of NVIDIA.
pub const NVIDIA: u16 = 0x10de;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct DiagnoseReport {
    pub system: SystemInfo,
    pub cpu: CpuInfo,
    pub memory: MemoryInfo,
    pub pci: Vec<PciDevice>,
    pub gpus: Vec<PciDevice>,
    pub disks: Vec<Disk>,
    pub nics: Vec<Nic>,
    /// What could not be read, with the path and the error; the rest of the report stands.
    pub problems: Vec<String>,
    pub elapsed_ms: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SystemInfo {
    pub vendor: Option<String>,
    pub product: Option<String>,
    pub uuid: Option<String>,
    pub serial: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CpuInfo {
    pub model: Option<String>,
    pub logical_cpus: u32,
    pub sockets: u32,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct MemoryInfo {
    pub total_bytes: u64,
    pub available_bytes: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PciDevice {
    /// Domain:bus:device.function.
    pub address: String,
    /// Four hex digits.
    pub vendor: String,
    pub device: String,
    /// Six hex digits: class, subclass, programming interface.
    pub class: String,
    pub driver: Option<String>,
    pub gpu: bool,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Disk {
    pub name: String,
    pub size_bytes: u64,
    pub logical_block_size: u32,
    pub rotational: bool,
    pub model: Option<String>,
    pub serial: Option<String>,
    /// `nvme`, `virtio`, `scsi` (SATA/SAS through libata or a HBA), or `other`.
    pub transport: String,
    pub nvme: Option<NvmeIdentity>,
    pub smart: Option<SmartHealth>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Nic {
    pub name: String,
    pub mac: Option<String>,
    pub operstate: Option<String>,
    /// `None` when the link is administratively down (the kernel refuses to say).
    pub carrier: Option<bool>,
    pub speed_mbps: Option<u32>,
    pub driver: Option<String>,
    /// The bus device behind the interface (a PCI address, or `virtioN` for virtio-net).
    pub bus_id: Option<String>,
}

/// Read everything under `root` (`/` on a machine). Never fails as a whole.
pub fn collect(root: &Path, nvme: &dyn NvmeAdmin) -> DiagnoseReport {
    let start = Instant::now();
    let mut r = DiagnoseReport {
        system: system(root),
        ..Default::default()
    };
    match fs::read_to_string(root.join("proc/cpuinfo")) {
        Ok(text) => r.cpu = parse_cpuinfo(&text),
        Err(e) => r.problems.push(format!("proc/cpuinfo: {e}")),
    }
    match fs::read_to_string(root.join("proc/meminfo")) {
        Ok(text) => r.memory = parse_meminfo(&text),
        Err(e) => r.problems.push(format!("proc/meminfo: {e}")),
    }
    r.pci = pci(root, &mut r.problems);
    r.gpus = r.pci.iter().filter(|d| d.gpu).cloned().collect();
    r.disks = disks(root, nvme, &mut r.problems);
    r.nics = nics(root, &mut r.problems);
    r.elapsed_ms = start.elapsed().as_millis() as u64;
    r
}

fn read_trim(path: &Path) -> Option<String> {
    let s = fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

fn link_name(path: &Path) -> Option<String> {
    fs::read_link(path)
        .ok()?
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
}

fn sorted_entries(dir: &Path, problems: &mut Vec<String>, what: &str) -> Vec<String> {
    match fs::read_dir(dir) {
        Ok(entries) => {
            let mut names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
        Err(e) => {
            problems.push(format!("{what}: {e}"));
            Vec::new()
        }
    }
}

fn system(root: &Path) -> SystemInfo {
    let dmi = root.join("sys/class/dmi/id");
    SystemInfo {
        vendor: read_trim(&dmi.join("sys_vendor")),
        product: read_trim(&dmi.join("product_name")),
        uuid: read_trim(&dmi.join("product_uuid")),
        serial: read_trim(&dmi.join("product_serial")),
    }
}

/// Model, logical CPUs and distinct `physical id`s of `/proc/cpuinfo`.
pub fn parse_cpuinfo(text: &str) -> CpuInfo {
    let mut cpu = CpuInfo::default();
    let mut sockets = std::collections::BTreeSet::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        match key.trim() {
            "processor" => cpu.logical_cpus += 1,
            "model name" if cpu.model.is_none() => cpu.model = Some(value.trim().to_string()),
            "physical id" => {
                sockets.insert(value.trim().to_string());
            }
            _ => {}
        }
    }
    cpu.sockets = (sockets.len() as u32).max(u32::from(cpu.logical_cpus > 0));
    cpu
}

/// MemTotal and MemAvailable of `/proc/meminfo`, in bytes.
pub fn parse_meminfo(text: &str) -> MemoryInfo {
    let kib = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .map_or(0, |n| n.saturating_mul(1024))
    };
    MemoryInfo {
        total_bytes: kib("MemTotal"),
        available_bytes: kib("MemAvailable"),
    }
}

fn hex_id(path: &Path, digits: usize) -> Option<String> {
    let raw = read_trim(path)?;
    let raw = raw.strip_prefix("0x").unwrap_or(&raw);
    let value = u32::from_str_radix(raw, 16).ok()?;
    Some(format!("{value:0digits$x}"))
}

/// A GPU: NVIDIA's vendor id and a display class (VGA 0300 or 3D controller 0302).
pub fn is_gpu(vendor: &str, class: &str) -> bool {
    u16::from_str_radix(vendor, 16).ok() == Some(NVIDIA)
        && (class.starts_with("0300") || class.starts_with("0302"))
}

fn pci(root: &Path, problems: &mut Vec<String>) -> Vec<PciDevice> {
    let dir = root.join("sys/bus/pci/devices");
    sorted_entries(&dir, problems, "sys/bus/pci/devices")
        .into_iter()
        .filter_map(|address| {
            let d = dir.join(&address);
            let vendor = hex_id(&d.join("vendor"), 4)?;
            let device = hex_id(&d.join("device"), 4).unwrap_or_default();
            let class = hex_id(&d.join("class"), 6).unwrap_or_default();
            Some(PciDevice {
                gpu: is_gpu(&vendor, &class),
                driver: link_name(&d.join("driver")),
                address,
                vendor,
                device,
                class,
            })
        })
        .collect()
}

/// Whole physical disks under `root`'s sysfs: partitions have `partition`, loop/ram/dm devices have no `device`.
fn is_whole_disk(d: &Path) -> bool {
    !d.join("partition").exists() && d.join("device").exists()
}

/// Names of the whole physical disks (`vda`, `nvme0n1`, `sda`), sorted.
pub fn collect_disk_names(root: &Path) -> Vec<String> {
    let dir = root.join("sys/class/block");
    sorted_entries(&dir, &mut Vec::new(), "sys/class/block")
        .into_iter()
        .filter(|n| is_whole_disk(&dir.join(n)))
        .collect()
}

fn disks(root: &Path, nvme: &dyn NvmeAdmin, problems: &mut Vec<String>) -> Vec<Disk> {
    let dir = root.join("sys/class/block");
    let mut out = Vec::new();
    for name in sorted_entries(&dir, problems, "sys/class/block") {
        let d = dir.join(&name);
        if !is_whole_disk(&d) {
            continue;
        }
        let sectors = read_trim(&d.join("size")).and_then(|s| s.parse::<u64>().ok());
        let Some(sectors) = sectors else {
            problems.push(format!("sys/class/block/{name}/size unreadable"));
            continue;
        };
        let transport = if name.starts_with("nvme") {
            "nvme"
        } else if name.starts_with("vd") {
            "virtio"
        } else if name.starts_with("sd") {
            "scsi"
        } else {
            "other"
        };
        let mut disk = Disk {
            size_bytes: sectors.saturating_mul(512),
            logical_block_size: read_trim(&d.join("queue/logical_block_size"))
                .and_then(|s| s.parse().ok())
                .unwrap_or(512),
            rotational: read_trim(&d.join("queue/rotational")).as_deref() == Some("1"),
            model: read_trim(&d.join("device/model")),
            serial: read_trim(&d.join("device/serial")).or_else(|| read_trim(&d.join("serial"))),
            transport: transport.to_string(),
            name: name.clone(),
            nvme: None,
            smart: None,
        };
        if transport == "nvme" {
            match nvme.identify(&name) {
                Ok(id) => {
                    disk.model = Some(id.model.clone())
                        .filter(|m| !m.is_empty())
                        .or(disk.model);
                    disk.serial = Some(id.serial.clone())
                        .filter(|s| !s.is_empty())
                        .or(disk.serial);
                    disk.nvme = Some(id);
                }
                Err(e) => problems.push(format!("{name}: NVMe Identify Controller: {e}")),
            }
            match nvme.smart(&name) {
                Ok(s) => disk.smart = Some(s),
                Err(e) => problems.push(format!("{name}: NVMe SMART / health log: {e}")),
            }
        }
        out.push(disk);
    }
    out
}

fn nics(root: &Path, problems: &mut Vec<String>) -> Vec<Nic> {
    let dir = root.join("sys/class/net");
    sorted_entries(&dir, problems, "sys/class/net")
        .into_iter()
        .filter(|n| n != "lo")
        .map(|name| {
            let d = dir.join(&name);
            Nic {
                mac: read_trim(&d.join("address")),
                operstate: read_trim(&d.join("operstate")),
                carrier: read_trim(&d.join("carrier")).map(|c| c == "1"),
                speed_mbps: read_trim(&d.join("speed"))
                    .and_then(|s| s.parse::<i64>().ok())
                    .filter(|&s| s > 0)
                    .and_then(|s| u32::try_from(s).ok()),
                driver: link_name(&d.join("device/driver")),
                bus_id: link_name(&d.join("device")),
                name,
            }
        })
        .collect()
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
