//! The real VFIO path of issue 15: an NVIDIA GPU's whole IOMMU group bound to `vfio-pci` through the real sysfs
//! (`bcd::vmm::vfio::Sysfs` on `/sys`, what bcd's VMM does before QEMU starts with the instance's GPUs), its VFIO
//! group device present, and every device given back to the driver it had. Needs an NVIDIA GPU on the PCI bus and
//! `BC_HWTESTS_VFIO=1`: binding takes the GPU from its driver, so it runs only where that is allowed. Otherwise it
//! prints `SKIP: <test>: <why>` (bc_testkit::skip!). The same steps against a fake sysfs run everywhere
//! (`bcd::vmm::vfio`'s unit tests).

use bcd::vmm::vfio::{self, PciSysfs, Sysfs};
use std::path::Path;

/// PCI addresses of the NVIDIA display or 3D controllers under `root` (vendor 0x10de, class 0x03xxxx).
fn nvidia_gpus(root: &Path) -> Vec<String> {
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let mut gpus: Vec<String> = std::fs::read_dir(root.join("bus/pci/devices"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            read(&e.path().join("vendor")).trim() == "0x10de"
                && read(&e.path().join("class")).trim().starts_with("0x03")
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    gpus.sort();
    gpus
}

#[test]
fn a_gpus_iommu_group_is_bound_to_vfio_and_given_back() {
    let root = Path::new("/sys");
    let Some(gpu) = nvidia_gpus(root).into_iter().next() else {
        bc_testkit::skip!("no NVIDIA GPU on this machine's PCI bus (/sys/bus/pci/devices)");
    };
    if std::env::var_os("BC_HWTESTS_VFIO").is_none_or(|v| v != "1") {
        bc_testkit::skip!(
            "binding GPU {gpu} to vfio-pci takes it from its driver: set BC_HWTESTS_VFIO=1 where that is allowed"
        );
    }
    let sys = Sysfs::new(root);
    let before = sys.driver(&gpu).expect("the GPU's driver");
    let (group, members) = sys
        .group(&gpu)
        .expect("the GPU's IOMMU group")
        .expect("the GPU is in an IOMMU group (is the IOMMU on: intel_iommu=on or amd_iommu=on?)");
    let binding =
        vfio::bind(&sys, std::slice::from_ref(&gpu)).expect("bind the GPU's group to vfio-pci");
    let bound = binding.passthrough();
    assert!(bound.contains(&gpu), "{bound:?}");
    for addr in &bound {
        assert!(
            members.contains(addr),
            "{addr} is not in group {group}: {members:?}"
        );
        assert_eq!(
            sys.driver(addr).expect("driver").as_deref(),
            Some(vfio::VFIO_DRIVER),
            "{addr}"
        );
    }
    assert!(
        Path::new(&format!("/dev/vfio/{group}")).exists(),
        "no /dev/vfio/{group} after binding group {group}"
    );
    let failed = vfio::release(&sys, &binding);
    assert!(failed.is_empty(), "releasing the group: {failed:?}");
    assert_eq!(
        sys.driver(&gpu).expect("driver"),
        before,
        "{gpu} back to its driver"
    );
}
