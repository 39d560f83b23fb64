//! The PROXY protocol, version 2 (HAProxy's `send-proxy-v2`, AWS and GCP network balancers, Envoy): the binary
//! header a TCP balancer writes before the client's bytes to say whom it is forwarding. The gateway reads it only
//! from the balancers it is told to trust ([`Trusted`]); from them it is required, from anyone else it is never
//! read (a peer cannot claim another's address).
//!
//! What is read: version 2 only (the text version 1, `send-proxy`, is refused with a message saying so), the
//! PROXY command with an IPv4 or IPv6 stream source (the forwarded client), and LOCAL (the balancer's own
//! connection, e.g. a health check: the connection's own address stands). UNSPEC and UNIX sources also leave the
//! connection's own address. TLVs are skipped; a header of more than [`MAX_HEADER`] bytes is refused.
//!
//! [`parse`] never reads past the header: it says how many bytes it needs until it has them all, so a reader takes
//! exactly the header off the stream and leaves the TLS ClientHello behind it.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// The 12 bytes every version 2 header begins with.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// The fixed part: signature, version and command, family and transport, length of the rest.
pub const FIXED: usize = 16;
/// The largest header accepted, TLVs included. Addresses take at most 216 bytes (UNIX); balancers add a few TLVs
/// (ALPN, authority, a unique id, AWS's endpoint id).
pub const MAX_HEADER: usize = 1024;

/// What [`parse`] found in the bytes it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// The header is not complete: it is at least `need` bytes long in all.
    Incomplete { need: usize },
    /// A header of `len` bytes; `source`: the forwarded client, or None when the connection's own address stands
    /// (LOCAL, UNSPEC, UNIX).
    Header {
        len: usize,
        source: Option<SocketAddr>,
    },
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error(
        "the connection began with a TLS record, not a PROXY protocol header: the balancer is trusted to send one \
         (set `send-proxy-v2` on its server lines, or remove its address from gateway_proxy_protocol_from)"
    )]
    Tls,
    #[error(
        "PROXY protocol version 1 (text) is not supported: configure the balancer with `send-proxy-v2` instead of \
         `send-proxy`"
    )]
    Version1,
    #[error("not a PROXY protocol v2 header (the first 12 bytes are not its signature)")]
    Signature,
    #[error("PROXY protocol version {0} is not supported (only 2)")]
    Version(u8),
    #[error("PROXY protocol command {0} is unknown (0 is LOCAL, 1 is PROXY)")]
    Command(u8),
    #[error("PROXY protocol header of {0} bytes is longer than the {MAX_HEADER} accepted")]
    TooLong(usize),
    #[error("PROXY protocol address family {0} is unknown")]
    Family(u8),
    #[error("PROXY protocol transport {0} is not a stream (the gateway serves TCP)")]
    Transport(u8),
    #[error("PROXY protocol addresses need {need} bytes, the header has {have}")]
    Short { need: usize, have: usize },
}

/// Parses the start of a connection's bytes as a version 2 header.
pub fn parse(buf: &[u8]) -> Result<Parsed, HeaderError> {
    // The first bytes already tell a TLS record or a version 1 header from a version 2 header.
    match buf.first() {
        None => return Ok(Parsed::Incomplete { need: FIXED }),
        Some(0x16) => return Err(HeaderError::Tls),
        Some(b'P') if b"PROXY ".starts_with(&buf[..buf.len().min(6)]) => {
            return if buf.len() >= 6 {
                Err(HeaderError::Version1)
            } else {
                Ok(Parsed::Incomplete { need: FIXED })
            };
        }
        Some(_) => {}
    }
    let sig = buf.len().min(SIGNATURE.len());
    if buf[..sig] != SIGNATURE[..sig] {
        return Err(HeaderError::Signature);
    }
    if buf.len() < FIXED {
        return Ok(Parsed::Incomplete { need: FIXED });
    }
    let (version, command) = (buf[12] >> 4, buf[12] & 0x0f);
    if version != 2 {
        return Err(HeaderError::Version(version));
    }
    if command > 1 {
        return Err(HeaderError::Command(command));
    }
    let len = FIXED + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if len > MAX_HEADER {
        return Err(HeaderError::TooLong(len));
    }
    if buf.len() < len {
        return Ok(Parsed::Incomplete { need: len });
    }
    let (family, transport) = (buf[13] >> 4, buf[13] & 0x0f);
    let body = &buf[FIXED..len];
    let need = match family {
        0 => 0,
        1 => 12,
        2 => 36,
        3 => 216,
        f => return Err(HeaderError::Family(f)),
    };
    if body.len() < need {
        return Err(HeaderError::Short {
            need,
            have: body.len(),
        });
    }
    // LOCAL: the balancer's own connection; its addresses, if any, are not a client's.
    if command == 0 {
        return Ok(Parsed::Header { len, source: None });
    }
    let source = match family {
        1 | 2 if transport != 1 => return Err(HeaderError::Transport(transport)),
        1 => {
            let ip = Ipv4Addr::new(body[0], body[1], body[2], body[3]);
            Some(SocketAddr::new(
                IpAddr::V4(ip),
                u16::from_be_bytes([body[8], body[9]]),
            ))
        }
        2 => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&body[..16]);
            let ip = Ipv6Addr::from(octets);
            Some(SocketAddr::new(
                ip.to_canonical(),
                u16::from_be_bytes([body[32], body[33]]),
            ))
        }
        _ => None,
    };
    Ok(Parsed::Header { len, source })
}

