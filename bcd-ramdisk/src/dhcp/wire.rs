//! DHCPv4 bytes → [`Message`] without ever panicking on what the network sends. dhcproto 0.15 `debug_assert!`s
//! a few option lengths (80, 81, 94, 152–155) while decoding and slices `chaddr` by the untrusted `hlen`, so the raw
//! packet is checked first (the same rules as bcd-site's server side, which the ramdisk does not link) and the
//! decoder still runs under `catch_unwind`. Fuzzed by `fuzz/fuzz_targets/ramdisk_dhcp.rs`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use dhcproto::v4::{MAGIC, Message};
use dhcproto::{Decodable, Decoder};

pub const HEADER_LEN: usize = 240;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("packet of {len} bytes is shorter than the {HEADER_LEN}-byte DHCP header")]
    TooShort { len: usize },
    #[error("magic cookie missing")]
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

/// Decode a DHCPv4 packet. Never panics.
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
