//! The pure wipe planner and the sample-position function.

#![deny(clippy::disallowed_methods)]

use super::{
    DeviceCapabilities, Expectation, MetadataArea, PlannedStep, Skipped, WipeMethod, WipePlan,
    WipePolicy,
};

const MIB: u64 = 1 << 20;

/// [`plan_with`] under the default policy (every method allowed, 64 samples of 4 KiB).
pub fn plan(caps: &DeviceCapabilities) -> WipePlan {
    plan_with(caps, &WipePolicy::default())
}

/// Decide how to wipe one device: the methods to try in order (strongest first), each skipped method with the
/// reason, the metadata areas and the verification sampling. Pure: no I/O, clock or randomness.
pub fn plan_with(caps: &DeviceCapabilities, policy: &WipePolicy) -> WipePlan {
    let mut plan = WipePlan {
        device: caps.name.clone(),
        size_bytes: caps.size_bytes,
        logical_block_size: caps.logical_block_size,
        refused: refusal(caps, policy),
        steps: Vec::new(),
        skipped: Vec::new(),
        metadata: Vec::new(),
        verify_samples: policy.verify_samples,
        sample_len: policy.sample_len,
    };
    if let Some(why) = &plan.refused {
        plan.skipped = WipeMethod::ALL
            .iter()
            .map(|&method| Skipped {
                method,
                reason: why.clone(),
            })
            .collect();
        return plan;
    }
    for method in WipeMethod::ALL {
        let decision = if policy.allowed.contains(&method) {
            applicable(caps, method)
        } else {
            Err("excluded by policy".to_string())
        };
        match decision {
            Ok((expect, reason)) => plan.steps.push(PlannedStep {
                method,
                expect,
                reason,
            }),
            Err(reason) => plan.skipped.push(Skipped { method, reason }),
        }
    }
    plan.metadata = metadata_areas(caps.size_bytes);
    plan
}

fn refusal(caps: &DeviceCapabilities, policy: &WipePolicy) -> Option<String> {
    let lbs = caps.logical_block_size;
    if caps.read_only {
        Some("device is read-only".into())
    } else if let Some(why) = &caps.in_use {
        Some(format!("device is in use: {why}"))
    } else if !(512..=4096).contains(&lbs) || !lbs.is_power_of_two() {
        Some(format!(
            "logical block size {lbs} is not a power of two in 512..=4096"
        ))
    } else if caps.size_bytes == 0 || !caps.size_bytes.is_multiple_of(u64::from(lbs)) {
        Some(format!(
            "size {} is not a positive multiple of the block size {lbs}",
            caps.size_bytes
        ))
    } else if policy.sample_len == 0 || !policy.sample_len.is_multiple_of(4096) {
        Some(format!(
            "sample length {} is not a multiple of 4096",
            policy.sample_len
        ))
    } else if caps.size_bytes < u64::from(policy.sample_len) {
        Some(format!(
            "device of {} bytes is smaller than one verification sample",
            caps.size_bytes
        ))
    } else {
        None
    }
}

