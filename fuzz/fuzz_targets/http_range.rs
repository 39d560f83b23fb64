#![no_main]
use bcd_ramdisk::stream::range::{
    ResponseHead, ResumeState, parse_content_length, parse_content_range,
};
use libfuzzer_sys::fuzz_target;

// Input: "<status>\n<content-range>\n<content-length>\n<etag>\n<received>": header values as a server would send
// them, against a resume state that has already received some bytes.
fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = s.split('\n');
    let status = lines
        .next()
        .and_then(|l| l.parse::<u16>().ok())
        .unwrap_or(206);
    let content_range = lines.next();
    let content_length = lines.next();
    let etag = lines.next();
    let received = lines
        .next()
        .and_then(|l| l.parse::<u64>().ok())
        .unwrap_or(0);
    if let Some(cr) = content_range {
        if let Ok(r) = parse_content_range(cr) {
            assert!(r.first <= r.last);
            assert!(r.complete_length.is_none_or(|c| r.last < c));
            assert!(r.len() >= 1);
        }
    }
    if let Some(cl) = content_length {
        let _ = parse_content_length(cl);
    }
    let mut state = ResumeState::new();
    let head = ResponseHead {
        status: 200,
        content_length,
        content_range: None,
        etag,
        last_modified: None,
    };
    let _ = state.accept(&head);
    let _ = state.on_data(received);
    let _ = state.request_headers();
    let head = ResponseHead {
        status,
        content_length,
        content_range,
        etag,
        last_modified: etag,
    };
    if let Ok(plan) = state.accept(&head) {
        assert!(plan.skip <= state.received());
    }
});
