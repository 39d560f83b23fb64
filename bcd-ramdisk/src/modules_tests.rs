use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::stream::Compression;
use crate::stream::test_support::compress;

/// A minimal ELF64 LE object with a null section, `.modinfo` and `.shstrtab`.
fn elf_with_modinfo(modinfo: &[u8]) -> Vec<u8> {
    let shstrtab = b"\0.modinfo\0.shstrtab\0";
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2;
    elf[5] = 1;
    let modinfo_off = elf.len();
    elf.extend_from_slice(modinfo);
    let shstr_off = elf.len();
    elf.extend_from_slice(shstrtab);
    while !elf.len().is_multiple_of(8) {
        elf.push(0);
    }
    let shoff = elf.len();
    let mut sh = |name: u32, off: usize, size: usize| {
        let mut h = [0u8; 64];
        h[..4].copy_from_slice(&name.to_le_bytes());
        h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
        h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
        elf.extend_from_slice(&h);
    };
    sh(0, 0, 0);
    sh(1, modinfo_off, modinfo.len());
    sh(10, shstr_off, shstrtab.len());
    elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
    elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
    elf[0x3e..0x40].copy_from_slice(&2u16.to_le_bytes());
    elf
}

const VIRTIO_BLK: &[u8] =
    b"license=GPL\0description=Virtio block driver\0alias=virtio:d00000002v*\0depends=virtio,virtio_ring\0softdep=pre: crc32c post: foo\0name=virtio_blk\0vermagic=6.1.0\0";

#[test]
fn reads_modinfo_from_elf_and_compressed_elf() {
    let elf = elf_with_modinfo(VIRTIO_BLK);
    let want = ModInfo {
        name: "virtio_blk".into(),
        depends: vec!["virtio".into(), "virtio_ring".into()],
        soft_pre: vec!["crc32c".into()],
        aliases: vec!["virtio:d00000002v*".into()],
    };
    assert_eq!(ModInfo::from_ko(&elf, "x"), Ok(want.clone()));
    for c in [Compression::Xz, Compression::Zstd, Compression::Gzip] {
        assert_eq!(
            ModInfo::from_ko(&compress(c, &elf), "x"),
            Ok(want.clone()),
            "{c:?}"
        );
    }
}

#[test]
fn empty_depends_and_missing_name() {
    let info = ModInfo::from_modinfo(b"depends=\0license=GPL\0", "virtio-ring");
    assert_eq!(
        info,
        ModInfo {
            name: "virtio_ring".into(),
            ..Default::default()
        }
    );
}

#[test]
fn bad_elves_are_errors() {
    assert_eq!(
        ModInfo::from_ko(b"hello", "x"),
        Err(ModuleError::NotElf("bad magic or short header"))
    );
    let mut elf = elf_with_modinfo(VIRTIO_BLK);
    elf[4] = 1;
    assert_eq!(
        ModInfo::from_ko(&elf, "x"),
        Err(ModuleError::NotElf("not 64-bit"))
    );
    let mut elf = elf_with_modinfo(VIRTIO_BLK);
    elf[0x28] = 0xff;
    elf[0x2f] = 0x7f;
    assert_eq!(ModInfo::from_ko(&elf, "x"), Err(ModuleError::BadSections));
    let mut elf = elf_with_modinfo(VIRTIO_BLK);
    let at = elf
        .windows(8)
        .position(|w| w == b".modinfo")
        .expect("name present");
    elf[at + 1] = b'X';
    assert_eq!(ModInfo::from_ko(&elf, "x"), Err(ModuleError::NoModinfo));
}

fn virtio() -> BTreeMap<String, ModInfo> {
    from_depends_map([
        ("virtio_ring", &[][..]),
        ("virtio", &[][..]),
        ("virtio_pci_modern_dev", &[][..]),
        ("virtio_pci_legacy_dev", &[][..]),
        (
            "virtio_pci",
            &[
                "virtio_pci_modern_dev",
                "virtio_pci_legacy_dev",
                "virtio",
                "virtio_ring",
            ][..],
        ),
        ("virtio_blk", &["virtio", "virtio_ring"][..]),
        ("failover", &[][..]),
        ("net_failover", &["failover"][..]),
        ("virtio_net", &["net_failover", "virtio", "virtio_ring"][..]),
        ("nvme", &["nvme_core"][..]),
        ("nvme_core", &["nvme_auth"][..]),
    ])
}

fn assert_deps_first(order: &[String], available: &BTreeMap<String, ModInfo>) {
    for (i, m) in order.iter().enumerate() {
        for d in &available[m].depends {
            if let Some(j) = order.iter().position(|x| x == d) {
                assert!(j < i, "{d} must come before {m} in {order:?}");
            }
        }
    }
}