/// Whether `method` applies to the device, with the expectation to verify and the reason; or why not.
fn applicable(
    caps: &DeviceCapabilities,
    method: WipeMethod,
) -> Result<(Expectation, String), String> {
    use WipeMethod::*;
    let nvme = match (method, &caps.nvme) {
        (NvmeSanitizeCrypto | NvmeSanitizeBlock | NvmeFormatCrypto | NvmeFormatUserData, None) => {
            return Err("not an NVMe namespace".into());
        }
        (_, nvme) => nvme.as_ref(),
    };
    match method {
        NvmeSanitizeCrypto => {
            let n = nvme.ok_or("not an NVMe namespace")?;
            if !n.identified {
                Err("NVMe Identify Controller unavailable; sanitize support unknown".into())
            } else if n.sanitize_crypto {
                Ok((
                    Expectation::Changed,
                    "controller supports sanitize crypto erase (SANICAP.CES)".into(),
                ))
            } else {
                Err("controller does not support sanitize crypto erase (SANICAP.CES=0)".into())
            }
        }
        NvmeSanitizeBlock => {
            let n = nvme.ok_or("not an NVMe namespace")?;
            if !n.identified {
                Err("NVMe Identify Controller unavailable; sanitize support unknown".into())
            } else if n.sanitize_block {
                Ok((
                    Expectation::Changed,
                    "controller supports sanitize block erase (SANICAP.BES)".into(),
                ))
            } else {
                Err("controller does not support sanitize block erase (SANICAP.BES=0)".into())
            }
        }
        NvmeFormatCrypto => {
            let n = nvme.ok_or("not an NVMe namespace")?;
            if !n.identified {
                Err("NVMe Identify Controller unavailable; format support unknown".into())
            } else if !n.format_supported {
                Err("controller does not support Format NVM (OACS bit 1 clear)".into())
            } else if n.format_crypto {
                Ok((
                    Expectation::Changed,
                    "Format NVM with SES 2 (FNA bit 2: crypto erase supported)".into(),
                ))
            } else {
                Err(
                    "controller does not support crypto erase in Format NVM (FNA bit 2 clear)"
                        .into(),
                )
            }
        }
        NvmeFormatUserData => {
            let n = nvme.ok_or("not an NVMe namespace")?;
            if !n.identified {
                Err("NVMe Identify Controller unavailable; format support unknown".into())
            } else if n.format_supported {
                Ok((
                    Expectation::Changed,
                    "Format NVM with SES 1 (user data erase)".into(),
                ))
            } else {
                Err("controller does not support Format NVM (OACS bit 1 clear)".into())
            }
        }
        SecureDiscard => {
            if caps.discard_max_bytes == 0 {
                Err("device does not support discard (discard_max_bytes = 0)".into())
            } else if caps.secure_discard == Some(false) {
                Err("device rejected BLKSECDISCARD before".into())
            } else {
                Ok((
                    Expectation::Changed,
                    "device supports discard; BLKSECDISCARD is tried (unadvertised by Linux)"
                        .into(),
                ))
            }
        }
        Discard => {
            if caps.discard_max_bytes == 0 {
                Err("device does not support discard (discard_max_bytes = 0)".into())
            } else {
                Ok((
                    Expectation::Zeroes,
                    "device supports discard; accepted only if sampled blocks read as zeros".into(),
                ))
            }
        }
        ZeroOut => Ok((
            Expectation::Zeroes,
            if caps.write_zeroes_max_bytes > 0 {
                "BLKZEROOUT offloaded to the device (write_zeroes_max_bytes > 0)".into()
            } else {
                "BLKZEROOUT; the kernel writes zero pages (no write-zeroes offload)".into()
            },
        )),
        Overwrite => Ok((
            Expectation::Zeroes,
            "zeros written with O_DIRECT: always possible".into(),
        )),
    }
}

/// Areas holding partition tables and signatures: the first and last MiB (protective MBR, primary and backup GPT,
/// ext4/XFS/LVM/btrfs superblocks, md 0.90/1.0/1.1/1.2 superblocks, ZFS labels L0–L3) and the btrfs superblock
/// mirrors at 64 MiB and 256 GiB.
fn metadata_areas(size: u64) -> Vec<MetadataArea> {
    if size <= 2 * MIB {
        return vec![MetadataArea {
            offset: 0,
            len: size,
            what: "whole device (smaller than 2 MiB)",
        }];
    }
    let mut areas = vec![MetadataArea {
        offset: 0,
        len: MIB,
        what: "MBR, primary GPT, superblocks at the start (ext4, XFS, LVM, btrfs, md 1.1/1.2, ZFS L0/L1)",
    }];
    for (offset, what) in [
        (64 * MIB, "btrfs superblock mirror 1"),
        (256 * 1024 * MIB, "btrfs superblock mirror 2"),
    ] {
        if offset + 4096 <= size - MIB {
            areas.push(MetadataArea {
                offset,
                len: 4096,
                what,
            });
        }
    }
    areas.push(MetadataArea {
        offset: size - MIB,
        len: MIB,
        what: "backup GPT, superblocks at the end (md 0.90/1.0, ZFS L2/L3)",
    });
    areas
}

/// Sample positions for verification: the first and last `sample_len` bytes plus `count` positions, one drawn
/// from each of `count` equal strata using `seed`. Positions are multiples of `sample_len`-or-4096 alignment and
/// always lie within the device. Pure: the executor draws and records the seed.
pub fn sample_offsets(size: u64, sample_len: u32, count: u32, seed: u64) -> Vec<u64> {
    let len = u64::from(sample_len.max(1));
    if size < len {
        return Vec::new();
    }
    let last = (size - len) / 4096 * 4096;
    let mut out = vec![0, last];
    let mut state = seed;
    let strata = u64::from(count);
    for i in 0..strata {
        let lo = size / strata * i;
        let hi = if i + 1 == strata {
            size
        } else {
            size / strata * (i + 1)
        };
        let span = hi.saturating_sub(lo).max(1);
        let pos = lo + splitmix64(&mut state) % span;
        out.push((pos / 4096 * 4096).min(last));
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
