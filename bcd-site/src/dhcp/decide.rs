//! The pure proxy-DHCP decision: request + netboot table + who we are → reply or ignore-with-reason.

#![deny(clippy::disallowed_methods)]

use std::fmt;
use std::net::Ipv4Addr;

use dhcproto::v4::{DhcpOption, DhcpOptions, HType, Message, MessageType, Opcode, OptionCode};

use super::table::{MacAddr, NetbootTable};

/// Which socket a request arrived on; the two behave differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenPort {
    /// UDP 67: DISCOVER is answered with an OFFER carrying the boot file and option 43.
    Dhcp,
    /// UDP 4011: the PXE boot-server port; REQUEST (or INFORM) is answered with an ACK.
    PxeBoot,
}

/// Loader file names, relative to the TFTP root (and to `/ipxe/` on the boot HTTP server for HTTP boot). `None`:
/// no loader is offered to those clients, and they are ignored with [`IgnoreReason::NoLoader`]; `bcd site serve`
/// also leaves out every configured file that is absent from the TFTP root ([`BootFiles::retain`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootFiles {
    /// Option 93 = 0 (x86 BIOS).
    pub bios: Option<String>,
    /// Option 93 = 7 or 9 (x64 UEFI), and 16 (x64 HTTP boot): `snponly.efi` uses the firmware's own NIC driver,
    /// `ipxe.efi` brings its own.
    pub x64_uefi: Option<String>,
    /// Option 93 = 11 (arm64 UEFI), and 19 (arm64 HTTP boot).
    pub arm64_uefi: Option<String>,
    /// Option 93 = 10 (32-bit ARM UEFI); none by default.
    pub arm32_uefi: Option<String>,
}

impl Default for BootFiles {
    fn default() -> Self {
        BootFiles {
            bios: Some("undionly.kpxe".into()),
            x64_uefi: Some("snponly.efi".into()),
            arm64_uefi: Some("snp-arm64.efi".into()),
            arm32_uefi: None,
        }
    }
}

/// One loader of [`BootFiles`]: which clients it boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Loader {
    Bios,
    X64Uefi,
    Arm64Uefi,
    Arm32Uefi,
}

impl Loader {
    pub const ALL: [Loader; 4] = [
        Loader::Bios,
        Loader::X64Uefi,
        Loader::Arm64Uefi,
        Loader::Arm32Uefi,
    ];

    /// Its key in `[boot.loaders]` of `site.toml`.
    pub fn key(self) -> &'static str {
        match self {
            Loader::Bios => "bios",
            Loader::X64Uefi => "x64_uefi",
            Loader::Arm64Uefi => "arm64_uefi",
            Loader::Arm32Uefi => "arm32_uefi",
        }
    }

    /// The clients it boots, by architecture and option 93 code, for operators' messages.
    pub fn clients(self) -> &'static str {
        match self {
            Loader::Bios => "x86 BIOS (option 93 = 0)",
            Loader::X64Uefi => "x64 UEFI (option 93 = 7, 9; HTTP boot 16)",
            Loader::Arm64Uefi => "arm64 UEFI (option 93 = 11; HTTP boot 19)",
            Loader::Arm32Uefi => "32-bit ARM UEFI (option 93 = 10)",
        }
    }
}

impl BootFiles {
    /// The file offered to `loader`'s clients, if any.
    pub fn get(&self, loader: Loader) -> Option<&str> {
        self.slot(loader).as_deref()
    }

    fn slot(&self, loader: Loader) -> &Option<String> {
        match loader {
            Loader::Bios => &self.bios,
            Loader::X64Uefi => &self.x64_uefi,
            Loader::Arm64Uefi => &self.arm64_uefi,
            Loader::Arm32Uefi => &self.arm32_uefi,
        }
    }

    fn slot_mut(&mut self, loader: Loader) -> &mut Option<String> {
        match loader {
            Loader::Bios => &mut self.bios,
            Loader::X64Uefi => &mut self.x64_uefi,
            Loader::Arm64Uefi => &mut self.arm64_uefi,
            Loader::Arm32Uefi => &mut self.arm32_uefi,
        }
    }

