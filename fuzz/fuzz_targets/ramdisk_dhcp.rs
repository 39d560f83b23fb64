#![no_main]
//! The ramdisk's DHCP client: decode (dhcproto behind the precheck) and the client state machine in every state
//! it can be in when a packet arrives, and the lease renewal while renewing and rebinding. No input may panic.
use std::time::{Duration, Instant};

use bcd_ramdisk::dhcp::renew::Renewal;
use bcd_ramdisk::dhcp::{DhcpClient, Lease, Step, wire};
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

    // Renewal: start from the xid whose successor (the renewal's transaction) is the packet's, so ACK and NAK
    // paths are reached (the inverse of the LCG step in `renew::next_xid`).
    let start_xid = xid.wrapping_sub(1_013_904_223).wrapping_mul(4_276_115_653);
    let yiaddr = data
        .get(16..20)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(
            std::net::Ipv4Addr::new(10, 0, 0, 5),
            std::net::Ipv4Addr::from,
        );
    let lease = Lease {
        address: yiaddr,
        prefix_len: 24,
        router: None,
        dns: Vec::new(),
        server: std::net::Ipv4Addr::new(10, 0, 0, 1),
        lease_secs: Some(120),
        renewal_secs: None,
        rebinding_secs: None,
    };
    if let Some(mut r) = Renewal::new(mac, start_xid, lease, t0) {
        let _ = r.on_timer(t0 + Duration::from_secs(60));
        let _ = r.on_packet(data, t0 + Duration::from_secs(61));
        let _ = r.on_timer(t0 + Duration::from_secs(105));
        let _ = r.on_packet(data, t0 + Duration::from_secs(106));
        let _ = r.on_timer(t0 + Duration::from_secs(500));
    }
});
