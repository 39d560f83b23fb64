#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = bcd_ramdisk::cmdline::split(s);
        let _ = bcd_ramdisk::cmdline::parse(s);
    }
});
