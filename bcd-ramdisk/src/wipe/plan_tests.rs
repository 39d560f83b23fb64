use proptest::prelude::*;

use super::*;
use crate::wipe::{DeviceCapabilities, Expectation, NvmeCapabilities, WipeMethod, WipePolicy};

const GIB: u64 = 1 << 30;

fn disk(name: &str) -> DeviceCapabilities {
    DeviceCapabilities {
        name: name.into(),
        size_bytes: 100 * GIB,
        logical_block_size: 512,
        read_only: false,
        in_use: None,
        rotational: false,
        nvme: None,
        discard_max_bytes: 0,
        write_zeroes_max_bytes: 0,
        secure_discard: None,
    }
}

fn nvme(
    sanitize_crypto: bool,
    sanitize_block: bool,
    format_supported: bool,
    format_crypto: bool,
) -> NvmeCapabilities {
    NvmeCapabilities {
        identified: true,
        sanitize_crypto,
        sanitize_block,
        format_supported,
        format_crypto,
        namespaces: 1,
        ..Default::default()
    }
}

fn methods(plan: &crate::wipe::WipePlan) -> Vec<WipeMethod> {
    plan.steps.iter().map(|s| s.method).collect()
}

fn skip_reason(plan: &crate::wipe::WipePlan, m: WipeMethod) -> &str {
    plan.skipped
        .iter()
        .find(|s| s.method == m)
        .map(|s| s.reason.as_str())
        .unwrap_or("<not skipped>")
}

#[test]
fn nvme_with_everything_tries_sanitize_crypto_first() {
    let caps = DeviceCapabilities {
        nvme: Some(nvme(true, true, true, true)),
        discard_max_bytes: 1 << 40,
        ..disk("nvme0n1")
    };
    let p = plan(&caps);
    use WipeMethod::*;
    assert_eq!(
        methods(&p),
        vec![
            NvmeSanitizeCrypto,
            NvmeSanitizeBlock,
            NvmeFormatCrypto,
            NvmeFormatUserData,
            SecureDiscard,
            Discard,
            ZeroOut,
            Overwrite
        ]
    );
    assert!(p.skipped.is_empty());
    assert_eq!(p.steps[0].expect, Expectation::Changed);
    assert!(p.refused.is_none());
}

#[test]
fn nvme_without_sanitize_falls_to_format_ses2_then_ses1() {
    let caps = DeviceCapabilities {
        nvme: Some(nvme(false, false, true, true)),
        discard_max_bytes: 1 << 40,
        ..disk("nvme0n1")
    };
    let p = plan(&caps);
    assert_eq!(p.steps[0].method, WipeMethod::NvmeFormatCrypto);
    assert_eq!(p.steps[1].method, WipeMethod::NvmeFormatUserData);
    assert!(skip_reason(&p, WipeMethod::NvmeSanitizeCrypto).contains("SANICAP.CES=0"));
    assert!(skip_reason(&p, WipeMethod::NvmeSanitizeBlock).contains("SANICAP.BES=0"));
}

#[test]
fn nvme_block_erase_only() {
    let caps = DeviceCapabilities {
        nvme: Some(nvme(false, true, true, false)),
        ..disk("nvme1n1")
    };
    let p = plan(&caps);
    use WipeMethod::*;
    assert_eq!(
        methods(&p),
        vec![NvmeSanitizeBlock, NvmeFormatUserData, ZeroOut, Overwrite]
    );
    assert!(skip_reason(&p, NvmeFormatCrypto).contains("FNA bit 2"));
    assert!(skip_reason(&p, Discard).contains("discard_max_bytes = 0"));
}

#[test]
fn nvme_without_format_or_sanitize() {
    let caps = DeviceCapabilities {
        nvme: Some(nvme(false, false, false, false)),
        discard_max_bytes: 512,
        ..disk("nvme2n1")
    };
    let p = plan(&caps);
    use WipeMethod::*;
    assert_eq!(
        methods(&p),
        vec![SecureDiscard, Discard, ZeroOut, Overwrite]
    );
    assert!(skip_reason(&p, NvmeFormatUserData).contains("OACS bit 1"));
    assert!(skip_reason(&p, NvmeFormatCrypto).contains("OACS bit 1"));
}

#[test]
fn unidentified_nvme_says_so() {
    let caps = DeviceCapabilities {
        nvme: Some(NvmeCapabilities::default()),
        ..disk("nvme0n1")
    };
    let p = plan(&caps);
    assert!(
        skip_reason(&p, WipeMethod::NvmeSanitizeCrypto).contains("Identify Controller unavailable")
    );
    assert_eq!(
        methods(&p),
        vec![WipeMethod::ZeroOut, WipeMethod::Overwrite]
    );
}

#[test]
fn sata_ssd_with_discard() {
    let caps = DeviceCapabilities {
        discard_max_bytes: 2 << 30,
        write_zeroes_max_bytes: 1 << 25,
        ..disk("sda")
    };
    let p = plan(&caps);
    use WipeMethod::*;
    assert_eq!(
        methods(&p),
        vec![SecureDiscard, Discard, ZeroOut, Overwrite]
    );
    assert_eq!(skip_reason(&p, NvmeSanitizeCrypto), "not an NVMe namespace");
    assert_eq!(
        p.steps[1].expect,
        Expectation::Zeroes,
        "discard must read back zeros"
    );
    assert!(p.steps[2].reason.contains("offloaded"));
}

