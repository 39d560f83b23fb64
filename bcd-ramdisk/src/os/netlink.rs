//! Just enough rtnetlink to configure the boot NIC after DHCP: set a link up, add an IPv4 address, add a default
//! route. Three request kinds with fixed layouts do not justify a netlink crate stack (rtnetlink pulls in
//! netlink-proto, netlink-packet-* and futures); messages are built by [`encode_*`] (pure, unit-tested against the
//! kernel's layouts) and sent on one `NETLINK_ROUTE` socket that waits for each ACK.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NLMSG_HDRLEN: usize = 16;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_REPLACE: u16 = 0x100;
const NLMSG_ERROR: u16 = 2;
const RTM_NEWLINK: u16 = 16;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_BROADCAST: u16 = 4;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const IFF_UP: u32 = 1;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn header(buf: &mut Vec<u8>, kind: u16, flags: u16, seq: u32) {
    buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by finish()
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
}

fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(align4(buf.len()), 0);
}

fn finish(mut buf: Vec<u8>) -> Vec<u8> {
    let len = buf.len() as u32;
    buf[..4].copy_from_slice(&len.to_ne_bytes());
    buf
}

/// RTM_NEWLINK setting IFF_UP on `index`.
pub fn encode_link_up(index: u32, seq: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(32);
    header(&mut b, RTM_NEWLINK, 0, seq);
    // struct ifinfomsg { family u8, pad u8, type u16, index i32, flags u32, change u32 }
    b.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    b.extend_from_slice(&(index as i32).to_ne_bytes());
    b.extend_from_slice(&IFF_UP.to_ne_bytes());
    b.extend_from_slice(&IFF_UP.to_ne_bytes());
    finish(b)
}

/// RTM_NEWADDR adding `addr/prefix` (with its broadcast address) on `index`.
pub fn encode_add_address(index: u32, addr: Ipv4Addr, prefix: u8, seq: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    header(&mut b, RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, seq);
    // struct ifaddrmsg { family u8, prefixlen u8, flags u8, scope u8, index u32 }
    b.extend_from_slice(&[libc::AF_INET as u8, prefix, 0, 0]);
    b.extend_from_slice(&index.to_ne_bytes());
    attr(&mut b, IFA_LOCAL, &addr.octets());
    attr(&mut b, IFA_ADDRESS, &addr.octets());
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    let bcast = Ipv4Addr::from(u32::from(addr) | !mask);
    attr(&mut b, IFA_BROADCAST, &bcast.octets());
    finish(b)
}

/// RTM_NEWROUTE adding `0.0.0.0/0 via gateway dev index` in the main table.
pub fn encode_default_route(index: u32, gateway: Ipv4Addr, seq: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    header(&mut b, RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, seq);
    // struct rtmsg { family, dst_len, src_len, tos, table, protocol, scope, type: u8; flags u32 }
    const RT_TABLE_MAIN: u8 = 254;
    const RTPROT_DHCP: u8 = 16;
    const RT_SCOPE_UNIVERSE: u8 = 0;
    const RTN_UNICAST: u8 = 1;
    b.extend_from_slice(&[
        libc::AF_INET as u8,
        0,
        0,
        0,
        RT_TABLE_MAIN,
        RTPROT_DHCP,
        RT_SCOPE_UNIVERSE,
        RTN_UNICAST,
    ]);
    b.extend_from_slice(&0u32.to_ne_bytes());
    attr(&mut b, RTA_DST, &[0, 0, 0, 0]);
    attr(&mut b, RTA_GATEWAY, &gateway.octets());
    attr(&mut b, RTA_OIF, &index.to_ne_bytes());
    finish(b)
}

/// The largest errno the kernel hands out (`MAX_ERRNO` in include/linux/err.h).
const MAX_ERRNO: i32 = 4095;

/// What an NLMSG_ERROR reply says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ack {
    /// Error code 0: the request was applied.
    Done,
    /// The kernel refused the request with this errno (the reply carries its negation).
    Errno(i32),
    /// The error field is neither 0 nor a negated errno (1..=4095): not a reply the kernel sends.
    Malformed(i32),
}

