//! Hardware inventory over Redfish: systems with their processors (GPUs are processors with `ProcessorType`
//! `GPU`), memory, drives (Storage, or SimpleStorage on older BMCs), Ethernet interfaces and PCIe devices (on the
//! system, or on its chassis in newer schemas), plus managers and chassis. A member that cannot be read becomes a
//! warning in the inventory rather than failing the whole read; [`Inventory`]'s `Display` is the operator summary.

use std::collections::BTreeSet;
use std::fmt;

use serde::de::DeserializeOwned;

use super::client::Bmc;
use super::error::RedfishError;
use super::models::{
    Chassis, Collection, ComputerSystem, Drive, EthernetInterface, Manager, Memory, PcieDevice,
    Processor, SimpleStorage, Storage,
};

/// Collection pages followed at most (`Members@odata.nextLink`).
const MAX_PAGES: usize = 32;

#[derive(Debug, Clone, Default)]
pub struct Inventory {
    pub bmc: String,
    pub vendor: Option<String>,
    pub redfish_version: Option<String>,
    pub quirks: &'static str,
    pub managers: Vec<Manager>,
    pub chassis: Vec<Chassis>,
    pub systems: Vec<SystemInventory>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Default)]
pub struct SystemInventory {
    pub path: String,
    pub system: ComputerSystem,
    pub processors: Vec<Processor>,
    pub memory: Vec<Memory>,
    pub drives: Vec<Drive>,
    pub nics: Vec<EthernetInterface>,
    pub pcie_devices: Vec<PcieDevice>,
}

fn is_type(p: &Processor, t: &str) -> bool {
    p.processor_type
        .as_deref()
        .is_some_and(|pt| pt.eq_ignore_ascii_case(t))
}

impl SystemInventory {
    pub fn gpus(&self) -> impl Iterator<Item = &Processor> {
        self.processors.iter().filter(|p| is_type(p, "GPU"))
    }

    /// Processors typed `CPU`, or untyped (older BMCs omit the type for CPUs).
    pub fn cpus(&self) -> impl Iterator<Item = &Processor> {
        self.processors
            .iter()
            .filter(|p| p.processor_type.is_none() || is_type(p, "CPU"))
    }

    pub fn memory_mib(&self) -> u64 {
        self.memory.iter().filter_map(|m| m.capacity_mib).sum()
    }
}

impl Bmc {
    /// Reads the whole inventory. Fails only when the systems cannot be listed.
    pub async fn inventory(&self) -> Result<Inventory, RedfishError> {
        let root = self.service_root().clone();
        let mut inv = Inventory {
            bmc: self.base_url().to_owned(),
            vendor: root.vendor.clone(),
            redfish_version: root.redfish_version.clone(),
            quirks: self.quirks().name,
            ..Inventory::default()
        };
        let mut warnings = Vec::new();
        if let Some(link) = &root.managers {
            inv.managers = self.members::<Manager>(&link.odata_id, &mut warnings).await;
        }
        if let Some(link) = &root.chassis {
            inv.chassis = self.members::<Chassis>(&link.odata_id, &mut warnings).await;
        }
        for path in self.systems().await? {
            let (system, _) = match self.get::<ComputerSystem>(&path).await {
                Ok(s) => s,
                Err(e) => {
                    warnings.push(e.to_string());
                    continue;
                }
            };
            let mut s = SystemInventory {
                path: path.clone(),
                ..SystemInventory::default()
            };
            if let Some(l) = &system.processors {
                s.processors = self.members(&l.odata_id, &mut warnings).await;
            }
            if let Some(l) = &system.memory {
                s.memory = self.members(&l.odata_id, &mut warnings).await;
            }
            if let Some(l) = &system.storage {
                for storage in self.members::<Storage>(&l.odata_id, &mut warnings).await {
                    for d in &storage.drives {
                        match self.get::<Drive>(&d.odata_id).await {
                            Ok((drive, _)) => s.drives.push(drive),
                            Err(e) => warnings.push(e.to_string()),
                        }
                    }
                }
            }
            if s.drives.is_empty()
                && let Some(l) = &system.simple_storage
            {
                for simple in self
                    .members::<SimpleStorage>(&l.odata_id, &mut warnings)
                    .await
                {
                    let present = simple.devices.into_iter().filter(|d| {
                        d.status.as_ref().and_then(|st| st.state.as_deref()) != Some("Absent")
                    });
                    s.drives.extend(present);
                }
            }
            if let Some(l) = &system.ethernet_interfaces {
                s.nics = self.members(&l.odata_id, &mut warnings).await;
            }
            let mut pcie: BTreeSet<String> = system
                .pcie_devices
                .iter()
                .map(|l| l.odata_id.clone())
                .collect();
            for chassis_link in &system.links.chassis {
                if let Ok((chassis, _)) = self.get::<Chassis>(&chassis_link.odata_id).await
                    && let Some(l) = chassis.pcie_devices
                    && let Ok(paths) = self.member_paths(&l.odata_id).await
                {
                    pcie.extend(paths);
                }
            }
            for p in pcie {
                match self.get::<PcieDevice>(&p).await {
                    Ok((dev, _)) => s.pcie_devices.push(dev),
                    Err(e) => warnings.push(e.to_string()),
                }
            }
            s.system = system;
            inv.systems.push(s);
        }
        inv.warnings = warnings;
        Ok(inv)
    }

