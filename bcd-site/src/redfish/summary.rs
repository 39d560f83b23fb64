//! The operator summary of `bcd site redfish <url> inspect`: `Display` of [`Inventory`]. Plain text, no Rust
//! `Debug` forms; `?` where the BMC did not say.

use std::fmt;

use super::inventory::{Inventory, OtherInterface};
use super::models::{Processor, Status};

fn s(v: &Option<String>) -> &str {
    v.as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or("?")
}

fn health(st: &Option<Status>) -> &str {
    st.as_ref().and_then(|s| s.health.as_deref()).unwrap_or("-")
}

impl fmt::Display for Inventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "BMC {} (vendor {}, Redfish {}, quirks {}{})",
            self.bmc,
            self.vendor,
            s(&self.redfish_version),
            self.quirks,
            self.expand
                .map(|q| format!(", collections read with {q}"))
                .unwrap_or_default()
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
        if self.systems.is_empty() {
            writeln!(
                f,
                "no systems (a chassis or enclosure manager, or a switch)"
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
            match &x.boot {
                Some(boot) => writeln!(
                    f,
                    "  power {}, health {}, BIOS {}, boot override {}/{} mode {}",
                    s(&x.power_state),
                    health(&x.status),
                    s(&x.bios_version),
                    s(&boot.boot_source_override_target),
                    s(&boot.boot_source_override_enabled),
                    s(&boot.boot_source_override_mode)
                )?,
                None => writeln!(
                    f,
                    "  power {}, health {}, BIOS {}, no boot override (no Boot object)",
                    s(&x.power_state),
                    health(&x.status),
                    s(&x.bios_version)
                )?,
            }
            if sys.processors_from_summary {
                let ps = x.processor_summary.clone().unwrap_or_default();
                writeln!(
                    f,
                    "  cpus: {} ({}; from ProcessorSummary, the Processors collection could not be read)",
                    sys.cpu_count(),
                    s(&ps.model)
                )?;
            } else {
                let cpus: Vec<&Processor> = sys.cpus().collect();
                let cores = cpus
                    .iter()
                    .filter_map(|p| p.total_cores)
                    .fold(0u64, u64::saturating_add);
                writeln!(f, "  cpus: {} ({} cores)", cpus.len(), cores)?;
                for p in &cpus {
                    writeln!(f, "    {}: {} {}", s(&p.id), s(&p.model), health(&p.status))?;
                }
            }
            writeln!(f, "  gpus: {}", sys.gpus.len())?;
            for g in &sys.gpus {
                writeln!(
                    f,
                    "    {}: {} {} serial {} {}",
                    s(&g.id),
                    s(&g.manufacturer),
                    s(&g.model),
                    s(&g.serial_number),
                    g.health.as_deref().unwrap_or("-")
                )?;
            }
            for p in sys.processors.iter().filter(|p| {
                p.processor_type.as_deref().is_some_and(|t| {
                    !t.eq_ignore_ascii_case("CPU") && !t.eq_ignore_ascii_case("GPU")
                })
            }) {
                writeln!(
                    f,
                    "  other processor {}: {} {} ({})",
                    s(&p.id),
                    s(&p.manufacturer),
                    s(&p.model),
                    s(&p.processor_type)
                )?;
            }
            if sys.memory_from_summary {
                writeln!(
                    f,
                    "  memory: {} GiB (from MemorySummary, the Memory collection could not be read)",
                    sys.memory_mib() / 1024
                )?;
            } else {
                writeln!(
                    f,
                    "  memory: {} modules, {} GiB",
                    sys.memory.len(),
                    sys.memory_mib() / 1024
                )?;
            }
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
                    n.mac_address.as_deref().unwrap_or("no MAC"),
                    speed,
                    s(&n.link_status)
                )?;
            }
            for o in &sys.other_interfaces {
                let (kind, n) = match o {
                    OtherInterface::Vlan(n) => ("VLAN", n),
                    OtherInterface::Virtual(n) => ("virtual interface", n),
                };
                writeln!(
                    f,
                    "  {kind} {}: {}",
                    s(&n.id),
                    n.mac_address.as_deref().unwrap_or("no MAC")
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
            if !sys.absent.is_empty() {
                let parts: Vec<String> =
                    sys.absent.iter().map(|(k, n)| format!("{n} {k}")).collect();
                writeln!(f, "  empty (Absent, not counted): {}", parts.join(", "))?;
            }
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        Ok(())
    }
}
