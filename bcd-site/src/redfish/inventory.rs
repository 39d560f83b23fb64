//! Hardware inventory over Redfish: per system its processors, memory, drives, NICs, PCIe devices and GPUs, plus
//! the BMC's managers and chassis. Only what is there counts: a CPU socket, DIMM slot or drive bay whose
//! `Status.State` is `Absent` is not a component, a link listed twice is one component, and a member that cannot be
//! read is a warning, never a component. Components are found where vendors put them:
//! - GPUs: processors with `ProcessorType` GPU; where there are none, HPE iLO's `Chassis/<id>/Devices` entries of
//!   `DeviceType` GPU whose PCI function (`DeviceInstances`, in `Systems/<id>/PCIDevices`) is a display controller
//!   or processing accelerator, or of a class not reported (so an NVSwitch, a bridge, or an HGX baseboard with no
//!   PCI function, all of which iLO also types GPU, are not counted).
//! - PCIe devices: the system's `PCIeDevices` and its chassis' collections; where both are empty, HPE's
//!   `Systems/<id>/PCIDevices` (empty slots, PCI class 0xff, left out).
//! - Drives: Storage (drive links), else the chassis' `Links.Drives` or `Drives` collection, else SimpleStorage.
//! - Processors and memory: the collections; when they cannot be read, `ProcessorSummary` and `MemorySummary`.
//!
//! A BMC without Systems (a chassis manager, a switch) still reports its managers and chassis. `Display` (in
//! [`super::summary`]) is the operator summary.

use std::collections::{BTreeMap, HashSet};

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::client::Bmc;
use super::error::RedfishError;
use super::listing::normalize;
use super::models::{
    Chassis, ComputerSystem, Drive, EthernetInterface, HpeDevice, HpePciDevice, Link, Manager,
    Member, Memory, PcieDevice, Processor, SimpleStorage, Status, Storage,
};

#[derive(Debug, Clone, Default)]
pub struct Inventory {
    pub bmc: String,
    /// The vendor as the BMC states it, or as recognised and by which mark.
    pub vendor: String,
    pub redfish_version: Option<String>,
    pub quirks: &'static str,
    /// The `$expand` query used for collections, if any.
    pub expand: Option<&'static str>,
    pub managers: Vec<Manager>,
    pub chassis: Vec<Chassis>,
    pub systems: Vec<SystemInventory>,
    pub warnings: Vec<String>,
}

/// A GPU, wherever the BMC reported it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gpu {
    pub id: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial_number: Option<String>,
    pub health: Option<String>,
    /// The resource it was read from.
    pub path: String,
}

/// An Ethernet interface that is not a NIC port of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OtherInterface {
    /// A VLAN on a NIC (`VLAN.VLANEnable` with an id on an interface of its own).
    Vlan(EthernetInterface),
    /// The Redfish host interface or another virtual interface between host and BMC.
    Virtual(EthernetInterface),
}

#[derive(Debug, Clone, Default)]
pub struct SystemInventory {
    pub path: String,
    pub system: ComputerSystem,
    /// Present processors (CPUs, GPUs and others).
    pub processors: Vec<Processor>,
    /// The Processors collection could not be read: counts come from `ProcessorSummary`.
    pub processors_from_summary: bool,
    /// Present memory modules.
    pub memory: Vec<Memory>,
    /// The Memory collection could not be read: the total comes from `MemorySummary`.
    pub memory_from_summary: bool,
    pub drives: Vec<Drive>,
    /// NIC ports (VLANs and virtual interfaces apart).
    pub nics: Vec<EthernetInterface>,
    pub other_interfaces: Vec<OtherInterface>,
    pub pcie_devices: Vec<PcieDevice>,
    pub gpus: Vec<Gpu>,
    /// Listed but `Absent`: CPU sockets, DIMM slots, drive bays, device slots.
    pub absent: BTreeMap<&'static str, usize>,
}

fn is_type(p: &Processor, t: &str) -> bool {
    p.processor_type
        .as_deref()
        .is_some_and(|pt| pt.eq_ignore_ascii_case(t))
}

fn absent(status: &Option<Status>) -> bool {
    status
        .as_ref()
        .and_then(|s| s.state.as_deref())
        .is_some_and(|s| s.eq_ignore_ascii_case("Absent"))
}

