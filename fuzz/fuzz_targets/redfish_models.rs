#![no_main]
use libfuzzer_sys::fuzz_target;

// Every Redfish model (service root, systems, managers, chassis, processors, memory, storage, NICs, PCIe devices,
// action info, error bodies) decoded from the same arbitrary bytes with serde_json: errors are fine, panics are not.
fuzz_target!(|data: &[u8]| {
    bcd_site::redfish::models::decode_all(data);
});