    /// Keeps the loaders for which `keep(loader, file)` holds and leaves the others unset (no longer offered).
    pub fn retain(&mut self, mut keep: impl FnMut(Loader, &str) -> bool) {
        for loader in Loader::ALL {
            let slot = self.slot_mut(loader);
            if slot.as_deref().is_some_and(|file| !keep(loader, file)) {
                *slot = None;
            }
        }
    }
}

/// What a port-67 OFFER tells PXE firmware (not iPXE, not HTTP boot, which always get their file or URL there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OfferStyle {
    /// The boot file is in the OFFER and option 43 says "use it" (PXE_DISCOVERY_CONTROL bit 3): no port 4011.
    #[default]
    Bootfile,
    /// No boot file in the OFFER: option 43 carries a one-item boot menu (picked at once), this server as the only
    /// boot server of that type, and discovery restricted to that list, so PXE firmware sends its REQUEST to port
    /// 4011, which answers with the boot file (PXE 2.1 boot-server discovery, what vendor ROMs do with WDS/dnsmasq).
    BootServer,
}

/// Who this proxy is, as clients must see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// Address on the boot segment: siaddr (TFTP server), option 54 and the host of every URL.
    pub server_ip: Ipv4Addr,
    /// Port of the boot HTTP server (`/boot/<mac>.ipxe`, `/ipxe/<loader>`).
    pub http_port: u16,
    pub files: BootFiles,
    /// What port-67 OFFERs to PXE firmware carry.
    pub offer: OfferStyle,
}

impl ServerInfo {
    fn http_base(&self) -> String {
        if self.http_port == 80 {
            format!("http://{}", self.server_ip)
        } else {
            format!("http://{}:{}", self.server_ip, self.http_port)
        }
    }

    /// The per-MAC iPXE script URL handed to clients that are already iPXE.
    pub fn ipxe_script_url(&self, mac: &MacAddr) -> String {
        format!("{}/boot/{mac}.ipxe", self.http_base())
    }

    fn http_loader_url(&self, file: &str) -> String {
        format!("{}/ipxe/{file}", self.http_base())
    }
}

/// Client system architecture (option 93, RFC 4578 and the IANA registry), as far as we boot it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    BiosX86,
    UefiX64,
    UefiArm32,
    UefiArm64,
    HttpX64,
    HttpArm64,
}

impl Arch {
    pub fn from_code(code: u16) -> Option<Arch> {
        match code {
            0 => Some(Arch::BiosX86),
            7 | 9 => Some(Arch::UefiX64),
            10 => Some(Arch::UefiArm32),
            11 => Some(Arch::UefiArm64),
            16 => Some(Arch::HttpX64),
            19 => Some(Arch::HttpArm64),
            _ => None,
        }
    }

    /// The loader that boots it.
    pub fn loader(self) -> Loader {
        match self {
            Arch::BiosX86 => Loader::Bios,
            Arch::UefiX64 | Arch::HttpX64 => Loader::X64Uefi,
            Arch::UefiArm32 => Loader::Arm32Uefi,
            Arch::UefiArm64 | Arch::HttpArm64 => Loader::Arm64Uefi,
        }
    }
}

/// Where a reply goes; the server turns this into a socket address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// Limited broadcast to the client port (68): the client has no address yet.
    Broadcast,
    /// Unicast to an address the client already holds (ciaddr), client port.
    Client(Ipv4Addr),
    /// Back to the relay agent (giaddr), server port 67.
    Relay(Ipv4Addr),
    /// Back to the exact source address and port (port 4011 requests).
    Source,
}

/// A reply to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub message: Message,
    pub destination: Destination,
    pub mac: MacAddr,
    /// The boot file or URL handed out, for the log.
    pub bootfile: String,
}

