//! Proxy-DHCP decisions: golden files of the replies as sent on the wire, and the reasons for silence.
//!
//! Requests are built the way the firmware builds them, encoded to bytes and decoded through
//! `bcd_site::dhcp::wire::decode`, so the golden path is the server's path. Regenerate the goldens with
//! `BC_UPDATE_GOLDEN=1 cargo test -p bcd-site --test dhcp_decide` and review the diff like code.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use bcd_site::dhcp::render::render;
use bcd_site::dhcp::wire::{decode, encode};
use bcd_site::dhcp::{
    BOOT_SERVER_TYPE, Decision, Destination, IgnoreReason, ListenPort, Loader, MacAddr,
    NetbootTable, OfferStyle, ServerInfo, decide,
};
use dhcproto::v4::{Architecture, DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Encodable, Encoder};

const SERVER: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 2);
const KNOWN: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const UNKNOWN: [u8; 6] = [0x52, 0x54, 0x00, 0x99, 0x99, 0x99];
const UUID: [u8; 17] = [
    0, 0x4c, 0x4c, 0x45, 0x44, 0x00, 0x10, 0x38, 0x80, 0x4e, 0xb4, 0xc0, 0x4f, 0x4d, 0x47, 0x31,
    0x32,
];

fn server() -> ServerInfo {
    ServerInfo {
        server_ip: SERVER,
        http_port: 8080,
        files: Default::default(),
        offer: OfferStyle::Bootfile,
    }
}

fn boot_server() -> ServerInfo {
    ServerInfo {
        offer: OfferStyle::BootServer,
        ..server()
    }
}

fn table() -> Result<NetbootTable> {
    Ok([format!("{}", MacAddr(KNOWN)).parse()?, "02:0b:".parse()?]
        .into_iter()
        .collect())
}

/// A client request as firmware sends it, round-tripped through bytes and our decoder.
struct Req {
    mac: [u8; 6],
    msg_type: MessageType,
    arch: Option<u16>,
    class: Option<&'static str>,
    user_class: Option<&'static [u8]>,
    ciaddr: Ipv4Addr,
    server_id: Option<Ipv4Addr>,
    extra: Vec<DhcpOption>,
}

impl Req {
    fn pxe(arch: u16, class: &'static str) -> Self {
        Req {
            mac: KNOWN,
            msg_type: MessageType::Discover,
            arch: Some(arch),
            class: Some(class),
            user_class: None,
            ciaddr: Ipv4Addr::UNSPECIFIED,
            server_id: None,
            extra: Vec::new(),
        }
    }

    fn bytes(&self) -> Result<Vec<u8>> {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_xid(0x1234_5678)
            .set_secs(4)
            .set_flags(Flags::default().set_broadcast())
            .set_ciaddr(self.ciaddr)
            .set_chaddr(&self.mac);
        let o = m.opts_mut();
        o.insert(DhcpOption::MessageType(self.msg_type));
        o.insert(DhcpOption::MaxMessageSize(1260));
        if let Some(a) = self.arch {
            o.insert(DhcpOption::ClientSystemArchitecture(Architecture::from(a)));
        }
        o.insert(DhcpOption::ClientNetworkInterface(1, 3, 16));
        o.insert(DhcpOption::ClientMachineIdentifier(UUID.to_vec()));
        if let Some(c) = self.class {
            o.insert(DhcpOption::ClassIdentifier(c.as_bytes().to_vec()));
        }
        if let Some(u) = self.user_class {
            o.insert(DhcpOption::UserClass(u.to_vec()));
        }
        if let Some(id) = self.server_id {
            o.insert(DhcpOption::ServerIdentifier(id));
        }
        o.insert(DhcpOption::ParameterRequestList(vec![
            OptionCode::SubnetMask,
            OptionCode::Router,
            OptionCode::VendorExtensions,
            OptionCode::ClassIdentifier,
            OptionCode::BootfileName,
        ]));
        for opt in &self.extra {
            o.insert(opt.clone());
        }
        let mut buf = Vec::new();
        m.encode(&mut Encoder::new(&mut buf))?;
        Ok(buf)
    }

