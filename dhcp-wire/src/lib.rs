//! DHCPv4 bytes ↔ [`Message`], without ever panicking on what the network sends. One crate for both sides of the
//! wire: bcd-site's proxy DHCP server and bcd-ramdisk's DHCP client (which may not link bcd-site), so the rules
//! below are written once. Fuzzed through both users (`fuzz/fuzz_targets/dhcp_decode.rs`, `ramdisk_dhcp.rs`).
//!
//! dhcproto 0.15 `debug_assert!`s the length of a few options (80, 81, 94, 152–155) while decoding, and
//! [`Message::chaddr`] slices by the untrusted `hlen`. [`decode`] therefore checks the raw packet first, rejecting
//! exactly those shapes, and still runs the decoder under `catch_unwind` as a last line of defence (a fuzz
//! harness that aborts on any panic proves the check alone suffices).

use std::panic::{AssertUnwindSafe, catch_unwind};

use dhcproto::v4::{MAGIC, Message};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};

/// Fixed BOOTP header (236 bytes) plus the magic cookie.
pub const HEADER_LEN: usize = 240;
/// Replies are padded to the minimum BOOTP size: some PXE ROMs drop shorter packets.
pub const MIN_REPLY_LEN: usize = 300;

/// Why a packet is not a DHCP message we accept.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("packet of {len} bytes is shorter than the {HEADER_LEN}-byte DHCP header")]
    TooShort { len: usize },
    #[error("magic cookie missing (not DHCP, maybe plain BOOTP)")]
    BadMagic,
    #[error("hardware address length {hlen} exceeds 16")]
    BadHlen { hlen: u8 },
    #[error("option {code} has length {len}, which RFC-conforming senders never use")]
    BadOptionLength { code: u8, len: usize },
    #[error("option {code} at offset {offset} runs past the end of the packet")]
    Truncated { code: u8, offset: usize },
    #[error("malformed DHCP message")]
    Malformed {
        #[source]
        source: dhcproto::error::DecodeError,
    },
    #[error("the DHCP decoder panicked on this packet")]
    DecoderPanicked,
}

/// Why a reply could not be encoded (a bug in the reply, never the client's doing).
#[derive(Debug, thiserror::Error)]
#[error("encoding DHCP reply")]
pub struct EncodeError {
    #[source]
    source: dhcproto::error::EncodeError,
}

/// Decodes a DHCPv4 packet. Never panics.
pub fn decode(packet: &[u8]) -> Result<Message, DecodeError> {
    precheck(packet)?;
    match catch_unwind(AssertUnwindSafe(|| {
        Message::decode(&mut Decoder::new(packet))
    })) {
        Ok(Ok(msg)) => Ok(msg),
        Ok(Err(source)) => Err(DecodeError::Malformed { source }),
        Err(_) => Err(DecodeError::DecoderPanicked),
    }
}

/// Encodes a reply into `out` (cleared first), padded to [`MIN_REPLY_LEN`].
pub fn encode(msg: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    out.clear();
    msg.encode(&mut Encoder::new(out))
        .map_err(|source| EncodeError { source })?;
    if out.len() < MIN_REPLY_LEN {
        out.resize(MIN_REPLY_LEN, 0);
    }
    Ok(())
}

/// Checks what dhcproto would otherwise assert on: header size, cookie, `hlen`, and the option lengths it
/// `debug_assert!`s, computed the way it computes them (consecutive instances of one code are concatenated,
/// RFC 3396).
fn precheck(packet: &[u8]) -> Result<(), DecodeError> {
    if packet.len() < HEADER_LEN {
        return Err(DecodeError::TooShort { len: packet.len() });
    }
    if packet[236..240] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let hlen = packet[2];
    if hlen > 16 {
        return Err(DecodeError::BadHlen { hlen });
    }
    let opts = &packet[HEADER_LEN..];
    let mut at = 0;
    // (code, concatenated length) of the option run being read.
    let mut run: Option<(u8, usize)> = None;
    while at < opts.len() {
        let code = opts[at];
        if code == 0 || code == 255 {
            // dhcproto stops at the first pad or end after a run; either way the run is complete.
            if let Some((c, len)) = run.take() {
                check_len(c, len)?;
            }
            if code == 255 {
                return Ok(());
            }
            at += 1;
            continue;
        }
        let Some(&len) = opts.get(at + 1) else {
            return Err(DecodeError::Truncated {
                code,
                offset: HEADER_LEN + at,
            });
        };
        let len = usize::from(len);
        if at + 2 + len > opts.len() {
            return Err(DecodeError::Truncated {
                code,
                offset: HEADER_LEN + at,
            });
        }
        run = match run {
            Some((c, total)) if c == code => Some((c, total + len)),
            Some((c, total)) => {
                check_len(c, total)?;
                Some((code, len))
            }
            None => Some((code, len)),
        };
        at += 2 + len;
    }
    if let Some((c, len)) = run {
        check_len(c, len)?;
    }
    Ok(())
}

