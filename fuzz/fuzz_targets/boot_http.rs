#![no_main]
use bcd_site::dhcp::MacAddr;
use bcd_site::http::conditional::{self, Precondition, Validators};
use bcd_site::http::range::{RangeDecision, decide};
use bcd_site::http::request::{self, MAX_HEAD, Parsed};
use bcd_site::http::{DesiredBoot, render_script};
use libfuzzer_sys::fuzz_target;

// The boot HTTP server's parsers of outside input, on the same bytes:
// - the whole input as a request head (Host and target rules, the header fields), then its preconditions
//   (If-Match, If-None-Match, If-Modified-Since, If-Unmodified-Since, If-Range) against a fixed file;
// - as "<Range header>\n<file length>\n<kernel>\n<initrd>\n<cmdline>": Range, and the control plane's desired boot
//   rendered as an iPXE script.
fuzz_target!(|data: &[u8]| {
    match request::parse(data) {
        Ok(Parsed::Complete { head, len }) => {
            assert!(len <= data.len());
            if let Some(target) = &head.target {
                assert!(target.starts_with('/'), "origin form: {target:?}");
            }
            // The validators of a file modified at 2026-11-29 00:00:00 UTC, 1 MiB long.
            let v = Validators::for_file(1_795_910_400, 1 << 20);
            let get = conditional::evaluate(&head.conditions, true, &v);
            let other = conditional::evaluate(&head.conditions, false, &v);
            // Only GET and HEAD are ever answered 304.
            assert_ne!(other, Precondition::NotModified);
            if get == Precondition::Failed {
                assert_eq!(other, Precondition::Failed);
            }
            if let Some(value) = &head.if_range {
                let _ = conditional::if_range_holds(value, &v);
            }
        }
        Ok(Parsed::Partial) => assert!(data.len() < MAX_HEAD),
        Err(rejection) => assert!(matches!(rejection.status, 400 | 431)),
    }

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
