use std::io;
use std::path::Path;

use super::*;

struct FakeNvme {
    fail_smart: bool,
}

impl NvmeAdmin for FakeNvme {
    fn identify(&self, name: &str) -> io::Result<NvmeIdentity> {
        Ok(NvmeIdentity {
            model: format!("Fake {name}"),
            serial: "SN123".into(),
            firmware: "1.0".into(),
            namespaces: 1,
            format_supported: true,
            ..Default::default()
        })
    }
    fn smart(&self, _name: &str) -> io::Result<SmartHealth> {
        if self.fail_smart {
            return Err(io::Error::other("status 0x2"));
        }
        let mut log = vec![0u8; 512];
        log[1..3].copy_from_slice(&313u16.to_le_bytes());
        log[3] = 100;
        log[128] = 42;
        SmartHealth::parse(&log).map_err(io::Error::other)
    }
}

fn write(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(p, content).expect("write");
}

fn symlink(root: &Path, rel: &str, target: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::os::unix::fs::symlink(target, p).expect("symlink");
}

fn fixture() -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    let r = t.path();
    write(
        r,
        "proc/cpuinfo",
        "processor\t: 0\nmodel name\t: AMD EPYC 9654\nphysical id\t: 0\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654\nphysical id\t: 1\n",
    );
    write(
        r,
        "proc/meminfo",
        "MemTotal:       2048 kB\nMemFree: 1 kB\nMemAvailable:   1024 kB\n",
    );
    write(r, "sys/class/dmi/id/sys_vendor", "QEMU\n");
    // An H100 (3D controller), an NVIDIA audio function (not a GPU), and a VGA card from another vendor.
    for (addr, vendor, device, class) in [
        ("0000:17:00.0", "0x10de", "0x2330", "0x030200"),
        ("0000:17:00.1", "0x10de", "0x22ba", "0x040300"),
        ("0000:00:02.0", "0x1234", "0x1111", "0x030000"),
    ] {
        write(r, &format!("sys/bus/pci/devices/{addr}/vendor"), vendor);
        write(r, &format!("sys/bus/pci/devices/{addr}/device"), device);
        write(r, &format!("sys/bus/pci/devices/{addr}/class"), class);
    }
    symlink(
        r,
        "sys/bus/pci/devices/0000:17:00.0/driver",
        "../../../bus/pci/drivers/nvidia",
    );
    // nvme0n1 with a partition, vda, and a loop device that must not be listed.
    write(r, "sys/class/block/nvme0n1/size", "2097152\n");
    write(
        r,
        "sys/class/block/nvme0n1/queue/logical_block_size",
        "4096\n",
    );
    write(r, "sys/class/block/nvme0n1/device/model", "Sysfs model\n");
    write(r, "sys/class/block/nvme0n1p1/partition", "1\n");
    write(r, "sys/class/block/nvme0n1p1/size", "100\n");
    write(r, "sys/class/block/vda/size", "1024\n");
    write(r, "sys/class/block/vda/serial", "vd-serial\n");
    write(r, "sys/class/block/vda/queue/rotational", "1\n");
    std::fs::create_dir_all(r.join("sys/class/block/vda/device")).expect("mkdir");
    write(r, "sys/class/block/loop0/size", "8\n");
    write(r, "sys/class/net/lo/address", "00:00:00:00:00:00\n");
    write(r, "sys/class/net/eth0/address", "52:54:00:12:34:56\n");
    write(r, "sys/class/net/eth0/operstate", "up\n");
    write(r, "sys/class/net/eth0/carrier", "1\n");
    write(r, "sys/class/net/eth0/speed", "-1\n");
    write(r, "sys/class/net/eth1/address", "52:54:00:12:34:57\n");
    write(r, "sys/class/net/eth1/operstate", "down\n");
    t
}

#[test]
fn collects_every_section_from_a_tree() {
    let t = fixture();
    let r = collect(t.path(), &FakeNvme { fail_smart: false });
    assert_eq!(r.problems, Vec::<String>::new());
    assert_eq!(r.system.vendor.as_deref(), Some("QEMU"));
    assert_eq!(r.cpu.logical_cpus, 2);
    assert_eq!(r.cpu.sockets, 2);
    assert_eq!(r.cpu.model.as_deref(), Some("AMD EPYC 9654"));
    assert_eq!(r.memory.total_bytes, 2048 * 1024);
    assert_eq!(r.memory.available_bytes, 1024 * 1024);
    assert_eq!(r.pci.len(), 3);
    assert_eq!(r.gpus.len(), 1);
    assert_eq!(r.gpus[0].address, "0000:17:00.0");
    assert_eq!(r.gpus[0].class, "030200");
    assert_eq!(r.gpus[0].driver.as_deref(), Some("nvidia"));
    let names: Vec<&str> = r.disks.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        ["nvme0n1", "vda"],
        "loop0 (no device link) and partitions never count"
    );
    assert_eq!(r.disks[1].serial.as_deref(), Some("vd-serial"));
    assert!(r.disks[1].rotational);
    assert_eq!(r.disks[1].size_bytes, 1024 * 512);
    assert_eq!(r.disks[1].transport, "virtio");
    assert_eq!(collect_disk_names(t.path()), ["nvme0n1", "vda"]);
    let nics: Vec<&str> = r.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(nics, ["eth0", "eth1"]);
    assert_eq!(r.nics[0].carrier, Some(true));
    assert_eq!(r.nics[0].speed_mbps, None);
    assert_eq!(r.nics[1].carrier, None);
}

#[test]
fn nvme_disks_get_identify_and_smart_or_a_problem() {
    let t = fixture();
    let r = collect(t.path(), &FakeNvme { fail_smart: false });
    let nvme = r
        .disks
        .iter()
        .find(|d| d.name == "nvme0n1")
        .expect("nvme listed");
    assert_eq!(nvme.transport, "nvme");
    assert_eq!(nvme.model.as_deref(), Some("Fake nvme0n1"));
    assert_eq!(nvme.logical_block_size, 4096);
    let smart = nvme.smart.as_ref().expect("smart");
    assert_eq!(smart.temperature_celsius, 40);
    assert_eq!(smart.power_on_hours, 42);
    assert!(smart.healthy);

    let r = collect(t.path(), &FakeNvme { fail_smart: true });
    assert!(
        r.problems.iter().any(|p| p.contains("nvme0n1: NVMe SMART")),
        "{:?}",
        r.problems
    );
}

#[test]
fn a_missing_tree_is_reported_not_fatal() {
    let t = tempfile::tempdir().expect("tempdir");
    let r = collect(t.path(), &FakeNvme { fail_smart: false });
    assert!(r.problems.len() >= 4, "{:?}", r.problems);
    assert!(r.disks.is_empty());
    let json = serde_json::to_string(&r).expect("serializes");
    assert!(json.contains("\"problems\""));
}

#[test]
fn gpu_rule() {
    assert!(is_gpu("10de", "030000"));
    assert!(is_gpu("10de", "030200"));
    assert!(!is_gpu("10de", "040300"));
    assert!(!is_gpu("1002", "030000"));
}

#[test]
fn smart_parse_rejects_short_logs() {
    assert!(SmartHealth::parse(&[0u8; 100]).is_err());
    let mut log = vec![0u8; 512];
    log[0] = 0x04;
    let s = SmartHealth::parse(&log).expect("parses");
    assert!(!s.healthy);
}
