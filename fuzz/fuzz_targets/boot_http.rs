#![no_main]
use bcd_site::dhcp::MacAddr;
use bcd_site::http::conditional::{self, Precondition, Validators};
use bcd_site::http::range::{RangeDecision, decide};
use bcd_site::http::request::{self, MAX_HEAD, Parsed};
use bcd_site::http::{DesiredBoot, render_script};
use libfuzzer_sys::fuzz_target;

/// Header fields the server reads; a structured head picks among them so that every one is reached.
const FIELDS: [&str; 11] = [
    "Host",
    "If-None-Match",
    "If-Match",
    "If-Modified-Since",
    "If-Unmodified-Since",
    "If-Range",
    "Range",
    "Connection",
    "Content-Length",
    "Transfer-Encoding",
    "X-Other",
];

/// The request head parser and the preconditions of a file on `head`.
fn check_head(head: &[u8]) {
    match request::parse(head) {
        Ok(Parsed::Complete { head: req, len }) => {
            assert!(len <= head.len());
            if let Some(target) = &req.target {
                assert!(target.starts_with('/'), "origin form: {target:?}");
            }
            // The validators of a file modified at 2026-11-29 00:00:00 UTC, 1 MiB long.
            let v = Validators::for_file(1_795_910_400, 1 << 20);
            let get = conditional::evaluate(&req.conditions, true, &v);
            let other = conditional::evaluate(&req.conditions, false, &v);
            // Only GET and HEAD are ever answered 304; If-Match / If-Unmodified-Since fail for every method.
            assert_ne!(other, Precondition::NotModified);
            if get == Precondition::Failed {
                assert_eq!(other, Precondition::Failed);
            }
            if let Some(value) = &req.if_range {
                let _ = conditional::if_range_holds(value, &v);
            }
        }
        Ok(Parsed::Partial) => assert!(head.len() < MAX_HEAD),
        Err(rejection) => assert!(matches!(rejection.status, 400 | 431)),
    }
}

// The boot HTTP server's parsers of outside input, on the same bytes:
// - the input as a request head, and a well-formed head built from it (Host and target rules, the header fields),
//   then its preconditions (If-Match, If-None-Match, If-Modified-Since, If-Unmodified-Since, If-Range) against a
//   fixed file;
// - as "<Range header>\n<file length>\n<kernel>\n<initrd>\n<cmdline>": Range, and the control plane's desired boot
//   rendered as an iPXE script.
fuzz_target!(|data: &[u8]| {
    // The bytes as a head, as a client sends them.
    check_head(data);
    // A well-formed head built from the bytes: the first line is the target (and its first byte the HTTP minor
    // version), every further line a field whose first byte picks the name from FIELDS and whose rest is the
    // value. This reaches the field handling (Host rules, precondition lists and dates) on every input.
    let mut lines = data.split(|b| *b == b'\n');
    let first = lines.next().unwrap_or_default();
    let (version, target) = first
        .split_first()
        .map_or((1, &b"/"[..]), |(v, t)| (v & 1, t));
    let mut head = b"GET ".to_vec();
    head.extend_from_slice(if target.is_empty() { b"/" } else { target });
    head.extend_from_slice(format!(" HTTP/1.{version}\r\n").as_bytes());
    for line in lines {
        let Some((pick, value)) = line.split_first() else {
            continue;
        };
        head.extend_from_slice(FIELDS[usize::from(*pick) % FIELDS.len()].as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    check_head(&head);

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
