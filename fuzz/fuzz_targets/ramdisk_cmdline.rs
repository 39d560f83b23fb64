#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = bcd_ramdisk::cmdline::split(s);
        if let Ok(params) = bcd_ramdisk::cmdline::parse(s) {
            // Agent mode hands the parsed values to bcd's configuration (gateway URL, pin, JoinService key).
            let _ = format!("{params:?}");
            let _ = bcd_ramdisk::agent::config_from_params(
                &params,
                std::path::Path::new("/nonexistent"),
            );
        }
    }
});