/// Why a request gets no answer. Every ignored packet is counted by [`IgnoreReason::kind`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IgnoreReason {
    NotBootRequest,
    NotEthernet {
        htype: u8,
        hlen: u8,
    },
    NoMessageType,
    /// The message type is not one this port answers (e.g. REQUEST on 67 is for the address server).
    UnansweredType {
        port: ListenPort,
        msg_type: String,
    },
    NotPxeClient {
        vendor_class: Option<String>,
    },
    NotMarkedForNetboot {
        mac: MacAddr,
    },
    NoArchitecture {
        mac: MacAddr,
    },
    /// An architecture code none of our loaders boots.
    UnsupportedArchitecture {
        mac: MacAddr,
        code: u16,
    },
    /// A known architecture whose loader is not configured, or was absent from the TFTP root at start.
    NoLoader {
        mac: MacAddr,
        code: u16,
        loader: Loader,
    },
    /// A 4011 request addressed (option 54) to another boot server.
    OtherServer {
        mac: MacAddr,
        server_id: Ipv4Addr,
    },
}

impl IgnoreReason {
    /// A stable short name, used as the drop counter's label.
    pub fn kind(&self) -> &'static str {
        match self {
            IgnoreReason::NotBootRequest => "not_boot_request",
            IgnoreReason::NotEthernet { .. } => "not_ethernet",
            IgnoreReason::NoMessageType => "no_message_type",
            IgnoreReason::UnansweredType { .. } => "unanswered_type",
            IgnoreReason::NotPxeClient { .. } => "not_pxe_client",
            IgnoreReason::NotMarkedForNetboot { .. } => "not_marked_for_netboot",
            IgnoreReason::NoArchitecture { .. } => "no_architecture",
            IgnoreReason::UnsupportedArchitecture { .. } => "unsupported_architecture",
            IgnoreReason::NoLoader { .. } => "no_loader",
            IgnoreReason::OtherServer { .. } => "other_server",
        }
    }
}

impl fmt::Display for IgnoreReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IgnoreReason::NotBootRequest => write!(f, "not a BOOTREQUEST"),
            IgnoreReason::NotEthernet { htype, hlen } => {
                write!(f, "hardware type {htype} / length {hlen} is not Ethernet")
            }
            IgnoreReason::NoMessageType => write!(f, "no DHCP message type (option 53)"),
            IgnoreReason::UnansweredType { port, msg_type } => {
                write!(f, "{msg_type} is not answered on {port:?}")
            }
            IgnoreReason::NotPxeClient { vendor_class } => {
                write!(
                    f,
                    "vendor class {vendor_class:?} is neither PXEClient nor HTTPClient"
                )
            }
            IgnoreReason::NotMarkedForNetboot { mac } => {
                write!(f, "{mac} is not marked for netboot")
            }
            IgnoreReason::NoArchitecture { mac } => {
                write!(
                    f,
                    "{mac} sent no client architecture (option 93 or PXEClient:Arch)"
                )
            }
            IgnoreReason::UnsupportedArchitecture { mac, code } => {
                write!(
                    f,
                    "{mac} has client architecture {code}, which no loader boots"
                )
            }
            IgnoreReason::NoLoader { mac, code, loader } => {
                write!(
                    f,
                    "{mac} has client architecture {code} ({}), and no boot.loaders.{} is served: set one, or \
                     put the file in the TFTP root and restart",
                    loader.clients(),
                    loader.key()
                )
            }
            IgnoreReason::OtherServer { mac, server_id } => {
                write!(f, "{mac} addressed boot server {server_id}, not us")
            }
        }
    }
}

/// The outcome of [`decide`].
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Reply(Box<Reply>),
    Ignore { reason: IgnoreReason },
}

