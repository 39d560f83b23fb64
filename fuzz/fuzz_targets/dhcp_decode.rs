#![no_main]
//! DHCP decode + proxy decision + reply encode/render: no input may panic (dhcproto's own debug assertions
//! included: libFuzzer aborts on any panic, so `wire::decode`'s precheck must keep them from firing).
use std::net::Ipv4Addr;

use bcd_site::dhcp::render::render;
use bcd_site::dhcp::rogue::observe;
use bcd_site::dhcp::wire::{decode, encode};
use bcd_site::dhcp::{
    Decision, ListenPort, MacAddr, NetbootRule, NetbootTable, OfferStyle, ServerInfo, decide,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = decode(data) else { return };
    // Mark the packet's own MAC for netboot so the fuzzer reaches the reply paths.
    let mut table = NetbootTable::new();
    if let Some(mac) = data.get(28..34).and_then(|b| <[u8; 6]>::try_from(b).ok()) {
        table.insert(NetbootRule::Mac(MacAddr(mac)));
    }
    let mut server = ServerInfo {
        server_ip: Ipv4Addr::new(10, 0, 0, 2),
        http_port: 8080,
        files: Default::default(),
        offer: OfferStyle::Bootfile,
    };
    for offer in [OfferStyle::Bootfile, OfferStyle::BootServer] {
        server.offer = offer;
        for port in [ListenPort::Dhcp, ListenPort::PxeBoot] {
            if let Decision::Reply(reply) = decide(&msg, port, &table, &server) {
                let mut out = Vec::new();
                encode(&reply.message, &mut out).expect("our replies always encode");
                render(&out).expect("our replies always render");
                decode(&out).expect("our replies decode");
            }
        }
    }
    let _ = observe(&msg, Ipv4Addr::new(10, 0, 0, 9), server.server_ip);
});
