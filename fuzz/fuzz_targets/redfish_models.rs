#![no_main]
use libfuzzer_sys::fuzz_target;

// Every Redfish model (service root, systems, managers, chassis, processors, memory, storage, NICs, PCIe devices,
// action info, error bodies) decoded from the same arbitrary bytes with serde_json: errors are fine, panics are not.
// The same bytes as a BMC secret (`{"username": …, "password": …}`): parsed or refused, never a panic.
fuzz_target!(|data: &[u8]| {
    bcd_site::redfish::models::decode_all(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = bcd_site::redfish::Credentials::from_secret_json(text);
    }
});