#[test]
fn virtio_block_and_net_order() {
    let available = virtio();
    let order = load_order(
        &["virtio-blk", "virtio_pci", "virtio_net"],
        &available,
        &BTreeSet::new(),
    )
    .expect("resolves");
    assert_eq!(
        order,
        [
            "virtio",
            "virtio_ring",
            "virtio_blk",
            "virtio_pci_modern_dev",
            "virtio_pci_legacy_dev",
            "virtio_pci",
            "failover",
            "net_failover",
            "virtio_net"
        ]
    );
    assert_deps_first(&order, &available);
}

#[test]
fn missing_and_builtin() {
    let available = virtio();
    assert_eq!(
        load_order(&["nvme"], &available, &BTreeSet::new()),
        Err(ModuleError::Missing {
            module: "nvme_auth".into(),
            needed_by: Some("nvme_core".into())
        })
    );
    let builtin: BTreeSet<String> = ["nvme_auth".to_string()].into();
    assert_eq!(
        load_order(&["nvme"], &available, &builtin),
        Ok(vec!["nvme_core".into(), "nvme".into()])
    );
    assert_eq!(
        load_order(&["ice"], &available, &builtin),
        Err(ModuleError::Missing {
            module: "ice".into(),
            needed_by: None
        })
    );
}

#[test]
fn cycles_are_reported_with_their_path() {
    let available = from_depends_map([("a", &["b"][..]), ("b", &["c"][..]), ("c", &["a"][..])]);
    assert_eq!(
        load_order(&["a"], &available, &BTreeSet::new()),
        Err(ModuleError::Cycle {
            path: vec!["a".into(), "b".into(), "c".into(), "a".into()]
        })
    );
    let self_loop = from_depends_map([("x", &["x"][..])]);
    assert!(matches!(
        load_order(&["x"], &self_loop, &BTreeSet::new()),
        Err(ModuleError::Cycle { .. })
    ));
}

proptest! {
    #[test]
    fn random_dags_resolve_with_deps_first(edges in prop::collection::vec((0usize..30, 0usize..30), 0..80)) {
        // Only edges from higher to lower numbers: a DAG.
        let mut deps: BTreeMap<String, Vec<String>> = (0..30).map(|i| (format!("m{i}"), vec![])).collect();
        for (a, b) in edges {
            if a > b {
                deps.entry(format!("m{a}")).or_default().push(format!("m{b}"));
            }
        }
        let available: BTreeMap<String, ModInfo> = deps
            .iter()
            .map(|(n, d)| (n.clone(), ModInfo { name: n.clone(), depends: d.clone(), ..Default::default() }))
            .collect();
        let order = load_order(&["m29", "m15", "m3"], &available, &BTreeSet::new()).expect("a DAG resolves");
        let unique: BTreeSet<&String> = order.iter().collect();
        prop_assert_eq!(unique.len(), order.len());
        assert_deps_first(&order, &available);
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = ModInfo::from_ko(&data, "x");
        let mut elf = elf_with_modinfo(VIRTIO_BLK);
        for (i, b) in data.iter().enumerate() {
            let at = (i * 7919) % elf.len();
            elf[at] ^= b;
        }
        let _ = ModInfo::from_ko(&elf, "x");
    }
}

/// Found by fuzz/fuzz_targets/ramdisk_modinfo.rs: a section header offset near usize::MAX overflowed `base + 0x18`.
#[test]
fn section_offsets_near_the_top_of_the_address_space_are_errors() {
    let mut elf = vec![0u8; 0x70];
    elf[..8].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 0, 0]);
    elf[0x28..0x30].copy_from_slice(&(u64::MAX - 0x10).to_le_bytes()); // e_shoff
    elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
    elf[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes()); // e_shnum
    elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes()); // e_shstrndx
    assert_eq!(ModInfo::from_elf(&elf, "x"), Err(ModuleError::BadSections));
    let crash = [
        0x7f, 0x45, 0x4c, 0x46, 0x02, 0x01, 0x00, 0x00, 0x23, 0x00, 0x00, 0x00, 0x5d, 0x00, 0x00,
        0xf6, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0xff, 0xff,
    ];
    let mut crash = crash.to_vec();
    crash.extend([0xffu8; 29]);
    crash.extend([0u8; 7]);
    crash.extend([0xffu8; 28]);
    crash.extend_from_slice(b"#]#\n/\n\0\0\n#\n]\n#\n\n");
    assert!(ModInfo::from_ko(&crash, "x").is_err());
}
