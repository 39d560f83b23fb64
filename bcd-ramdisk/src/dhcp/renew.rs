//! Keeping a lease (RFC 2131 §4.4.5): at T1 (half the lease) REQUEST the server that gave it, by unicast from the
//! bound address; at T2 (7/8) REQUEST any server by broadcast; at expiry the lease is lost. A wipe or an image
//! stream can outlast a lease by hours, and a DHCP server that sees no renewal may hand the address to another
//! machine while our session still uses it.
//!
//! Sans-I/O like [`super::DhcpClient`]: fed packets and the time, it answers with what to send and where.

#![deny(clippy::disallowed_methods)]

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Encodable, Encoder};

use super::{Lease, lease_of, wire};

/// RFC 2131 §4.4.5: retransmit after half the remaining time, but not more often than this.
const MIN_RETRANSMIT: Duration = Duration::from_secs(60);
/// Option 51's "infinite" value.
const INFINITE: u32 = u32::MAX;

/// What the caller must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RenewStep {
    /// Send these bytes to this server's port 67 (renewing: unicast from the bound address).
    Unicast(Ipv4Addr, Vec<u8>),
    /// Broadcast these bytes to 255.255.255.255:67 (rebinding).
    Broadcast(Vec<u8>),
    /// The lease was extended (same address); the times start again from now.
    Renewed(Lease),
    /// The lease is gone (NAK, expiry, or a server moving us): stop using the address and start over.
    Lost(String),
    Wait,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Bound,
    Renewing,
    Rebinding,
    Lost,
}

/// The renewal of one bound lease.
#[derive(Debug)]
pub struct Renewal {
    mac: [u8; 6],
    xid: u32,
    lease: Lease,
    t1: Instant,
    t2: Instant,
    expiry: Instant,
    phase: Phase,
    next_send: Option<Instant>,
    /// Packets ignored (not for us, malformed, wrong type).
    pub ignored: u32,
}

