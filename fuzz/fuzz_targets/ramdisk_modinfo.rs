#![no_main]
//! Kernel module metadata: the ELF section walk and (compressed) module decoding must never panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = bcd_ramdisk::modules::ModInfo::from_ko(data, "fuzz");
    let _ = bcd_ramdisk::modules::ModInfo::from_modinfo(data, "fuzz");
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = bcd_ramdisk::modules::parse_builtin(s);
    }
});
