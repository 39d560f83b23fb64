//! Run [`super::DhcpClient`] on a real interface: choose the boot NIC, set it up, exchange DHCP over a UDP socket
//! bound to it (`SO_BINDTODEVICE`, `SO_BROADCAST`), then add the address and default route over rtnetlink.

// The I/O around the sans-I/O client: it reads the clock and feeds the client the time.
#![allow(clippy::disallowed_methods)]

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use tracing::{info, warn};

use super::{DhcpClient, Lease, Step};
use crate::os::netlink::RouteSocket;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("no network interface to use (looked for {wanted})")]
    NoNic { wanted: String },
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{0}")]
    Dhcp(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Io { what, source }
}

/// An interface of `/sys/class/net`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub mac: [u8; 6],
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let parts: Vec<&str> = s.trim().split(':').collect();
    if parts.len() != 6 {
        return None;
    }
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
}

/// Ethernet interfaces other than loopback, sorted by name.
pub fn interfaces(sys_class_net: &Path) -> Vec<Interface> {
    let mut out: Vec<Interface> = fs::read_dir(sys_class_net)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let dir = e.path();
                    // type 1 = ARPHRD_ETHER
                    if name == "lo" || fs::read_to_string(dir.join("type")).ok()?.trim() != "1" {
                        return None;
                    }
                    let index = fs::read_to_string(dir.join("ifindex"))
                        .ok()?
                        .trim()
                        .parse()
                        .ok()?;
                    let mac = parse_mac(&fs::read_to_string(dir.join("address")).ok()?)?;
                    Some(Interface { name, index, mac })
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn has_carrier(name: &str) -> bool {
    fs::read_to_string(Path::new("/sys/class/net").join(name).join("carrier"))
        .map(|c| c.trim() == "1")
        .unwrap_or(false)
}

/// Pick the boot NIC: by name, else by the PXE MAC, else the first with a carrier (after setting all up and
/// waiting up to `carrier_wait`).
pub fn choose_nic(
    name: Option<&str>,
    mac: Option<[u8; 6]>,
    carrier_wait: Duration,
) -> Result<Interface, NetError> {
    let all = interfaces(Path::new("/sys/class/net"));
    let wanted = match (name, mac) {
        (Some(n), _) => format!("bc.nic={n}"),
        (None, Some(m)) => format!("BOOTIF MAC {}", hex::encode(m)),
        (None, None) => "any interface with a carrier".into(),
    };
    let mut nl = RouteSocket::open().map_err(io_err("opening a netlink socket"))?;
    let candidates: Vec<Interface> = all
        .into_iter()
        // An explicit name wins over the PXE MAC.
        .filter(|i| match (name, mac) {
            (Some(n), _) => i.name == n,
            (None, Some(m)) => i.mac == m,
            (None, None) => true,
        })
        .collect();
    if candidates.is_empty() {
        return Err(NetError::NoNic { wanted });
    }
    for i in &candidates {
        nl.link_up(i.index)
            .map_err(io_err(format!("setting {} up", i.name)))?;
    }
    let deadline = Instant::now() + carrier_wait;
    loop {
        if let Some(i) = candidates.iter().find(|i| has_carrier(&i.name)) {
            return Ok(i.clone());
        }
        if Instant::now() >= deadline {
            // An explicit choice is used even without a carrier report (some drivers are late to set it).
            if name.is_some() || mac.is_some() {
                return Ok(candidates[0].clone());
            }
            return Err(NetError::NoNic { wanted });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A UDP socket on port 68 bound to `nic`, allowed to broadcast.
fn dhcp_socket(nic: &Interface) -> Result<std::net::UdpSocket, NetError> {
    let sock = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))
        .map_err(io_err("creating the DHCP socket"))?;
    sock.set_reuse_address(true)
        .map_err(io_err("SO_REUSEADDR"))?;
    sock.set_broadcast(true).map_err(io_err("SO_BROADCAST"))?;
    sock.bind_device(Some(nic.name.as_bytes()))
        .map_err(io_err(format!("binding the DHCP socket to {}", nic.name)))?;
    sock.bind(&SockAddr::from(SocketAddrV4::new(
        Ipv4Addr::UNSPECIFIED,
        68,
    )))
    .map_err(io_err("binding UDP port 68"))?;
    Ok(sock.into())
}

/// Waits for a packet until `deadline`: `Some(n)` bytes, or `None` when the time came first.
fn recv_until(
    sock: &std::net::UdpSocket,
    buf: &mut [u8],
    deadline: Option<Instant>,
    nic: &str,
) -> Result<Option<usize>, NetError> {
    let wait = deadline
        .map_or(Duration::from_millis(100), |d| {
            d.saturating_duration_since(Instant::now())
        })
        .max(Duration::from_millis(10));
    sock.set_read_timeout(Some(wait))
        .map_err(io_err("SO_RCVTIMEO"))?;
    match sock.recv(buf) {
        Ok(n) => Ok(Some(n)),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(io_err(format!("receiving DHCP on {nic}"))(e)),
    }
}

/// DHCP on `nic`, then configure the lease. Gives up after `timeout`.
pub fn acquire(nic: &Interface, xid: u32, timeout: Duration) -> Result<Lease, NetError> {
    let lease = exchange(nic, xid, timeout)?;
    configure(nic, &lease)?;
    Ok(lease)
}

/// The DISCOVER → OFFER → REQUEST → ACK exchange on `nic`, configuring nothing.
fn exchange(nic: &Interface, xid: u32, timeout: Duration) -> Result<Lease, NetError> {
    let sock = dhcp_socket(nic)?;
    let server = SocketAddrV4::new(Ipv4Addr::BROADCAST, 67);
    let mut client = DhcpClient::new(nic.mac, xid, timeout);
    let mut step = client.start(Instant::now());
    let mut buf = [0u8; 1500];
    let lease = loop {
        match step {
            Step::Send(bytes) => {
                sock.send_to(&bytes, server)
                    .map_err(io_err(format!("sending DHCP on {}", nic.name)))?;
                step = Step::Wait;
                continue;
            }
            Step::Bound(lease) => break lease,
            Step::Failed(why) => return Err(NetError::Dhcp(why)),
            Step::Wait => {}
        }
        step = match recv_until(&sock, &mut buf, client.deadline(), &nic.name)? {
            Some(n) => client.on_packet(&buf[..n], Instant::now()),
            None => client.on_timer(Instant::now()),
        };
    };
    if client.ignored > 0 {
        warn!(nic = %nic.name, ignored = client.ignored, "DHCP packets ignored");
    }
    Ok(lease)
}

/// Adds the lease's address and default route to `nic`.
fn configure(nic: &Interface, lease: &Lease) -> Result<(), NetError> {
    let mut nl = RouteSocket::open().map_err(io_err("opening a netlink socket"))?;
    nl.add_address(nic.index, lease.address, lease.prefix_len)
        .map_err(io_err(format!(
            "adding {}/{} to {}",
            lease.address, lease.prefix_len, nic.name
        )))?;
    if let Some(gw) = lease.router {
        nl.add_default_route(nic.index, gw)
            .map_err(io_err(format!("adding the default route via {gw}")))?;
    }
    info!(nic = %nic.name, address = %lease.address, prefix = lease.prefix_len, router = ?lease.router,
        server = %lease.server, "DHCP lease configured");
    Ok(())
}

/// What [`keep`] tells its caller (PID 1 prints each on the console).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseEvent {
    /// The lease was renewed (or rebound) for this many seconds.
    Renewed {
        address: Ipv4Addr,
        lease_secs: Option<u32>,
    },
    /// The lease was lost; DHCP starts over.
    Lost { address: Ipv4Addr, why: String },
    /// A new lease after a loss (`changed`: a different address, added beside the old one).
    Reacquired { address: Ipv4Addr, changed: bool },
    /// Something failed; [`keep`] retries after a pause.
    Trouble(String),
}

/// Keeps `lease` on `nic` for as long as the process lives (run it on its own thread): renews at T1 by unicast,
/// rebinds at T2 by broadcast, and after a loss runs DHCP again (adding the new address when it differs). Returns
/// only when the lease never expires (nothing to do) or when `events` asks to stop (returns `false`).
pub fn keep(nic: &Interface, lease: Lease, xid: u32, events: &mut dyn FnMut(LeaseEvent) -> bool) {
    let mut xid = xid;
    let mut lease = lease;
    loop {
        let Some(mut renewal) =
            super::renew::Renewal::new(nic.mac, xid, lease.clone(), Instant::now())
        else {
            info!(nic = %nic.name, address = %lease.address, "the lease does not expire: nothing to renew");
            return;
        };
        match renew_until_lost(nic, &mut renewal, events) {
            Ok(None) => return,
            Ok(Some(why)) => {
                if !events(LeaseEvent::Lost {
                    address: lease.address,
                    why,
                }) {
                    return;
                }
            }
            Err(e) => {
                if !events(LeaseEvent::Trouble(bc_error_chain::chain(&e))) {
                    return;
                }
                // The socket failed (interface gone?): keep the lease we have and try again shortly.
                std::thread::sleep(Duration::from_secs(5));
                continue;
            }
        }
        // Lost: start over until a server answers.
        xid = xid.wrapping_mul(2_891_336_453).wrapping_add(1);
        loop {
            match exchange(nic, xid, Duration::from_secs(60)) {
                Ok(new) => {
                    let changed = new.address != lease.address;
                    if changed
                        && let Err(e) = configure(nic, &new)
                        && !events(LeaseEvent::Trouble(bc_error_chain::chain(&e)))
                    {
                        return;
                    }
                    if !events(LeaseEvent::Reacquired {
                        address: new.address,
                        changed,
                    }) {
                        return;
                    }
                    lease = new;
                    break;
                }
                Err(e) => {
                    if !events(LeaseEvent::Trouble(bc_error_chain::chain(&e))) {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Runs one lease's renewals: `Ok(Some(why))` when it is lost, `Ok(None)` when told to stop.
fn renew_until_lost(
    nic: &Interface,
    renewal: &mut super::renew::Renewal,
    events: &mut dyn FnMut(LeaseEvent) -> bool,
) -> Result<Option<String>, NetError> {
    use super::renew::RenewStep;
    let sock = dhcp_socket(nic)?;
    let mut buf = [0u8; 1500];
    let mut step = RenewStep::Wait;
    loop {
        match step {
            RenewStep::Unicast(server, bytes) => {
                sock.send_to(&bytes, SocketAddrV4::new(server, 67))
                    .map_err(io_err(format!("sending the DHCP renewal to {server}")))?;
            }
            RenewStep::Broadcast(bytes) => {
                sock.send_to(&bytes, SocketAddrV4::new(Ipv4Addr::BROADCAST, 67))
                    .map_err(io_err(format!(
                        "broadcasting the DHCP rebinding on {}",
                        nic.name
                    )))?;
            }
            RenewStep::Renewed(l) => {
                if !events(LeaseEvent::Renewed {
                    address: l.address,
                    lease_secs: l.lease_secs,
                }) {
                    return Ok(None);
                }
            }
            RenewStep::Lost(why) => return Ok(Some(why)),
            RenewStep::Wait => {}
        }
        step = match recv_until(&sock, &mut buf, Some(renewal.deadline()), &nic.name)? {
            Some(n) => renewal.on_packet(&buf[..n], Instant::now()),
            None => renewal.on_timer(Instant::now()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_ethernet_interfaces_from_sysfs() {
        let t = tempfile::tempdir().expect("tempdir");
        for (name, ty, index, mac) in [
            ("lo", "772", "1", "00:00:00:00:00:00"),
            ("eth1", "1", "3", "52:54:00:00:00:02"),
            ("eth0", "1", "2", "52:54:00:12:34:56"),
            ("ib0", "32", "4", "80:00:00:00"),
            ("bad0", "1", "x", "52:54:00:00:00:03"),
        ] {
            let d = t.path().join(name);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("type"), format!("{ty}\n")).expect("write");
            std::fs::write(d.join("ifindex"), format!("{index}\n")).expect("write");
            std::fs::write(d.join("address"), format!("{mac}\n")).expect("write");
        }
        let all = interfaces(t.path());
        assert_eq!(
            all,
            [
                Interface {
                    name: "eth0".into(),
                    index: 2,
                    mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56]
                },
                Interface {
                    name: "eth1".into(),
                    index: 3,
                    mac: [0x52, 0x54, 0, 0, 0, 2]
                },
            ]
        );
        assert_eq!(parse_mac("52:54:00:12:34"), None);
        assert_eq!(parse_mac("zz:54:00:12:34:56"), None);
    }
}
