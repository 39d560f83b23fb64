//! A human-readable rendering of a DHCP packet *as sent on the wire*, for golden files and debug logs.
//!
//! It reads the encoded bytes rather than the [`dhcproto`] structure, so a golden file shows exactly what a
//! client receives. Options are listed sorted by code; repeated codes (RFC 3396) are joined.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use super::wire::HEADER_LEN;

/// The packet is too short or its options are malformed.
#[derive(Debug, thiserror::Error)]
#[error("cannot render DHCP packet: {why}")]
pub struct RenderError {
    why: &'static str,
}

/// Renders `packet` one field per line.
pub fn render(packet: &[u8]) -> Result<String, RenderError> {
    if packet.len() < HEADER_LEN {
        return Err(RenderError {
            why: "shorter than the header",
        });
    }
    let mut s = String::new();
    let op = match packet[0] {
        1 => "BOOTREQUEST",
        2 => "BOOTREPLY",
        _ => "unknown",
    };
    let ip = |at: usize| Ipv4Addr::new(packet[at], packet[at + 1], packet[at + 2], packet[at + 3]);
    let hlen = usize::from(packet[2]).min(16);
    // Writing to a String cannot fail.
    let _ = writeln!(
        s,
        "op {op} htype {} hlen {} hops {}",
        packet[1], packet[2], packet[3]
    );
    let _ = writeln!(
        s,
        "xid 0x{:08x} secs {} flags 0x{:04x}",
        u32::from_be_bytes([packet[4], packet[5], packet[6], packet[7]]),
        u16::from_be_bytes([packet[8], packet[9]]),
        u16::from_be_bytes([packet[10], packet[11]]),
    );
    let _ = writeln!(s, "ciaddr {}", ip(12));
    let _ = writeln!(s, "yiaddr {}", ip(16));
    let _ = writeln!(s, "siaddr {}", ip(20));
    let _ = writeln!(s, "giaddr {}", ip(24));
    let chaddr: Vec<String> = packet[28..28 + hlen]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let _ = writeln!(s, "chaddr {}", chaddr.join(":"));
    let _ = writeln!(s, "sname {}", text_until_nul(&packet[44..108]));
    let _ = writeln!(s, "file {}", text_until_nul(&packet[108..236]));

    let mut opts: BTreeMap<u8, Vec<u8>> = BTreeMap::new();
    let mut rest = &packet[HEADER_LEN..];
    let mut ended = false;
    while let [code, tail @ ..] = rest {
        match *code {
            0 => rest = tail,
            255 => {
                ended = true;
                break;
            }
            code => {
                let (&len, tail) = tail.split_first().ok_or(RenderError {
                    why: "option without length",
                })?;
                let len = usize::from(len);
                if len > tail.len() {
                    return Err(RenderError {
                        why: "option runs past the end",
                    });
                }
                opts.entry(code)
                    .or_default()
                    .extend_from_slice(&tail[..len]);
                rest = &tail[len..];
            }
        }
    }
    for (code, value) in &opts {
        let _ = writeln!(
            s,
            "option {code} {}: {}",
            option_name(*code),
            render_value(*code, value)
        );
    }
    if !ended {
        let _ = writeln!(s, "(no end option)");
    }
    Ok(s)
}

fn option_name(code: u8) -> &'static str {
    match code {
        43 => "vendor-encapsulated-options",
        53 => "message-type",
        54 => "server-identifier",
        60 => "vendor-class-identifier",
        66 => "tftp-server-name",
        67 => "bootfile-name",
        77 => "user-class",
        93 => "client-system-architecture",
        94 => "client-network-interface",
        97 => "client-machine-identifier",
        _ => "unknown",
    }
}

fn render_value(code: u8, value: &[u8]) -> String {
    match (code, value) {
        (53, [t]) => {
            let name = match t {
                1 => "DISCOVER",
                2 => "OFFER",
                3 => "REQUEST",
                4 => "DECLINE",
                5 => "ACK",
                6 => "NAK",
                7 => "RELEASE",
                8 => "INFORM",
                _ => "?",
            };
            format!("{t} ({name})")
        }
        (54, [a, b, c, d]) => Ipv4Addr::new(*a, *b, *c, *d).to_string(),
        (43, _) | (97, _) | (93, _) | (94, _) => hex(value),
        _ if !value.is_empty() && value.iter().all(|b| b.is_ascii_graphic() || *b == b' ') => {
            format!("{:?}", String::from_utf8_lossy(value))
        }
        _ => hex(value),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn text_until_nul(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    format!("{:?}", String::from_utf8_lossy(&field[..end]))
}
