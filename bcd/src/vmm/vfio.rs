//! VFIO passthrough of an instance's GPUs: every device of each GPU's IOMMU group is bound to `vfio-pci` before
//! QEMU starts (a group is the unit the IOMMU isolates, so a VM gets all of it or none), and given back to the
//! driver it had when the VM exits. PCI bridges in a group stay with their driver (the kernel allows that, and
//! passing one through is useless).
//!
//! The sysfs work goes through the narrow [`PciSysfs`] trait: [`Sysfs`] reads and writes a sysfs tree under a root
//! (`/sys` on a node; tests point it at a prepared tree), [`FakeKernel`] is an in-memory model of what the kernel does
//! when `driver_override`, `unbind` and `drivers_probe` are written. [`bind`] and [`release`] are written against
//! the trait only.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const VFIO_DRIVER: &str = "vfio-pci";

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("{addr} is not a PCI address (dddd:bb:dd.f)")]
    BadAddress { addr: String },
    #[error(
        "PCI device {addr} has no IOMMU group: enable the IOMMU (intel_iommu=on / amd_iommu=on, and in the \
         firmware) to pass GPUs through"
    )]
    NoGroup { addr: String },
    #[error("the vfio-pci driver is not loaded: run `modprobe vfio-pci` (and load it at boot)")]
    NoVfioDriver,
    #[error(
        "{addr} is still bound to {driver:?} after binding it to vfio-pci: is the device in use?"
    )]
    NotBound {
        addr: String,
        driver: Option<String>,
    },
    #[error("sysfs {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The sysfs operations passthrough needs, relative to the sysfs root (`bus/pci/devices/...`).
pub trait PciSysfs: Send + Sync {
    /// The PCI addresses in the IOMMU group of `addr` (`None`: the device has no group).
    fn group(&self, addr: &str) -> Result<Option<(u32, Vec<String>)>, VfioError>;
    /// The driver bound to `addr`, if any.
    fn driver(&self, addr: &str) -> Result<Option<String>, VfioError>;
    /// The device's class code (e.g. `0x030200` for a 3D controller, `0x060400` for a PCI bridge).
    fn class(&self, addr: &str) -> Result<u32, VfioError>;
    /// Whether a driver is registered (`/sys/bus/pci/drivers/<name>`).
    fn has_driver(&self, name: &str) -> bool;
    /// Writes `driver_override` of `addr` (empty clears it).
    fn set_override(&self, addr: &str, driver: &str) -> Result<(), VfioError>;
    /// Unbinds `addr` from its driver.
    fn unbind(&self, addr: &str) -> Result<(), VfioError>;
    /// Asks the kernel to bind `addr` to a driver (`drivers_probe`).
    fn probe(&self, addr: &str) -> Result<(), VfioError>;
}

/// One device of a bound group and the driver it had before.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundDevice {
    pub addr: String,
    pub previous_driver: Option<String>,
}

/// What [`bind`] did, kept in the instance's directory so a restarted bcd still releases it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// IOMMU group number → its devices that were bound.
    pub groups: BTreeMap<u32, Vec<BoundDevice>>,
}

impl Binding {
    /// The devices QEMU gets (`-device vfio-pci,host=<addr>`), in address order.
    pub fn passthrough(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .groups
            .values()
            .flatten()
            .map(|d| d.addr.clone())
            .collect();
        v.sort();
        v
    }
}

/// `dddd:bb:dd.f`, lowercase (NVML reports an 8-digit domain: `00000000:18:00.0` becomes `0000:18:00.0`).
pub fn normalize_addr(addr: &str) -> Result<String, VfioError> {
    let bad = || VfioError::BadAddress {
        addr: addr.chars().take(40).collect(),
    };
    let a = addr.trim().to_ascii_lowercase();
    let (domain, rest) = a.split_once(':').ok_or_else(bad)?;
    let domain = u32::from_str_radix(domain, 16).map_err(|_| bad())?;
    let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
    let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !(domain <= 0xffff && hex(bus, 2) && hex(dev, 2) && func.len() == 1 && hex(func, 1)) {
        return Err(bad());
    }
    Ok(format!("{domain:04x}:{bus}:{dev}.{func}"))
}