/// `xx:xx:xx:xx:xx:xx` (or with `-`), not all zero: a MAC; anything else (`Not Available`, empty) is not.
pub fn valid_mac(mac: &str) -> bool {
    let parts: Vec<&str> = mac.trim().split([':', '-']).collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()))
        && parts.iter().any(|p| *p != "00")
}

impl SystemInventory {
    pub fn gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.gpus.iter()
    }

    /// Processors typed `CPU`, or untyped (older BMCs omit the type for CPUs).
    pub fn cpus(&self) -> impl Iterator<Item = &Processor> {
        self.processors
            .iter()
            .filter(|p| p.processor_type.is_none() || is_type(p, "CPU"))
    }

    /// CPUs present: counted from the collection, or from `ProcessorSummary.Count` when it could not be read.
    pub fn cpu_count(&self) -> u64 {
        if self.processors_from_summary {
            return self
                .system
                .processor_summary
                .as_ref()
                .and_then(|p| p.count)
                .unwrap_or(0);
        }
        self.cpus().count() as u64
    }

    /// Memory in MiB: the modules' sum, or `MemorySummary.TotalSystemMemoryGiB` when they could not be read.
    pub fn memory_mib(&self) -> u64 {
        if self.memory_from_summary {
            return self
                .system
                .memory_summary
                .as_ref()
                .and_then(|m| m.total_system_memory_gib)
                .map_or(0, |g| (g * 1024.0).round() as u64);
        }
        // Saturating: the sizes are the BMC's word, and a wrapped sum would be a plausible wrong total.
        self.memory
            .iter()
            .filter_map(|m| m.capacity_mib)
            .fold(0, u64::saturating_add)
    }

    /// The NICs' MACs that are MACs.
    pub fn macs(&self) -> impl Iterator<Item = &str> {
        self.nics
            .iter()
            .filter_map(|n| n.mac_address.as_deref())
            .filter(|m| valid_mac(m))
    }

    fn count_absent(&mut self, what: &'static str) {
        *self.absent.entry(what).or_default() += 1;
    }
}

/// The `@odata.id` at `path` (`["Hpe", "Links", "Devices"]`) of a vendor extension.
fn oem_link(oem: &Option<Value>, path: &[&str]) -> Option<String> {
    let mut v = oem.as_ref()?;
    for key in path {
        v = v.get(key)?;
    }
    v.get("@odata.id")?.as_str().map(str::to_owned)
}

/// Members that could not be read, summed up so that 32 missing PCIe devices are one line, not 32.
#[derive(Default)]
struct Failures {
    errors: Vec<RedfishError>,
}

impl Failures {
    fn report(self, what: &str, collection: &str, warnings: &mut Vec<String>) {
        match self.errors.len() {
            0 => {}
            1..=3 => warnings.extend(self.errors.iter().map(|e| format!("{what}: {e}"))),
            n => warnings.push(format!(
                "{what}: {n} members of {collection} could not be read; the first: {}",
                self.errors[0]
            )),
        }
    }
}

impl Bmc {
    /// What an inventory says of the BMC itself, before anything is read.
    fn inventory_header(&self) -> Inventory {
        Inventory {
            bmc: self.base_url().to_owned(),
            vendor: self.vendor_line(),
            redfish_version: self.service_root().redfish_version.clone(),
            quirks: self.quirks().name,
            expand: self.expand(),
            ..Inventory::default()
        }
    }

    /// The inventory of the one system at `path` (see [`Bmc::system_path`]) and of the chassis it links to, without
    /// the BMC's managers or its other systems: what inspecting one machine needs. A BMC that holds many systems (a
    /// chassis manager; sushy's fake driver, with 20 machines behind it in `scripts/bench metal`) is not read whole
    /// for each of its machines. Fails when the system itself cannot be read.
    pub async fn inventory_of(&self, path: &str) -> Result<Inventory, RedfishError> {
        let mut inv = self.inventory_header();
        let f = self.fetch::<ComputerSystem>(path).await?;
        let mut warnings: Vec<String> = f.warnings.iter().map(|w| format!("{path}: {w}")).collect();
        let mut chassis_by_path = BTreeMap::new();
        let s = self
            .system_inventory(
                path.to_owned(),
                f.value,
                &mut chassis_by_path,
                &mut warnings,
            )
            .await;
        inv.systems.push(s);
        inv.chassis = chassis_by_path.into_values().collect();
        inv.warnings = warnings;
        Ok(inv)
    }