    fn decide(&self, port: ListenPort) -> Result<Decision> {
        self.decide_with(port, &server())
    }

    fn decide_with(&self, port: ListenPort, server: &ServerInfo) -> Result<Decision> {
        let msg = decode(&self.bytes()?)?;
        Ok(decide(&msg, port, &table()?, server))
    }
}

fn golden(name: &str, port: ListenPort, req: &Req) -> Result<()> {
    golden_with(name, port, req, &server())
}

fn golden_with(name: &str, port: ListenPort, req: &Req, server: &ServerInfo) -> Result<()> {
    let reply = match req.decide_with(port, server)? {
        Decision::Reply(r) => r,
        Decision::Ignore { reason } => bail!("{name}: expected a reply, got ignore: {reason}"),
    };
    assert_eq!(
        reply.message.yiaddr(),
        Ipv4Addr::UNSPECIFIED,
        "{name}: a proxy never assigns"
    );
    let mut wire = Vec::new();
    encode(&reply.message, &mut wire)?;
    let rendered = format!("# destination {:?}\n{}", reply.destination, render(&wire)?);
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/{name}.txt"));
    bc_testkit::assert_golden(path, &rendered);
    Ok(())
}

#[test]
fn golden_bios_arch_0() -> Result<()> {
    golden(
        "offer-arch0-bios",
        ListenPort::Dhcp,
        &Req::pxe(0, "PXEClient:Arch:00000:UNDI:002001"),
    )
}

#[test]
fn golden_x64_uefi_arch_7() -> Result<()> {
    golden(
        "offer-arch7-uefi-x64",
        ListenPort::Dhcp,
        &Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016"),
    )
}

#[test]
fn golden_x64_uefi_arch_9() -> Result<()> {
    golden(
        "offer-arch9-uefi-x64",
        ListenPort::Dhcp,
        &Req::pxe(9, "PXEClient:Arch:00009:UNDI:003016"),
    )
}

#[test]
fn golden_arm64_uefi_arch_11() -> Result<()> {
    golden(
        "offer-arch11-uefi-arm64",
        ListenPort::Dhcp,
        &Req::pxe(11, "PXEClient:Arch:00011:UNDI:003016"),
    )
}

#[test]
fn golden_http_boot_arch_16() -> Result<()> {
    golden(
        "offer-arch16-http",
        ListenPort::Dhcp,
        &Req::pxe(16, "HTTPClient:Arch:00016:UNDI:003001"),
    )
}

#[test]
fn golden_ipxe_user_class() -> Result<()> {
    let mut req = Req::pxe(0, "PXEClient:Arch:00000:UNDI:002001");
    req.user_class = Some(b"iPXE");
    golden("offer-ipxe-user-class", ListenPort::Dhcp, &req)
}

/// OVMF's own PXE after the proxy offer: REQUEST to 4011 from port 4011, answered with an ACK to the source.
#[test]
fn golden_port_4011_request() -> Result<()> {
    let mut req = Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016");
    req.msg_type = MessageType::Request;
    req.ciaddr = Ipv4Addr::new(10, 20, 0, 50);
    req.server_id = Some(SERVER);
    // PXE_BOOT_ITEM type 0 layer 0: echoed back.
    req.extra
        .push(DhcpOption::VendorExtensions(vec![71, 4, 0, 0, 0, 0, 255]));
    golden("ack-4011-uefi-x64", ListenPort::PxeBoot, &req)
}

// === [dhcp] offer = "boot-server" ===

/// OVMF / vendor PXE firmware on 67 with `offer = "boot-server"`: no file, a boot-server menu naming us.
#[test]
fn golden_boot_server_offer_uefi_x64() -> Result<()> {
    golden_with(
        "offer-boot-server-arch7-uefi-x64",
        ListenPort::Dhcp,
        &Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016"),
        &boot_server(),
    )
}

#[test]
fn golden_boot_server_offer_bios() -> Result<()> {
    golden_with(
        "offer-boot-server-arch0-bios",
        ListenPort::Dhcp,
        &Req::pxe(0, "PXEClient:Arch:00000:UNDI:002001"),
        &boot_server(),
    )
}

