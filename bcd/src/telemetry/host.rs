//! Host metrics with node_exporter's names (CPU, memory, load, filesystems, disks, network), read from procfs under
//! the hardware root like the inventory. The parsers take the file text (pure, fuzzed); [`families`] reads the
//! files and statvfs()s the mounted filesystems.
//!
//! Pseudo and network filesystems are left out (node_exporter leaves out the pseudo ones by default; a network
//! mount is left out here because a hung server would hang statvfs and with it the sample). Disk partitions,
//! loop and ram devices are left out as node_exporter does.

use bc_telemetry::{Family, Kind, Labels};
use std::path::Path;

/// Linux reports CPU times in USER_HZ ticks, 100 per second on every architecture bcd runs on.
const USER_HZ: f64 = 100.0;

const CPU_MODES: [&str; 8] = [
    "user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal",
];

/// One `cpuN` line of /proc/stat: ticks per mode, in [`CPU_MODES`] order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuTimes {
    pub cpu: u32,
    pub ticks: [u64; 8],
}

pub fn parse_stat(text: &str) -> Vec<CpuTimes> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        let Some(cpu) = f
            .next()
            .and_then(|n| n.strip_prefix("cpu"))
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        let mut ticks = [0u64; 8];
        for t in &mut ticks {
            *t = f.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
        out.push(CpuTimes { cpu, ticks });
    }
    out
}

/// Every /proc/meminfo field in bytes, under node_exporter's name (`Active(anon)` → `Active_anon`).
pub fn parse_meminfo(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let mut f = rest.split_ascii_whitespace();
        let Some(v) = f.next().and_then(|v| v.parse::<u64>().ok()) else {
            continue;
        };
        let bytes = match f.next() {
            Some("kB") => v.saturating_mul(1024),
            _ => v,
        };
        let name: String = key
            .trim()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
            .trim_end_matches('_')
            .to_string();
        if !name.is_empty() {
            out.push((name, bytes as f64));
        }
    }
    out
}

pub fn parse_loadavg(text: &str) -> Option<[f64; 3]> {
    let mut f = text.split_ascii_whitespace().map(|v| v.parse::<f64>().ok());
    Some([f.next()??, f.next()??, f.next()??])
}

/// One /proc/diskstats line: reads, sectors read, writes, sectors written, milliseconds doing I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskStat {
    pub device: String,
    pub reads: u64,
    pub read_sectors: u64,
    pub writes: u64,
    pub write_sectors: u64,
    pub io_ms: u64,
}

/// node_exporter's default device exclusion: ram, loop, fd and partitions.
fn disk_excluded(name: &str) -> bool {
    let trailing_digits = name.trim_end_matches(|c: char| c.is_ascii_digit());
    let has_digits = trailing_digits.len() < name.len();
    name.starts_with("ram")
        || name.starts_with("zram")
        || name.starts_with("loop")
        || name.starts_with("fd")
        || (has_digits
            && ["sd", "hd", "vd", "xvd"].iter().any(|p| {
                trailing_digits
                    .strip_prefix(p)
                    .is_some_and(|l| l.len() == 1 && l.bytes().all(|b| b.is_ascii_lowercase()))
            }))
        || (name.starts_with("nvme") && trailing_digits.ends_with('p'))
}

pub fn parse_diskstats(text: &str) -> Vec<DiskStat> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        if f.len() < 14 {
            continue;
        }
        let n = |i: usize| f[i].parse::<u64>().unwrap_or(0);
        let device = f[2].to_string();
        if disk_excluded(&device) {
            continue;
        }
        out.push(DiskStat {
            device,
            reads: n(3),
            read_sectors: n(5),
            writes: n(7),
            write_sectors: n(9),
            io_ms: n(12),
        });
    }
    out
}

/// One /proc/net/dev line: receive and transmit bytes, packets, errors, drops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetDev {
    pub device: String,
    pub rx: [u64; 4],
    pub tx: [u64; 4],
}

pub fn parse_netdev(text: &str) -> Vec<NetDev> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let v: Vec<u64> = rest
            .split_ascii_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if v.len() < 16 {
            continue;
        }
        out.push(NetDev {
            device: name.trim().to_string(),
            rx: [v[0], v[1], v[2], v[3]],
            tx: [v[8], v[9], v[10], v[11]],
        });
    }
    out
}

/// One /proc/mounts line (octal escapes such as `\040` decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub device: String,
    pub mountpoint: String,
    pub fstype: String,
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

const SKIPPED_FS: &[&str] = &[
    "autofs",
    "binfmt_misc",
    "bpf",
    "cgroup",
    "cgroup2",
    "configfs",
    "debugfs",
    "devpts",
    "devtmpfs",
    "fusectl",
    "hugetlbfs",
    "iso9660",
    "mqueue",
    "nsfs",
    "overlay",
    "proc",
    "procfs",
    "pstore",
    "rpc_pipefs",
    "securityfs",
    "selinuxfs",
    "squashfs",
    "sysfs",
    "tracefs",
    "efivarfs",
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "fuse.sshfs",
    "ceph",
    "9p",
    "ramfs",
];

