//! Noticing a second server that hands PXE boot information to clients on our segment.
//!
//! Two boot servers answering the same client make boots nondeterministic (firmware takes whichever offer it
//! likes). The proxy watches replies on the client port and reports any from another server that carries PXE
//! boot information; the operator decides what to do.

use std::fmt;
use std::net::Ipv4Addr;

use dhcproto::v4::{DhcpOption, HType, Message, MessageType, Opcode, OptionCode};

use super::table::MacAddr;

/// Another server offering PXE or HTTP boot to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RogueServer {
    /// Option 54 if present, else the packet's source address.
    pub server_id: Ipv4Addr,
    pub client_mac: Option<MacAddr>,
    pub xid: u32,
    pub message_type: String,
    pub vendor_class: Option<String>,
    pub bootfile: Option<String>,
}

impl fmt::Display for RogueServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} sent a {} with boot information",
            self.server_id, self.message_type
        )?;
        if let Some(mac) = self.client_mac {
            write!(f, " to {mac}")?;
        }
        if let Some(class) = &self.vendor_class {
            write!(f, ", vendor class {class:?}")?;
        }
        if let Some(file) = &self.bootfile {
            write!(f, ", boot file {file:?}")?;
        }
        Ok(())
    }
}

/// Looks at a reply seen on the segment (`source` is its IP source address) and reports it if it is an OFFER or
/// ACK from a server other than `us` carrying option 60 `PXEClient`/`HTTPClient` or a boot file. Pure.
pub fn observe(msg: &Message, source: Ipv4Addr, us: Ipv4Addr) -> Option<RogueServer> {
    if msg.opcode() != Opcode::BootReply {
        return None;
    }
    let opts = msg.opts();
    let msg_type = opts.msg_type()?;
    if !matches!(msg_type, MessageType::Offer | MessageType::Ack) {
        return None;
    }
    let server_id = match opts.get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(id)) => *id,
        _ => source,
    };
    if server_id == us {
        return None;
    }
    let vendor_class = match opts.get(OptionCode::ClassIdentifier) {
        Some(DhcpOption::ClassIdentifier(c))
            if c.starts_with(b"PXEClient") || c.starts_with(b"HTTPClient") =>
        {
            Some(String::from_utf8_lossy(c).into_owned())
        }
        _ => None,
    };
    let bootfile = match opts.get(OptionCode::BootfileName) {
        Some(DhcpOption::BootfileName(f)) if !f.is_empty() => Some(lossy_until_nul(f)),
        _ => msg.fname().map(lossy_until_nul).filter(|f| !f.is_empty()),
    };
    if vendor_class.is_none() && bootfile.is_none() {
        return None;
    }
    let client_mac = (msg.htype() == HType::Eth && msg.hlen() == 6)
        .then(|| msg.chaddr().try_into().ok().map(MacAddr))
        .flatten();
    Some(RogueServer {
        server_id,
        client_mac,
        xid: msg.xid(),
        message_type: format!("{msg_type:?}").to_uppercase(),
        vendor_class,
        bootfile,
    })
}

fn lossy_until_nul(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
    const OTHER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 9);

    fn offer(class: Option<&[u8]>, file: Option<&str>) -> Message {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootReply)
            .set_xid(7)
            .set_chaddr(&[2, 0, 0, 0, 0, 1]);
        m.opts_mut()
            .insert(DhcpOption::MessageType(MessageType::Offer));
        m.opts_mut().insert(DhcpOption::ServerIdentifier(OTHER));
        if let Some(c) = class {
            m.opts_mut().insert(DhcpOption::ClassIdentifier(c.to_vec()));
        }
        if let Some(f) = file {
            m.set_fname_str(f);
        }
        m
    }

    #[test]
    fn reports_pxe_offers_from_other_servers() {
        let seen = observe(&offer(Some(b"PXEClient"), None), OTHER, US);
        let seen = seen.as_ref().map(ToString::to_string);
        assert_eq!(
            seen.as_deref(),
            Some(
                "10.0.0.9 sent a OFFER with boot information to 02:00:00:00:00:01, vendor class \"PXEClient\""
            )
        );
        let by_file = observe(&offer(None, Some("pxelinux.0")), OTHER, US);
        assert_eq!(
            by_file.and_then(|r| r.bootfile),
            Some("pxelinux.0".to_string())
        );
    }

    #[test]
    fn ignores_plain_offers_our_own_and_requests() {
        assert_eq!(observe(&offer(None, None), OTHER, US), None);
        assert_eq!(observe(&offer(Some(b"MSFT 5.0"), None), OTHER, US), None);
        let mut ours = offer(Some(b"PXEClient"), None);
        ours.opts_mut().insert(DhcpOption::ServerIdentifier(US));
        assert_eq!(observe(&ours, US, US), None);
        let mut req = offer(Some(b"PXEClient"), None);
        req.set_opcode(Opcode::BootRequest);
        assert_eq!(observe(&req, OTHER, US), None);
    }
}