/// The REQUEST the firmware then unicasts to 4011 naming our menu item (type 0x8000, layer 0), as OVMF sends it
/// (no ciaddr yet is also fine: the answer goes back to the source address and port).
#[test]
fn golden_boot_server_4011_request() -> Result<()> {
    let mut req = Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016");
    req.msg_type = MessageType::Request;
    req.ciaddr = Ipv4Addr::new(10, 20, 0, 50);
    let [t0, t1] = BOOT_SERVER_TYPE.to_be_bytes();
    req.extra
        .push(DhcpOption::VendorExtensions(vec![71, 4, t0, t1, 0, 0, 255]));
    golden_with(
        "ack-4011-boot-server-uefi-x64",
        ListenPort::PxeBoot,
        &req,
        &boot_server(),
    )
}

/// PXE vendor sub-options of an option 43 value, by code.
fn sub_options(value: &[u8]) -> Result<Vec<(u8, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut rest = value;
    loop {
        match rest {
            [255, ..] => return Ok(out),
            [0, tail @ ..] => rest = tail,
            [code, len, tail @ ..] if usize::from(*len) <= tail.len() => {
                let (v, next) = tail.split_at(usize::from(*len));
                out.push((*code, v.to_vec()));
                rest = next;
            }
            _ => bail!("option 43 malformed or without end: {value:02x?}"),
        }
    }
}

/// What makes PXE firmware go to 4011, checked field by field (the golden file shows the bytes; this says why).
#[test]
fn boot_server_offer_sends_firmware_to_port_4011() -> Result<()> {
    let req = Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016");
    let Decision::Reply(reply) = req.decide_with(ListenPort::Dhcp, &boot_server())? else {
        bail!("not answered");
    };
    let m = &reply.message;
    assert!(
        m.fname().is_none_or(|f| f.iter().all(|&b| b == 0)),
        "boot file field set: {:?}",
        m.fname()
    );
    assert!(
        m.opts().get(OptionCode::BootfileName).is_none(),
        "option 67 present"
    );
    assert_eq!(m.siaddr(), SERVER);
    assert_eq!(
        m.opts().get(OptionCode::ClassIdentifier),
        Some(&DhcpOption::ClassIdentifier(b"PXEClient".to_vec()))
    );
    let Some(DhcpOption::VendorExtensions(v43)) = m.opts().get(OptionCode::VendorExtensions) else {
        bail!("no option 43");
    };
    let subs = sub_options(v43)?;
    let get = |code: u8| {
        subs.iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| v.clone())
    };
    let control = get(6).context("no PXE_DISCOVERY_CONTROL")?;
    assert_eq!(control.len(), 1);
    assert_eq!(
        control[0] & 0x08,
        0,
        "bit 3 would let firmware skip discovery"
    );
    assert_eq!(
        control[0] & 0x07,
        0x07,
        "broadcast/multicast discovery not disabled, or list not enforced"
    );
    let [t0, t1] = BOOT_SERVER_TYPE.to_be_bytes();
    assert_ne!(BOOT_SERVER_TYPE, 0, "type 0 is local boot");
    let mut servers = vec![t0, t1, 1];
    servers.extend_from_slice(&SERVER.octets());
    assert_eq!(
        get(8),
        Some(servers),
        "PXE_BOOT_SERVERS must name us for our type"
    );
    let menu = get(9).context("no PXE_BOOT_MENU")?;
    assert_eq!(&menu[..2], &[t0, t1], "menu item of another type");
    assert_eq!(
        usize::from(menu[2]),
        menu.len() - 3,
        "menu description length"
    );
    let prompt = get(10).context("no PXE_MENU_PROMPT")?;
    assert_eq!(prompt[0], 0, "a non-zero timeout waits for a key press");
    assert!(reply.bootfile.contains("snponly.efi"), "{}", reply.bootfile);
    Ok(())
}

