use std::io;

use super::*;
use crate::os::RangeOp;
use crate::wipe::{
    BlockDevice, DeviceCapabilities, FormatSes, NvmeCapabilities, SanitizeAction, WipeMethod, plan,
};

/// How the fake answers a discard.
#[derive(Clone, Copy, PartialEq)]
enum DiscardBehaviour {
    Zeroes,
    /// Accepts the discard but the data stays readable (non-deterministic TRIM).
    KeepsData,
    Unsupported,
}

struct FakeDisk {
    data: Vec<u8>,
    lbs: u32,
    discard: DiscardBehaviour,
    sanitize: Option<io::ErrorKind>,
    fail_reads: bool,
    ops: Vec<String>,
}

impl FakeDisk {
    fn new(size: usize) -> Self {
        let data = (0..size).map(|i| (i % 251) as u8 | 1).collect();
        Self {
            data,
            lbs: 512,
            discard: DiscardBehaviour::Zeroes,
            sanitize: None,
            fail_reads: false,
            ops: Vec::new(),
        }
    }

    fn caps(&self) -> DeviceCapabilities {
        DeviceCapabilities {
            name: "fake".into(),
            size_bytes: self.data.len() as u64,
            logical_block_size: self.lbs,
            read_only: false,
            in_use: None,
            rotational: false,
            nvme: None,
            discard_max_bytes: 1 << 30,
            write_zeroes_max_bytes: 0,
            secure_discard: None,
        }
    }
}

