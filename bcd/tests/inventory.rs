//! Inventory sections over a prepared fake root (DMI, procfs, sysfs net and block with symlinks like the kernel's)
//! and over this machine's real /proc and /sys.

use anyhow::Result;
use bcd::gpu::fixture::{self, FixtureBackend};
use bcd::inventory::{self, Section};
use serde_json::Value;
use std::collections::HashMap;
use std::os::unix::fs::symlink;
use std::path::Path;

fn write(root: &Path, rel: &str, text: &str) -> Result<()> {
    let p = root.join(rel);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(p, text)?;
    Ok(())
}

const CPUINFO: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\
physical id\t: 0\ncore id\t\t: 0\nflags\t\t: fpu sse avx avx2 avx512f sha_ni svm\n\n\
processor\t: 1\nphysical id\t: 0\ncore id\t\t: 0\n\nprocessor\t: 2\nphysical id\t: 1\ncore id\t\t: 0\n\n\
processor\t: 3\nphysical id\t: 1\ncore id\t\t: 1\n";

/// A node with DMI, 2 sockets, 64 GiB, a physical NIC plus loopback, an NVMe disk, a SATA disk and a loop device.
fn fake_root(root: &Path) -> Result<()> {
    for (k, v) in [
        ("sys_vendor", "Supermicro"),
        ("product_name", "SYS-821GE"),
        ("product_uuid", "4c4c4544-0000-1111-2222-333344445555"),
        ("product_serial", "S123"),
        ("board_serial", "B456"),
        ("bios_version", "2.1"),
    ] {
        write(root, &format!("sys/class/dmi/id/{k}"), &format!("{v}\n"))?;
    }
    write(root, "proc/cpuinfo", CPUINFO)?;
    write(
        root,
        "proc/meminfo",
        "MemTotal:       67108864 kB\nMemFree:  1234 kB\nSwapTotal: 0 kB\n",
    )?;

    let pci = root.join("sys/devices/pci0000:00/0000:17:00.0");
    std::fs::create_dir_all(&pci)?;
    std::fs::create_dir_all(root.join("sys/bus/pci/drivers/mlx5_core"))?;
    symlink(
        root.join("sys/bus/pci/drivers/mlx5_core"),
        pci.join("driver"),
    )?;
    for (k, v) in [
        ("address", "b8:3f:d2:00:00:01"),
        ("mtu", "9000"),
        ("operstate", "up"),
        ("speed", "400000"),
    ] {
        write(
            root,
            &format!("sys/class/net/ens1f0/{k}"),
            &format!("{v}\n"),
        )?;
    }
    symlink(&pci, root.join("sys/class/net/ens1f0/device"))?;
    write(root, "sys/class/net/lo/address", "00:00:00:00:00:00\n")?;

    write(root, "sys/block/nvme0n1/size", "7501476528\n")?;
    write(root, "sys/block/nvme0n1/queue/rotational", "0\n")?;
    write(root, "sys/block/nvme0n1/removable", "0\n")?;
    write(
        root,
        "sys/block/nvme0n1/device/model",
        "SAMSUNG MZQL27T6HBLA-00A07   \n",
    )?;
    write(root, "sys/block/nvme0n1/device/serial", "S6CKNT0W000001\n")?;
    write(root, "sys/block/sda/size", "3907029168\n")?;
    write(root, "sys/block/sda/queue/rotational", "1\n")?;
    write(root, "sys/block/sda/device/model", "ST2000NM000A\n")?;
    std::fs::write(
        root.join("sys/block/sda/device/vpd_pg80"),
        b"\x00\x80\x00\x08ZFN0ABCD",
    )?;
    write(root, "sys/block/loop0/size", "0\n")?;
    Ok(())
}

fn payload(sections: &[Section], name: &str) -> Result<Value> {
    let s = sections
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| anyhow::anyhow!("no {name} section"))?;
    assert_eq!(s.hash, bc_proto::sha256(&s.payload), "{name} hash");
    Ok(serde_json::from_slice(&s.payload)?)
}

