#![no_main]
//! The ramdisk's DHCP client: decode (dhcproto behind the precheck) and the client state machine in every state
//! it can be in when a packet arrives. No input may panic.
use std::time::{Duration, Instant};

use bcd_ramdisk::dhcp::{DhcpClient, Step, wire};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = wire::decode(data);
    let mac = data
        .get(28..34)
        .and_then(|b| <[u8; 6]>::try_from(b).ok())
        .unwrap_or([0x52, 0x54, 0, 0, 0, 1]);
    let xid = data
        .get(4..8)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, u32::from_be_bytes);
    let t0 = Instant::now();
    let mut client = DhcpClient::new(mac, xid, Duration::from_secs(5));
    let _ = client.start(t0);
    // Selecting; if the packet was an acceptable OFFER the client is now Requesting: feed it again.
    if let Step::Send(_) = client.on_packet(data, t0) {
        let _ = client.on_packet(data, t0);
    }
    let _ = client.on_timer(t0 + Duration::from_secs(6));
});