/// PXE vendor sub-option 6, PXE_DISCOVERY_CONTROL: bit 3 = "a boot file is in this offer: download it, no
/// prompt, menu or boot-server discovery".
const PXE_DISCOVERY_CONTROL: u8 = 6;
const DISCOVERY_USE_BOOTFILE: u8 = 0x08;
/// PXE_DISCOVERY_CONTROL bits 0–2: no broadcast, no multicast discovery; only the servers in PXE_BOOT_SERVERS.
const DISCOVERY_USE_SERVER_LIST: u8 = 0x07;
/// PXE vendor sub-option 8, PXE_BOOT_SERVERS: type (2), IP count (1), IPs.
const PXE_BOOT_SERVERS: u8 = 8;
/// PXE vendor sub-option 9, PXE_BOOT_MENU: type (2), description length (1), description.
const PXE_BOOT_MENU: u8 = 9;
/// PXE vendor sub-option 10, PXE_MENU_PROMPT: timeout in seconds (1; 0 = take the first item at once), prompt.
const PXE_MENU_PROMPT: u8 = 10;
/// PXE vendor sub-option 71, PXE_BOOT_ITEM: echoed on 4011 when the client names one.
const PXE_BOOT_ITEM: u8 = 71;
/// The boot server type of our one menu item. Type 0 means "local boot" to firmware (it would stop PXE), 1–32767
/// are assigned to vendors (1 is Microsoft WDS); 32768–65534 are free for private use.
pub const BOOT_SERVER_TYPE: u16 = 0x8000;
const BOOT_MENU_TEXT: &[u8] = b"Better Compute";
const MENU_PROMPT_TEXT: &[u8] = b"PXE";

/// Decides the answer to one request. Pure: no clock, no I/O.
pub fn decide(
    request: &Message,
    port: ListenPort,
    table: &NetbootTable,
    server: &ServerInfo,
) -> Decision {
    match decide_inner(request, port, table, server) {
        Ok(reply) => Decision::Reply(Box::new(reply)),
        Err(reason) => Decision::Ignore { reason },
    }
}

