//! `serve::run` on loopback: one process answering proxy DHCP (port 4011 here: replies go back to the source, so
//! nothing is broadcast), TFTP and boot HTTP from one netboot table, and a table update through the channel
//! reaching both the DHCP answers and the iPXE scripts.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bcd_site::dhcp::MacAddr;
use bcd_site::dhcp::dhcproto::v4::{
    Architecture, DhcpOption, Message, MessageType, Opcode, OptionCode,
};
use bcd_site::dhcp::dhcproto::{Encodable, Encoder};
use bcd_site::dhcp::server::{DhcpSockets, bind_udp};
use bcd_site::dhcp::wire::decode;
use bcd_site::http::DesiredBoot;
use bcd_site::serve::{Bound, Netboot, SiteConfig, SiteCounters, run};
use bcd_site::tftp::codec::{Mode, Packet, Request, RequestOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

const MARKED: MacAddr = MacAddr([0x52, 0x54, 0, 0, 0, 1]);
const LATER: MacAddr = MacAddr([0x52, 0x54, 0, 0, 0, 2]);
const UNMARKED: MacAddr = MacAddr([0x52, 0x54, 0, 0, 0, 9]);

fn pxe_request(mac: MacAddr, msg_type: MessageType, xid: u32) -> Result<Vec<u8>> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(xid)
        .set_chaddr(&mac.0);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(msg_type));
    o.insert(DhcpOption::ClientSystemArchitecture(Architecture::from(7)));
    o.insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
    ));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf))?;
    Ok(buf)
}

fn ack_bytes(m: &Message) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf))?;
    Ok(buf)
}

/// A PXE OFFER as another proxy would broadcast it.
fn offer_from(server: Ipv4Addr) -> Result<Vec<u8>> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootReply)
        .set_xid(77)
        .set_chaddr(&UNMARKED.0);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(MessageType::Offer));
    o.insert(DhcpOption::ServerIdentifier(server));
    o.insert(DhcpOption::ClassIdentifier(b"PXEClient".to_vec()));
    ack_bytes(&m)
}

async fn ask(client: &UdpSocket, to: SocketAddr, packet: &[u8]) -> Result<Option<Message>> {
    client.send_to(packet, to).await?;
    let mut buf = [0u8; 1500];
    match timeout(Duration::from_millis(500), client.recv_from(&mut buf)).await {
        Err(_) => Ok(None),
        Ok(r) => Ok(Some(decode(&buf[..r?.0])?)),
    }
}

async fn http_get(addr: SocketAddr, path: &str, extra: &str) -> Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: t\r\n{extra}Connection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut out = Vec::new();
    timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

async fn tftp_get(server: SocketAddr, name: &str) -> Result<Vec<u8>> {
    let client = UdpSocket::bind("127.0.0.1:0").await?;
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: name.into(),
        mode: Mode::Octet,
        options: RequestOptions::default(),
    })
    .encode(&mut out);
    client.send_to(&out, server).await?;
    let mut got = Vec::new();
    let mut buf = [0u8; 600];
    loop {
        let (n, from) = timeout(Duration::from_secs(3), client.recv_from(&mut buf)).await??;
        match Packet::decode(&buf[..n])? {
            Packet::Data { block, data } => {
                got.extend_from_slice(data);
                let last = data.len() < 512;
                out.clear();
                Packet::Ack { block }.encode(&mut out);
                client.send_to(&out, from).await?;
                if last {
                    return Ok(got);
                }
            }
            other => bail!("unexpected TFTP packet {other:?}"),
        }
    }
}

fn public(path: &Path, data: &[u8]) -> Result<()> {
    std::fs::write(path, data)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))?;
    Ok(())
}

