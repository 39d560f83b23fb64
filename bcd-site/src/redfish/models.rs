//! The Redfish resources this client reads, as serde models of its own (DSP0268 names, `PascalCase` on the wire).
//!
//! Every field is optional or defaulted: BMCs omit, null or misspell properties freely, and a missing property must
//! surface as "unknown" in the inventory rather than fail the whole read. Unknown properties are ignored.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `null` reads as the default (BMCs write `"Members": null`, `"PCIeDevices": null`).
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `{"@odata.id": "/redfish/v1/..."}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    #[serde(rename = "@odata.id", default)]
    pub odata_id: String,
}

/// `Status` of any resource.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Status {
    pub state: Option<String>,
    pub health: Option<String>,
}

/// A collection member: a link, or with `$expand` the member itself (`body` holds its other properties).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Member {
    #[serde(rename = "@odata.id", default)]
    pub odata_id: String,
    #[serde(flatten)]
    pub body: serde_json::Map<String, Value>,
}

impl Member {
    /// The member was inlined (`$expand`): it has properties beyond the `@odata.*` annotations.
    pub fn is_expanded(&self) -> bool {
        self.body.keys().any(|k| !k.starts_with("@odata."))
    }
}

/// Any resource collection.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Collection {
    #[serde(rename = "Members", deserialize_with = "nullable")]
    pub members: Vec<Member>,
    #[serde(rename = "Members@odata.count")]
    pub count: Option<u64>,
    #[serde(rename = "Members@odata.nextLink")]
    pub next_link: Option<String>,
}

/// `ProtocolFeaturesSupported.ExpandQuery` of the service root (DSP0266 `$expand`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ExpandQuery {
    /// `$expand=*`
    pub expand_all: Option<bool>,
    /// `($levels=n)`
    pub levels: Option<bool>,
    /// `$expand=~`
    pub links: Option<bool>,
    /// `$expand=.`
    pub no_links: Option<bool>,
    pub max_levels: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ProtocolFeaturesSupported {
    pub expand_query: Option<ExpandQuery>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ServiceRootLinks {
    pub sessions: Option<Link>,
}

/// `/redfish/v1`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ServiceRoot {
    pub id: Option<String>,
    pub name: Option<String>,
    pub redfish_version: Option<String>,
    #[serde(rename = "UUID")]
    pub uuid: Option<String>,
    /// Since ServiceRoot 1.5 (`Dell`, `HPE`, `Supermicro`, `AMI`, …).
    pub vendor: Option<String>,
    pub product: Option<String>,
    pub systems: Option<Link>,
    pub managers: Option<Link>,
    pub chassis: Option<Link>,
    pub session_service: Option<Link>,
    pub links: ServiceRootLinks,
    pub protocol_features_supported: Option<ProtocolFeaturesSupported>,
    /// Vendor extensions; only the key names are used (an `Hpe`, `Dell`, `Supermicro` or `Ami` key names the
    /// vendor on BMCs older than the `Vendor` property).
    pub oem: Option<Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct SessionService {
    pub service_enabled: Option<bool>,
    pub session_timeout: Option<u64>,
    pub sessions: Option<Link>,
}

/// `Boot` of a ComputerSystem.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Boot {
    pub boot_source_override_target: Option<String>,
    pub boot_source_override_enabled: Option<String>,
    pub boot_source_override_mode: Option<String>,
    #[serde(rename = "BootSourceOverrideTarget@Redfish.AllowableValues")]
    pub allowed_targets: Option<Vec<String>>,
    pub http_boot_uri: Option<String>,
}

/// `#ComputerSystem.Reset` in `Actions`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ResetAction {
    pub target: Option<String>,
    #[serde(rename = "ResetType@Redfish.AllowableValues")]
    pub allowed: Option<Vec<String>>,
    #[serde(rename = "@Redfish.ActionInfo")]
    pub action_info: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SystemActions {
    #[serde(rename = "#ComputerSystem.Reset")]
    pub reset: Option<ResetAction>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ProcessorSummary {
    pub count: Option<u64>,
    pub model: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct MemorySummary {
    #[serde(rename = "TotalSystemMemoryGiB")]
    pub total_system_memory_gib: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct SystemLinks {
    #[serde(deserialize_with = "nullable")]
    pub chassis: Vec<Link>,
    #[serde(deserialize_with = "nullable")]
    pub managed_by: Vec<Link>,
}

/// A ComputerSystem.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ComputerSystem {
    #[serde(rename = "@odata.id")]
    pub odata_id: Option<String>,
    #[serde(rename = "@odata.etag")]
    pub odata_etag: Option<String>,
    pub id: Option<String>,
    pub name: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial_number: Option<String>,
    #[serde(rename = "UUID")]
    pub uuid: Option<String>,
    pub power_state: Option<String>,
    pub boot: Option<Boot>,
    pub bios_version: Option<String>,
    pub processor_summary: Option<ProcessorSummary>,
    pub memory_summary: Option<MemorySummary>,
    pub processors: Option<Link>,
    pub memory: Option<Link>,
    pub storage: Option<Link>,
    pub simple_storage: Option<Link>,
    pub ethernet_interfaces: Option<Link>,
    /// ComputerSystem ≤ 1.x kept PCIe devices here; newer ones keep them on the Chassis.
    #[serde(rename = "PCIeDevices", deserialize_with = "nullable")]
    pub pcie_devices: Vec<Link>,
    pub actions: SystemActions,
    pub links: SystemLinks,
    pub status: Option<Status>,
    /// Vendor extensions (HPE's `Oem.Hpe.Links.PCIDevices`).
    pub oem: Option<Value>,
}

/// A Manager (the BMC itself).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Manager {
    pub id: Option<String>,
    pub name: Option<String>,
    pub manager_type: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub firmware_version: Option<String>,
    pub status: Option<Status>,
    /// Vendor extensions; only the key names are used, to identify the vendor.
    pub oem: Option<Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ChassisLinks {
    /// Drives of the chassis (where a BMC has no Storage on the system).
    #[serde(deserialize_with = "nullable")]
    pub drives: Vec<Link>,
    #[serde(deserialize_with = "nullable")]
    pub computer_systems: Vec<Link>,
}

/// A Chassis.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Chassis {
    pub id: Option<String>,
    pub name: Option<String>,
    pub chassis_type: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial_number: Option<String>,
    #[serde(rename = "PCIeDevices")]
    pub pcie_devices: Option<Link>,
    /// Chassis ≥ 1.14: a collection of the chassis' drives.
    pub drives: Option<Link>,
    pub links: ChassisLinks,
    pub status: Option<Status>,
    /// Vendor extensions (HPE's `Oem.Hpe.Links.Devices`).
    pub oem: Option<Value>,
}

/// A Processor: CPUs, and GPUs/FPGAs/accelerators (`ProcessorType`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Processor {
    pub id: Option<String>,
    pub name: Option<String>,
    /// `CPU`, `GPU`, `FPGA`, `DSP`, `Accelerator`, `Core`, `Thread`, `OEM`.
    pub processor_type: Option<String>,
    pub processor_architecture: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub socket: Option<String>,
    pub total_cores: Option<u64>,
    pub total_threads: Option<u64>,
    #[serde(rename = "MaxSpeedMHz")]
    pub max_speed_mhz: Option<u64>,
    pub serial_number: Option<String>,
    pub status: Option<Status>,
}