#[test]
fn fake_root_yields_every_section() -> Result<()> {
    let dir = tempfile::tempdir()?;
    fake_root(dir.path())?;
    let fx = dir.path().join("gpus.json");
    std::fs::write(&fx, fixture::synthetic(8, "inv"))?;
    let backend = FixtureBackend::load(&fx)?;
    let sections = inventory::collect(dir.path(), Some(&backend));
    let names: Vec<&str> = sections.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        vec!["system", "cpu", "memory", "gpus", "nics", "disks"]
    );

    let system = payload(&sections, "system")?;
    assert_eq!(system["vendor"], "Supermicro");
    assert_eq!(
        system["product_uuid"],
        "4c4c4544-0000-1111-2222-333344445555"
    );
    assert_eq!(system["chassis_serial"], Value::Null);

    let cpu = payload(&sections, "cpu")?;
    assert_eq!(cpu["model"], "AMD EPYC 9654 96-Core Processor");
    assert_eq!(
        (
            cpu["sockets"].as_u64(),
            cpu["cores"].as_u64(),
            cpu["threads"].as_u64()
        ),
        (Some(2), Some(3), Some(4))
    );
    assert_eq!(
        cpu["flags"],
        serde_json::json!(["avx", "avx2", "avx512f", "sha_ni", "svm"])
    );

    let memory = payload(&sections, "memory")?;
    assert_eq!(memory["total_bytes"].as_u64(), Some(64 << 30));

    let gpus = payload(&sections, "gpus")?;
    assert_eq!(gpus["backend"], "fixture");
    assert_eq!(gpus["gpus"].as_array().map(Vec::len), Some(8));

    let nics = payload(&sections, "nics")?;
    assert_eq!(
        nics["nics"],
        serde_json::json!([{
            "name": "ens1f0", "mac": "b8:3f:d2:00:00:01", "driver": "mlx5_core", "pci_address": "0000:17:00.0",
            "speed_mbps": 400000, "link": "up", "mtu": 9000
        }])
    );

    let disks = payload(&sections, "disks")?;
    assert_eq!(
        disks["disks"],
        serde_json::json!([
            {"name": "nvme0n1", "size_bytes": 7501476528u64 * 512, "model": "SAMSUNG MZQL27T6HBLA-00A07",
             "serial": "S6CKNT0W000001", "rotational": false, "nvme": true, "removable": false},
            {"name": "sda", "size_bytes": 3907029168u64 * 512, "model": "ST2000NM000A",
             "serial": "ZFN0ABCD", "rotational": true, "nvme": false, "removable": false}
        ])
    );
    Ok(())
}

#[test]
fn only_changed_sections_are_resent() -> Result<()> {
    let dir = tempfile::tempdir()?;
    fake_root(dir.path())?;
    let first = inventory::collect(dir.path(), None);
    let known: HashMap<String, [u8; 32]> = first.iter().map(|s| (s.name.clone(), s.hash)).collect();

    // Nothing changed: nothing to send, even though free memory moved.
    write(
        dir.path(),
        "proc/meminfo",
        "MemTotal:       67108864 kB\nMemFree:  999 kB\nSwapTotal: 0 kB\n",
    )?;
    let again = inventory::collect(dir.path(), None);
    assert!(inventory::changed(&again, &known).is_empty());

    // A link goes down: only nics changes.
    write(dir.path(), "sys/class/net/ens1f0/operstate", "down\n")?;
    let after = inventory::collect(dir.path(), None);
    let changed: Vec<&str> = inventory::changed(&after, &known)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(changed, vec!["nics"]);
    Ok(())
}

#[test]
fn named_sections_and_missing_root() -> Result<()> {
    let dir = tempfile::tempdir()?;
    fake_root(dir.path())?;
    let some = inventory::collect_sections(
        dir.path(),
        None,
        &["disks".into(), "cpu".into(), "bogus".into()],
    );
    let names: Vec<&str> = some.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["cpu", "disks"]);
    assert_eq!(inventory::collect_sections(dir.path(), None, &[]).len(), 6);

    // An empty root still yields every section, each with a note saying what was missing.
    let empty = tempfile::tempdir()?;
    let sections = inventory::collect(empty.path(), None);
    assert_eq!(sections.len(), 6);
    for name in ["system", "cpu", "memory", "nics", "disks"] {
        let p = payload(&sections, name)?;
        assert!(
            p["notes"].as_array().is_some_and(|n| !n.is_empty()),
            "{name}: {p}"
        );
    }
    Ok(())
}

#[test]
fn this_machine_has_cpu_and_memory() -> Result<()> {
    let sections = inventory::collect(Path::new("/"), None);
    let cpu = payload(&sections, "cpu")?;
    assert!(cpu["threads"].as_u64().is_some_and(|n| n > 0), "{cpu}");
    assert!(cpu["cores"].as_u64().is_some_and(|n| n > 0), "{cpu}");
    let memory = payload(&sections, "memory")?;
    assert!(
        memory["total_bytes"].as_u64().is_some_and(|n| n > 0),
        "{memory}"
    );
    // The other sections exist and parse, whatever this machine has.
    for name in ["system", "gpus", "nics", "disks"] {
        payload(&sections, name)?;
    }
    println!(
        "this machine: {} threads, {} MiB; {} NICs, {} disks",
        cpu["threads"],
        memory["total_bytes"].as_u64().unwrap_or(0) >> 20,
        payload(&sections, "nics")?["nics"]
            .as_array()
            .map_or(0, Vec::len),
        payload(&sections, "disks")?["disks"]
            .as_array()
            .map_or(0, Vec::len)
    );
    Ok(())
}