#[tokio::test]
async fn one_table_drives_dhcp_tftp_and_http() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (tftp_root, artifacts) = (dir.path().join("tftp"), dir.path().join("artifacts"));
    std::fs::create_dir_all(&tftp_root)?;
    std::fs::create_dir_all(artifacts.join("lab"))?;
    public(&tftp_root.join("snponly.efi"), b"loader bytes")?;
    public(&tftp_root.join("undionly.kpxe"), b"bios loader")?;
    public(&artifacts.join("lab/vmlinuz"), b"0123456789")?;
    let text = format!(
        "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = {:?}\nartifacts = {:?}\n\
         report_interval_s = 0\n\n[[machine]]\nmac = \"{MARKED}\"\nkernel = \"lab/vmlinuz\"\ncmdline = \"console=ttyS0\"\n",
        tftp_root.display().to_string(),
        artifacts.display().to_string(),
    );
    let config = SiteConfig::from_toml(&text, Path::new("test-site.toml"))?;

    let any = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);
    let bound = Bound {
        dhcp: DhcpSockets {
            dhcp: bind_udp(any, None)?,
            pxe: bind_udp(any, None)?,
            watch: Some(bind_udp(any, None)?),
        },
        tftp: UdpSocket::bind(any).await?,
        http: TcpListener::bind(any).await?,
    };
    let (dhcp, pxe) = (bound.dhcp.dhcp.local_addr()?, bound.dhcp.pxe.local_addr()?);
    let watch_addr = bound.dhcp.watch.as_ref().context("watch")?.local_addr()?;
    let (tftp, http) = (bound.tftp.local_addr()?, bound.http.local_addr()?);
    let (table_tx, table_rx) = watch::channel(config.netboot.clone());
    let counters = SiteCounters::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let server_counters = counters.clone();
    let server = tokio::spawn(async move {
        run(&config, bound, table_rx, server_counters, None, async {
            let _ = stopped.await;
        })
        .await
    });

    let client = UdpSocket::bind(any).await?;
    let ack = ask(&client, pxe, &pxe_request(MARKED, MessageType::Request, 1)?)
        .await?
        .context("no ACK on 4011 for the marked MAC")?;
    assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(
        ack.opts().get(OptionCode::BootfileName),
        Some(&DhcpOption::BootfileName(b"snponly.efi".to_vec()))
    );
    assert_eq!(
        ask(
            &client,
            pxe,
            &pxe_request(UNMARKED, MessageType::Request, 2)?
        )
        .await?,
        None
    );
    // A DISCOVER on 67 from an unmarked MAC: counted, not answered (a marked one would be broadcast).
    client
        .send_to(&pxe_request(UNMARKED, MessageType::Discover, 3)?, dhcp)
        .await?;

    assert_eq!(tftp_get(tftp, "snponly.efi").await?, b"loader bytes");
    let script = http_get(http, &format!("/boot/{MARKED}.ipxe"), "").await?;
    assert!(script.starts_with("HTTP/1.1 200"), "{script}");
    assert!(
        script.contains("kernel /artifacts/lab/vmlinuz console=ttyS0"),
        "{script}"
    );
    let part = http_get(http, "/artifacts/lab/vmlinuz", "Range: bytes=2-4\r\n").await?;
    assert!(
        part.starts_with("HTTP/1.1 206") && part.ends_with("234"),
        "{part}"
    );
    assert!(
        http_get(http, &format!("/boot/{LATER}.ipxe"), "")
            .await?
            .starts_with("HTTP/1.1 404")
    );

    // The table's source adds a machine: both services see it.
    let mut table = Netboot::from_machines(BTreeMap::new());
    table.insert(
        MARKED,
        DesiredBoot {
            kernel: "lab/vmlinuz".into(),
            initrd: None,
            cmdline: String::new(),
        },
    );
    table.insert(
        LATER,
        DesiredBoot {
            kernel: "http://m/k".into(),
            initrd: None,
            cmdline: "x=1".into(),
        },
    );
    table_tx.send(table)?;
    let mut answered = None;
    for xid in 10..50 {
        answered = ask(
            &client,
            pxe,
            &pxe_request(LATER, MessageType::Request, xid)?,
        )
        .await?;
        if answered.is_some() {
            break;
        }
    }
    assert!(answered.is_some(), "the added MAC is never answered");
    let later = http_get(http, &format!("/boot/{LATER}.ipxe"), "").await?;
    assert!(later.contains("kernel http://m/k x=1"), "{later}");

    // Another server's PXE offer seen on the client port is reported as a rogue; our own answers are not.
    client.send_to(&ack_bytes(&ack)?, watch_addr).await?;
    let rogue = offer_from(Ipv4Addr::new(10, 9, 9, 9))?;
    client.send_to(&rogue, watch_addr).await?;
    let mut seen = counters.dhcp.snapshot();
    for _ in 0..100 {
        if seen.rogue_seen > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        seen = counters.dhcp.snapshot();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = counters.dhcp.snapshot();
    assert_eq!(seen.rogue_seen, 1, "{seen:?}");
    assert_eq!(
        seen.last_rogue.map(|r| r.server_id),
        Some(Ipv4Addr::new(10, 9, 9, 9))
    );

    let d = counters.dhcp.snapshot();
    assert_eq!(d.ignored.get("not_marked_for_netboot"), Some(&2), "{d:?}");
    assert!(d.replied >= 2, "{d:?}");
    let _ = stop.send(());
    timeout(Duration::from_secs(10), server).await???;
    Ok(())
}