fn decide_inner(
    req: &Message,
    port: ListenPort,
    table: &NetbootTable,
    server: &ServerInfo,
) -> Result<Reply, IgnoreReason> {
    if req.opcode() != Opcode::BootRequest {
        return Err(IgnoreReason::NotBootRequest);
    }
    let mac = ethernet_mac(req)?;
    let opts = req.opts();
    let msg_type = opts.msg_type().ok_or(IgnoreReason::NoMessageType)?;
    let reply_type = match (port, msg_type) {
        (ListenPort::Dhcp, MessageType::Discover) => MessageType::Offer,
        (ListenPort::PxeBoot, MessageType::Request | MessageType::Inform) => MessageType::Ack,
        (port, other) => {
            return Err(IgnoreReason::UnansweredType {
                port,
                msg_type: format!("{other:?}"),
            });
        }
    };

    let class = vendor_class(opts);
    let client_kind = match class {
        Some(c) if c.starts_with(b"PXEClient") => ClientKind::Pxe,
        Some(c) if c.starts_with(b"HTTPClient") => ClientKind::Http,
        other => {
            return Err(IgnoreReason::NotPxeClient {
                vendor_class: other.map(|c| String::from_utf8_lossy(c).into_owned()),
            });
        }
    };
    if !table.contains(&mac) {
        return Err(IgnoreReason::NotMarkedForNetboot { mac });
    }
    if port == ListenPort::PxeBoot
        && let Some(DhcpOption::ServerIdentifier(id)) = opts.get(OptionCode::ServerIdentifier)
        && *id != server.server_ip
    {
        return Err(IgnoreReason::OtherServer {
            mac,
            server_id: *id,
        });
    }

    // iPXE asks again once loaded: hand it the script, never the loader (that would loop). It needs no
    // architecture-specific file, so its architecture is not consulted.
    let ipxe = is_ipxe(opts);
    let (bootfile, answer_class) = if ipxe {
        let class = match client_kind {
            ClientKind::Http => ANSWER_HTTP,
            ClientKind::Pxe => ANSWER_PXE,
        };
        (server.ipxe_script_url(&mac), class)
    } else {
        let code = client_arch(opts, class).ok_or(IgnoreReason::NoArchitecture { mac })?;
        let arch =
            Arch::from_code(code).ok_or(IgnoreReason::UnsupportedArchitecture { mac, code })?;
        let loader = arch.loader();
        let file = server
            .files
            .get(loader)
            .ok_or(IgnoreReason::NoLoader { mac, code, loader })?;
        match arch {
            Arch::HttpX64 | Arch::HttpArm64 => (server.http_loader_url(file), ANSWER_HTTP),
            Arch::BiosX86 | Arch::UefiX64 | Arch::UefiArm32 | Arch::UefiArm64 => {
                (file.to_owned(), ANSWER_PXE)
            }
        }
    };

    // new_with_id, not default(): default() draws a random xid, and a decision reads no RNG.
    let mut reply = Message::new_with_id(
        req.xid(),
        req.ciaddr(),
        Ipv4Addr::UNSPECIFIED,
        server.server_ip,
        req.giaddr(),
        &mac.0,
    );
    reply
        .set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_hops(0)
        .set_secs(0)
        .set_flags(req.flags());
    reply.clear_sname();
    // PXE firmware (not iPXE) told to discover the boot server gets no file on 67: it must ask 4011.
    let discover = port == ListenPort::Dhcp
        && answer_class == ANSWER_PXE
        && !ipxe
        && server.offer == OfferStyle::BootServer;
    // The fname field holds at most 128 bytes; longer URLs travel in option 67 only.
    if !discover && bootfile.len() <= 127 {
        reply.set_fname(bootfile.as_bytes());
    } else {
        reply.clear_fname();
    }

    let out = reply.opts_mut();
    out.insert(DhcpOption::MessageType(reply_type));
    out.insert(DhcpOption::ServerIdentifier(server.server_ip));
    out.insert(DhcpOption::ClassIdentifier(answer_class.to_vec()));
    if discover {
        out.insert(DhcpOption::VendorExtensions(boot_server_discovery(
            server.server_ip,
        )));
    } else {
        out.insert(DhcpOption::BootfileName(bootfile.clone().into_bytes()));
        if answer_class == ANSWER_PXE {
            out.insert(DhcpOption::VendorExtensions(pxe_vendor_options(port, opts)));
        }
    }
    if let Some(DhcpOption::ClientMachineIdentifier(uuid)) =
        opts.get(OptionCode::ClientMachineIdentifier)
    {
        // PXE clients expect their UUID/GUID (option 97) back.
        out.insert(DhcpOption::ClientMachineIdentifier(uuid.clone()));
    }

    let destination = match port {
        ListenPort::PxeBoot => Destination::Source,
        ListenPort::Dhcp if !req.giaddr().is_unspecified() => Destination::Relay(req.giaddr()),
        ListenPort::Dhcp if !req.ciaddr().is_unspecified() => Destination::Client(req.ciaddr()),
        ListenPort::Dhcp => Destination::Broadcast,
    };
    Ok(Reply {
        message: reply,
        destination,
        mac,
        bootfile: if discover {
            format!("(none: boot-server discovery on port 4011, then {bootfile})")
        } else {
            bootfile
        },
    })
}

const ANSWER_PXE: &[u8] = b"PXEClient";
const ANSWER_HTTP: &[u8] = b"HTTPClient";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientKind {
    Pxe,
    Http,
}

/// The client's Ethernet MAC (`chaddr`), when the request names one.
pub(crate) fn client_mac(req: &Message) -> Option<MacAddr> {
    ethernet_mac(req).ok()
}

fn ethernet_mac(req: &Message) -> Result<MacAddr, IgnoreReason> {
    let hlen = req.hlen();
    if req.htype() != HType::Eth || hlen != 6 {
        return Err(IgnoreReason::NotEthernet {
            htype: req.htype().into(),
            hlen,
        });
    }
    // hlen == 6 was checked, so chaddr() cannot slice out of bounds.
    let bytes: [u8; 6] = req
        .chaddr()
        .try_into()
        .map_err(|_| IgnoreReason::NotEthernet {
            htype: req.htype().into(),
            hlen,
        })?;
    Ok(MacAddr(bytes))
}