fn check_len(code: u8, len: usize) -> Result<(), DecodeError> {
    let ok = match code {
        80 => len == 0,        // rapid commit
        81 => len >= 3,        // client FQDN
        94 => len == 3,        // client network interface identifier
        152..=155 => len == 4, // bulk lease query times
        _ => true,
    };
    if ok {
        Ok(())
    } else {
        Err(DecodeError::BadOptionLength { code, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A minimal valid header: BOOTREQUEST, Ethernet, hlen 6, cookie.
    fn header() -> Vec<u8> {
        let mut p = vec![0u8; HEADER_LEN];
        p[0] = 1;
        p[1] = 1;
        p[2] = 6;
        p[236..240].copy_from_slice(&MAGIC);
        p
    }

    #[test]
    fn rejects_the_shapes_dhcproto_asserts_on() {
        for (opt, code) in [
            (&[80u8, 1, 0][..], 80),
            (&[94, 2, 1, 2][..], 94),
            (&[81, 2, 0, 0][..], 81),
            (&[152, 3, 0, 0, 0][..], 152),
            (&[155, 0][..], 155),
            // concatenated: two 94s of length 2 make 4
            (&[94, 2, 1, 2, 94, 2, 3, 4][..], 94),
        ] {
            let mut p = header();
            p.extend_from_slice(opt);
            p.push(255);
            match decode(&p) {
                Err(DecodeError::BadOptionLength { code: c, .. }) => assert_eq!(c, code),
                other => panic!("option {opt:?}: expected BadOptionLength, got {other:?}"),
            }
        }
    }

    /// The hazard is real: without the precheck, dhcproto itself panics on such a packet in debug builds.
    /// (If a dhcproto upgrade fixes this, the test fails and the precheck can be reconsidered.)
    #[cfg(debug_assertions)]
    #[test]
    fn dhcproto_alone_panics_on_what_the_precheck_rejects() {
        let mut p = header();
        p.extend_from_slice(&[94, 2, 1, 2, 255]);
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let raw = catch_unwind(|| Message::decode(&mut Decoder::new(&p)));
        std::panic::set_hook(hook);
        assert!(
            raw.is_err(),
            "dhcproto no longer panics on option 94 of length 2"
        );
        assert!(matches!(
            decode(&p),
            Err(DecodeError::BadOptionLength { code: 94, len: 2 })
        ));
    }

    #[test]
    fn rejects_oversized_hlen_and_short_packets() {
        let mut p = header();
        p[2] = 17;
        assert!(matches!(decode(&p), Err(DecodeError::BadHlen { hlen: 17 })));
        assert!(matches!(
            decode(&p[..100]),
            Err(DecodeError::TooShort { len: 100 })
        ));
        let mut p = header();
        p[236] = 0;
        assert!(matches!(decode(&p), Err(DecodeError::BadMagic)));
        let mut p = header();
        p.extend_from_slice(&[60, 9, b'P']);
        assert!(matches!(
            decode(&p),
            Err(DecodeError::Truncated { code: 60, .. })
        ));
    }

    #[test]
    fn accepts_well_formed_options_and_pads_replies() -> Result<(), Box<dyn std::error::Error>> {
        let mut p = header();
        p.extend_from_slice(&[53, 1, 1, 94, 3, 1, 2, 1, 93, 2, 0, 7, 0, 0, 255]);
        let msg = decode(&p)?;
        assert_eq!(msg.chaddr().len(), 6);
        let mut out = Vec::new();
        encode(&msg, &mut out)?;
        assert_eq!(out.len(), MIN_REPLY_LEN);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            // The precheck alone must keep the decoder from panicking: a caught panic is a failure too.
            prop_assert!(!matches!(decode(&bytes), Err(DecodeError::DecoderPanicked)));
        }

        /// Valid header, arbitrary option area: reaches the option decoder every time.
        #[test]
        fn never_panics_on_arbitrary_options(
            hlen in any::<u8>(),
            opts in proptest::collection::vec(any::<u8>(), 0..400),
        ) {
            let mut p = header();
            p[2] = hlen;
            p.extend_from_slice(&opts);
            let decoded = decode(&p);
            prop_assert!(!matches!(decoded, Err(DecodeError::DecoderPanicked)));
            if let Ok(msg) = decoded {
                // Accessors we use on decoded messages must be safe too.
                let _ = msg.chaddr();
                let _ = msg.opts().msg_type();
            }
        }

        /// Options built from (code, len, data) triples, the shape most likely to reach each decoder arm.
        #[test]
        fn never_panics_on_structured_options(
            opts in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..12)), 0..24),
        ) {
            let mut p = header();
            for (code, data) in &opts {
                p.push(*code);
                p.push(data.len() as u8);
                p.extend_from_slice(data);
            }
            p.push(255);
            prop_assert!(!matches!(decode(&p), Err(DecodeError::DecoderPanicked)));
        }
    }
}
