#![no_main]
//! What devices and the kernel hand the ramdisk: NVMe Identify Controller and SMART pages, /proc/cpuinfo and
//! /proc/meminfo text, rtnetlink replies. No input may panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut page = data.to_vec();
    page.resize(4096, 0);
    let _ = bcd_ramdisk::wipe::NvmeCapabilities::from_identify_controller(&page);
    let _ = bcd_ramdisk::diagnose::SmartHealth::parse(data);
    let _ = bcd_ramdisk::os::netlink::decode_ack(data, 1);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = bcd_ramdisk::diagnose::parse_cpuinfo(s);
        let _ = bcd_ramdisk::diagnose::parse_meminfo(s);
    }
});