/// The answer to `seq` among the messages in `reply`, or `None` if `reply` holds no NLMSG_ERROR for it (or is
/// truncated). Never panics: the error field is read as the kernel writes it (`-errno`) and anything else is
/// [`Ack::Malformed`].
pub fn decode_ack(reply: &[u8], seq: u32) -> Option<Ack> {
    let mut at = 0usize;
    while let Some(head) = reply.get(at..at.checked_add(NLMSG_HDRLEN)?) {
        let len = u32::from_ne_bytes(head[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(head[4..6].try_into().ok()?);
        let got_seq = u32::from_ne_bytes(head[8..12].try_into().ok()?);
        let end = at.checked_add(len)?;
        if len < NLMSG_HDRLEN || end > reply.len() {
            return None;
        }
        if kind == NLMSG_ERROR && got_seq == seq && len >= NLMSG_HDRLEN + 4 {
            let code = i32::from_ne_bytes(reply.get(at + 16..at + 20)?.try_into().ok()?);
            return Some(match code {
                0 => Ack::Done,
                c if (-MAX_ERRNO..0).contains(&c) => Ack::Errno(-c),
                c => Ack::Malformed(c),
            });
        }
        at = at.checked_add(align4(len))?;
    }
    None
}

// === impl RouteSocket ===

/// A `NETLINK_ROUTE` socket that sends one request at a time and waits for its ACK.
pub struct RouteSocket {
    fd: OwnedFd,
    seq: u32,
}

impl RouteSocket {
    pub fn open() -> io::Result<Self> {
        // SAFETY: socket(2) with constant arguments; the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let timeout = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        // SAFETY: SO_RCVTIMEO reads a timeval through the pointer, which points at a live timeval of the given size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd, seq: 1 })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn request(&mut self, msg: &[u8], seq: u32) -> io::Result<()> {
        let mut addr: libc::sockaddr_nl =
            // SAFETY: sockaddr_nl is plain old data; all-zero is a valid value (kernel destination).
            unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `msg` is a live buffer of msg.len() bytes; `addr` is a live sockaddr_nl of the given size.
        let rc = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 8192];
        loop {
            // SAFETY: `buf` is a live, writable buffer of buf.len() bytes.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            match decode_ack(&buf[..n as usize], seq) {
                Some(Ack::Done) => return Ok(()),
                Some(Ack::Errno(errno)) => return Err(io::Error::from_raw_os_error(errno)),
                Some(Ack::Malformed(code)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "netlink reply to request {seq} carries error code {code}, not 0 or a negated errno: \
                             not a kernel reply (is something else bound to this socket?)"
                        ),
                    ));
                }
                None => continue,
            }
        }
    }

    pub fn link_up(&mut self, index: u32) -> io::Result<()> {
        let seq = self.next_seq();
        self.request(&encode_link_up(index, seq), seq)
    }

    pub fn add_address(&mut self, index: u32, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        let seq = self.next_seq();
        self.request(&encode_add_address(index, addr, prefix, seq), seq)
    }

    /// Add the default route; an existing one (`EEXIST`) is left alone and counts as success.
    pub fn add_default_route(&mut self, index: u32, gateway: Ipv4Addr) -> io::Result<()> {
        let seq = self.next_seq();
        match self.request(&encode_default_route(index, gateway, seq), seq) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_up_layout() {
        let m = encode_link_up(3, 7);
        assert_eq!(m.len(), 32);
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap_or_default()),
            32
        );
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), RTM_NEWLINK);
        assert_eq!(
            u32::from_ne_bytes(m[8..12].try_into().unwrap_or_default()),
            7
        );
        assert_eq!(
            i32::from_ne_bytes(m[20..24].try_into().unwrap_or_default()),
            3
        );
    }

    #[test]
    fn address_layout_has_broadcast() {
        let m = encode_add_address(2, Ipv4Addr::new(10, 1, 2, 3), 24, 1);
        // 16 header + 8 ifaddrmsg + 3 × 8 attributes
        assert_eq!(m.len(), 48);
        assert_eq!(m[17], 24);
        assert_eq!(&m[44..48], &[10, 1, 2, 255]);
    }

    #[test]
    fn ack_decoding() {
        let mut ack = vec![0u8; 36];
        ack[0..4].copy_from_slice(&36u32.to_ne_bytes());
        ack[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        ack[8..12].copy_from_slice(&9u32.to_ne_bytes());
        ack[16..20].copy_from_slice(&(-17i32).to_ne_bytes());
        assert_eq!(decode_ack(&ack, 9), Some(Ack::Errno(17)));
        assert_eq!(decode_ack(&ack, 8), None);
        assert_eq!(decode_ack(&ack[..10], 9), None);
        ack[16..20].copy_from_slice(&0i32.to_ne_bytes());
        assert_eq!(decode_ack(&ack, 9), Some(Ack::Done));
        ack[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(decode_ack(&ack, 9), None);
    }

    /// The fuzzer's find (fuzz/regressions/ramdisk_device_pages): an error field of i32::MIN was negated and
    /// panicked with "attempt to negate with overflow". Every code outside 0 and -1..=-4095 is malformed.
    #[test]
    fn error_codes_that_are_not_negated_errnos_are_malformed_not_a_panic() {
        let mut ack = vec![0u8; 36];
        ack[0..4].copy_from_slice(&36u32.to_ne_bytes());
        ack[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        ack[8..12].copy_from_slice(&1u32.to_ne_bytes());
        for code in [i32::MIN, i32::MIN + 1, -4096, 1, 4095, i32::MAX] {
            ack[16..20].copy_from_slice(&code.to_ne_bytes());
            assert_eq!(decode_ack(&ack, 1), Some(Ack::Malformed(code)), "{code}");
        }
        ack[16..20].copy_from_slice(&(-4095i32).to_ne_bytes());
        assert_eq!(decode_ack(&ack, 1), Some(Ack::Errno(4095)));
    }

    /// Lengths near u32::MAX and a message that ends exactly at the buffer's end: no overflow, no out-of-bounds.
    #[test]
    fn huge_and_exact_lengths_are_handled() {
        let mut m = vec![0u8; 20];
        m[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(decode_ack(&m, 0), None);
        // A 17-byte non-error message followed by nothing: align4(17) = 20 steps past the end, and stops.
        m[0..4].copy_from_slice(&17u32.to_ne_bytes());
        m[4..6].copy_from_slice(&3u16.to_ne_bytes());
        assert_eq!(decode_ack(&m, 0), None);
    }

    /// Against the real kernel in a fresh network namespace would need root and unshare; the loopback device of
    /// this namespace is already up, so setting it up again must be acknowledged without error when we may.
    #[test]
    fn link_up_on_loopback_is_acknowledged_or_refused_cleanly() {
        let mut sock = match RouteSocket::open() {
            Ok(s) => s,
            Err(e) => bc_testkit::skip!("no NETLINK_ROUTE socket here ({e})"),
        };
        match sock.link_up(1) {
            Ok(()) => {}
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}"),
        }
    }
}
