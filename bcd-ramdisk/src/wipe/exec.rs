//! The wipe executor: runs a [`WipePlan`] on a [`BlockDevice`] and records evidence.

use std::io;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{
    BlockDevice, Expectation, FormatSes, SanitizeAction, Skipped, WipeMethod, WipePlan,
    sample_offsets,
};
use crate::os::{AlignedBuf, RangeOp};

/// How one planned method fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttemptResult {
    /// The device or kernel does not support it here (learned by trying).
    Unsupported(String),
    /// It ran and failed.
    Failed(String),
    /// It ran, but sampled blocks do not look erased.
    NotVerified { bad_samples: Vec<u64> },
    /// It ran and every sample verified.
    Verified,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    pub method: WipeMethod,
    pub result: AttemptResult,
    pub elapsed: Duration,
}

/// One verification sample after the winning method.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SampleCheck {
    pub offset: u64,
    pub expect: Expectation,
    pub ok: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WipeOutcome {
    /// Data erased by `method` and verified; metadata areas zeroed and verified.
    Wiped { method: WipeMethod },
    /// Not wiped; the reason says what went wrong. Never reported as wiped.
    Failed { reason: String },
}

/// Per-device evidence: what was tried, why other methods were skipped, and what the samples showed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WipeEvidence {
    pub device: String,
    pub outcome: WipeOutcome,
    pub attempts: Vec<Attempt>,
    pub skipped: Vec<Skipped>,
    /// Seed of the sample positions (recorded so the check can be repeated).
    pub sample_seed: u64,
    pub samples: Vec<SampleCheck>,
    pub metadata_verified: bool,
    pub elapsed: Duration,
}

impl WipeEvidence {
    pub fn is_wiped(&self) -> bool {
        matches!(self.outcome, WipeOutcome::Wiped { .. })
    }
}

/// Run `plan` on `dev`. Sample positions come from `seed` (draw it at random in production, record it in the
/// evidence). Each method must run and then pass sampled read-back before it counts; then the metadata areas are
/// zeroed and read back in full.
pub fn execute<D: BlockDevice>(dev: &mut D, plan: &WipePlan, seed: u64) -> WipeEvidence {
    let start = Instant::now();
    let mut ev = WipeEvidence {
        device: plan.device.clone(),
        outcome: WipeOutcome::Failed {
            reason: String::new(),
        },
        attempts: Vec::new(),
        skipped: plan.skipped.clone(),
        sample_seed: seed,
        samples: Vec::new(),
        metadata_verified: false,
        elapsed: Duration::ZERO,
    };
    ev.outcome = match run(dev, plan, seed, &mut ev) {
        Ok(method) => WipeOutcome::Wiped { method },
        Err(reason) => WipeOutcome::Failed { reason },
    };
    ev.elapsed = start.elapsed();
    match &ev.outcome {
        WipeOutcome::Wiped { method } => {
            info!(device = %ev.device, ?method, elapsed = ?ev.elapsed, "device wiped and verified")
        }
        WipeOutcome::Failed { reason } => warn!(device = %ev.device, %reason, "device NOT wiped"),
    }
    ev
}

fn run<D: BlockDevice>(
    dev: &mut D,
    plan: &WipePlan,
    seed: u64,
    ev: &mut WipeEvidence,
) -> Result<WipeMethod, String> {
    if let Some(why) = &plan.refused {
        return Err(format!("refused: {why}"));
    }
    if dev.size() != plan.size_bytes || dev.logical_block_size() != plan.logical_block_size {
        return Err(format!(
            "device changed since it was probed: {} bytes / {} B blocks, plan says {} / {}",
            dev.size(),
            dev.logical_block_size(),
            plan.size_bytes,
            plan.logical_block_size
        ));
    }
    let offsets = sample_offsets(plan.size_bytes, plan.sample_len, plan.verify_samples, seed);
    let len = plan.sample_len as usize;
    let before = read_samples(dev, &offsets, len)
        .map_err(|e| format!("reading samples before the wipe: {e}"))?;

    let mut winner = None;
    for step in &plan.steps {
        let t = Instant::now();
        let result = match apply(dev, step.method, plan.size_bytes).and_then(|()| dev.sync()) {
            Err(e) if is_unsupported(&e) => AttemptResult::Unsupported(e.to_string()),
            Err(e) => AttemptResult::Failed(e.to_string()),
            Ok(()) => match read_samples(dev, &offsets, len) {
                Err(e) => AttemptResult::Failed(format!("reading samples back: {e}")),
                Ok(after) => {
                    let checks = check(&offsets, &before, &after, step.expect);
                    let bad: Vec<u64> = checks.iter().filter(|c| !c.ok).map(|c| c.offset).collect();
                    if bad.is_empty() {
                        ev.samples = checks;
                        AttemptResult::Verified
                    } else {
                        AttemptResult::NotVerified { bad_samples: bad }
                    }
                }
            },
        };
        info!(device = %plan.device, method = ?step.method, ?result, "wipe attempt");
        let verified = result == AttemptResult::Verified;
        ev.attempts.push(Attempt {
            method: step.method,
            result,
            elapsed: t.elapsed(),
        });
        if verified {
            winner = Some(step.method);
            break;
        }
    }
    let method =
        winner.ok_or_else(|| "no method erased the device and passed verification".to_string())?;

    for area in &plan.metadata {
        zero(dev, area.offset, area.len)
            .map_err(|e| format!("zeroing {} at {}: {e}", area.what, area.offset))?;
    }
    dev.sync()
        .map_err(|e| format!("flushing after the metadata wipe: {e}"))?;
    for area in &plan.metadata {
        verify_zero(dev, area.offset, area.len).map_err(|e| {
            format!(
                "metadata area {} at {} not verified: {e}",
                area.what, area.offset
            )
        })?;
    }
    ev.metadata_verified = true;
    Ok(method)
}

