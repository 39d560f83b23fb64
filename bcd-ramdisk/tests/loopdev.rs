//! Real block devices: loop devices over sparse files in a temp dir. Each test skips with a printed reason when it
//! cannot attach a loop device (not root, no loop driver, no losetup); the device is always detached by a guard.

use std::path::PathBuf;
use std::process::Command;

use bcd_ramdisk::os::{AlignedBuf, DirectDevice};
use bcd_ramdisk::stream::{
    BlockSink, DigestAlgo, DigestOver, ExpectedDigest, StreamSpec, digest_of, write_image,
};
use bcd_ramdisk::wipe::{
    AttemptResult, WipeMethod, WipeOutcome, WipePolicy, execute, plan, plan_with, probe_sysfs,
};

mod loopback;
use loopback::{Loop, SIZE};

macro_rules! attach_or_skip {
    ($fill:expr) => {
        match Loop::attach($fill) {
            Ok(l) => l,
            Err(why) => bc_testkit::skip!("{why}"),
        }
    };
}

/// Pseudo-random bytes, none of them zero.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = vec![0u8; len.div_ceil(8) * 8];
    for word in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&(x | 0x0101_0101_0101_0101).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn read_all(dev: &mut DirectDevice, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let mut buf = AlignedBuf::new(1 << 20);
    let mut at = 0;
    while at < len {
        let n = dev.read_at(buf.as_mut_slice(), at).expect("O_DIRECT read");
        assert!(n > 0, "device ended early");
        out.extend_from_slice(&buf.as_slice()[..n]);
        at += n as u64;
    }
    out.truncate(len as usize);
    out
}

fn wipe_with(method: WipeMethod) {
    let data = noise(SIZE as usize, 7);
    let lo = attach_or_skip!(Some(&data));
    let caps = probe_sysfs(
        &lo.sysfs(),
        &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
    )
    .expect("probe loop device");
    assert_eq!(caps.size_bytes, SIZE);
    let policy = WipePolicy {
        allowed: vec![method],
        verify_samples: 32,
        sample_len: 4096,
    };
    let p = plan_with(&caps, &policy);
    assert_eq!(
        p.steps.iter().map(|s| s.method).collect::<Vec<_>>(),
        vec![method],
        "{:?}",
        p.skipped
    );
    let mut dev = DirectDevice::open(&lo.dev).expect("open loop device O_DIRECT|O_EXCL");
    let ev = execute(&mut dev, &p, 0xfeed);
    assert_eq!(ev.outcome, WipeOutcome::Wiped { method }, "{ev:#?}");
    assert!(ev.metadata_verified);
    assert!(ev.samples.len() >= 30 && ev.samples.iter().all(|s| s.ok));
    let content = read_all(&mut dev, SIZE);
    assert!(
        content.iter().all(|&b| b == 0),
        "{method:?} left data on the device"
    );
}

#[test]
fn wipe_by_discard() {
    wipe_with(WipeMethod::Discard);
}

#[test]
fn wipe_by_zeroout() {
    wipe_with(WipeMethod::ZeroOut);
}

#[test]
fn wipe_by_overwrite() {
    wipe_with(WipeMethod::Overwrite);
}

#[test]
fn default_plan_on_loop_learns_secure_discard_is_unsupported() {
    let data = noise(4 << 20, 3);
    let lo = attach_or_skip!(Some(&data));
    let caps = probe_sysfs(&lo.sysfs(), "").expect("probe");
    let p = plan(&caps);
    let mut dev = DirectDevice::open(&lo.dev).expect("open");
    let ev = execute(&mut dev, &p, 1);
    assert_eq!(
        ev.attempts.first().map(|a| a.method),
        Some(WipeMethod::SecureDiscard)
    );
    assert!(
        matches!(ev.attempts[0].result, AttemptResult::Unsupported(_)),
        "{:?}",
        ev.attempts[0]
    );
    assert!(ev.is_wiped(), "{ev:#?}");
    assert!(
        ev.skipped
            .iter()
            .any(|s| s.method == WipeMethod::NvmeSanitizeCrypto)
    );
}

#[test]
fn exclusive_open_refuses_a_second_opener() {
    let lo = attach_or_skip!(None);
    let _first = DirectDevice::open(&lo.dev).expect("first open");
    let second = DirectDevice::open(&lo.dev);
    assert!(second.is_err(), "O_EXCL must refuse a claimed device");
}