/// A version 2 header: PROXY from `source` to `destination` (both of one family), or LOCAL when None. For tests,
/// fuzzing and the benchmarks' balancer stand-ins.
pub fn encode(addresses: Option<(SocketAddr, SocketAddr)>) -> Vec<u8> {
    let mut out = SIGNATURE.to_vec();
    let Some((src, dst)) = addresses else {
        out.extend_from_slice(&[0x20, 0x00, 0, 0]);
        return out;
    };
    let body: Vec<u8> = match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out.push(0x21);
            out.push(0x11);
            [&s.octets()[..], &d.octets()[..]].concat()
        }
        (s, d) => {
            let v6 = |ip: IpAddr| match ip {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            out.push(0x21);
            out.push(0x21);
            [&v6(s).octets()[..], &v6(d).octets()[..]].concat()
        }
    };
    let len = body.len() + 4;
    out.extend_from_slice(&(len as u16).to_be_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&src.port().to_be_bytes());
    out.extend_from_slice(&dst.port().to_be_bytes());
    out
}

/// An IP network: an address and how many of its leading bits are fixed (`10.0.0.0/8`, `fd00::/64`; an address
/// alone is the single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    addr: IpAddr,
    bits: u8,
}

impl Prefix {
    /// Whether `ip` is in the network (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.bits)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.bits))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Prefix {
    type Err = String;

    fn from_str(s: &str) -> Result<Prefix, String> {
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| {
            format!("{s:?} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/24)")
        })?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => match b.parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => return Err(format!("{s:?}: the prefix length must be 0 to {max}")),
            },
        };
        // An IPv4-mapped IPv6 network is the IPv4 network it maps (`::ffff:10.0.0.0/104` is `10.0.0.0/8`).
        match addr.to_canonical() {
            IpAddr::V4(v4) if addr.is_ipv6() => match bits.checked_sub(96) {
                Some(bits) => Ok(Prefix {
                    addr: IpAddr::V4(v4),
                    bits,
                }),
                None => Err(format!(
                    "{s:?}: an IPv4-mapped network needs a prefix length of 96 or more"
                )),
            },
            addr => Ok(Prefix { addr, bits }),
        }
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.bits)
    }
}

/// The balancers whose connections must begin with a PROXY protocol header; empty: none (no header is ever read).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trusted(pub Vec<Prefix>);