fn mount_skipped(m: &Mount) -> bool {
    let under = |p: &str| m.mountpoint == p || m.mountpoint.starts_with(&format!("{p}/"));
    SKIPPED_FS.contains(&m.fstype.as_str())
        || under("/dev")
        || under("/proc")
        || under("/sys")
        || m.mountpoint.starts_with("/run/credentials/")
        || m.mountpoint.starts_with("/var/lib/docker/")
        || m.mountpoint.starts_with("/var/lib/containers/storage/")
}

pub fn parse_mounts(text: &str) -> Vec<Mount> {
    let mut out: Vec<Mount> = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        let m = Mount {
            device: unescape(f[0]),
            mountpoint: unescape(f[1]),
            fstype: f[2].to_string(),
        };
        if !mount_skipped(&m) && !out.iter().any(|o| o.mountpoint == m.mountpoint) {
            out.push(m);
        }
    }
    out
}

fn read(root: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(root.join(rel)).ok()
}

/// The host families, read now under `root`.
pub fn families(root: &Path, out: &mut Vec<Family>) {
    if let Some(t) = read(root, "proc/stat") {
        let mut f = Family::new(
            "node_cpu_seconds_total",
            Kind::Counter,
            "s",
            "Seconds the CPUs spent in each mode.",
        );
        for c in parse_stat(&t) {
            for (mode, ticks) in CPU_MODES.iter().zip(c.ticks) {
                f.push(
                    Labels::new()
                        .with("cpu", c.cpu.to_string())
                        .with("mode", *mode),
                    ticks as f64 / USER_HZ,
                );
            }
        }
        out.push(f);
    }
    if let Some(t) = read(root, "proc/meminfo") {
        for (name, bytes) in parse_meminfo(&t) {
            out.push(
                Family::new(
                    format!("node_memory_{name}_bytes"),
                    Kind::Gauge,
                    "By",
                    format!("Memory information field {name}_bytes."),
                )
                .with(Labels::new(), bytes),
            );
        }
    }
    if let Some(l) = read(root, "proc/loadavg").and_then(|t| parse_loadavg(&t)) {
        let names = [
            ("node_load1", "1m load average."),
            ("node_load5", "5m load average."),
            ("node_load15", "15m load average."),
        ];
        for ((name, help), v) in names.into_iter().zip(l) {
            out.push(Family::new(name, Kind::Gauge, "1", help).with(Labels::new(), v));
        }
    }
    if let Some(t) = read(root, "proc/mounts") {
        filesystems(root, &parse_mounts(&t), out);
    }
    if let Some(t) = read(root, "proc/diskstats") {
        let stats = parse_diskstats(&t);
        let fam = |name: &str,
                   kind: Kind,
                   unit: &'static str,
                   help: &str,
                   v: &dyn Fn(&DiskStat) -> f64| {
            let mut f = Family::new(name, kind, unit, help);
            for d in &stats {
                f.push(Labels::new().with("device", &d.device), v(d));
            }
            f
        };
        out.push(fam(
            "node_disk_reads_completed_total",
            Kind::Counter,
            "1",
            "The total number of reads completed successfully.",
            &|d| d.reads as f64,
        ));
        out.push(fam(
            "node_disk_writes_completed_total",
            Kind::Counter,
            "1",
            "The total number of writes completed successfully.",
            &|d| d.writes as f64,
        ));
        out.push(fam(
            "node_disk_read_bytes_total",
            Kind::Counter,
            "By",
            "The total number of bytes read successfully.",
            &|d| (d.read_sectors * 512) as f64,
        ));
        out.push(fam(
            "node_disk_written_bytes_total",
            Kind::Counter,
            "By",
            "The total number of bytes written successfully.",
            &|d| (d.write_sectors * 512) as f64,
        ));
        out.push(fam(
            "node_disk_io_time_seconds_total",
            Kind::Counter,
            "s",
            "Total seconds spent doing I/Os.",
            &|d| d.io_ms as f64 / 1000.0,
        ));
    }
    if let Some(t) = read(root, "proc/net/dev") {
        let devs = parse_netdev(&t);
        let names = ["bytes", "packets", "errs", "drop"];
        for (dir, pick) in [("receive", 0usize), ("transmit", 1)] {
            for (i, what) in names.iter().enumerate() {
                let name = format!("node_network_{dir}_{what}_total");
                let unit = if *what == "bytes" { "By" } else { "1" };
                let mut f = Family::new(
                    &name,
                    Kind::Counter,
                    unit,
                    format!("Network device statistic {dir}_{what}."),
                );
                for d in &devs {
                    let v = if pick == 0 { d.rx[i] } else { d.tx[i] };
                    f.push(Labels::new().with("device", &d.device), v as f64);
                }
                out.push(f);
            }
        }
    }
}

