#![no_main]
//! TFTP packet decode (requests with options included) and option negotiation: no input may panic, and a
//! decoded request re-encodes to bytes that decode to the same request.
use bcd_site::tftp::codec::Packet;
use bcd_site::tftp::{Limits, negotiate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(packet) = Packet::decode(data) else {
        return;
    };
    if let Packet::Rrq(req) | Packet::Wrq(req) = &packet {
        let _ = negotiate(&req.options, data.len() as u64, &Limits::default());
        let mut out = Vec::new();
        packet.encode(&mut out);
        assert_eq!(Packet::decode(&out).ok().as_ref(), Some(&packet));
    }
});