/// A Memory module.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Memory {
    pub id: Option<String>,
    pub name: Option<String>,
    #[serde(rename = "CapacityMiB")]
    pub capacity_mib: Option<u64>,
    pub memory_device_type: Option<String>,
    pub operating_speed_mhz: Option<u64>,
    pub manufacturer: Option<String>,
    pub part_number: Option<String>,
    pub serial_number: Option<String>,
    pub device_locator: Option<String>,
    pub status: Option<Status>,
}

/// A Storage subsystem.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Storage {
    pub id: Option<String>,
    pub name: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub drives: Vec<Link>,
    pub status: Option<Status>,
}

/// A Drive.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Drive {
    pub id: Option<String>,
    pub name: Option<String>,
    pub capacity_bytes: Option<u64>,
    pub media_type: Option<String>,
    pub protocol: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial_number: Option<String>,
    pub status: Option<Status>,
}

/// SimpleStorage (older BMCs and the DMTF mockup): devices inline.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct SimpleStorage {
    pub id: Option<String>,
    pub name: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub devices: Vec<Drive>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Vlan {
    #[serde(rename = "VLANEnable")]
    pub vlan_enable: Option<bool>,
    #[serde(rename = "VLANId")]
    pub vlan_id: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct EthernetInterfaceLinks {
    /// Set on the host's end of the Redfish host interface (EthernetInterface ≥ 1.6).
    pub host_interface: Option<Link>,
}

/// An EthernetInterface of a system.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct EthernetInterface {
    pub id: Option<String>,
    pub name: Option<String>,
    pub description: Option<String>,
    /// `Physical` or `Virtual` (EthernetInterface ≥ 1.6).
    pub ethernet_interface_type: Option<String>,
    #[serde(rename = "VLAN")]
    pub vlan: Option<Vlan>,
    pub links: EthernetInterfaceLinks,
    #[serde(rename = "MACAddress")]
    pub mac_address: Option<String>,
    #[serde(rename = "PermanentMACAddress")]
    pub permanent_mac_address: Option<String>,
    pub speed_mbps: Option<u64>,
    pub link_status: Option<String>,
    pub interface_enabled: Option<bool>,
    pub status: Option<Status>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct PcieInterface {
    #[serde(rename = "PCIeType")]
    pub pcie_type: Option<String>,
    #[serde(rename = "MaxPCIeType")]
    pub max_pcie_type: Option<String>,
    pub lanes_in_use: Option<u64>,
    pub max_lanes: Option<u64>,
}

/// A PCIeDevice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct PcieDevice {
    pub id: Option<String>,
    pub name: Option<String>,
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial_number: Option<String>,
    pub device_type: Option<String>,
    #[serde(rename = "PCIeInterface")]
    pub pcie_interface: Option<PcieInterface>,
    pub status: Option<Status>,
}