#[test]
fn stream_zstd_image_to_loop_with_o_direct_and_read_back() {
    let lo = attach_or_skip!(Some(&noise(SIZE as usize, 11)));
    // 20 MiB + an unaligned tail: half zeros, half noise.
    let len = (20 << 20) + 1234;
    let mut raw = vec![0u8; len / 2];
    raw.extend(noise(len - len / 2, 5));
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    let mut spec = StreamSpec::new(ExpectedDigest {
        algo: DigestAlgo::Sha512,
        over: DigestOver::Decompressed,
        value: digest_of(DigestAlgo::Sha512, &raw),
    });
    spec.image_size = Some(len as u64);
    let mut dev = DirectDevice::open(&lo.dev).expect("open");
    assert_eq!(dev.alignment(), 512);
    let report =
        write_image(&compressed[..], &mut dev, &spec, &mut |_| {}).expect("stream to loop device");
    assert!(report.read_back_verified);
    assert_eq!(report.written_bytes, (len as u64).div_ceil(512) * 512);
    let on_disk = read_all(&mut dev, len as u64);
    assert!(on_disk == raw, "device content differs from the image");
}

#[test]
fn corrupted_image_leaves_the_device_zeroed() {
    let lo = attach_or_skip!(Some(&noise(SIZE as usize, 13)));
    let raw = noise(5 << 20, 17);
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    let mut spec = StreamSpec::new(ExpectedDigest {
        algo: DigestAlgo::Sha256,
        over: DigestOver::Compressed,
        value: digest_of(DigestAlgo::Sha256, &compressed),
    });
    spec.digest.value[5] ^= 0x40;
    let mut dev = DirectDevice::open(&lo.dev).expect("open");
    let failure =
        write_image(&compressed[..], &mut dev, &spec, &mut |_| {}).expect_err("digest mismatch");
    assert!(
        matches!(failure.scrub, bcd_ramdisk::stream::Scrub::Zeroed { bytes } if bytes == 5 << 20),
        "{failure}"
    );
    let on_disk = read_all(&mut dev, 5 << 20);
    assert!(
        on_disk.iter().all(|&b| b == 0),
        "half-written image left behind"
    );
}

#[test]
fn nvme_identify_on_a_loop_device_fails_cleanly() {
    let lo = attach_or_skip!(None);
    let dev = DirectDevice::open(&lo.dev).expect("open");
    let err = dev
        .nvme_identify_controller()
        .expect_err("a loop device is not NVMe");
    assert!(
        matches!(err.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)),
        "{err}"
    );
}

/// Unmounts on drop.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn mounted_device_is_refused_and_reported_failed() {
    let lo = attach_or_skip!(None);
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&lo.dev)
        .status();
    if !matches!(mkfs, Ok(s) if s.success()) {
        bc_testkit::skip!("mkfs.ext4 unavailable ({mkfs:?})");
    }
    let mnt = tempfile::tempdir().expect("mount point");
    let mounted = Command::new("mount").arg(&lo.dev).arg(mnt.path()).status();
    if !matches!(mounted, Ok(s) if s.success()) {
        bc_testkit::skip!("mount failed ({mounted:?})");
    }
    let _guard = Mounted(mnt.path().to_path_buf());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let caps = probe_sysfs(&lo.sysfs(), &mountinfo).expect("probe");
    assert!(
        caps.in_use
            .as_deref()
            .is_some_and(|w| w.contains("mounted")),
        "{caps:?}"
    );
    let p = plan(&caps);
    assert!(p.refused.is_some() && p.steps.is_empty());
    // The kernel refuses the exclusive open too, so nothing can write to it by accident.
    assert!(
        DirectDevice::open(&lo.dev).is_err(),
        "O_EXCL open of a mounted device must fail"
    );
    let mut head = [0u8; 4096];
    std::io::Read::read_exact(
        &mut std::fs::File::open(&lo.dev).expect("open for reading"),
        &mut head,
    )
    .expect("read superblock");
    assert_eq!(
        head[0x438..0x43a],
        [0x53, 0xef],
        "ext4 superblock untouched"
    );
}

#[test]
fn probe_device_reads_the_real_sysfs() {
    let lo = attach_or_skip!(None);
    let name = lo
        .dev
        .file_name()
        .and_then(|n| n.to_str())
        .expect("loopN")
        .to_string();
    let caps = bcd_ramdisk::wipe::probe_device(&name).expect("probe");
    assert_eq!(caps.name, name);
    assert_eq!(caps.size_bytes, SIZE);
    assert_eq!(caps.logical_block_size, 512);
    assert!(caps.nvme.is_none());
    assert!(caps.discard_max_bytes > 0, "loop devices support discard");
    assert_eq!(caps.in_use, None);
}