/// The style changes only what PXE firmware gets on 67: iPXE and HTTP boot still get their script or URL there.
#[test]
fn boot_server_style_leaves_ipxe_and_http_boot_alone() -> Result<()> {
    let mut ipxe = Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016");
    ipxe.user_class = Some(b"iPXE");
    let http = Req::pxe(16, "HTTPClient:Arch:00016:UNDI:003001");
    for req in [&ipxe, &http] {
        let (Decision::Reply(a), Decision::Reply(b)) = (
            req.decide_with(ListenPort::Dhcp, &server())?,
            req.decide_with(ListenPort::Dhcp, &boot_server())?,
        ) else {
            bail!("not answered");
        };
        assert_eq!(a, b, "{:?} changed with the offer style", req.class);
        assert!(b.message.opts().get(OptionCode::BootfileName).is_some());
    }
    Ok(())
}

fn ignored(req: &Req, port: ListenPort) -> Result<IgnoreReason> {
    match req.decide(port)? {
        Decision::Ignore { reason } => Ok(reason),
        Decision::Reply(r) => bail!("expected ignore, got a reply with {}", r.bootfile),
    }
}

#[test]
fn unknown_mac_is_ignored() -> Result<()> {
    let mut req = Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016");
    req.mac = UNKNOWN;
    let reason = ignored(&req, ListenPort::Dhcp)?;
    assert_eq!(
        reason,
        IgnoreReason::NotMarkedForNetboot {
            mac: MacAddr(UNKNOWN)
        }
    );
    assert_eq!(
        reason.to_string(),
        "52:54:00:99:99:99 is not marked for netboot"
    );
    assert!(matches!(
        ignored(&req, ListenPort::PxeBoot)?,
        IgnoreReason::UnansweredType { .. }
    ));
    Ok(())
}

#[test]
fn non_pxe_clients_are_ignored() -> Result<()> {
    let mut req = Req::pxe(0, "MSFT 5.0");
    assert_eq!(
        ignored(&req, ListenPort::Dhcp)?,
        IgnoreReason::NotPxeClient {
            vendor_class: Some("MSFT 5.0".into())
        }
    );
    req.class = None;
    assert_eq!(
        ignored(&req, ListenPort::Dhcp)?,
        IgnoreReason::NotPxeClient { vendor_class: None }
    );
    Ok(())
}

#[test]
fn other_silences_have_reasons() -> Result<()> {
    // REQUEST on 67 belongs to the address server.
    let mut req = Req::pxe(0, "PXEClient:Arch:00000:UNDI:002001");
    req.msg_type = MessageType::Request;
    assert_eq!(ignored(&req, ListenPort::Dhcp)?.kind(), "unanswered_type");
    // A 4011 request for another boot server.
    req.server_id = Some(Ipv4Addr::new(10, 20, 0, 3));
    assert_eq!(ignored(&req, ListenPort::PxeBoot)?.kind(), "other_server");
    // An architecture no loader boots: IA32 UEFI (6).
    assert_eq!(
        ignored(&Req::pxe(6, "PXEClient"), ListenPort::Dhcp)?,
        IgnoreReason::UnsupportedArchitecture {
            mac: MacAddr(KNOWN),
            code: 6
        }
    );
    // ARM32 UEFI (10) has no loader unless one is configured.
    assert_eq!(
        ignored(&Req::pxe(10, "PXEClient"), ListenPort::Dhcp)?,
        IgnoreReason::NoLoader {
            mac: MacAddr(KNOWN),
            code: 10,
            loader: Loader::Arm32Uefi,
        }
    );
    let mut req = Req::pxe(0, "PXEClient");
    req.arch = None;
    assert_eq!(ignored(&req, ListenPort::Dhcp)?.kind(), "no_architecture");
    Ok(())
}

