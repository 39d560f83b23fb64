//! The proxy-DHCP server on loopback, driven by a real UDP client.
//!
//! "Broadcast" replies are pointed at 127.0.0.1 and the client's port, so nothing leaves loopback.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bcd_site::dhcp::dhcproto::v4::{
    Architecture, DhcpOption, Message, MessageType, Opcode, OptionCode,
};
use bcd_site::dhcp::dhcproto::{Encodable, Encoder};
use bcd_site::dhcp::server::{DhcpCounters, DhcpSockets, ServerConfig, bind_udp, run};
use bcd_site::dhcp::wire::decode;
use bcd_site::dhcp::{NetbootTable, ServerInfo};
use tokio::net::UdpSocket;
use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

const LOCAL: Ipv4Addr = Ipv4Addr::LOCALHOST;
const KNOWN: [u8; 6] = [0x52, 0x54, 0x00, 0x00, 0x00, 0x01];

fn request(mac: [u8; 6], msg_type: MessageType, xid: u32) -> Result<Vec<u8>> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(xid)
        .set_chaddr(&mac);
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

struct Harness {
    dhcp: SocketAddr,
    pxe: SocketAddr,
    watch: SocketAddr,
    client: UdpSocket,
    table: watch::Sender<NetbootTable>,
    counters: Arc<DhcpCounters>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

async fn start(table: NetbootTable) -> Result<Harness> {
    start_on(table, None).await
}

async fn start_on(table: NetbootTable, device: Option<&str>) -> Result<Harness> {
    let any = SocketAddrV4::new(LOCAL, 0);
    let sockets = DhcpSockets {
        dhcp: bind_udp(any, device)?,
        pxe: bind_udp(any, device)?,
        watch: Some(bind_udp(any, device)?),
    };
    let (dhcp, pxe) = (sockets.dhcp.local_addr()?, sockets.pxe.local_addr()?);
    let watch_addr = sockets
        .watch
        .as_ref()
        .context("watch socket")?
        .local_addr()?;
    let client = UdpSocket::bind(any).await?;
    let mut config = ServerConfig::new(ServerInfo {
        server_ip: LOCAL,
        http_port: 8080,
        files: Default::default(),
        offer: Default::default(),
    });
    config.broadcast = LOCAL;
    config.client_port = client.local_addr()?.port();
    let (table_tx, table_rx) = watch::channel(table);
    let counters = Arc::new(DhcpCounters::default());
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(run(sockets, table_rx, config, counters.clone(), async {
        let _ = stopped.await;
    }));
    Ok(Harness {
        dhcp,
        pxe,
        watch: watch_addr,
        client,
        table: table_tx,
        counters,
        stop: Some(stop),
        server,
    })
}

impl Harness {
    async fn recv(&self, wait: Duration) -> Result<Option<(Message, SocketAddr)>> {
        let mut buf = [0u8; 1500];
        match timeout(wait, self.client.recv_from(&mut buf)).await {
            Err(_) => Ok(None),
            Ok(r) => {
                let (n, from) = r?;
                Ok(Some((decode(&buf[..n])?, from)))
            }
        }
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        timeout(Duration::from_secs(5), self.server).await??;
        Ok(())
    }
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) -> Result<()> {
    for _ in 0..200 {
        if check() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("timed out waiting for {what}")
}

#[tokio::test]
async fn offers_on_67_and_acks_on_4011() -> Result<()> {
    let h = start(
        [format!("{}", bcd_site::dhcp::MacAddr(KNOWN)).parse()?]
            .into_iter()
            .collect(),
    )
    .await?;

    h.client
        .send_to(&request(KNOWN, MessageType::Discover, 1)?, h.dhcp)
        .await?;
    let (offer, from) = h.recv(Duration::from_secs(2)).await?.context("no OFFER")?;
    assert_eq!(from, h.dhcp, "the OFFER comes from the port-67 socket");
    assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer));
    assert_eq!(offer.xid(), 1);
    assert_eq!(offer.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert!(matches!(
        offer.opts().get(OptionCode::BootfileName),
        Some(DhcpOption::BootfileName(f)) if f == b"snponly.efi"
    ));

    // Port 4011: the reply goes back to the exact source (here a second client socket).
    let other = UdpSocket::bind(SocketAddrV4::new(LOCAL, 0)).await?;
    other
        .send_to(&request(KNOWN, MessageType::Request, 2)?, h.pxe)
        .await?;
    let mut buf = [0u8; 1500];
    let (n, from) = timeout(Duration::from_secs(2), other.recv_from(&mut buf)).await??;
    assert_eq!(from, h.pxe);
    let ack = decode(&buf[..n])?;
    assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(ack.xid(), 2);

    let c = h.counters.snapshot();
    assert_eq!((c.received, c.replied, c.decode_failed), (2, 2, 0));
    assert_eq!(c.replied_4011, 1, "only the ACK counts as a 4011 reply");
    h.stop().await
}

#[tokio::test]
async fn drops_are_counted_and_table_updates_apply() -> Result<()> {
    let h = start(NetbootTable::new()).await?;

    // Unknown MAC: silence, counted with its reason.
    h.client
        .send_to(&request(KNOWN, MessageType::Discover, 10)?, h.dhcp)
        .await?;
    // Garbage and a packet shaped to trip dhcproto's debug assertions: counted, the server survives.
    h.client.send_to(b"definitely not dhcp", h.dhcp).await?;
    let mut evil = request(KNOWN, MessageType::Discover, 11)?;
    let end = evil.len() - 1;
    evil.splice(end..end, [94u8, 1, 1]);
    h.client.send_to(&evil, h.dhcp).await?;
    assert!(
        h.recv(Duration::from_millis(300)).await?.is_none(),
        "no reply expected"
    );
    let counters = h.counters.clone();
    wait_for("three drops", || {
        let c = counters.snapshot();
        c.decode_failed == 2 && c.ignored.get("not_marked_for_netboot") == Some(&1)
    })
    .await?;
    // Not answered, but seen: the metal flow's "last DHCP seen at" for a machine that never netbooted.
    let seen = h.counters.take_sightings();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0.to_string(), "52:54:00:00:00:01");
    assert!(
        h.counters.take_sightings().is_empty(),
        "a take drains the sightings"
    );

