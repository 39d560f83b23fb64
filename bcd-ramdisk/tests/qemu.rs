//! The ramdisk in QEMU (TCG unless BC_QEMU_ACCEL=kvm): the real kernel, initramfs and static binary built by
//! images/build-ramdisk and images/build-lab-os, booted with a virtio disk and an emulated NVMe disk.
//!
//! - diagnose finds both disks (NVMe Identify and SMART through the admin passthrough);
//! - wipe picks the method per device (NVMe Format NVM on the NVMe disk, discard or write-zeroes on virtio) and the
//!   host then reads both disk files back as all zeros;
//! - stream gets an address from dnsmasq with the ramdisk's own DHCP client, writes the lab OS image from an HTTP
//!   server in a network namespace, writes the NoCloud seed and kexecs into the installed kernel, whose /init
//!   prints a marker and the seed;
//! - a corrupted image fails with the digest error and the disk is left zeroed.
//!
//! Each test prints `SKIP: …` and returns when QEMU or the images are absent (or, for the network tests, when not
//! root). Guests run one at a time.

#[path = "qemu/lab.rs"]
mod lab;

use std::time::Duration;

use bc_testkit::skip;
use lab::{Disk, Netns, SERIAL, boot, images, nonzero_offsets, patterned_disk};

const DISK: u64 = 64 << 20;

#[test]
fn diagnose_and_wipe_nvme_and_virtio() {
    let images = match images(false) {
        Ok(i) => i,
        Err(why) => skip!("{why}"),
    };
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let work = tempfile::tempdir().expect("tempdir");
    let vda = work.path().join("vda.img");
    let nvme = work.path().join("nvme.img");
    patterned_disk(&vda, DISK).expect("vda");
    patterned_disk(&nvme, DISK).expect("nvme");
    let run = boot(
        &images,
        work.path(),
        "bc.action=diagnose,wipe bc.disks=all",
        &[
            Disk {
                path: &vda,
                kind: "virtio",
                serial: "bc-vd-1",
            },
            Disk {
                path: &nvme,
                kind: "nvme",
                serial: "bcnvme01",
            },
        ],
        None,
        Duration::from_secs(120),
    );
    println!("qemu run: {:?}", run.elapsed);
    assert!(run.has_line("bc-done"), "{}", run.dump());
    assert!(
        run.status.is_some_and(|s| s.success()) && !run.timed_out,
        "{}",
        run.dump()
    );

    // Only the drivers of present devices are loaded: virtio and NVMe here, never the Mellanox or Intel NIC drivers.
    let modules = run.report("modules").expect("modules report");
    let has = |list: &str, m: &str| {
        modules[list]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == m))
    };
    for m in ["virtio_pci", "virtio_blk", "nvme", "ext4"] {
        assert!(has("loaded", m), "{m} not loaded: {modules}");
    }
    for m in ["mlx5_core", "ice", "e1000e", "bnxt_en"] {
        assert!(has("not_needed", m), "{m} should not be loaded: {modules}");
    }

    let diag = run.report("diagnose").expect("diagnose report");
    let disks = diag["disks"].as_array().expect("disks");
    let by_name = |n: &str| {
        disks
            .iter()
            .find(|d| d["name"] == n)
            .unwrap_or_else(|| panic!("{n} missing from {disks:?}"))
    };
    let nv = by_name("nvme0n1");
    assert_eq!(nv["transport"], "nvme");
    assert_eq!(nv["size_bytes"], DISK);
    assert_eq!(
        nv["nvme"]["serial"], "bcnvme01",
        "Identify Controller: {nv}"
    );
    assert_eq!(nv["nvme"]["format_supported"], true);
    assert_eq!(nv["smart"]["healthy"], true, "SMART log: {nv}");
    let vd = by_name("vda");
    assert_eq!(vd["transport"], "virtio");
    assert_eq!(vd["serial"], "bc-vd-1");
    assert_eq!(vd["size_bytes"], DISK);
    if let Some((ms, uptime)) = run.phase("diagnose") {
        println!("diagnose report at {ms} ms after PID 1 started, kernel uptime {uptime} s");
    }

    let wipe = run.report("wipe").expect("wipe report");
    let views = wipe.as_array().expect("wipe views");
    let method = |n: &str| {
        let v = views
            .iter()
            .find(|v| v["device"] == n)
            .unwrap_or_else(|| panic!("{n} missing from {views:?}"));
        assert_eq!(v["wiped"], true, "{v}");
        assert_eq!(v["metadata_verified"], true, "{v}");
        v["method"].as_str().unwrap_or_default().to_string()
    };
    let nvme_method = method("nvme0n1");
    let vda_method = method("vda");
    println!("wipe methods: nvme0n1 {nvme_method}, vda {vda_method}");
    assert!(
        nvme_method.starts_with("NvmeFormat") || nvme_method.starts_with("NvmeSanitize"),
        "an NVMe disk that supports Format NVM must be erased by the controller, got {nvme_method}"
    );
    assert!(
        matches!(vda_method.as_str(), "Discard" | "ZeroOut"),
        "virtio-blk supports discard/write-zeroes, got {vda_method}"
    );
    // The host's view of the disks: nothing of the pattern is left.
    for disk in [&vda, &nvme] {
        let left = nonzero_offsets(disk).expect("read back");
        assert!(
            left.is_empty(),
            "{} still has data at {left:?}",
            disk.display()
        );
    }
}

fn lab_os_digest(images: &lab::Images) -> String {
    std::fs::read_to_string(images.dir.join("lab-os.img.zst.sha256"))
        .expect("lab-os.img.zst.sha256")
        .trim()
        .to_string()
}