/// A loader left out (not configured, or absent from the TFTP root at start: `serve::served_loaders`) is offered
/// to nobody: its clients, PXE and HTTP boot alike, are ignored with the reason, on both ports and in both offer
/// styles; the other architectures are still answered.
#[test]
fn an_absent_loader_is_not_offered() -> Result<()> {
    let mut without_arm64 = server();
    without_arm64
        .files
        .retain(|loader, _| loader != Loader::Arm64Uefi);
    assert_eq!(without_arm64.files.arm64_uefi, None);
    assert_eq!(without_arm64.files.x64_uefi.as_deref(), Some("snponly.efi"));
    let mut request = Req::pxe(11, "PXEClient:Arch:00011:UNDI:003016");
    for info in [
        without_arm64.clone(),
        ServerInfo {
            offer: OfferStyle::BootServer,
            ..without_arm64.clone()
        },
    ] {
        for (arch, class) in [
            (11, "PXEClient:Arch:00011:UNDI:003016"),
            (19, "HTTPClient:Arch:00019:UNDI:003016"),
        ] {
            for (port, msg_type) in [
                (ListenPort::Dhcp, MessageType::Discover),
                (ListenPort::PxeBoot, MessageType::Request),
            ] {
                request = Req::pxe(arch, class);
                request.msg_type = msg_type;
                match request.decide_with(port, &info)? {
                    Decision::Ignore { reason } => {
                        assert_eq!(
                            reason,
                            IgnoreReason::NoLoader {
                                mac: MacAddr(KNOWN),
                                code: arch,
                                loader: Loader::Arm64Uefi
                            }
                        );
                        assert_eq!(reason.kind(), "no_loader");
                    }
                    Decision::Reply(r) => bail!("arch {arch} on {port:?} offered {}", r.bootfile),
                }
            }
        }
        for arch in [7, 9, 16] {
            let class = if arch == 16 {
                "HTTPClient"
            } else {
                "PXEClient"
            };
            assert!(
                matches!(
                    Req::pxe(arch, class).decide_with(ListenPort::Dhcp, &info)?,
                    Decision::Reply(_)
                ),
                "arch {arch} must still be answered"
            );
        }
    }
    // With the loader present the same request is answered (the golden offer-arch11-uefi-arm64).
    assert!(matches!(
        request.decide_with(ListenPort::PxeBoot, &server())?,
        Decision::Reply(_)
    ));
    assert_eq!(
        IgnoreReason::NoLoader {
            mac: MacAddr(KNOWN),
            code: 11,
            loader: Loader::Arm64Uefi
        }
        .to_string(),
        "52:54:00:12:34:56 has client architecture 11 (arm64 UEFI (option 93 = 11; HTTP boot 19)), and no \
         boot.loaders.arm64_uefi is served: set one, or put the file in the TFTP root and restart"
    );
    Ok(())
}

#[test]
fn architecture_falls_back_to_vendor_class() -> Result<()> {
    let mut req = Req::pxe(0, "PXEClient:Arch:00007:UNDI:003016");
    req.arch = None;
    match req.decide(ListenPort::Dhcp)? {
        Decision::Reply(r) => assert_eq!(r.bootfile, "snponly.efi"),
        Decision::Ignore { reason } => bail!("ignored: {reason}"),
    }
    Ok(())
}

#[test]
fn load_generator_prefix_and_configurable_loader() -> Result<()> {
    let mut req = Req::pxe(7, "PXEClient:Arch:00007:UNDI:003016");
    req.mac = [0x02, 0x0b, 0, 0, 0, 1];
    let msg = decode(&req.bytes()?)?;
    let mut info = server();
    info.files.x64_uefi = Some("ipxe.efi".into());
    match decide(&msg, ListenPort::Dhcp, &table()?, &info) {
        Decision::Reply(r) => {
            assert_eq!(r.bootfile, "ipxe.efi");
            assert_eq!(r.destination, Destination::Broadcast);
        }
        Decision::Ignore { reason } => bail!("ignored: {reason}"),
    }
    Ok(())
}

