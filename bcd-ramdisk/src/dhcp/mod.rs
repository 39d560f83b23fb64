//! The ramdisk's own DHCPv4 client for the boot NIC.
//!
//! [`DhcpClient`] is sans-I/O: it is fed received bytes and the time, and answers with bytes to broadcast, a
//! [`Lease`] or a failure; it never touches a socket or reads the clock. [`net::acquire`] runs it over a UDP socket
//! bound to the NIC and then configures the address and default route over rtnetlink ([`crate::os::netlink`]).
//! DISCOVER → OFFER → REQUEST → ACK with the broadcast flag set (we have no address to receive unicast on);
//! retransmissions back off 1, 2, 4, 8 s (± 0.5 s) with a cap, a NAK restarts discovery, and the whole exchange gives up
//! after a deadline the caller sets.

#![deny(clippy::disallowed_methods)]

pub mod net;
pub mod renew;
pub mod wire;

use bc_backoff::{ExponentialBackoff, Jitter};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Encodable, Encoder};

/// What the server gave us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    pub router: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
    pub server: Ipv4Addr,
    pub lease_secs: Option<u32>,
    /// The server's T1 and T2 (options 58 and 59), when it sent them: when to renew and to rebind, in seconds
    /// from the ACK (RFC 2131 §4.4.5). Without them (or when they are not T1 < T2 < the lease) the client takes
    /// half and seven eighths of the lease.
    pub renewal_secs: Option<u32>,
    pub rebinding_secs: Option<u32>,
}

/// What the caller must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Broadcast these bytes to 255.255.255.255:67.
    Send(Vec<u8>),
    /// Bound: configure the lease.
    Bound(Lease),
    /// Nothing to do until the next packet or [`DhcpClient::deadline`].
    Wait,
    /// Gave up.
    Failed(String),
}

#[derive(Clone, Debug)]
enum State {
    Init,
    Selecting,
    Requesting { offer: Lease },
    Bound,
    Failed,
}

/// A DHCP exchange for one interface.
#[derive(Debug)]
pub struct DhcpClient {
    mac: [u8; 6],
    xid: u32,
    state: State,
    retries: u32,
    next_send: Option<Instant>,
    give_up_at: Option<Instant>,
    timeout: Duration,
    /// Packets ignored (not for us, malformed, wrong type): counted, never fatal.
    pub ignored: u32,
}

/// Retransmissions: 1, 2, 4, 8, 8, … s, each randomised by ±0.5 s (RFC 2131 §4.1 asks ±1 s around 4, 8, … s; half a
/// second around a one-second start keeps the first retry above zero).
const RETRANSMIT: ExponentialBackoff = ExponentialBackoff::new(
    Duration::from_secs(1),
    Duration::from_secs(8),
    Jitter::Spread(Duration::from_millis(500)),
);

impl DhcpClient {
    /// `xid` must be random per exchange; `timeout` bounds the whole exchange.
    pub fn new(mac: [u8; 6], xid: u32, timeout: Duration) -> Self {
        Self {
            mac,
            xid,
            state: State::Init,
            retries: 0,
            next_send: None,
            give_up_at: None,
            timeout,
            ignored: 0,
        }
    }