    // The control plane marks the MAC: the next DISCOVER is answered.
    h.table.send(["52:54:00:".parse()?].into_iter().collect())?;
    h.client
        .send_to(&request(KNOWN, MessageType::Discover, 12)?, h.dhcp)
        .await?;
    let (offer, _) = h
        .recv(Duration::from_secs(2))
        .await?
        .context("no OFFER after the table update")?;
    assert_eq!(offer.xid(), 12);
    h.stop().await
}

#[tokio::test]
async fn reports_a_second_pxe_server() -> Result<()> {
    let h = start(NetbootTable::new()).await?;
    let rogue_ip = Ipv4Addr::new(10, 9, 9, 9);
    let mut m = Message::default();
    m.set_opcode(Opcode::BootReply)
        .set_xid(99)
        .set_chaddr(&KNOWN);
    m.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Offer));
    m.opts_mut().insert(DhcpOption::ServerIdentifier(rogue_ip));
    m.opts_mut()
        .insert(DhcpOption::ClassIdentifier(b"PXEClient".to_vec()));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf))?;
    h.client.send_to(&buf, h.watch).await?;
    let counters = h.counters.clone();
    wait_for("the rogue report", || counters.snapshot().rogue_seen == 1).await?;
    let rogue = h.counters.snapshot().last_rogue.context("rogue recorded")?;
    assert_eq!(rogue.server_id, rogue_ip);
    assert_eq!(rogue.xid, 99);
    h.stop().await
}

/// SO_BINDTODEVICE as the site agent uses it (needs CAP_NET_RAW; skipped with a reason without it).
#[tokio::test]
async fn serves_when_bound_to_a_device() -> Result<()> {
    let table: NetbootTable = ["52:54:00:".parse()?].into_iter().collect();
    let h = match start_on(table, Some("lo")).await {
        Ok(h) => h,
        Err(e) if format!("{e:#}").contains("Operation not permitted") => {
            bc_testkit::skip!("SO_BINDTODEVICE not permitted here ({e:#})");
        }
        Err(e) => return Err(e),
    };
    h.client
        .send_to(&request(KNOWN, MessageType::Discover, 21)?, h.dhcp)
        .await?;
    let (offer, _) = h
        .recv(Duration::from_secs(2))
        .await?
        .context("no OFFER on lo")?;
    assert_eq!(offer.xid(), 21);
    h.stop().await
}