#[test]
fn stream_seed_and_kexec_into_the_installed_os() {
    let images = match images(true) {
        Ok(i) => i,
        Err(why) => skip!("{why}"),
    };
    if !lab::is_root() {
        skip!("needs root for the network namespace");
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = Netns::create(&images.dir).expect("network namespace");
    let work = tempfile::tempdir().expect("tempdir");
    let vda = work.path().join("vda.img");
    patterned_disk(&vda, DISK).expect("vda");
    let sha = lab_os_digest(&images);
    let run = boot(
        &images,
        work.path(),
        &format!(
            "bc.action=wipe,stream,kexec bc.disks=vda bc.target=vda bc.boot_token=bt_lab_0001 \
             bc.image=http://{}:8080/lab-os.img.zst bc.image_sha256={sha}",
            lab::SERVER_IP
        ),
        &[Disk {
            path: &vda,
            kind: "virtio",
            serial: "bc-vd-1",
        }],
        Some(&ns),
        Duration::from_secs(150),
    );
    println!("qemu run: {:?}", run.elapsed);
    let dhcp = run
        .report("dhcp")
        .unwrap_or_else(|| panic!("no DHCP lease\n{}", run.dump()));
    assert!(
        dhcp["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.99.0.")),
        "{dhcp}"
    );
    assert_eq!(dhcp["server"], lab::SERVER_IP);
    let stream = run
        .report("stream")
        .unwrap_or_else(|| panic!("no stream report\n{}", run.dump()));
    assert_eq!(stream["read_back_verified"], true, "{stream}");
    assert_eq!(stream["compression"], "Zstd");
    assert_eq!(stream["digest"], sha.as_str());
    assert_eq!(
        stream["image_bytes"],
        std::fs::metadata(images.dir.join("lab-os.img"))
            .expect("lab-os.img")
            .len()
    );
    let deploy = run
        .report("deploy")
        .unwrap_or_else(|| panic!("no deploy report\n{}", run.dump()));
    assert_eq!(deploy["kexec_staged"], true, "{deploy}");
    assert!(run.has_line("BC-LAB-OS booted"), "{}", run.dump());
    // The seed's user-data joins with the token the ramdisk left on the root (0600, never in the seed itself); the
    // lab OS names the token by its digest. Without a control plane here (no bc.url) its `bcd join` fails, and
    // with no node identity it powers off instead of running `bcd run` in vain.
    assert!(
        run.has_line("BC-LAB-OS-SEED user-data: bcd --config /etc/bcd/bcd.toml join --token-file /etc/bcd/join-token"),
        "the installed OS must find the seed's join script\n{}",
        run.dump()
    );
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"bt_lab_0001\n"));
    assert!(
        run.has_line(&format!(
            "BC-LAB-OS: join token on the root (sha256 {})",
            &digest[..16]
        )),
        "the installed OS must find the boot token on its root\n{}",
        run.dump()
    );
    assert!(
        run.has_line(
            "BC-LAB-OS: bcd join failed and this system has no node identity; powering off"
        ),
        "{}",
        run.dump()
    );
    assert!(
        run.has_line("BC-LAB-OS-SEED meta-data: instance-id: bc-525400123456-"),
        "{}",
        run.dump()
    );
    assert!(
        run.status.is_some_and(|s| s.success()) && !run.timed_out,
        "{}",
        run.dump()
    );
}

#[test]
fn a_corrupted_image_fails_and_leaves_the_disk_wiped() {
    let images = match images(true) {
        Ok(i) => i,
        Err(why) => skip!("{why}"),
    };
    if !lab::is_root() {
        skip!("needs root for the network namespace");
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The served file is a valid zstd stream of the lab OS image with one byte flipped in the middle, so only the
    // digest (the real image's) can tell; the stream runs to the end before the mismatch is known.
    let served = tempfile::tempdir().expect("tempdir");
    let mut bytes = std::fs::read(images.dir.join("lab-os.img")).expect("lab os");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    let raw = served.path().join("lab-os.img");
    std::fs::write(&raw, &bytes).expect("write corrupted copy");
    let zstd = std::process::Command::new("zstd")
        .args(["-q", "-3", "--rm"])
        .arg(&raw)
        .status();
    if !zstd.is_ok_and(|s| s.success()) {
        skip!("zstd is not installed");
    }
    let ns = Netns::create(served.path()).expect("network namespace");
    let work = tempfile::tempdir().expect("tempdir");
    let vda = work.path().join("vda.img");
    patterned_disk(&vda, DISK).expect("vda");
    let sha = lab_os_digest(&images);
    let run = boot(
        &images,
        work.path(),
        &format!(
            "bc.action=wipe,stream bc.disks=vda bc.target=vda \
             bc.image=http://{}:8080/lab-os.img.zst bc.image_sha256={sha}",
            lab::SERVER_IP
        ),
        &[Disk {
            path: &vda,
            kind: "virtio",
            serial: "bc-vd-1",
        }],
        Some(&ns),
        Duration::from_secs(120),
    );
    println!("qemu run: {:?}", run.elapsed);
    let fatal = run
        .log
        .lines()
        .find(|l| l.contains("bc-fatal:"))
        .unwrap_or_else(|| panic!("no fatal error\n{}", run.dump()))
        .to_string();
    println!("{fatal}");
    assert!(fatal.contains("sha256 mismatch"), "{fatal}");
    assert!(fatal.contains("bytes zeroed"), "{fatal}");
    assert!(!run.has_line("bc-report stream"), "{}", run.dump());
    assert!(
        run.status.is_some_and(|s| s.success()) && !run.timed_out,
        "the ramdisk powers off after a fatal error\n{}",
        run.dump()
    );
    let left = nonzero_offsets(&vda).expect("read back");
    assert!(
        left.is_empty(),
        "the disk must be left wiped, data at {left:?}"
    );
}
