#![no_main]
use bcd_site::dhcp::MacAddr;
use bcd_site::http::range::{RangeDecision, decide};
use bcd_site::http::{DesiredBoot, render_script};
use libfuzzer_sys::fuzz_target;

// Input: "<Range header>\n<file length>\n<kernel>\n<initrd>\n<cmdline>": the boot HTTP server's parsers of outside
// input (Range) and of control-plane data (the desired boot rendered as an iPXE script).
fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = s.splitn(5, '\n');
    let range = lines.next();
    let len = lines
        .next()
        .and_then(|l| l.parse::<u64>().ok())
        .unwrap_or(1 << 20);
    if let RangeDecision::Partial { first, last } = decide(range, len) {
        assert!(first <= last && last < len);
    }
    let boot = DesiredBoot {
        kernel: lines.next().unwrap_or_default().to_owned(),
        initrd: lines.next().map(str::to_owned),
        cmdline: lines.next().unwrap_or_default().to_owned(),
    };
    if let Ok(script) = render_script(&MacAddr([2, 0, 0, 0, 0, 1]), &boot) {
        // A rendered script never carries more commands than kernel, initrd and boot.
        assert!(script.lines().count() <= 5);
    }
});