impl Trusted {
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|p| p.contains(ip))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Trusted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let all: Vec<String> = self.0.iter().map(Prefix::to_string).collect();
        f.write_str(&all.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("a socket address")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an IP address")
    }

    fn prefix(s: &str) -> Prefix {
        s.parse().expect("a prefix")
    }

    #[test]
    fn an_encoded_header_parses_back_byte_by_byte() {
        for (src, dst) in [
            (addr("10.1.2.3:4567"), addr("10.0.0.1:8443")),
            (addr("[fd00::7]:1"), addr("[fd00::1]:8443")),
        ] {
            let h = encode(Some((src, dst)));
            // Fed a byte at a time, it asks for more until it has exactly the header.
            for cut in 0..h.len() {
                match parse(&h[..cut]) {
                    Ok(Parsed::Incomplete { need }) => assert!(need > cut && need <= h.len()),
                    other => panic!("{cut} bytes of {}: {other:?}", h.len()),
                }
            }
            let mut with_hello = h.clone();
            with_hello.extend_from_slice(&[0x16, 3, 1, 0, 5]);
            assert_eq!(
                parse(&with_hello),
                Ok(Parsed::Header {
                    len: h.len(),
                    source: Some(src)
                })
            );
        }
    }

    #[test]
    fn local_unspec_and_mapped_addresses() {
        let local = encode(None);
        assert_eq!(
            parse(&local),
            Ok(Parsed::Header {
                len: 16,
                source: None
            })
        );
        // PROXY over UNSPEC: the connection's own address stands.
        let mut unspec = SIGNATURE.to_vec();
        unspec.extend_from_slice(&[0x21, 0x00, 0, 0]);
        assert_eq!(
            parse(&unspec),
            Ok(Parsed::Header {
                len: 16,
                source: None
            })
        );
        // An IPv4 client carried as IPv4-mapped IPv6 is its IPv4 address (one per-source account, not two).
        let h = encode(Some((addr("[::ffff:10.9.8.7]:5"), addr("[::1]:1"))));
        assert_eq!(
            parse(&h),
            Ok(Parsed::Header {
                len: h.len(),
                source: Some(addr("10.9.8.7:5"))
            })
        );
        // TLVs after the addresses are skipped.
        let mut tlv = encode(Some((addr("1.2.3.4:5"), addr("5.6.7.8:9"))));
        tlv[15] += 7;
        tlv.extend_from_slice(&[0x01, 0, 4, b'h', b'2', 0, 0]);
        assert!(matches!(
            parse(&tlv),
            Ok(Parsed::Header { len: 35, source: Some(s) }) if s == addr("1.2.3.4:5")
        ));
    }

    #[test]
    fn refusals_say_what_to_change() {
        let hello = [0x16, 3, 1, 2, 0, 1];
        assert_eq!(parse(&hello), Err(HeaderError::Tls));
        assert!(HeaderError::Tls.to_string().contains("send-proxy-v2"));
        assert_eq!(
            parse(b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n"),
            Err(HeaderError::Version1)
        );
        assert_eq!(parse(b"PROX"), Ok(Parsed::Incomplete { need: FIXED }));
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Err(HeaderError::Signature));
        let good = encode(Some((addr("1.2.3.4:5"), addr("5.6.7.8:9"))));
        let with = |i: usize, b: u8| {
            let mut h = good.clone();
            h[i] = b;
            parse(&h)
        };
        assert_eq!(with(12, 0x11), Err(HeaderError::Version(1)));
        assert_eq!(with(12, 0x22), Err(HeaderError::Command(2)));
        assert_eq!(with(13, 0x41), Err(HeaderError::Family(4)));
        assert_eq!(with(13, 0x12), Err(HeaderError::Transport(2)));
        assert_eq!(
            with(13, 0x21),
            Err(HeaderError::Short { need: 36, have: 12 })
        );
        let mut long = good.clone();
        long[14..16].copy_from_slice(&2000u16.to_be_bytes());
        assert_eq!(parse(&long), Err(HeaderError::TooLong(2016)));
    }

    #[test]
    fn prefixes_hold_what_they_name() {
        let p = prefix("10.0.0.0/8");
        assert!(p.contains(ip("10.255.1.2")));
        assert!(p.contains(ip("::ffff:10.1.1.1")));
        assert!(!p.contains(ip("11.0.0.1")));
        assert!(!p.contains(ip("fd00::1")));
        let host = prefix("127.0.0.3");
        assert_eq!(host.to_string(), "127.0.0.3/32");
        assert!(host.contains(ip("127.0.0.3")));
        assert!(!host.contains(ip("127.0.0.1")));
        let all = prefix("0.0.0.0/0");
        assert!(all.contains(ip("192.0.2.1")));
        let v6 = prefix("fd00:1::/32");
        assert!(v6.contains(ip("fd00:1:ffff::1")));
        assert!(!v6.contains(ip("fd00:2::1")));
        assert!("10.0.0.0/33".parse::<Prefix>().is_err());
        let mapped = prefix("::ffff:10.0.0.0/104");
        assert_eq!(mapped.to_string(), "10.0.0.0/8");
        assert!("::ffff:10.0.0.0/64".parse::<Prefix>().is_err());
        assert!("ten".parse::<Prefix>().is_err_and(|e| e.contains("e.g.")));
        let trusted = Trusted(vec![host, v6]);
        assert_eq!(trusted.to_string(), "127.0.0.3/32,fd00:1::/32");
        assert!(trusted.contains(ip("127.0.0.3")));
        assert!(!Trusted::default().contains(ip("127.0.0.3")));
    }
}