fn filesystems(root: &Path, mounts: &[Mount], out: &mut Vec<Family>) {
    let mut size = Family::new(
        "node_filesystem_size_bytes",
        Kind::Gauge,
        "By",
        "Filesystem size in bytes.",
    );
    let mut free = Family::new(
        "node_filesystem_free_bytes",
        Kind::Gauge,
        "By",
        "Filesystem free space in bytes.",
    );
    let mut avail = Family::new(
        "node_filesystem_avail_bytes",
        Kind::Gauge,
        "By",
        "Filesystem space available to non-root users in bytes.",
    );
    let mut files = Family::new(
        "node_filesystem_files",
        Kind::Gauge,
        "1",
        "Filesystem total file nodes.",
    );
    let mut files_free = Family::new(
        "node_filesystem_files_free",
        Kind::Gauge,
        "1",
        "Filesystem total free file nodes.",
    );
    for m in mounts {
        let path = root.join(m.mountpoint.trim_start_matches('/'));
        let Ok(st) = rustix::fs::statvfs(&path) else {
            continue;
        };
        let labels = Labels::new()
            .with("device", &m.device)
            .with("fstype", &m.fstype)
            .with("mountpoint", &m.mountpoint);
        let frsize = st.f_frsize as f64;
        size.push(labels.clone(), st.f_blocks as f64 * frsize);
        free.push(labels.clone(), st.f_bfree as f64 * frsize);
        avail.push(labels.clone(), st.f_bavail as f64 * frsize);
        files.push(labels.clone(), st.f_files as f64);
        files_free.push(labels, st.f_ffree as f64);
    }
    out.extend([size, free, avail, files, files_free]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_meminfo_loadavg() {
        let s = parse_stat("cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 100 0 50 1000 1 0 2 0 0 0\nintr 5\n");
        assert_eq!(
            s,
            vec![CpuTimes {
                cpu: 0,
                ticks: [100, 0, 50, 1000, 1, 0, 2, 0]
            }]
        );
        let m = parse_meminfo(
            "MemTotal:       16384 kB\nActive(anon):     4 kB\nHugePages_Total:       0\n",
        );
        assert_eq!(
            m,
            vec![
                ("MemTotal".into(), 16_777_216.0),
                ("Active_anon".into(), 4096.0),
                ("HugePages_Total".into(), 0.0)
            ]
        );
        assert_eq!(
            parse_loadavg("0.50 1.25 2.00 1/300 42\n"),
            Some([0.5, 1.25, 2.0])
        );
        assert_eq!(parse_loadavg("x"), None);
    }

    #[test]
    fn disks_net_mounts() {
        let d = parse_diskstats(
            " 259 0 nvme0n1 10 0 80 5 20 0 160 7 0 30 12 0 0 0 0\n 259 1 nvme0n1p1 1 0 8 0 0 0 0 0 0 0 0\n   7 0 loop0 1 0 2 0 0 0 0 0 0 0 0\n   8 0 sda 1 0 2 0 3 0 4 0 0 9 0\n   8 1 sda1 1 0 2 0 3 0 4 0 0 9 0\n",
        );
        assert_eq!(
            d.iter().map(|x| x.device.as_str()).collect::<Vec<_>>(),
            vec!["nvme0n1", "sda"]
        );
        assert_eq!(
            (
                d[0].reads,
                d[0].read_sectors,
                d[0].writes,
                d[0].write_sectors,
                d[0].io_ms
            ),
            (10, 80, 20, 160, 30)
        );
        let n = parse_netdev(
            "Inter-|   Receive\n face |bytes\n  eth0: 100 2 0 0 0 0 0 0 200 3 1 0 0 0 0 0\n    lo: 5 1 0 0 0 0 0 0 5 1 0 0 0 0 0 0\n",
        );
        assert_eq!(
            n[0],
            NetDev {
                device: "eth0".into(),
                rx: [100, 2, 0, 0],
                tx: [200, 3, 1, 0]
            }
        );
        let m = parse_mounts(
            "/dev/nvme0n1p2 / ext4 rw 0 0\nproc /proc proc rw 0 0\n/dev/sdb1 /mnt/my\\040data xfs rw 0 0\nsrv:/x /nfs nfs4 rw 0 0\n",
        );
        assert_eq!(
            m.iter().map(|x| x.mountpoint.as_str()).collect::<Vec<_>>(),
            vec!["/", "/mnt/my data"]
        );
    }

    #[test]
    fn garbage_never_panics() {
        for t in [
            "",
            "cpu",
            "cpuX 1",
            ":",
            "a:b",
            "\\",
            "x \\04",
            "1 2",
            "\u{0}:\u{0}",
        ] {
            let _ = (
                parse_stat(t),
                parse_meminfo(t),
                parse_loadavg(t),
                parse_diskstats(t),
                parse_netdev(t),
                parse_mounts(t),
            );
        }
    }
}
