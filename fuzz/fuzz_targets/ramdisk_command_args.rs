#![no_main]
//! The ramdisk's session-command arguments arrive from the control plane as JSON bytes: parsing never panics, for
//! every kind, whatever the bytes.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for kind in bcd_ramdisk::commands::KINDS {
        let _ = bcd_ramdisk::commands::parse(kind, data);
    }
});