impl Renewal {
    /// Renewal of `lease`, bound at `bound_at`; `None` when the lease never expires (no option 51, or infinite).
    /// `xid` seeds the transaction ids of the renewals.
    pub fn new(mac: [u8; 6], xid: u32, lease: Lease, bound_at: Instant) -> Option<Self> {
        let secs = lease.lease_secs.filter(|s| *s != INFINITE && *s > 0)?;
        let (t1, t2, expiry) = times(bound_at, secs, &lease);
        Some(Self {
            mac,
            xid,
            lease,
            t1,
            t2,
            expiry,
            phase: Phase::Bound,
            next_send: None,
            ignored: 0,
        })
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// When [`Renewal::on_timer`] should next be called.
    pub fn deadline(&self) -> Instant {
        match self.phase {
            Phase::Bound => self.t1,
            Phase::Renewing => self.next_send.map_or(self.t2, |n| n.min(self.t2)),
            Phase::Rebinding => self.next_send.map_or(self.expiry, |n| n.min(self.expiry)),
            Phase::Lost => self.expiry,
        }
    }

    /// Time passed: start renewing or rebinding, retransmit, or declare the lease lost.
    pub fn on_timer(&mut self, now: Instant) -> RenewStep {
        if self.phase == Phase::Lost {
            return RenewStep::Wait;
        }
        if now >= self.expiry {
            self.phase = Phase::Lost;
            return RenewStep::Lost(format!(
                "lease on {} expired: no server answered the renewal or the rebinding",
                self.lease.address
            ));
        }
        match self.phase {
            Phase::Bound if now >= self.t1 => {
                self.phase = Phase::Renewing;
                self.xid = next_xid(self.xid);
                self.send(now)
            }
            Phase::Renewing if now >= self.t2 => {
                self.phase = Phase::Rebinding;
                self.send(now)
            }
            Phase::Renewing | Phase::Rebinding if self.next_send.is_some_and(|t| now >= t) => {
                self.send(now)
            }
            _ => RenewStep::Wait,
        }
    }

    fn send(&mut self, now: Instant) -> RenewStep {
        let until = if self.phase == Phase::Renewing {
            self.t2
        } else {
            self.expiry
        };
        let remaining = until.saturating_duration_since(now);
        self.next_send = Some(now + (remaining / 2).max(MIN_RETRANSMIT.min(remaining)));
        let mut out = Vec::with_capacity(300);
        if let Err(e) = self.request().encode(&mut Encoder::new(&mut out)) {
            // Our own message failed to encode: nothing sane to send; the lease runs out and is lost.
            tracing::error!(error = %bc_error_chain::InlineErrorChain::new(&e), "encoding the DHCP renewal");
            return RenewStep::Wait;
        }
        if self.phase == Phase::Renewing {
            RenewStep::Unicast(self.lease.server, out)
        } else {
            RenewStep::Broadcast(out)
        }
    }

    /// RFC 2131 table 5, RENEWING/REBINDING: `ciaddr` set, no requested-address or server-identifier option.
    fn request(&self) -> Message {
        let mut msg = Message::new_with_id(
            self.xid,
            self.lease.address,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            &self.mac,
        );
        let opts = msg.opts_mut();
        opts.insert(DhcpOption::MessageType(MessageType::Request));
        let mut client_id = vec![1u8];
        client_id.extend_from_slice(&self.mac);
        opts.insert(DhcpOption::ClientIdentifier(client_id));
        opts.insert(DhcpOption::ParameterRequestList(vec![
            OptionCode::SubnetMask,
            OptionCode::Router,
            OptionCode::DomainNameServer,
            OptionCode::AddressLeaseTime,
        ]));
        opts.insert(DhcpOption::ClassIdentifier(b"bcd-ramdisk".to_vec()));
        msg
    }

    /// A packet arrived on port 68.
    pub fn on_packet(&mut self, bytes: &[u8], now: Instant) -> RenewStep {
        if !matches!(self.phase, Phase::Renewing | Phase::Rebinding) {
            self.ignored += 1;
            return RenewStep::Wait;
        }
        let Ok(msg) = wire::decode(bytes) else {
            self.ignored += 1;
            return RenewStep::Wait;
        };
        if msg.opcode() != Opcode::BootReply
            || msg.xid() != self.xid
            || msg.chaddr().get(..6) != Some(&self.mac[..])
        {
            self.ignored += 1;
            return RenewStep::Wait;
        }
        match msg.opts().msg_type() {
            Some(MessageType::Ack) => match lease_of(&msg) {
                Some(lease) if lease.address == self.lease.address => {
                    let secs = lease.lease_secs.filter(|s| *s > 0);
                    self.lease = lease.clone();
                    self.phase = Phase::Bound;
                    self.next_send = None;
                    match secs {
                        Some(s) if s != INFINITE => {
                            (self.t1, self.t2, self.expiry) = times(now, s, &lease);
                        }
                        // Now infinite (or unstated): nothing more to renew.
                        _ => {
                            let far = now + Duration::from_secs(100 * 365 * 24 * 3600);
                            (self.t1, self.t2, self.expiry) = (far, far, far);
                        }
                    }
                    RenewStep::Renewed(lease)
                }
                Some(lease) => {
                    self.phase = Phase::Lost;
                    RenewStep::Lost(format!(
                        "the server answered the renewal of {} with {}",
                        self.lease.address, lease.address
                    ))
                }
                None => {
                    self.ignored += 1;
                    RenewStep::Wait
                }
            },
            Some(MessageType::Nak) => {
                self.phase = Phase::Lost;
                RenewStep::Lost(format!(
                    "the server refused the renewal of {} (NAK)",
                    self.lease.address
                ))
            }
            _ => {
                self.ignored += 1;
                RenewStep::Wait
            }
        }
    }
}

/// T1, T2 and expiry of a lease of `secs` seconds bound at `at`.
/// T1, T2 and the expiry of a lease of `secs` bound `at`: the server's T1 and T2 when it sent both and
/// 0 < T1 < T2 < the lease, else half and seven eighths of the lease (RFC 2131 §4.4.5's defaults). A server's
/// T1 alone (T1 < the lease) keeps the default T2 when that is later.
fn times(at: Instant, secs: u32, lease: &Lease) -> (Instant, Instant, Instant) {
    let d = |s: u32| Duration::from_secs(u64::from(s));
    let whole = d(secs);
    let (mut t1, mut t2) = (whole / 2, whole * 7 / 8);
    match (lease.renewal_secs, lease.rebinding_secs) {
        (Some(r), Some(b)) if 0 < r && r < b && b < secs => (t1, t2) = (d(r), d(b)),
        (Some(r), None) if 0 < r && d(r) < t2 => t1 = d(r),
        (None, Some(b)) if t1 < d(b) && b < secs => t2 = d(b),
        _ => {}
    }
    (at + t1, at + t2, at + whole)
}

/// The next renewal's transaction id (a fixed LCG step keeps the state machine free of RNG reads; the first xid
/// was random).
fn next_xid(xid: u32) -> u32 {
    xid.wrapping_mul(1_664_525).wrapping_add(1_013_904_223)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests pick one real instant as their origin
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
    const ADDR: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 50);

