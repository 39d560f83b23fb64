//! Fuzz the GPU fixture parser (JSON with faults) and diag.nvml over whatever it yields: neither may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(file) = bcd::gpu::fixture::parse(text) {
        let health = file.health();
        let _ = file.infos();
        let report = bcd::diag::check(&health, &bcd::diag::DiagPolicy::new(8));
        let _ = report.to_json();
    }
    if let Ok(policy) = bcd::diag::DiagPolicy::from_json(data) {
        let _ = bcd::diag::check(&[], &policy);
    }
    let _ = bcd::inventory::host::parse_cpuinfo(text);
    let _ = bcd::inventory::host::parse_meminfo(text);
});