fn vendor_class(opts: &DhcpOptions) -> Option<&[u8]> {
    match opts.get(OptionCode::ClassIdentifier) {
        Some(DhcpOption::ClassIdentifier(c)) => Some(c),
        _ => None,
    }
}

/// Option 93, else the `Arch:NNNNN` field of `PXEClient:Arch:NNNNN:UNDI:...`.
fn client_arch(opts: &DhcpOptions, class: Option<&[u8]>) -> Option<u16> {
    if let Some(DhcpOption::ClientSystemArchitecture(arch)) =
        opts.get(OptionCode::ClientSystemArchitecture)
    {
        return Some(u16::from(*arch));
    }
    let class = std::str::from_utf8(class?).ok()?;
    let mut parts = class.split(':');
    while let Some(part) = parts.next() {
        if part == "Arch" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

/// User class (option 77) is iPXE: either the raw string iPXE sends or an RFC 3004 list containing it.
fn is_ipxe(opts: &DhcpOptions) -> bool {
    let Some(DhcpOption::UserClass(data)) = opts.get(OptionCode::UserClass) else {
        return false;
    };
    if data.as_slice() == b"iPXE" {
        return true;
    }
    let mut rest = data.as_slice();
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::from(len);
        if len == 0 || len > tail.len() {
            return false;
        }
        let (class, next) = tail.split_at(len);
        if class == b"iPXE" {
            return true;
        }
        rest = next;
    }
    false
}

/// Option 43 for PXE clients: use the boot file in this packet, no discovery; on 4011 echo the boot item asked for.
fn pxe_vendor_options(port: ListenPort, req: &DhcpOptions) -> Vec<u8> {
    let mut v = vec![PXE_DISCOVERY_CONTROL, 1, DISCOVERY_USE_BOOTFILE];
    if port == ListenPort::PxeBoot
        && let Some(item) = requested_boot_item(req)
    {
        v.extend_from_slice(&[PXE_BOOT_ITEM, 4]);
        v.extend_from_slice(&item);
    }
    v.push(255);
    v
}

/// Option 43 of a boot-server OFFER: discovery only through the server list, which names us alone; a one-item
/// menu of our type with a zero-second prompt, so firmware picks it without a key press and unicasts its REQUEST
/// (with PXE_BOOT_ITEM = our type, layer 0) to us on port 4011.
fn boot_server_discovery(server_ip: Ipv4Addr) -> Vec<u8> {
    let [t0, t1] = BOOT_SERVER_TYPE.to_be_bytes();
    let mut v = vec![PXE_DISCOVERY_CONTROL, 1, DISCOVERY_USE_SERVER_LIST];
    v.extend_from_slice(&[PXE_BOOT_SERVERS, 7, t0, t1, 1]);
    v.extend_from_slice(&server_ip.octets());
    // Both texts are constants far below 255 bytes.
    v.extend_from_slice(&[PXE_BOOT_MENU, 3 + BOOT_MENU_TEXT.len() as u8, t0, t1]);
    v.push(BOOT_MENU_TEXT.len() as u8);
    v.extend_from_slice(BOOT_MENU_TEXT);
    v.extend_from_slice(&[PXE_MENU_PROMPT, 1 + MENU_PROMPT_TEXT.len() as u8, 0]);
    v.extend_from_slice(MENU_PROMPT_TEXT);
    v.push(255);
    v
}

fn requested_boot_item(req: &DhcpOptions) -> Option<[u8; 4]> {
    let Some(DhcpOption::VendorExtensions(data)) = req.get(OptionCode::VendorExtensions) else {
        return None;
    };
    let mut rest = data.as_slice();
    while let [code, tail @ ..] = rest {
        match *code {
            0 => rest = tail,
            255 => return None,
            code => {
                let (&len, tail) = tail.split_first()?;
                let len = usize::from(len);
                if len > tail.len() {
                    return None;
                }
                let (value, next) = tail.split_at(len);
                if code == PXE_BOOT_ITEM {
                    return value.try_into().ok();
                }
                rest = next;
            }
        }
    }
    None
}