    fn lease(secs: Option<u32>) -> Lease {
        Lease {
            address: ADDR,
            prefix_len: 24,
            router: Some(SERVER),
            dns: Vec::new(),
            server: SERVER,
            lease_secs: secs,
            renewal_secs: None,
            rebinding_secs: None,
        }
    }

    fn reply(kind: MessageType, xid: u32, yiaddr: Ipv4Addr, secs: u32) -> Vec<u8> {
        let mut msg = Message::new_with_id(
            xid,
            ADDR,
            yiaddr,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            &MAC,
        );
        msg.set_opcode(Opcode::BootReply);
        let o = msg.opts_mut();
        o.insert(DhcpOption::MessageType(kind));
        o.insert(DhcpOption::ServerIdentifier(SERVER));
        o.insert(DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)));
        o.insert(DhcpOption::AddressLeaseTime(secs));
        let mut out = Vec::new();
        msg.encode(&mut Encoder::new(&mut out)).expect("encode");
        out
    }

    fn decoded(bytes: &[u8]) -> Message {
        wire::decode(bytes).expect("our own packet decodes")
    }

    #[test]
    fn the_servers_t1_and_t2_are_kept_when_they_fit_the_lease() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let with = |r: Option<u32>, b: Option<u32>| {
            let l = Lease {
                renewal_secs: r,
                rebinding_secs: b,
                ..lease(Some(120))
            };
            let (t1, t2, end) = times(t0, 120, &l);
            (t1 - t0, t2 - t0, end - t0)
        };
        assert_eq!(with(None, None), (s(60), s(105), s(120)));
        assert_eq!(with(Some(10), Some(20)), (s(10), s(20), s(120)));
        assert_eq!(with(Some(10), None), (s(10), s(105), s(120)));
        assert_eq!(with(None, Some(110)), (s(60), s(110), s(120)));
        // Inconsistent: T1 ≥ T2, T2 ≥ the lease, zero, T1 past the default T2: RFC 2131's defaults.
        for (r, b) in [
            (Some(30), Some(20)),
            (Some(10), Some(120)),
            (Some(0), Some(20)),
            (Some(110), None),
            (None, Some(50)),
        ] {
            assert_eq!(with(r, b), (s(60), s(105), s(120)), "{r:?} {b:?}");
        }
        // And from the wire: an ACK's options 58 and 59 reach the lease.
        let mut bytes = reply(MessageType::Ack, 7, ADDR, 120);
        let mut msg = decoded(&bytes);
        msg.opts_mut().insert(DhcpOption::Renewal(10));
        msg.opts_mut().insert(DhcpOption::Rebinding(20));
        bytes.clear();
        msg.encode(&mut Encoder::new(&mut bytes)).expect("encode");
        let l = lease_of(&decoded(&bytes)).expect("a lease");
        assert_eq!((l.renewal_secs, l.rebinding_secs), (Some(10), Some(20)));
    }

    #[test]
    fn unicast_at_t1_broadcast_at_t2_lost_at_expiry() {
        let t0 = Instant::now();
        let mut r = Renewal::new(MAC, 7, lease(Some(1000)), t0).expect("finite lease");
        assert_eq!(r.deadline(), t0 + Duration::from_secs(500));
        assert_eq!(
            r.on_timer(t0 + Duration::from_secs(499)),
            RenewStep::Wait,
            "nothing before T1"
        );
        let t1 = t0 + Duration::from_secs(500);
        let RenewStep::Unicast(to, bytes) = r.on_timer(t1) else {
            panic!("renewing unicasts to the server");
        };
        assert_eq!(to, SERVER);
        let m = decoded(&bytes);
        assert_eq!(m.opts().msg_type(), Some(MessageType::Request));
        assert_eq!(m.ciaddr(), ADDR, "ciaddr carries the bound address");
        assert!(!m.flags().broadcast());
        assert!(m.opts().get(OptionCode::RequestedIpAddress).is_none());
        assert!(m.opts().get(OptionCode::ServerIdentifier).is_none());
        assert_ne!(m.xid(), 7, "a new transaction");
        // Half the 375 s left to T2 (187.5 s), above the 60 s floor.
        assert_eq!(r.deadline(), t1 + Duration::from_millis(187_500));
        assert!(matches!(
            r.on_timer(t1 + Duration::from_millis(187_500)),
            RenewStep::Unicast(..)
        ));
        let t2 = t0 + Duration::from_secs(875);
        let RenewStep::Broadcast(bytes) = r.on_timer(t2) else {
            panic!("rebinding broadcasts");
        };
        assert_eq!(decoded(&bytes).ciaddr(), ADDR);
        // 125 s left: half is 62.5 s.
        assert_eq!(r.deadline(), t2 + Duration::from_millis(62_500));
        assert!(matches!(
            r.on_timer(t0 + Duration::from_secs(1000)),
            RenewStep::Lost(why) if why.contains("expired")
        ));
        assert_eq!(r.on_timer(t0 + Duration::from_secs(2000)), RenewStep::Wait);
    }

    #[test]
    fn an_ack_extends_the_lease_from_now() {
        let t0 = Instant::now();
        let mut r = Renewal::new(MAC, 7, lease(Some(120)), t0).expect("finite lease");
        let t1 = t0 + Duration::from_secs(60);
        let RenewStep::Unicast(_, bytes) = r.on_timer(t1) else {
            panic!("renewing");
        };
        let xid = decoded(&bytes).xid();
        // Short lease: the 60 s floor is cut to the 45 s left before T2.
        assert_eq!(r.deadline(), t0 + Duration::from_secs(105));
        assert_eq!(
            r.on_packet(&reply(MessageType::Ack, xid ^ 1, ADDR, 120), t1),
            RenewStep::Wait,
            "another transaction's ACK is ignored"
        );
        let at = t1 + Duration::from_secs(1);
        match r.on_packet(&reply(MessageType::Ack, xid, ADDR, 300), at) {
            RenewStep::Renewed(l) => assert_eq!(l.lease_secs, Some(300)),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.deadline(), at + Duration::from_secs(150), "new T1");
        assert_eq!(r.ignored, 1);
    }

    #[test]
    fn a_nak_or_another_address_loses_the_lease() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(60);
        for (kind, addr, want) in [
            (MessageType::Nak, ADDR, "NAK"),
            (MessageType::Ack, Ipv4Addr::new(10, 9, 0, 77), "10.9.0.77"),
        ] {
            let mut r = Renewal::new(MAC, 7, lease(Some(120)), t0).expect("finite lease");
            let RenewStep::Unicast(_, bytes) = r.on_timer(t1) else {
                panic!("renewing");
            };
            let xid = decoded(&bytes).xid();
            match r.on_packet(&reply(kind, xid, addr, 120), t1) {
                RenewStep::Lost(why) => assert!(why.contains(want), "{why}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn infinite_or_unstated_leases_need_no_renewal() {
        let t0 = Instant::now();
        assert!(Renewal::new(MAC, 7, lease(None), t0).is_none());
        assert!(Renewal::new(MAC, 7, lease(Some(u32::MAX)), t0).is_none());
        assert!(Renewal::new(MAC, 7, lease(Some(0)), t0).is_none());
    }

    #[test]
    fn packets_while_bound_and_garbage_are_ignored() {
        let t0 = Instant::now();
        let mut r = Renewal::new(MAC, 7, lease(Some(120)), t0).expect("finite lease");
        assert_eq!(
            r.on_packet(&reply(MessageType::Nak, 7, ADDR, 120), t0),
            RenewStep::Wait,
            "nothing asked, nothing taken"
        );
        let _ = r.on_timer(t0 + Duration::from_secs(60));
        assert_eq!(r.on_packet(b"not dhcp", t0), RenewStep::Wait);
        assert_eq!(r.ignored, 2);
    }
}
