//! `serve::run` with a loader missing from the TFTP root (Debian's `ipxe` package has no `snp-arm64.efi`, the
//! default arm64 loader): the start warns once per architecture whose loader is absent, those clients are never
//! offered it (no TFTP error or 404 later), and a listed MAC dropped for that reason is logged at info. A test
//! binary of its own: it captures the log with a subscriber for its thread only.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use bcd_site::dhcp::MacAddr;
use bcd_site::dhcp::dhcproto::v4::{
    Architecture, DhcpOption, Message, MessageType, Opcode, OptionCode,
};
use bcd_site::dhcp::dhcproto::{Encodable, Encoder};
use bcd_site::dhcp::server::{DhcpSockets, bind_udp};
use bcd_site::dhcp::wire::decode;
use bcd_site::serve::{Bound, SiteConfig, SiteCounters, run};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

const MARKED: MacAddr = MacAddr([0x52, 0x54, 0, 0, 0, 1]);

/// Log lines, as the fmt subscriber writes them.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        self.0
            .lock()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn lines_with(&self, parts: &[&str]) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut b) = self.0.lock() {
            b.extend_from_slice(data);
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

fn request(arch: u16, class: &str, xid: u32) -> Result<Vec<u8>> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(xid)
        .set_chaddr(&MARKED.0);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(MessageType::Request));
    o.insert(DhcpOption::ClientSystemArchitecture(Architecture::from(
        arch,
    )));
    o.insert(DhcpOption::ClassIdentifier(class.as_bytes().to_vec()));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf))?;
    Ok(buf)
}

async fn ask(client: &UdpSocket, to: SocketAddr, packet: &[u8]) -> Result<Option<Message>> {
    client.send_to(packet, to).await?;
    let mut buf = [0u8; 1500];
    match timeout(Duration::from_millis(300), client.recv_from(&mut buf)).await {
        Err(_) => Ok(None),
        Ok(r) => Ok(Some(decode(&buf[..r?.0])?)),
    }
}

fn public(path: &Path, data: &[u8]) -> Result<()> {
    std::fs::write(path, data)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))?;
    Ok(())
}

#[tokio::test]
async fn absent_loaders_are_warned_and_not_offered() -> Result<()> {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _log = tracing::subscriber::set_default(subscriber);

    // The TFTP root of a Debian host with the ipxe package: undionly.kpxe and snponly.efi, no arm64 loader. The
    // BIOS loader is there but not public (mode 0600): neither TFTP nor /ipxe/ would serve it.
    let dir = tempfile::tempdir()?;
    let (tftp_root, artifacts) = (dir.path().join("tftp"), dir.path().join("artifacts"));
    std::fs::create_dir_all(&tftp_root)?;
    std::fs::create_dir_all(&artifacts)?;
    public(&tftp_root.join("snponly.efi"), b"x64 loader")?;
    std::fs::write(tftp_root.join("undionly.kpxe"), b"bios loader")?;
    std::fs::set_permissions(
        tftp_root.join("undionly.kpxe"),
        std::fs::Permissions::from_mode(0o600),
    )?;
    let text = format!(
        "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = {:?}\nartifacts = {:?}\n\
         report_interval_s = 0\n\n[[machine]]\nmac = \"{MARKED}\"\nkernel = \"k\"\n",
        tftp_root.display().to_string(),
        artifacts.display().to_string(),
    );
    let config = SiteConfig::from_toml(&text, Path::new("test-site.toml"))?;
    let any = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);
    let bound = Bound {
        dhcp: DhcpSockets {
            dhcp: bind_udp(any, None)?,
            pxe: bind_udp(any, None)?,
            watch: None,
        },
        tftp: UdpSocket::bind(any).await?,
        http: TcpListener::bind(any).await?,
    };
    let pxe = bound.dhcp.pxe.local_addr()?;
    let (_table_tx, table_rx) = watch::channel(config.netboot.clone());
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
    // x64 UEFI is answered with its loader: the server is up.
    let ack = ask(&client, pxe, &request(7, "PXEClient:Arch:00007", 1)?)
        .await?
        .context("no ACK for x64 UEFI, whose loader is present")?;
    assert_eq!(
        ack.opts().get(OptionCode::BootfileName),
        Some(&DhcpOption::BootfileName(b"snponly.efi".to_vec()))
    );
    // arm64 UEFI (PXE and HTTP boot) and BIOS: nothing offered, twice each.
    for xid in [2, 3] {
        for (arch, class) in [
            (11, "PXEClient:Arch:00011"),
            (19, "HTTPClient:Arch:00019"),
            (0, "PXEClient:Arch:00000"),
        ] {
            assert_eq!(
                ask(
                    &client,
                    pxe,
                    &request(arch, class, xid * 100 + u32::from(arch))?
                )
                .await?,
                None,
                "architecture {arch} was offered a loader that is not served"
            );
        }
    }
    let d = counters.dhcp.snapshot();
    assert_eq!(d.ignored.get("no_loader"), Some(&6), "{d:?}");
    assert_eq!(d.replied, 1, "{d:?}");

    // One warning per absent loader, naming the field, the file and the clients; none for the present one.
    let arm64 = logs.lines_with(&[
        "WARN",
        "loader not served",
        "boot.loaders.arm64_uefi",
        "snp-arm64.efi",
    ]);
    assert_eq!(arm64.len(), 1, "{}", logs.text());
    assert!(
        arm64[0].contains("arm64 UEFI (option 93 = 11; HTTP boot 19)"),
        "{}",
        arm64[0]
    );
    assert!(arm64[0].contains("file not found"), "{}", arm64[0]);
    let bios = logs.lines_with(&[
        "WARN",
        "loader not served",
        "boot.loaders.bios",
        "undionly.kpxe",
    ]);
    assert_eq!(bios.len(), 1, "{}", logs.text());
    assert!(bios[0].contains("file is not public"), "{}", bios[0]);
    assert!(
        logs.lines_with(&["loader not served", "x64_uefi"])
            .is_empty(),
        "{}",
        logs.text()
    );
    assert!(
        logs.lines_with(&["loader not served", "arm32_uefi"])
            .is_empty(),
        "unconfigured is no warning"
    );
    // The listed MAC dropped for it: info, once per MAC and reason (not per packet).
    let dropped = logs.lines_with(&[
        "INFO",
        "no loader for its architecture",
        "52:54:00:00:00:01",
    ]);
    assert_eq!(dropped.len(), 1, "{}", logs.text());
    assert!(
        dropped[0].contains("boot.loaders.arm64_uefi"),
        "{}",
        dropped[0]
    );

    let _ = stop.send(());
    timeout(Duration::from_secs(10), server).await???;
    Ok(())
}