    /// Reads the whole inventory. Fails only when the systems cannot be listed at all.
    pub async fn inventory(&self) -> Result<Inventory, RedfishError> {
        let root = self.service_root().clone();
        let mut inv = self.inventory_header();
        let mut warnings = Vec::new();
        if let Some(link) = &root.managers {
            inv.managers = self
                .read_members::<Manager>("managers", &link.odata_id, &mut warnings)
                .await
                .into_iter()
                .map(|(_, m)| m)
                .collect();
        }
        let mut chassis_by_path: BTreeMap<String, Chassis> = BTreeMap::new();
        if let Some(link) = &root.chassis {
            for (path, c) in self
                .read_members::<Chassis>("chassis", &link.odata_id, &mut warnings)
                .await
            {
                chassis_by_path.insert(normalize(&path), c.clone());
                inv.chassis.push(c);
            }
        }
        let systems = self.systems().await?;
        warnings.extend(systems.warnings.iter().cloned());
        for member in &systems.members {
            let f = match self.member::<ComputerSystem>(member).await {
                Ok(f) => f,
                Err(e) => {
                    warnings.push(format!("system: {e}"));
                    continue;
                }
            };
            let path = member.odata_id.clone();
            warnings.extend(f.warnings.iter().map(|w| format!("{path}: {w}")));
            let s = self
                .system_inventory(path, f.value, &mut chassis_by_path, &mut warnings)
                .await;
            inv.systems.push(s);
        }
        inv.warnings = warnings;
        Ok(inv)
    }

    async fn system_inventory(
        &self,
        path: String,
        system: ComputerSystem,
        chassis: &mut BTreeMap<String, Chassis>,
        warnings: &mut Vec<String>,
    ) -> SystemInventory {
        let mut s = SystemInventory {
            path: path.clone(),
            ..SystemInventory::default()
        };
        match &system.processors {
            Some(l) => match self
                .try_members::<Processor>("processors", &l.odata_id, warnings)
                .await
            {
                Some(items) => {
                    for (_, p) in items {
                        if absent(&p.status) {
                            s.count_absent("CPU sockets");
                        } else {
                            s.processors.push(p);
                        }
                    }
                }
                None => s.processors_from_summary = system.processor_summary.is_some(),
            },
            None => s.processors_from_summary = system.processor_summary.is_some(),
        }
        match &system.memory {
            Some(l) => match self
                .try_members::<Memory>("memory", &l.odata_id, warnings)
                .await
            {
                Some(items) => {
                    for (_, m) in items {
                        if absent(&m.status) {
                            s.count_absent("DIMM slots");
                        } else {
                            s.memory.push(m);
                        }
                    }
                }
                None => s.memory_from_summary = system.memory_summary.is_some(),
            },
            None => s.memory_from_summary = system.memory_summary.is_some(),
        }
        self.drives(&system, &mut s, chassis, warnings).await;
        if let Some(l) = &system.ethernet_interfaces {
            for (p, n) in self
                .read_members::<EthernetInterface>("ethernet interfaces", &l.odata_id, warnings)
                .await
            {
                self.classify_nic(&p, n, &mut s, warnings);
            }
        }
        self.pcie_and_gpus(&system, &mut s, chassis, warnings).await;
        s.system = system;
        s
    }

    fn classify_nic(
        &self,
        path: &str,
        mut n: EthernetInterface,
        s: &mut SystemInventory,
        warnings: &mut Vec<String>,
    ) {
        if let Some(mac) = n.mac_address.as_deref()
            && !valid_mac(mac)
        {
            if !mac.trim().is_empty() {
                warnings.push(format!("{path}: MACAddress {mac:?} is not a MAC address"));
            }
            n.mac_address = None;
        }
        let text = |v: &Option<String>| v.as_deref().unwrap_or_default().to_ascii_lowercase();
        let (name, id) = (text(&n.name), text(&n.id));
        let typed_virtual = n
            .ethernet_interface_type
            .as_deref()
            .is_some_and(|t| t.eq_ignore_ascii_case("Virtual"));
        let vlan_enabled = n.vlan.as_ref().is_some_and(|v| v.vlan_enable == Some(true));
        let vlan = typed_virtual && vlan_enabled || id.contains("vlan") || name.contains("vlan");
        let host_interface =
            n.links.host_interface.is_some() || name.contains("host interface") || typed_virtual;
        if absent(&n.status) {
            s.count_absent("NIC ports");
        } else if vlan {
            s.other_interfaces.push(OtherInterface::Vlan(n));
        } else if host_interface {
            s.other_interfaces.push(OtherInterface::Virtual(n));
        } else {
            s.nics.push(n);
        }
    }