const CLASS_BRIDGE: u32 = 0x06;

/// Binds the whole IOMMU group of each device in `addrs` to vfio-pci. On an error, what this call bound is given
/// back before returning.
pub fn bind(sys: &dyn PciSysfs, addrs: &[String]) -> Result<Binding, VfioError> {
    if !sys.has_driver(VFIO_DRIVER) {
        return Err(VfioError::NoVfioDriver);
    }
    let mut binding = Binding::default();
    let result = (|| {
        for addr in addrs {
            let addr = normalize_addr(addr)?;
            let (group, devices) = sys
                .group(&addr)?
                .ok_or_else(|| VfioError::NoGroup { addr: addr.clone() })?;
            if binding.groups.contains_key(&group) {
                continue;
            }
            let mut bound = Vec::new();
            for dev in devices {
                if sys.class(&dev)? >> 16 == CLASS_BRIDGE {
                    continue;
                }
                let previous = sys.driver(&dev)?;
                // Recorded before the change, so a failure half-way is still given back.
                bound.push(BoundDevice {
                    addr: dev.clone(),
                    previous_driver: previous.clone(),
                });
                binding.groups.insert(group, bound.clone());
                if previous.as_deref() == Some(VFIO_DRIVER) {
                    continue;
                }
                sys.set_override(&dev, VFIO_DRIVER)?;
                if previous.is_some() {
                    sys.unbind(&dev)?;
                }
                sys.probe(&dev)?;
                let now = sys.driver(&dev)?;
                if now.as_deref() != Some(VFIO_DRIVER) {
                    return Err(VfioError::NotBound {
                        addr: dev,
                        driver: now,
                    });
                }
            }
            binding.groups.insert(group, bound);
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(binding),
        Err(e) => {
            let left = release(sys, &binding);
            if !left.is_empty() {
                tracing::warn!(devices = ?left, "devices not given back after a failed VFIO bind");
            }
            Err(e)
        }
    }
}

/// Gives every device of `binding` back to the driver it had (clears the override, unbinds from vfio-pci, probes).
/// Returns the devices that did not go back (logged; the next release tries again).
pub fn release(sys: &dyn PciSysfs, binding: &Binding) -> Vec<String> {
    let mut left = Vec::new();
    for dev in binding.groups.values().flatten() {
        if dev.previous_driver.as_deref() == Some(VFIO_DRIVER) {
            continue;
        }
        let step = || -> Result<Option<String>, VfioError> {
            sys.set_override(&dev.addr, "")?;
            if sys.driver(&dev.addr)?.as_deref() == Some(VFIO_DRIVER) {
                sys.unbind(&dev.addr)?;
            }
            if dev.previous_driver.is_some() {
                sys.probe(&dev.addr)?;
            }
            sys.driver(&dev.addr)
        };
        match step() {
            Ok(now) if now == dev.previous_driver => {}
            Ok(now) => {
                tracing::warn!(addr = dev.addr, want = ?dev.previous_driver, got = ?now, "device not back with its driver");
                left.push(dev.addr.clone());
            }
            Err(e) => {
                tracing::warn!(addr = dev.addr, error = %crate::join::error_chain(&e), "releasing a VFIO device failed");
                left.push(dev.addr.clone());
            }
        }
    }
    left
}

// === impl Sysfs ===

/// The real sysfs under `root` (`/sys` on a node).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    pub fn new(root: &Path) -> Sysfs {
        Sysfs {
            root: root.to_path_buf(),
        }
    }

    fn dev(&self, addr: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(addr)
    }

    fn write(&self, path: PathBuf, value: &str) -> Result<(), VfioError> {
        // sysfs attributes take one write(2) of the whole value.
        std::fs::write(&path, value).map_err(|source| VfioError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

fn link_name(path: &Path) -> Option<String> {
    std::fs::read_link(path)
        .ok()?
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
}

impl PciSysfs for Sysfs {
    fn group(&self, addr: &str) -> Result<Option<(u32, Vec<String>)>, VfioError> {
        let Some(group) = link_name(&self.dev(addr).join("iommu_group")) else {
            return Ok(None);
        };
        let Ok(number) = group.parse::<u32>() else {
            return Ok(None);
        };
        let dir = self
            .root
            .join("kernel/iommu_groups")
            .join(&group)
            .join("devices");
        let mut devices: Vec<String> = std::fs::read_dir(&dir)
            .map_err(|source| VfioError::Io {
                path: dir.display().to_string(),
                source,
            })?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        devices.sort();
        Ok(Some((number, devices)))
    }

    fn driver(&self, addr: &str) -> Result<Option<String>, VfioError> {
        Ok(link_name(&self.dev(addr).join("driver")))
    }

    fn class(&self, addr: &str) -> Result<u32, VfioError> {
        let path = self.dev(addr).join("class");
        let text = std::fs::read_to_string(&path).map_err(|source| VfioError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let t = text.trim();
        Ok(u32::from_str_radix(t.trim_start_matches("0x"), 16).unwrap_or(0))
    }

    fn has_driver(&self, name: &str) -> bool {
        self.root.join("bus/pci/drivers").join(name).is_dir()
    }

    fn set_override(&self, addr: &str, driver: &str) -> Result<(), VfioError> {
        // An empty override is written as a newline (the kernel clears it on "\n").
        let value = if driver.is_empty() { "\n" } else { driver };
        self.write(self.dev(addr).join("driver_override"), value)
    }

    fn unbind(&self, addr: &str) -> Result<(), VfioError> {
        self.write(self.dev(addr).join("driver/unbind"), addr)
    }

    fn probe(&self, addr: &str) -> Result<(), VfioError> {
        self.write(self.root.join("bus/pci/drivers_probe"), addr)
    }
}

// === impl FakeKernel ===

/// An in-memory PCI bus that behaves like the kernel for the operations above: `probe` binds a device to its
/// override if one is set, else to its native driver. For tests and fixtures.
#[derive(Debug, Default)]
pub struct FakeKernel {
    state: std::sync::Mutex<FakeState>,
}

#[derive(Debug, Default, Clone)]
struct FakeState {
    /// addr → (group, class, native driver, bound driver, override)
    devices: BTreeMap<String, FakeDevice>,
    drivers: Vec<String>,
    /// Devices whose bind is refused (in use).
    stuck: Vec<String>,
    log: Vec<String>,
}

#[derive(Debug, Clone)]
struct FakeDevice {
    group: Option<u32>,
    class: u32,
    native: Option<String>,
    bound: Option<String>,
    over: Option<String>,
}

impl FakeKernel {
    pub fn new(drivers: &[&str]) -> FakeKernel {
        let k = FakeKernel::default();
        if let Ok(mut s) = k.state.lock() {
            s.drivers = drivers.iter().map(|d| d.to_string()).collect();
        }
        k
    }

    /// Adds a device bound to `driver` in IOMMU `group`.
    pub fn add(&self, addr: &str, group: Option<u32>, class: u32, driver: Option<&str>) {
        if let Ok(mut s) = self.state.lock() {
            s.devices.insert(
                addr.to_string(),
                FakeDevice {
                    group,
                    class,
                    native: driver.map(str::to_string),
                    bound: driver.map(str::to_string),
                    over: None,
                },
            );
        }
    }

    /// Makes binding `addr` to anything but its native driver fail silently (as when a device is in use).
    pub fn stick(&self, addr: &str) {
        if let Ok(mut s) = self.state.lock() {
            s.stuck.push(addr.to_string());
        }
    }

    /// The driver each device is bound to now.
    pub fn bound(&self) -> BTreeMap<String, Option<String>> {
        self.state
            .lock()
            .map(|s| {
                s.devices
                    .iter()
                    .map(|(a, d)| (a.clone(), d.bound.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The writes made, in order (`override <addr> <value>`, `unbind <addr>`, `probe <addr>`).
    pub fn log(&self) -> Vec<String> {
        self.state.lock().map(|s| s.log.clone()).unwrap_or_default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> T {
        match self.state.lock() {
            Ok(mut s) => f(&mut s),
            Err(p) => f(&mut p.into_inner()),
        }
    }
}

fn missing(addr: &str) -> VfioError {
    VfioError::Io {
        path: format!("bus/pci/devices/{addr}"),
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    }
}

impl PciSysfs for FakeKernel {
    fn group(&self, addr: &str) -> Result<Option<(u32, Vec<String>)>, VfioError> {
        self.with(|s| {
            let d = s.devices.get(addr).ok_or_else(|| missing(addr))?;
            Ok(d.group.map(|g| {
                let members = s
                    .devices
                    .iter()
                    .filter(|(_, o)| o.group == Some(g))
                    .map(|(a, _)| a.clone())
                    .collect();
                (g, members)
            }))
        })
    }

    fn driver(&self, addr: &str) -> Result<Option<String>, VfioError> {
        self.with(|s| {
            s.devices
                .get(addr)
                .map(|d| d.bound.clone())
                .ok_or_else(|| missing(addr))
        })
    }

    fn class(&self, addr: &str) -> Result<u32, VfioError> {
        self.with(|s| {
            s.devices
                .get(addr)
                .map(|d| d.class)
                .ok_or_else(|| missing(addr))
        })
    }

    fn has_driver(&self, name: &str) -> bool {
        self.with(|s| s.drivers.iter().any(|d| d == name))
    }

    fn set_override(&self, addr: &str, driver: &str) -> Result<(), VfioError> {
        self.with(|s| {
            s.log.push(format!("override {addr} {driver}"));
            let d = s.devices.get_mut(addr).ok_or_else(|| missing(addr))?;
            d.over = (!driver.is_empty()).then(|| driver.to_string());
            Ok(())
        })
    }

    fn unbind(&self, addr: &str) -> Result<(), VfioError> {
        self.with(|s| {
            s.log.push(format!("unbind {addr}"));
            let d = s.devices.get_mut(addr).ok_or_else(|| missing(addr))?;
            d.bound = None;
            Ok(())
        })
    }

    fn probe(&self, addr: &str) -> Result<(), VfioError> {
        self.with(|s| {
            s.log.push(format!("probe {addr}"));
            let stuck = s.stuck.iter().any(|a| a == addr);
            let drivers = s.drivers.clone();
            let d = s.devices.get_mut(addr).ok_or_else(|| missing(addr))?;
            if d.bound.is_some() {
                return Ok(());
            }
            let want = d.over.clone().or_else(|| d.native.clone());
            d.bound = match want {
                Some(w) if stuck && Some(&w) != d.native.as_ref() => d.native.clone(),
                Some(w) if drivers.contains(&w) => Some(w),
                _ => None,
            };
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: u32 = 0x030200;
    const AUDIO: u32 = 0x040300;
    const BRIDGE: u32 = 0x060400;

    fn node() -> FakeKernel {
        let k = FakeKernel::new(&["nvidia", "snd_hda_intel", "pcieport", VFIO_DRIVER]);
        k.add("0000:17:00.0", Some(20), BRIDGE, Some("pcieport"));
        k.add("0000:18:00.0", Some(20), GPU, Some("nvidia"));
        k.add("0000:18:00.1", Some(20), AUDIO, Some("snd_hda_intel"));
        k.add("0000:3a:00.0", Some(31), GPU, Some("nvidia"));
        k.add("0000:5d:00.0", None, GPU, Some("nvidia"));
        k
    }

    #[test]
    fn the_whole_group_but_its_bridge_goes_to_vfio_and_comes_back() {
        let k = node();
        let before = k.bound();
        let b = bind(&k, &["00000000:18:00.0".into()]).expect("bind");
        assert_eq!(b.passthrough(), vec!["0000:18:00.0", "0000:18:00.1"]);
        let now = k.bound();
        assert_eq!(now["0000:18:00.0"].as_deref(), Some(VFIO_DRIVER));
        assert_eq!(now["0000:18:00.1"].as_deref(), Some(VFIO_DRIVER));
        assert_eq!(
            now["0000:17:00.0"].as_deref(),
            Some("pcieport"),
            "bridge untouched"
        );
        assert_eq!(
            now["0000:3a:00.0"].as_deref(),
            Some("nvidia"),
            "other GPU untouched"
        );
        // It survives a restart as JSON.
        let json = serde_json::to_string(&b).expect("json");
        let b: Binding = serde_json::from_str(&json).expect("parse");
        assert!(release(&k, &b).is_empty());
        assert_eq!(k.bound(), before);
        assert!(
            k.log().contains(&"override 0000:18:00.0 ".to_string()),
            "{:?}",
            k.log()
        );
    }

    #[test]
    fn a_device_without_group_or_driver_is_refused_and_a_half_bind_is_undone() {
        let k = node();
        assert!(matches!(
            bind(&k, &["0000:5d:00.0".into()]),
            Err(VfioError::NoGroup { .. })
        ));
        let before = k.bound();
        k.stick("0000:18:00.1");
        let e = bind(&k, &["0000:3a:00.0".into(), "0000:18:00.0".into()]);
        assert!(matches!(e, Err(VfioError::NotBound { .. })), "{e:?}");
        assert_eq!(k.bound(), before, "everything given back after the failure");
        let bare = FakeKernel::new(&["nvidia"]);
        bare.add("0000:18:00.0", Some(1), GPU, Some("nvidia"));
        assert!(matches!(
            bind(&bare, &["0000:18:00.0".into()]),
            Err(VfioError::NoVfioDriver)
        ));
        assert!(normalize_addr("18:00.0").is_err());
        assert!(normalize_addr("0000:18:00.0/../x").is_err());
    }

    /// The real implementation against a prepared sysfs tree: it reads groups, drivers and classes where the
    /// kernel puts them and writes the right attribute files.
    #[test]
    fn sysfs_reads_and_writes_the_kernel_files() {
        use std::os::unix::fs::symlink;
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path();
        let devs = root.join("bus/pci/devices");
        let drv = root.join("bus/pci/drivers");
        for d in ["nvidia", VFIO_DRIVER] {
            std::fs::create_dir_all(drv.join(d)).expect("mkdir");
        }
        std::fs::write(root.join("bus/pci/drivers_probe"), "").expect("probe file");
        let group = root.join("kernel/iommu_groups/20/devices");
        std::fs::create_dir_all(&group).expect("mkdir");
        for (addr, class) in [("0000:18:00.0", "0x030200"), ("0000:18:00.1", "0x040300")] {
            let d = devs.join(addr);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("class"), format!("{class}\n")).expect("class");
            std::fs::write(d.join("driver_override"), "(null)\n").expect("override");
            symlink("../../../kernel/iommu_groups/20", d.join("iommu_group")).expect("link");
            symlink(&d, group.join(addr)).expect("link");
        }
        // A driver directory with its unbind file, linked as the GPU's driver.
        std::fs::write(drv.join("nvidia/unbind"), "").expect("unbind");
        symlink(drv.join("nvidia"), devs.join("0000:18:00.0/driver")).expect("link");
        let s = Sysfs::new(root);
        assert_eq!(
            s.group("0000:18:00.0").expect("group"),
            Some((20, vec!["0000:18:00.0".into(), "0000:18:00.1".into()]))
        );
        assert_eq!(
            s.driver("0000:18:00.0").expect("driver").as_deref(),
            Some("nvidia")
        );
        assert_eq!(s.driver("0000:18:00.1").expect("driver"), None);
        assert_eq!(s.class("0000:18:00.0").expect("class"), GPU);
        assert!(s.has_driver(VFIO_DRIVER) && !s.has_driver("amdgpu"));
        s.set_override("0000:18:00.0", VFIO_DRIVER)
            .expect("override");
        s.unbind("0000:18:00.0").expect("unbind");
        s.probe("0000:18:00.0").expect("probe");
        let read = |p: PathBuf| std::fs::read_to_string(p).expect("read");
        assert_eq!(read(devs.join("0000:18:00.0/driver_override")), VFIO_DRIVER);
        assert_eq!(read(drv.join("nvidia/unbind")), "0000:18:00.0");
        assert_eq!(read(root.join("bus/pci/drivers_probe")), "0000:18:00.0");
        s.set_override("0000:18:00.0", "").expect("clear");
        assert_eq!(read(devs.join("0000:18:00.0/driver_override")), "\n");
        // The tree does not react like a kernel, so bind() sees the GPU still on nvidia and says so.
        assert!(matches!(
            bind(&s, &["0000:18:00.0".into()]),
            Err(VfioError::NotBound { .. })
        ));
    }
}