/// iPXE never gets a loader again, whatever its architecture: that is the chainload loop.
#[test]
fn ipxe_always_gets_the_script() -> Result<()> {
    // Architecture 10 has no loader configured: iPXE needs none, it still gets its script.
    for (arch, class) in [
        (0, "PXEClient:Arch:00000:UNDI:002001"),
        (7, "PXEClient:Arch:00007:UNDI:003016"),
        (10, "PXEClient:Arch:00010:UNDI:003016"),
    ] {
        let mut req = Req::pxe(arch, class);
        // RFC 3004 form of the user class, as some iPXE builds send it.
        req.user_class = Some(b"\x04iPXE");
        match req.decide(ListenPort::Dhcp)? {
            Decision::Reply(r) => {
                assert_eq!(
                    r.bootfile,
                    "http://10.20.0.2:8080/boot/52:54:00:12:34:56.ipxe"
                )
            }
            Decision::Ignore { reason } => bail!("ignored: {reason}"),
        }
    }
    Ok(())
}

#[test]
fn relayed_and_configured_clients_get_unicast() -> Result<()> {
    let req = Req::pxe(0, "PXEClient");
    let mut msg = decode(&req.bytes()?)?;
    msg.set_giaddr(Ipv4Addr::new(10, 30, 0, 1));
    match decide(&msg, ListenPort::Dhcp, &table()?, &server()) {
        Decision::Reply(r) => {
            assert_eq!(
                r.destination,
                Destination::Relay(Ipv4Addr::new(10, 30, 0, 1))
            );
            assert_eq!(r.message.giaddr(), Ipv4Addr::new(10, 30, 0, 1));
        }
        Decision::Ignore { reason } => bail!("ignored: {reason}"),
    }
    Ok(())
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn class() -> impl Strategy<Value = Option<&'static str>> {
        prop_oneof![
            Just(None),
            Just(Some("PXEClient:Arch:00000:UNDI:002001")),
            Just(Some("PXEClient")),
            Just(Some("HTTPClient:Arch:00016:UNDI:003001")),
            Just(Some("MSFT 5.0")),
            Just(Some("udhcp 1.36")),
        ]
    }

    fn msg_type() -> impl Strategy<Value = MessageType> {
        (1u8..=8).prop_map(MessageType::from)
    }

    proptest! {
        /// Whatever arrives, a reply never assigns an address, only goes to marked MACs of PXE/HTTP clients,
        /// answers the xid asked, and names us as the server.
        #[test]
        fn replies_only_to_marked_netboot_clients_and_never_assign(
            known in any::<bool>(),
            tail in any::<[u8; 4]>(),
            arch in prop_oneof![Just(None), (0u16..24).prop_map(Some)],
            class in class(),
            ipxe in any::<bool>(),
            msg_type in msg_type(),
            on_4011 in any::<bool>(),
        ) {
            // 02:0b: is marked by prefix; 52:54: only for the one KNOWN MAC.
            let first = if known { [0x02, 0x0b] } else { [0x52, 0x54] };
            let mac = [first[0], first[1], tail[0], tail[1], tail[2], tail[3]];
            let req = Req {
                mac,
                msg_type,
                arch,
                class,
                user_class: ipxe.then_some(&b"iPXE"[..]),
                ciaddr: Ipv4Addr::UNSPECIFIED,
                server_id: None,
                extra: Vec::new(),
            };
            let port = if on_4011 { ListenPort::PxeBoot } else { ListenPort::Dhcp };
            let decision = req.decide(port).map_err(|e| TestCaseError::fail(e.to_string()))?;
            if let Decision::Reply(r) = decision {
                prop_assert!(known || mac == KNOWN);
                prop_assert!(class.is_some_and(|c| c.starts_with("PXEClient") || c.starts_with("HTTPClient")));
                prop_assert_eq!(r.message.yiaddr(), Ipv4Addr::UNSPECIFIED);
                prop_assert_eq!(r.message.xid(), 0x1234_5678);
                prop_assert_eq!(r.message.siaddr(), SERVER);
                prop_assert_eq!(r.mac, MacAddr(mac));
                let expected = if on_4011 { MessageType::Ack } else { MessageType::Offer };
                prop_assert_eq!(r.message.opts().msg_type(), Some(expected));
                if ipxe {
                    prop_assert!(r.bootfile.ends_with(".ipxe"), "iPXE got {}", r.bootfile);
                }
                let mut wire = Vec::new();
                encode(&r.message, &mut wire).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(decode(&wire).is_ok());
            }
        }
    }
}
