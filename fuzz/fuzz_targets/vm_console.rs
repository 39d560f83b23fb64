#![no_main]
//! An instance's serial console is written by its guest (the tenant's, so outside input): reading "cloud-init
//! finished in the current boot" from it never panics, whatever the bytes, and a final message whole on one line
//! after the last start mark is always seen, also with a kernel message cut into it.
use bcd::vmm::console::{START_MARK, cloud_init_done_in};
use libfuzzer_sys::fuzz_target;

const FINAL: &str = "[   40.100000] cloud-init[412]: Cloud-init v. 22.4.2 finished at Tue, 01 Dec 2026 10:00:00 +0000.";

fuzz_target!(|data: &[u8]| {
    let _ = cloud_init_done_in(data);
    // The guest's bytes then a new boot that finished: seen, whatever came before.
    let mut log = data.to_vec();
    log.extend_from_slice(format!("\n{START_MARK}\n{FINAL}\n").as_bytes());
    assert!(cloud_init_done_in(&log));
    // The same final line with the guest's bytes as one kernel message cut into it (text without a line break or a
    // start mark of its own).
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if text.contains(['\n', '\r']) || text.contains(START_MARK) {
        return;
    }
    let (head, tail) = FINAL.split_at(FINAL.find("fin").unwrap_or(0) + 3);
    let cut = format!("{START_MARK}\n{head}[   40.123456] {text}\r\n{tail}\n");
    assert!(cloud_init_done_in(cut.as_bytes()), "{cut:?}");
});