#[test]
fn known_secure_discard_failure_is_skipped() {
    let caps = DeviceCapabilities {
        discard_max_bytes: 1 << 30,
        secure_discard: Some(false),
        ..disk("loop0")
    };
    let p = plan(&caps);
    assert!(skip_reason(&p, WipeMethod::SecureDiscard).contains("rejected"));
    assert_eq!(p.steps[0].method, WipeMethod::Discard);
}

#[test]
fn spinning_disk_without_discard_overwrites() {
    let caps = DeviceCapabilities {
        rotational: true,
        ..disk("sdb")
    };
    let p = plan(&caps);
    assert_eq!(
        methods(&p),
        vec![WipeMethod::ZeroOut, WipeMethod::Overwrite]
    );
    assert!(p.steps[0].reason.contains("kernel writes zero pages"));
}

#[test]
fn policy_restricts_methods() {
    let caps = DeviceCapabilities {
        discard_max_bytes: 1 << 30,
        ..disk("loop0")
    };
    let policy = WipePolicy {
        allowed: vec![WipeMethod::Overwrite],
        ..Default::default()
    };
    let p = plan_with(&caps, &policy);
    assert_eq!(methods(&p), vec![WipeMethod::Overwrite]);
    assert_eq!(skip_reason(&p, WipeMethod::Discard), "excluded by policy");
}

#[test]
fn refusals() {
    let cases = [
        (
            DeviceCapabilities {
                read_only: true,
                ..disk("sr0")
            },
            "read-only",
        ),
        (
            DeviceCapabilities {
                in_use: Some("sda1 (8:1) is mounted".into()),
                ..disk("sda")
            },
            "in use",
        ),
        (
            DeviceCapabilities {
                size_bytes: 0,
                ..disk("sdc")
            },
            "positive multiple",
        ),
        (
            DeviceCapabilities {
                size_bytes: 1000,
                ..disk("sdc")
            },
            "positive multiple",
        ),
        (
            DeviceCapabilities {
                logical_block_size: 520,
                ..disk("sdd")
            },
            "power of two",
        ),
    ];
    for (caps, needle) in cases {
        let p = plan(&caps);
        let why = p.refused.clone().expect("refused");
        assert!(why.contains(needle), "{why}");
        assert!(p.steps.is_empty());
        assert_eq!(p.skipped.len(), WipeMethod::ALL.len());
    }
}

#[test]
fn metadata_covers_both_gpt_copies_and_btrfs_mirrors() {
    let p = plan(&disk("sda"));
    let size = 100 * GIB;
    assert_eq!(
        p.metadata.first().map(|a| (a.offset, a.len)),
        Some((0, 1 << 20))
    );
    assert_eq!(
        p.metadata.last().map(|a| (a.offset, a.len)),
        Some((size - (1 << 20), 1 << 20))
    );
    assert!(p.metadata.iter().any(|a| a.offset == 64 << 20));
    assert!(
        !p.metadata.iter().any(|a| a.offset == 256 * GIB),
        "mirror past the end is left out"
    );
    let small = plan(&DeviceCapabilities {
        size_bytes: 1 << 20,
        ..disk("tiny")
    });
    assert_eq!(small.metadata.len(), 1);
    assert_eq!(small.metadata[0].len, 1 << 20);
}

#[test]
fn samples_cover_both_ends() {
    let offs = sample_offsets(64 << 20, 4096, 16, 42);
    assert_eq!(offs.first(), Some(&0));
    assert_eq!(offs.last(), Some(&((64 << 20) - 4096)));
    assert!(offs.len() >= 10);
    assert_eq!(
        sample_offsets(64 << 20, 4096, 16, 42),
        offs,
        "same seed, same positions"
    );
    assert_ne!(sample_offsets(64 << 20, 4096, 16, 43), offs);
    assert!(sample_offsets(100, 4096, 4, 1).is_empty());
}

proptest! {
    #[test]
    fn samples_stay_inside_and_aligned(size in 4096u64..1 << 45, count in 0u32..200, seed: u64) {
        let size = size / 512 * 512;
        prop_assume!(size >= 4096);
        for o in sample_offsets(size, 4096, count, seed) {
            prop_assert!(o + 4096 <= size);
            prop_assert_eq!(o % 4096, 0);
        }
    }

    #[test]
    fn every_method_is_planned_or_skipped_once(
        size in 1u64..1 << 45, lbs in prop::sample::select(vec![512u32, 4096, 520]),
        ro: bool, discard in 0u64..2, nv in prop::option::of((any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>())),
    ) {
        let caps = DeviceCapabilities {
            size_bytes: size, logical_block_size: lbs, read_only: ro, discard_max_bytes: discard,
            nvme: nv.map(|(a, b, c, d)| nvme(a, b, c, d)), ..disk("x")
        };
        let p = plan(&caps);
        let mut all: Vec<WipeMethod> = p.steps.iter().map(|s| s.method).chain(p.skipped.iter().map(|s| s.method)).collect();
        all.sort();
        prop_assert_eq!(all, WipeMethod::ALL.to_vec());
        if p.refused.is_none() {
            prop_assert_eq!(p.steps.last().map(|s| s.method), Some(WipeMethod::Overwrite));
        }
    }
}