fn apply<D: BlockDevice>(dev: &mut D, method: WipeMethod, size: u64) -> io::Result<()> {
    match method {
        WipeMethod::NvmeSanitizeCrypto => dev.nvme_sanitize(SanitizeAction::CryptoErase),
        WipeMethod::NvmeSanitizeBlock => dev.nvme_sanitize(SanitizeAction::BlockErase),
        WipeMethod::NvmeFormatCrypto => dev.nvme_format(FormatSes::CryptoErase),
        WipeMethod::NvmeFormatUserData => dev.nvme_format(FormatSes::UserDataErase),
        WipeMethod::SecureDiscard => dev.range_op(RangeOp::SecureDiscard, 0, size),
        WipeMethod::Discard => dev.range_op(RangeOp::Discard, 0, size),
        WipeMethod::ZeroOut => dev.range_op(RangeOp::ZeroOut, 0, size),
        WipeMethod::Overwrite => overwrite(dev, 0, size),
    }
}

fn is_unsupported(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Unsupported
        || matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP | libc::ENOTTY | libc::ENOSYS)
        )
}

const CHUNK: u64 = 4 << 20;

fn overwrite<D: BlockDevice>(dev: &mut D, offset: u64, len: u64) -> io::Result<()> {
    let zeros = AlignedBuf::new(CHUNK as usize);
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let n = (end - at).min(CHUNK);
        dev.write_all_at(&zeros.as_slice()[..n as usize], at)?;
        at += n;
    }
    Ok(())
}

/// Zero a metadata area: `BLKZEROOUT`, else written zeros.
fn zero<D: BlockDevice>(dev: &mut D, offset: u64, len: u64) -> io::Result<()> {
    match dev.range_op(RangeOp::ZeroOut, offset, len) {
        Ok(()) => Ok(()),
        Err(_) => overwrite(dev, offset, len),
    }
}

fn verify_zero<D: BlockDevice>(dev: &mut D, offset: u64, len: u64) -> io::Result<()> {
    let mut buf = AlignedBuf::new(CHUNK.min(len) as usize);
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(buf.len() as u64) as usize;
        let chunk = &mut buf.as_mut_slice()[..n];
        dev.read_exact_at(chunk, at)?;
        if let Some(i) = chunk.iter().position(|&b| b != 0) {
            return Err(io::Error::other(format!(
                "non-zero byte at {}",
                at + i as u64
            )));
        }
        at += n as u64;
    }
    Ok(())
}

fn read_samples<D: BlockDevice>(
    dev: &mut D,
    offsets: &[u64],
    len: usize,
) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = AlignedBuf::new(len);
    offsets
        .iter()
        .map(|&o| {
            dev.read_exact_at(&mut buf.as_mut_slice()[..len], o)?;
            Ok(buf.as_slice()[..len].to_vec())
        })
        .collect()
}

fn check(
    offsets: &[u64],
    before: &[Vec<u8>],
    after: &[Vec<u8>],
    expect: Expectation,
) -> Vec<SampleCheck> {
    offsets
        .iter()
        .zip(before.iter().zip(after))
        .map(|(&offset, (b, a))| {
            let ok = match expect {
                Expectation::Zeroes => a.iter().all(|&x| x == 0),
                // A block that was all zeros cannot show a change; one that held data must not hold it still.
                Expectation::Changed => b.iter().all(|&x| x == 0) || a != b,
            };
            SampleCheck { offset, expect, ok }
        })
        .collect()
}

#[cfg(test)]
#[path = "exec_tests.rs"]
mod tests;