impl BlockDevice for FakeDisk {
    fn name(&self) -> String {
        "fake".into()
    }
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn logical_block_size(&self) -> u32 {
        self.lbs
    }
    fn read_exact_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.fail_reads {
            return Err(io::Error::other("medium error"));
        }
        buf.copy_from_slice(&self.data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.data[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn range_op(&mut self, op: RangeOp, offset: u64, len: u64) -> io::Result<()> {
        self.ops.push(format!("{op:?}"));
        let range = offset as usize..(offset + len) as usize;
        match (op, self.discard) {
            (RangeOp::SecureDiscard, _) => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
            (RangeOp::Discard, DiscardBehaviour::Unsupported) => {
                Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
            }
            (RangeOp::Discard, DiscardBehaviour::KeepsData) => Ok(()),
            (RangeOp::Discard | RangeOp::ZeroOut, _) => {
                self.data[range].fill(0);
                Ok(())
            }
        }
    }
    fn nvme_sanitize(&mut self, action: SanitizeAction) -> io::Result<()> {
        self.ops.push(format!("{action:?}"));
        if let Some(kind) = self.sanitize {
            return Err(io::Error::new(kind, "sanitize failed"));
        }
        // A crypto erase leaves noise behind.
        for (i, b) in self.data.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(11) ^ 0x5a;
        }
        Ok(())
    }
    fn nvme_format(&mut self, ses: FormatSes) -> io::Result<()> {
        self.ops.push(format!("{ses:?}"));
        self.data.fill(0);
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
}

const SIZE: usize = 8 << 20;

#[test]
fn loop_like_device_ends_with_discard_after_secure_discard_is_unsupported() {
    let mut dev = FakeDisk::new(SIZE);
    let p = plan(&dev.caps());
    let ev = execute(&mut dev, &p, 7);
    assert_eq!(
        ev.outcome,
        WipeOutcome::Wiped {
            method: WipeMethod::Discard
        }
    );
    assert!(matches!(
        ev.attempts[0].result,
        AttemptResult::Unsupported(_)
    ));
    assert_eq!(ev.attempts[1].result, AttemptResult::Verified);
    assert!(ev.metadata_verified);
    assert!(ev.samples.iter().all(|s| s.ok) && ev.samples.len() > 10);
    assert!(dev.data.iter().all(|&b| b == 0));
}

#[test]
fn discard_that_keeps_data_is_not_trusted() {
    let mut dev = FakeDisk::new(SIZE);
    dev.discard = DiscardBehaviour::KeepsData;
    let p = plan(&dev.caps());
    let ev = execute(&mut dev, &p, 7);
    assert_eq!(
        ev.outcome,
        WipeOutcome::Wiped {
            method: WipeMethod::ZeroOut
        }
    );
    assert!(
        matches!(&ev.attempts[1].result, AttemptResult::NotVerified { bad_samples } if !bad_samples.is_empty())
    );
    assert!(dev.data.iter().all(|&b| b == 0));
}

#[test]
fn nvme_sanitize_crypto_verified_by_change_then_metadata_zeroed() {
    let mut dev = FakeDisk::new(SIZE);
    let caps = DeviceCapabilities {
        nvme: Some(NvmeCapabilities {
            identified: true,
            sanitize_crypto: true,
            ..Default::default()
        }),
        ..dev.caps()
    };
    let ev = execute(&mut dev, &plan(&caps), 99);
    assert_eq!(
        ev.outcome,
        WipeOutcome::Wiped {
            method: WipeMethod::NvmeSanitizeCrypto
        }
    );
    assert_eq!(
        dev.ops,
        vec!["CryptoErase", "ZeroOut", "ZeroOut"],
        "sanitize, then the two metadata areas"
    );
    assert!(
        dev.data[..1 << 20].iter().all(|&b| b == 0),
        "GPT area zeroed"
    );
    assert!(
        dev.data[SIZE - (1 << 20)..].iter().all(|&b| b == 0),
        "backup GPT area zeroed"
    );
    assert!(
        dev.data[(1 << 20)..SIZE - (1 << 20)]
            .iter()
            .any(|&b| b != 0),
        "crypto erase leaves noise"
    );
}

#[test]
fn failed_sanitize_falls_back_and_is_recorded() {
    let mut dev = FakeDisk::new(SIZE);
    dev.sanitize = Some(io::ErrorKind::Other);
    let caps = DeviceCapabilities {
        nvme: Some(NvmeCapabilities {
            identified: true,
            sanitize_crypto: true,
            ..Default::default()
        }),
        ..dev.caps()
    };
    let ev = execute(&mut dev, &plan(&caps), 1);
    assert!(matches!(ev.attempts[0].result, AttemptResult::Failed(_)));
    assert_eq!(
        ev.outcome,
        WipeOutcome::Wiped {
            method: WipeMethod::Discard
        }
    );
}

#[test]
fn unreadable_device_is_failed_never_wiped() {
    let mut dev = FakeDisk::new(SIZE);
    dev.fail_reads = true;
    let p = plan(&dev.caps());
    let ev = execute(&mut dev, &p, 1);
    assert!(!ev.is_wiped());
    assert!(
        matches!(&ev.outcome, WipeOutcome::Failed { reason } if reason.contains("medium error"))
    );
    assert!(
        dev.ops.is_empty(),
        "nothing destructive ran on a device that cannot be verified"
    );
}

#[test]
fn refused_and_changed_devices_fail() {
    let mut dev = FakeDisk::new(SIZE);
    let caps = DeviceCapabilities {
        in_use: Some("mounted".into()),
        ..dev.caps()
    };
    let ev = execute(&mut dev, &plan(&caps), 1);
    assert!(matches!(&ev.outcome, WipeOutcome::Failed { reason } if reason.starts_with("refused")));
    let caps = DeviceCapabilities {
        size_bytes: (SIZE * 2) as u64,
        ..dev.caps()
    };
    let ev = execute(&mut dev, &plan(&caps), 1);
    assert!(
        matches!(&ev.outcome, WipeOutcome::Failed { reason } if reason.contains("changed since"))
    );
    assert!(dev.ops.is_empty());
}

#[test]
fn only_methods_that_verify_count() {
    let mut dev = FakeDisk::new(SIZE);
    dev.discard = DiscardBehaviour::KeepsData;
    let policy = crate::wipe::WipePolicy {
        allowed: vec![WipeMethod::Discard],
        ..Default::default()
    };
    let p = crate::wipe::plan_with(&dev.caps(), &policy);
    let ev = execute(&mut dev, &p, 3);
    assert!(
        !ev.is_wiped(),
        "a discard that leaves data is a failure, not a wipe"
    );
    assert!(!ev.metadata_verified);
}

#[test]
fn discard_unsupported_at_run_time_falls_to_zeroout() {
    let mut dev = FakeDisk::new(SIZE);
    dev.discard = DiscardBehaviour::Unsupported;
    let p = plan(&dev.caps());
    let ev = execute(&mut dev, &p, 5);
    assert_eq!(
        ev.outcome,
        WipeOutcome::Wiped {
            method: WipeMethod::ZeroOut
        }
    );
    assert!(matches!(
        ev.attempts[1].result,
        AttemptResult::Unsupported(_)
    ));
    assert_eq!(ev.attempts.len(), 3);
}