/// HPE iLO's `HpeServerDevice` (`Chassis/<id>/Devices/<n>`): cards and GPUs, with the PCI functions they are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct HpeDevice {
    pub id: Option<String>,
    pub name: Option<String>,
    /// `GPU`, `LOM/NIC`, `Smart Storage`, `Unknown`, …
    pub device_type: Option<String>,
    pub manufacturer: Option<String>,
    pub part_number: Option<String>,
    pub serial_number: Option<String>,
    pub location: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub device_instances: Vec<Link>,
    pub status: Option<Status>,
}

/// HPE iLO's `HpePciDevice` (`Systems/<id>/PCIDevices/<n>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct HpePciDevice {
    pub id: Option<String>,
    pub name: Option<String>,
    pub device_type: Option<String>,
    /// PCI base class (3 display controller, 0x12 processing accelerator, 0xff empty slot).
    pub class_code: Option<u64>,
    pub subclass_code: Option<u64>,
    pub structured_name: Option<String>,
    pub location_string: Option<String>,
    pub vendor_id: Option<u64>,
    pub device_id: Option<u64>,
}

/// `@Redfish.ActionInfo` of a reset action.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ActionInfo {
    #[serde(deserialize_with = "nullable")]
    pub parameters: Vec<ActionParameter>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ActionParameter {
    pub name: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub allowable_values: Vec<String>,
}

/// One `@Message.ExtendedInfo` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ExtendedMessage {
    pub message_id: Option<String>,
    pub message: Option<String>,
    pub resolution: Option<String>,
    pub severity: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorDetail {
    pub code: Option<String>,
    pub message: Option<String>,
    #[serde(rename = "@Message.ExtendedInfo", deserialize_with = "nullable")]
    pub extended_info: Vec<ExtendedMessage>,
}

/// A Redfish error body `{"error": {...}}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl ErrorBody {
    /// The most useful text a BMC gave: extended messages (with their ids) or the top-level message.
    pub fn summary(&self) -> Option<String> {
        let parts: Vec<String> = self
            .error
            .extended_info
            .iter()
            .filter_map(|m| {
                let text = m.message.as_deref()?;
                Some(match &m.message_id {
                    Some(id) => format!("{text} ({id})"),
                    None => text.to_owned(),
                })
            })
            .collect();
        if !parts.is_empty() {
            return Some(parts.join("; "));
        }
        match (&self.error.message, &self.error.code) {
            (Some(m), Some(c)) => Some(format!("{m} ({c})")),
            (Some(m), None) => Some(m.clone()),
            (None, Some(c)) => Some(c.clone()),
            (None, None) => None,
        }
    }

    /// Every message id, for matching against the quirk table's busy ids.
    pub fn message_ids(&self) -> impl Iterator<Item = &str> {
        self.error.code.iter().map(String::as_str).chain(
            self.error
                .extended_info
                .iter()
                .filter_map(|m| m.message_id.as_deref()),
        )
    }
}

/// Decodes every model from the same bytes, strictly and leniently ([`super::decode`]); the fuzz target's entry
/// point. Never panics.
pub fn decode_all(data: &[u8]) {
    fn one<T: serde::de::DeserializeOwned>(data: &[u8]) {
        let _ = serde_json::from_slice::<T>(data);
    }
    one::<ServiceRoot>(data);
    one::<SessionService>(data);
    one::<Collection>(data);
    one::<ComputerSystem>(data);
    one::<Manager>(data);
    one::<Chassis>(data);
    one::<Processor>(data);
    one::<Memory>(data);
    one::<Storage>(data);
    one::<Drive>(data);
    one::<SimpleStorage>(data);
    one::<EthernetInterface>(data);
    one::<PcieDevice>(data);
    one::<ActionInfo>(data);
    one::<HpeDevice>(data);
    one::<HpePciDevice>(data);
    fn lenient<T: serde::de::DeserializeOwned>(data: &[u8]) {
        let _ = super::decode::decode::<T>(data);
    }
    lenient::<ServiceRoot>(data);
    lenient::<Collection>(data);
    lenient::<ComputerSystem>(data);
    lenient::<Manager>(data);
    lenient::<Chassis>(data);
    lenient::<Processor>(data);
    lenient::<Memory>(data);
    lenient::<Storage>(data);
    lenient::<Drive>(data);
    lenient::<SimpleStorage>(data);
    lenient::<EthernetInterface>(data);
    lenient::<PcieDevice>(data);
    lenient::<HpeDevice>(data);
    lenient::<HpePciDevice>(data);
    if let Ok(e) = serde_json::from_slice::<ErrorBody>(data) {
        let _ = e.summary();
        let _ = e.message_ids().count();
    }
}