    async fn drives(
        &self,
        system: &ComputerSystem,
        s: &mut SystemInventory,
        chassis: &mut BTreeMap<String, Chassis>,
        warnings: &mut Vec<String>,
    ) {
        let mut links: Vec<Link> = Vec::new();
        let mut storage_read = false;
        if let Some(l) = &system.storage
            && let Some(items) = self
                .try_members::<Storage>("storage", &l.odata_id, warnings)
                .await
        {
            storage_read = true;
            for (_, st) in items {
                links.extend(st.drives);
            }
        }
        if !storage_read || links.is_empty() {
            // No Storage: the drives of the system's chassis.
            for c in self.system_chassis(system, chassis, warnings).await {
                links.extend(c.links.drives.iter().cloned());
                if let Some(d) = &c.drives {
                    for (p, _) in self
                        .read_members::<Value>("chassis drives", &d.odata_id, warnings)
                        .await
                    {
                        links.push(Link { odata_id: p });
                    }
                }
            }
        }
        let mut seen = HashSet::new();
        let mut failures = Failures::default();
        for l in links {
            if !seen.insert(normalize(&l.odata_id)) {
                continue;
            }
            match self.fetch::<Drive>(&l.odata_id).await {
                Ok(f) => {
                    warnings.extend(f.warnings.iter().map(|w| format!("{}: {w}", l.odata_id)));
                    if absent(&f.value.status) {
                        s.count_absent("drive bays");
                    } else {
                        s.drives.push(f.value);
                    }
                }
                Err(e) => failures.errors.push(e),
            }
        }
        failures.report("drives", "the storage", warnings);
        if s.drives.is_empty()
            && let Some(l) = &system.simple_storage
        {
            for (_, simple) in self
                .read_members::<SimpleStorage>("simple storage", &l.odata_id, warnings)
                .await
            {
                for d in simple.devices {
                    if absent(&d.status) {
                        s.count_absent("drive bays");
                    } else {
                        s.drives.push(d);
                    }
                }
            }
        }
    }

    /// The chassis the system links to, read once per inventory.
    async fn system_chassis(
        &self,
        system: &ComputerSystem,
        chassis: &mut BTreeMap<String, Chassis>,
        warnings: &mut Vec<String>,
    ) -> Vec<Chassis> {
        let mut out = Vec::new();
        for l in &system.links.chassis {
            let key = normalize(&l.odata_id);
            if let Some(c) = chassis.get(&key) {
                out.push(c.clone());
                continue;
            }
            match self.fetch::<Chassis>(&l.odata_id).await {
                Ok(f) => {
                    chassis.insert(key, f.value.clone());
                    out.push(f.value);
                }
                Err(e) => warnings.push(format!("chassis of the system: {e}")),
            }
        }
        out
    }