    /// When [`DhcpClient::on_timer`] should next be called.
    pub fn deadline(&self) -> Option<Instant> {
        match (self.next_send, self.give_up_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Start: the first DISCOVER.
    pub fn start(&mut self, now: Instant) -> Step {
        self.give_up_at = Some(now + self.timeout);
        self.state = State::Selecting;
        self.retries = 0;
        self.send(now)
    }

    /// The [`RETRANSMIT`] delay of this retry, so a rack of machines booting together does not retransmit in
    /// lockstep. The random number is drawn from the transaction id (random per exchange), keeping the state machine
    /// free of clock and RNG reads.
    fn backoff(&self) -> Duration {
        let mix = self
            .xid
            .rotate_left(self.retries.wrapping_mul(7))
            .wrapping_mul(0x9E37_79B9);
        let unit = f64::from(mix >> 22) / f64::from((1u32 << 10) - 1); // 0..=1
        RETRANSMIT.delay(self.retries, unit)
    }

    fn send(&mut self, now: Instant) -> Step {
        let msg = match &self.state {
            State::Selecting => self.message(MessageType::Discover, None),
            State::Requesting { offer } => self.message(MessageType::Request, Some(offer)),
            _ => return Step::Wait,
        };
        self.next_send = Some(now + self.backoff());
        self.retries += 1;
        let mut out = Vec::with_capacity(300);
        match msg.encode(&mut Encoder::new(&mut out)) {
            Ok(()) => Step::Send(out),
            Err(e) => self.fail(format!("encoding our own DHCP message: {e}")),
        }
    }

    fn fail(&mut self, why: String) -> Step {
        self.state = State::Failed;
        self.next_send = None;
        self.give_up_at = None;
        Step::Failed(why)
    }

    fn message(&self, kind: MessageType, offer: Option<&Lease>) -> Message {
        let unspecified = Ipv4Addr::UNSPECIFIED;
        let mut msg = Message::new_with_id(
            self.xid,
            unspecified,
            unspecified,
            unspecified,
            unspecified,
            &self.mac,
        );
        msg.set_flags(Flags::default().set_broadcast());
        let opts = msg.opts_mut();
        opts.insert(DhcpOption::MessageType(kind));
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
        if let Some(offer) = offer {
            opts.insert(DhcpOption::RequestedIpAddress(offer.address));
            opts.insert(DhcpOption::ServerIdentifier(offer.server));
        }
        msg
    }

    /// Time passed: retransmit or give up.
    pub fn on_timer(&mut self, now: Instant) -> Step {
        if matches!(self.state, State::Bound | State::Failed | State::Init) {
            return Step::Wait;
        }
        if self.give_up_at.is_some_and(|t| now >= t) {
            let what = match self.state {
                State::Requesting { .. } => "no ACK to our REQUEST",
                _ => "no OFFER",
            };
            return self.fail(format!(
                "DHCP gave up after {:?}: {what} ({} packets ignored)",
                self.timeout, self.ignored
            ));
        }
        if self.next_send.is_some_and(|t| now >= t) {
            return self.send(now);
        }
        Step::Wait
    }

    /// A packet arrived on port 68.
    pub fn on_packet(&mut self, bytes: &[u8], now: Instant) -> Step {
        let Ok(msg) = wire::decode(bytes) else {
            self.ignored += 1;
            return Step::Wait;
        };
        if msg.opcode() != Opcode::BootReply
            || msg.xid() != self.xid
            || msg.chaddr().get(..6) != Some(&self.mac[..])
        {
            self.ignored += 1;
            return Step::Wait;
        }
        let kind = msg.opts().msg_type();
        match (&self.state, kind) {
            (State::Selecting, Some(MessageType::Offer)) => match lease_of(&msg) {
                Some(offer) => {
                    self.state = State::Requesting { offer };
                    self.retries = 0;
                    self.send(now)
                }
                None => {
                    self.ignored += 1;
                    Step::Wait
                }
            },
            (State::Requesting { offer }, Some(MessageType::Ack)) => match lease_of(&msg) {
                Some(lease) if lease.address == offer.address => {
                    self.state = State::Bound;
                    self.next_send = None;
                    self.give_up_at = None;
                    Step::Bound(lease)
                }
                _ => {
                    self.ignored += 1;
                    Step::Wait
                }
            },
            (State::Requesting { .. }, Some(MessageType::Nak)) => {
                self.state = State::Selecting;
                self.retries = 0;
                self.send(now)
            }
            _ => {
                self.ignored += 1;
                Step::Wait
            }
        }
    }
}

/// `/etc/resolv.conf` for the lease's DNS servers (at most 3, the resolver's limit).
pub fn resolv_conf(lease: &Lease) -> String {
    lease
        .dns
        .iter()
        .take(3)
        .map(|ip| format!("nameserver {ip}\n"))
        .collect()
}

/// The lease an OFFER or ACK describes; `None` without a usable address or server identifier.
fn lease_of(msg: &Message) -> Option<Lease> {
    let address = msg.yiaddr();
    if address.is_unspecified() || address.is_broadcast() || address.is_multicast() {
        return None;
    }
    let opts = msg.opts();
    let server = match opts.get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(ip)) => *ip,
        _ => return None,
    };
    let prefix_len = match opts.get(OptionCode::SubnetMask) {
        Some(DhcpOption::SubnetMask(mask)) => {
            let m = u32::from(*mask);
            // A mask must be contiguous ones; anything else falls back to the classful /24 most labs use.
            if m.leading_ones() + m.trailing_zeros() == 32 {
                m.leading_ones() as u8
            } else {
                24
            }
        }
        _ => 24,
    };
    let router = match opts.get(OptionCode::Router) {
        Some(DhcpOption::Router(r)) => r.first().copied(),
        _ => None,
    };
    let dns = match opts.get(OptionCode::DomainNameServer) {
        Some(DhcpOption::DomainNameServer(d)) => d.clone(),
        _ => Vec::new(),
    };
    let lease_secs = match opts.get(OptionCode::AddressLeaseTime) {
        Some(DhcpOption::AddressLeaseTime(s)) => Some(*s),
        _ => None,
    };
    let renewal_secs = match opts.get(OptionCode::Renewal) {
        Some(DhcpOption::Renewal(s)) => Some(*s),
        _ => None,
    };
    let rebinding_secs = match opts.get(OptionCode::Rebinding) {
        Some(DhcpOption::Rebinding(s)) => Some(*s),
        _ => None,
    };
    Some(Lease {
        address,
        prefix_len,
        router,
        dns,
        server,
        lease_secs,
        renewal_secs,
        rebinding_secs,
    })
}

#[cfg(test)]
#[path = "tests.rs"]
#[allow(clippy::disallowed_methods)] // the tests pick one real instant as their origin
mod tests;