    async fn member_paths(&self, collection: &str) -> Result<Vec<String>, RedfishError> {
        let mut paths = Vec::new();
        let mut next = Some(collection.to_owned());
        for _ in 0..MAX_PAGES {
            let Some(page) = next.take() else { break };
            let (c, _) = self.get::<Collection>(&page).await?;
            paths.extend(c.members.into_iter().map(|l| l.odata_id));
            next = c.next_link;
        }
        Ok(paths)
    }

    async fn members<T: DeserializeOwned>(
        &self,
        collection: &str,
        warnings: &mut Vec<String>,
    ) -> Vec<T> {
        let paths = match self.member_paths(collection).await {
            Ok(p) => p,
            Err(e) => {
                warnings.push(e.to_string());
                return Vec::new();
            }
        };
        let mut out = Vec::with_capacity(paths.len());
        for p in paths {
            match self.get::<T>(&p).await {
                Ok((v, _)) => out.push(v),
                Err(e) => warnings.push(e.to_string()),
            }
        }
        out
    }
}

fn s(v: &Option<String>) -> &str {
    v.as_deref().unwrap_or("?")
}

fn health(st: &Option<super::models::Status>) -> &str {
    st.as_ref().and_then(|s| s.health.as_deref()).unwrap_or("-")
}

impl fmt::Display for Inventory {
    /// The operator summary of `bcd site redfish <url> inspect`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "BMC {} (vendor {}, Redfish {}, quirks {})",
            self.bmc,
            s(&self.vendor),
            s(&self.redfish_version),
            self.quirks
        )?;
        for m in &self.managers {
            writeln!(
                f,
                "  manager {}: {} firmware {} health {}",
                s(&m.id),
                s(&m.model),
                s(&m.firmware_version),
                health(&m.status)
            )?;
        }
        for c in &self.chassis {
            writeln!(
                f,
                "  chassis {}: {} {} serial {}",
                s(&c.id),
                s(&c.manufacturer),
                s(&c.model),
                s(&c.serial_number)
            )?;
        }
        for sys in &self.systems {
            let x = &sys.system;
            writeln!(f, "system {} ({})", s(&x.id), sys.path)?;
            writeln!(
                f,
                "  {} {} serial {} uuid {}",
                s(&x.manufacturer),
                s(&x.model),
                s(&x.serial_number),
                s(&x.uuid)
            )?;
            let boot = x.boot.clone().unwrap_or_default();
            writeln!(
                f,
                "  power {}, health {}, BIOS {}, boot override {}/{} mode {}",
                s(&x.power_state),
                health(&x.status),
                s(&x.bios_version),
                s(&boot.boot_source_override_target),
                s(&boot.boot_source_override_enabled),
                s(&boot.boot_source_override_mode)
            )?;
            let cpus: Vec<&Processor> = sys.cpus().collect();
            let cores: u64 = cpus.iter().filter_map(|p| p.total_cores).sum();
            writeln!(f, "  cpus: {} ({} cores)", cpus.len(), cores)?;
            for p in &cpus {
                writeln!(f, "    {}: {} {}", s(&p.id), s(&p.model), health(&p.status))?;
            }
            let gpus: Vec<&Processor> = sys.gpus().collect();
            writeln!(f, "  gpus: {}", gpus.len())?;
            for p in &gpus {
                writeln!(
                    f,
                    "    {}: {} {} serial {} {}",
                    s(&p.id),
                    s(&p.manufacturer),
                    s(&p.model),
                    s(&p.serial_number),
                    health(&p.status)
                )?;
            }
            let others: Vec<&Processor> = sys
                .processors
                .iter()
                .filter(|p| !cpus.contains(p) && !gpus.contains(p))
                .collect();
            for p in others {
                writeln!(
                    f,
                    "  other processor {}: {} {} ({})",
                    s(&p.id),
                    s(&p.manufacturer),
                    s(&p.model),
                    s(&p.processor_type)
                )?;
            }
            writeln!(
                f,
                "  memory: {} modules, {} GiB",
                sys.memory.len(),
                sys.memory_mib() / 1024
            )?;
            writeln!(f, "  drives: {}", sys.drives.len())?;
            for d in &sys.drives {
                let gb = d
                    .capacity_bytes
                    .map_or("?".to_owned(), |b| format!("{} GB", b / 1_000_000_000));
                writeln!(
                    f,
                    "    {}: {} {} {}",
                    s(&d.name),
                    s(&d.model),
                    gb,
                    health(&d.status)
                )?;
            }
            writeln!(f, "  nics: {}", sys.nics.len())?;
            for n in &sys.nics {
                let speed = n.speed_mbps.map_or("?".to_owned(), |m| format!("{m} Mb/s"));
                writeln!(
                    f,
                    "    {}: {} {} link {}",
                    s(&n.id),
                    s(&n.mac_address),
                    speed,
                    s(&n.link_status)
                )?;
            }
            writeln!(f, "  pcie devices: {}", sys.pcie_devices.len())?;
            for d in &sys.pcie_devices {
                writeln!(
                    f,
                    "    {}: {} {} ({})",
                    s(&d.id),
                    s(&d.manufacturer),
                    s(&d.model),
                    s(&d.device_type)
                )?;
            }
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        Ok(())
    }
}