    async fn pcie_and_gpus(
        &self,
        system: &ComputerSystem,
        s: &mut SystemInventory,
        chassis: &mut BTreeMap<String, Chassis>,
        warnings: &mut Vec<String>,
    ) {
        let mut seen = HashSet::new();
        let mut members: Vec<Member> = Vec::new();
        for l in &system.pcie_devices {
            if seen.insert(normalize(&l.odata_id)) {
                members.push(Member {
                    odata_id: l.odata_id.clone(),
                    body: Default::default(),
                });
            }
        }
        let system_chassis = self.system_chassis(system, chassis, warnings).await;
        for c in &system_chassis {
            let Some(l) = &c.pcie_devices else { continue };
            match self.list(&l.odata_id).await {
                Ok(listed) => {
                    warnings.extend(listed.warnings);
                    for m in listed.members {
                        if seen.insert(normalize(&m.odata_id)) {
                            members.push(m);
                        }
                    }
                }
                Err(e) => warnings.push(format!("PCIe devices: {e}")),
            }
        }
        let mut failures = Failures::default();
        for m in &members {
            match self.member::<PcieDevice>(m).await {
                Ok(f) if absent(&f.value.status) => s.count_absent("PCIe slots"),
                Ok(f) => s.pcie_devices.push(f.value),
                Err(e) => failures.errors.push(e),
            }
        }
        failures.report("PCIe devices", "PCIeDevices", warnings);

        // HPE iLO: PCI functions of the system, and devices (cards, GPUs) of the chassis.
        let mut pci_class: BTreeMap<String, Option<u64>> = BTreeMap::new();
        let standard_empty = s.pcie_devices.is_empty();
        if let Some(l) = oem_link(&system.oem, &["Hpe", "Links", "PCIDevices"]) {
            for (p, d) in self
                .read_members::<HpePciDevice>("HPE PCI devices", &l, warnings)
                .await
            {
                pci_class.insert(normalize(&p), d.class_code);
                let empty = d.class_code == Some(0xff);
                if standard_empty && !empty {
                    s.pcie_devices.push(PcieDevice {
                        id: d.id.clone(),
                        name: d.name.clone(),
                        model: d.name.clone(),
                        device_type: d.device_type.clone(),
                        ..PcieDevice::default()
                    });
                }
            }
        }
        let processor_gpus: Vec<Gpu> = s
            .processors
            .iter()
            .filter(|p| is_type(p, "GPU"))
            .map(|gpu| Gpu {
                id: gpu.id.clone(),
                manufacturer: gpu.manufacturer.clone(),
                model: gpu.model.clone(),
                serial_number: gpu.serial_number.clone(),
                health: gpu.status.as_ref().and_then(|st| st.health.clone()),
                path: system
                    .processors
                    .as_ref()
                    .map_or_else(String::new, |l| l.odata_id.clone()),
            })
            .collect();
        s.gpus = processor_gpus;
        if !s.gpus.is_empty() {
            return;
        }
        for c in &system_chassis {
            let Some(l) = oem_link(&c.oem, &["Hpe", "Links", "Devices"]) else {
                continue;
            };
            for (p, d) in self
                .read_members::<HpeDevice>("HPE devices", &l, warnings)
                .await
            {
                let typed_gpu = d
                    .device_type
                    .as_deref()
                    .is_some_and(|t| t.eq_ignore_ascii_case("GPU"));
                if !typed_gpu || absent(&d.status) {
                    continue;
                }
                // A GPU is a PCI function: of class 3 (display) or 0x12 (accelerator), or of a class not known
                // here. A device typed GPU with no PCI function (an HGX baseboard) is not one.
                let classes: Vec<Option<u64>> = d
                    .device_instances
                    .iter()
                    .filter_map(|i| pci_class.get(&normalize(&i.odata_id)).copied())
                    .collect();
                let gpu_class = !d.device_instances.is_empty()
                    && (classes.is_empty()
                        || classes
                            .iter()
                            .any(|c| c.is_none_or(|c| c == 3 || c == 0x12)));
                if gpu_class {
                    s.gpus.push(Gpu {
                        id: d.id.clone(),
                        manufacturer: d.manufacturer.clone(),
                        model: d.name.clone(),
                        serial_number: d.serial_number.clone().filter(|x| !x.is_empty()),
                        health: d.status.as_ref().and_then(|st| st.health.clone()),
                        path: p,
                    });
                }
            }
        }
    }

    /// The members of a collection, or `None` (with a warning) when the collection itself cannot be read.
    async fn try_members<T: DeserializeOwned>(
        &self,
        what: &str,
        collection: &str,
        warnings: &mut Vec<String>,
    ) -> Option<Vec<(String, T)>> {
        let listed = match self.list(collection).await {
            Ok(l) => l,
            Err(e) => {
                warnings.push(format!("{what}: {e}"));
                return None;
            }
        };
        warnings.extend(listed.warnings.iter().cloned());
        let mut out = Vec::with_capacity(listed.members.len());
        let mut failures = Failures::default();
        for m in &listed.members {
            match self.member::<T>(m).await {
                Ok(f) => {
                    warnings.extend(f.warnings.iter().map(|w| format!("{}: {w}", m.odata_id)));
                    out.push((m.odata_id.clone(), f.value));
                }
                Err(e) => failures.errors.push(e),
            }
        }
        failures.report(what, collection, warnings);
        Some(out)
    }

    async fn read_members<T: DeserializeOwned>(
        &self,
        what: &str,
        collection: &str,
        warnings: &mut Vec<String>,
    ) -> Vec<(String, T)> {
        self.try_members(what, collection, warnings)
            .await
            .unwrap_or_default()
    }
}
