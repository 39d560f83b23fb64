//! The host sections: `system` (DMI from /sys/class/dmi/id), `cpu` (/proc/cpuinfo) and `memory` (/proc/meminfo).
//! The parsers take the file text, so they are tested and fuzzed without a file system.

use super::read_attr;
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::Path;

// === system ===

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SystemSection {
    pub vendor: Option<String>,
    pub product: Option<String>,
    pub product_uuid: Option<String>,
    pub product_serial: Option<String>,
    pub board_vendor: Option<String>,
    pub board_name: Option<String>,
    pub board_serial: Option<String>,
    pub chassis_serial: Option<String>,
    pub bios_vendor: Option<String>,
    pub bios_version: Option<String>,
    pub bios_date: Option<String>,
    pub notes: Vec<String>,
}

pub fn system(root: &Path) -> SystemSection {
    let dir = root.join("sys/class/dmi/id");
    let attr = |name: &str| read_attr(&dir.join(name));
    let mut s = SystemSection {
        vendor: attr("sys_vendor"),
        product: attr("product_name"),
        product_uuid: attr("product_uuid"),
        product_serial: attr("product_serial"),
        board_vendor: attr("board_vendor"),
        board_name: attr("board_name"),
        board_serial: attr("board_serial"),
        chassis_serial: attr("chassis_serial"),
        bios_vendor: attr("bios_vendor"),
        bios_version: attr("bios_version"),
        bios_date: attr("bios_date"),
        notes: Vec::new(),
    };
    if !dir.is_dir() {
        s.notes.push(format!(
            "{} is absent (no DMI on this machine)",
            dir.display()
        ));
    }
    s
}

// === cpu ===

/// Flags worth showing an operator; the full list is summarised by its count.
const NOTABLE_FLAGS: [&str; 20] = [
    "aes",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "avx",
    "avx2",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx512bw",
    "avx512f",
    "fma",
    "hypervisor",
    "sev",
    "sev_snp",
    "sha_ni",
    "svm",
    "tdx_guest",
    "vaes",
    "vmx",
];

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CpuSection {
    pub model: Option<String>,
    pub vendor: Option<String>,
    pub sockets: u32,
    pub cores: u32,
    pub threads: u32,
    pub flag_count: u32,
    /// The notable flags present (see the list in this module), sorted.
    pub flags: Vec<String>,
    pub notes: Vec<String>,
}

/// Parses /proc/cpuinfo (x86 blocks with `physical id`/`core id`; other architectures count processors).
pub fn parse_cpuinfo(text: &str) -> CpuSection {
    let mut s = CpuSection::default();
    let mut sockets = BTreeSet::new();
    let mut cores = BTreeSet::new();
    let mut physical: Option<&str> = None;
    let mut flags: BTreeSet<&str> = BTreeSet::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            // A blank line ends a processor block.
            physical = None;
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match key {
            "processor" => s.threads = s.threads.saturating_add(1),
            "model name" | "Hardware" | "cpu model" if s.model.is_none() && !value.is_empty() => {
                s.model = Some(value.to_string())
            }
            "vendor_id" | "CPU implementer" if s.vendor.is_none() && !value.is_empty() => {
                s.vendor = Some(value.to_string())
            }
            "physical id" => {
                physical = Some(value);
                sockets.insert(value.to_string());
            }
            "core id" => {
                cores.insert((physical.unwrap_or("0").to_string(), value.to_string()));
            }
            "flags" | "Features" if flags.is_empty() => flags = value.split_whitespace().collect(),
            _ => {}
        }
    }
    s.sockets = u32::try_from(sockets.len())
        .unwrap_or(u32::MAX)
        .max(u32::from(s.threads > 0));
    s.cores = match u32::try_from(cores.len()).unwrap_or(u32::MAX) {
        0 => s.threads,
        n => n,
    };
    s.flag_count = u32::try_from(flags.len()).unwrap_or(u32::MAX);
    s.flags = NOTABLE_FLAGS
        .iter()
        .filter(|f| flags.contains(**f))
        .map(|f| (*f).to_string())
        .collect();
    if s.threads == 0 {
        s.notes.push("no processor entries in cpuinfo".into());
    }
    s
}

pub fn cpu(root: &Path) -> CpuSection {
    let path = root.join("proc/cpuinfo");
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_cpuinfo(&text),
        Err(e) => CpuSection {
            notes: vec![format!("reading {}: {e}", path.display())],
            ..CpuSection::default()
        },
    }
}

// === memory ===

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MemorySection {
    pub total_bytes: u64,
    pub swap_total_bytes: u64,
    pub hugepages_total: u64,
    pub hugepage_size_bytes: u64,
    pub notes: Vec<String>,
}

/// Parses /proc/meminfo; only totals (free memory changes every second and would churn the hash).
pub fn parse_meminfo(text: &str) -> MemorySection {
    let mut s = MemorySection::default();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let Some(Ok(n)) = parts.next().map(str::parse::<u64>) else {
            continue;
        };
        let bytes = match parts.next() {
            Some("kB") => n.saturating_mul(1024),
            _ => n,
        };
        match key.trim() {
            "MemTotal" => s.total_bytes = bytes,
            "SwapTotal" => s.swap_total_bytes = bytes,
            "HugePages_Total" => s.hugepages_total = n,
            "Hugepagesize" => s.hugepage_size_bytes = bytes,
            _ => {}
        }
    }
    if s.total_bytes == 0 {
        s.notes.push("no MemTotal in meminfo".into());
    }
    s
}

pub fn memory(root: &Path) -> MemorySection {
    let path = root.join("proc/meminfo");
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_meminfo(&text),
        Err(e) => MemorySection {
            notes: vec![format!("reading {}: {e}", path.display())],
            ..MemorySection::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_SOCKETS: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon X\nphysical id\t: 0\n\
core id\t\t: 0\nflags\t\t: fpu avx avx2 sha_ni\n\nprocessor\t: 1\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 2\nphysical id\t: 1\ncore id\t\t: 0\n\nprocessor\t: 3\nphysical id\t: 1\ncore id\t\t: 1\n";

    #[test]
    fn cpuinfo_counts_sockets_cores_threads() {
        let s = parse_cpuinfo(TWO_SOCKETS);
        assert_eq!((s.sockets, s.cores, s.threads), (2, 3, 4));
        assert_eq!(s.model.as_deref(), Some("Xeon X"));
        assert_eq!(s.vendor.as_deref(), Some("GenuineIntel"));
        assert_eq!(s.flag_count, 4);
        assert_eq!(s.flags, vec!["avx", "avx2", "sha_ni"]);
    }

    #[test]
    fn cpuinfo_without_topology_counts_threads() {
        let s = parse_cpuinfo("processor : 0\nFeatures : fp asimd\n\nprocessor : 1\n");
        assert_eq!((s.sockets, s.cores, s.threads), (1, 2, 2));
        assert_eq!(s.flag_count, 2);
        let empty = parse_cpuinfo("");
        assert_eq!(empty.threads, 0);
        assert_eq!(empty.notes.len(), 1);
    }

    #[test]
    fn meminfo_keeps_totals_only() {
        let s = parse_meminfo(
            "MemTotal: 16 kB\nMemFree: 8 kB\nSwapTotal: 0 kB\nHugePages_Total: 4\nHugepagesize: 2048 kB\nbad\nX: y kB\n",
        );
        assert_eq!(s.total_bytes, 16 * 1024);
        assert_eq!(s.hugepages_total, 4);
        assert_eq!(s.hugepage_size_bytes, 2048 * 1024);
        assert!(s.notes.is_empty());
    }
}
