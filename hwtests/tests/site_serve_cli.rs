//! The real `bcd site serve` binary on loopback (no root, no QEMU): it starts from a site.toml, serves the table's
//! iPXE scripts and loaders, picks up a changed `[[machine]]` table on SIGHUP, refuses an invalid one while
//! keeping the running table, and on SIGTERM stops cleanly with its final counters in the log.
//! `bcd` is `BCD_BIN`, else built by the test (`cargo build -p bcd`).

use std::fs;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::unix::fs::PermissionsExt as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

mod common;
use common::{Proc, bcd_binary};

fn free_tcp_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn free_udp_port() -> Result<u16> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn get(port: u16, path: &str) -> Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> Result<bool>) -> Result<()> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if check()? {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("timed out waiting for {what}")
}

fn signal(p: &Proc, sig: &str) -> Result<()> {
    let ok = Command::new("kill")
        .args([sig, &p.child.id().to_string()])
        .status()?
        .success();
    if !ok {
        bail!("kill {sig} failed");
    }
    Ok(())
}

const MAC1: &str = "52:54:00:aa:00:01";
const MAC2: &str = "52:54:00:aa:00:02";

#[test]
fn serve_reloads_the_table_on_sighup_and_stops_on_sigterm() -> Result<()> {
    let bcd = bcd_binary()?;
    let dir = tempfile::tempdir()?;
    let (tftp, artifacts) = (dir.path().join("tftp"), dir.path().join("artifacts"));
    fs::create_dir_all(&tftp)?;
    fs::create_dir_all(&artifacts)?;
    for f in ["undionly.kpxe", "snponly.efi"] {
        fs::write(tftp.join(f), b"loader")?;
        fs::set_permissions(tftp.join(f), fs::Permissions::from_mode(0o644))?;
    }
    let http_port = free_tcp_port()?;
    let head = format!(
        "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = \"{}\"\nartifacts = \"{}\"\n\
         http_port = {http_port}\ntftp_port = {}\ndhcp_port = {}\npxe_port = {}\nwatch_rogues = false\n\n",
        tftp.display(),
        artifacts.display(),
        free_udp_port()?,
        free_udp_port()?,
        free_udp_port()?,
    );
    let machine = |mac: &str, kernel: &str| {
        format!(
            "[[machine]]\nmac = \"{mac}\"\nkernel = \"{kernel}\"\ncmdline = \"console=ttyS0\"\n\n"
        )
    };
    let config = dir.path().join("site.toml");
    fs::write(&config, format!("{head}{}", machine(MAC1, "k1")))?;
    let log = dir.path().join("bcd.log");
    let mut bcd = Proc::spawn(
        "bcd site serve",
        Command::new(&bcd)
            .args(["site", "serve", "--config"])
            .arg(&config)
            .env("BCD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log)?),
    )?;
    let log_text = || fs::read_to_string(&log).unwrap_or_default();
    let started = wait_for("bcd site serving", Duration::from_secs(10), || {
        if let Some(status) = bcd.child.try_wait()? {
            bail!("bcd site serve exited ({status}): {}", log_text());
        }
        Ok(log_text().contains("bcd site serving"))
    });
    started.with_context(log_text)?;

    let script = get(http_port, &format!("/boot/{MAC1}.ipxe"))?;
    assert!(
        script.starts_with("HTTP/1.1 200") && script.contains("kernel /artifacts/k1 console=ttyS0"),
        "{script}"
    );
    assert!(get(http_port, "/ipxe/snponly.efi")?.ends_with("loader"));
    assert!(get(http_port, &format!("/boot/{MAC2}.ipxe"))?.starts_with("HTTP/1.1 404"));

    // SIGHUP with a second machine: served without a restart.
    fs::write(
        &config,
        format!("{head}{}{}", machine(MAC1, "k1"), machine(MAC2, "k2")),
    )?;
    signal(&bcd, "-HUP")?;
    wait_for("the reloaded table", Duration::from_secs(5), || {
        Ok(get(http_port, &format!("/boot/{MAC2}.ipxe"))?.starts_with("HTTP/1.1 200"))
    })
    .with_context(log_text)?;

    // SIGHUP with a broken file: refused, the running table stays.
    fs::write(
        &config,
        format!("{head}{}[[machine]]\nmac = \"nope\"\n", machine(MAC1, "k1")),
    )?;
    signal(&bcd, "-HUP")?;
    wait_for("the refused reload", Duration::from_secs(5), || {
        Ok(log_text().contains("reload refused"))
    })
    .with_context(log_text)?;
    assert!(
        log_text().contains("machine[1].mac"),
        "the refusal does not name the field: {}",
        log_text()
    );
    assert!(get(http_port, &format!("/boot/{MAC2}.ipxe"))?.starts_with("HTTP/1.1 200"));

    if !bcd.terminate(Duration::from_secs(10)) {
        bail!("bcd site serve did not stop on SIGTERM: {}", log_text());
    }
    let text = log_text();
    let status = bcd.child.wait()?;
    assert!(status.success(), "exit {status}: {text}");
    assert!(text.contains("bcd site stopped"), "{text}");
    let http = text
        .lines()
        .rfind(|l| l.contains("boot HTTP counters"))
        .context("no final HTTP counters")?;
    // Three scripts (MAC1, MAC2 after the reload, MAC2 after the refused one), one loader; the 404s depend on how
    // soon the reload landed.
    assert!(
        http.contains(" scripts=3 ") && http.contains(" files=1 "),
        "{http}"
    );
    Ok(())
}

/// Issue 17 item 2: the site agent's unit (packaging/systemd/bcd-site.service) runs `bcd` as a dynamic user that
/// keeps only CAP_NET_BIND_SERVICE and CAP_NET_RAW. Under that sandbox (reproduced here, in a private network
/// namespace so the fixed ports are the test's own) `bcd site serve` binds DHCP 67, 68 (rogue watch), proxy DHCP
/// 4011, TFTP 69 and HTTP 80 on its interface and then says it is ready, pinging the watchdog; with the same
/// sandbox but no capabilities it fails, names the port it could not bind, and never says ready.
#[test]
fn the_site_agent_under_its_units_sandbox_binds_its_privileged_ports() -> Result<()> {
    use bc_testkit::unit::{Notifications, Sandbox, can_sandbox};
    if let Err(why) = can_sandbox() {
        bc_testkit::skip!("{why}");
    }
    let bcd = bcd_binary()?;
    let dir = tempfile::tempdir()?;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
    let root = dir.path().join("stage");
    let (tftp, artifacts) = (root.join("srv/tftp"), root.join("srv/artifacts"));
    fs::create_dir_all(&tftp)?;
    fs::create_dir_all(&artifacts)?;
    fs::create_dir_all(root.join("var/lib/bcd-site"))?;
    let config = root.join("site.toml");
    fs::write(
        &config,
        format!(
            "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = \"{}\"\nartifacts = \"{}\"\n",
            tftp.display(),
            artifacts.display()
        ),
    )?;
    let unit = include_str!("../../packaging/systemd/bcd-site.service");
    let mut sandbox = Sandbox::parse(unit);
    sandbox.private_network = true;
    assert!(sandbox.dynamic_user, "{unit}");
    let log = dir.path().join("bcd.log");
    let run = |sandbox: &Sandbox, notes: &Notifications| -> Result<Proc> {
        let args: Vec<&std::ffi::OsStr> = vec![
            bcd.as_os_str(),
            "site".as_ref(),
            "serve".as_ref(),
            "--config".as_ref(),
            config.as_os_str(),
        ];
        let mut cmd = sandbox.command(&root, &args).map_err(anyhow::Error::msg)?;
        Proc::spawn(
            "bcd site serve (sandboxed)",
            cmd.env("BCD_LOG", "info")
                .env("NOTIFY_SOCKET", &notes.path)
                .env("WATCHDOG_USEC", "200000")
                .stdout(Stdio::null())
                .stderr(fs::File::create(&log)?),
        )
    };
    let log_text = || fs::read_to_string(&log).unwrap_or_default();

    let mut notes = Notifications::bind(dir.path())?;
    let mut served = run(&sandbox, &notes)?;
    notes
        .until("READY=1", 20)
        .map_err(|e| anyhow::anyhow!("{e}: {}", log_text()))?;
    notes.pings(3, 5).map_err(anyhow::Error::msg)?;
    signal(&served, "-TERM")?;
    notes.until("STOPPING=1", 10).map_err(anyhow::Error::msg)?;
    assert!(
        served.terminate(Duration::from_secs(10)),
        "no clean stop: {}",
        log_text()
    );

    // The same sandbox without the capabilities: the bind fails and says which port; never ready.
    let mut bare = sandbox.clone();
    bare.ambient.clear();
    bare.bounding = Some(Vec::new());
    let mut notes = Notifications::bind(&dir.path().join("stage"))?;
    let mut refused = run(&bare, &notes)?;
    let status = {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = refused.child.try_wait()? {
                break s;
            }
            if Instant::now() > end {
                refused.terminate(Duration::from_secs(1));
                bail!(
                    "bcd site serve without capabilities did not exit: {}",
                    log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert!(!status.success());
    let text = log_text();
    assert!(
        text.contains("ermission denied") && text.contains(":67"),
        "{text}"
    );
    assert!(
        notes.until("READY=1", 1).is_err(),
        "ready without its ports: {:?}",
        notes.seen
    );
    Ok(())
}
