//! Two real `bcd site run` processes of one site against a real control plane (fresh PostgreSQL, mTLS on
//! loopback), each enrolled with `bcd site enroll`: only the boot-lease holder answers proxy DHCP; SIGKILL the holder
//! and the standby answers within the lease expiry; SIGTERM releases the lease at once. The holder fills its
//! artifact cache (`boot.artifacts`) with an artifact a machine of the site references.

mod common;

use bcd_site::dhcp::MacAddr;
use bcd_site::dhcp::dhcproto::v4::{Architecture, DhcpOption, Message, MessageType, Opcode};
use bcd_site::dhcp::dhcproto::{Encodable, Encoder};
use common::{Plane, TestResult, plane};
use serde_json::json;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bcd");
const MAC: &str = "52:54:00:00:00:42";
const LEASE_TTL_S: u64 = 2;

struct Agent {
    child: Child,
    pxe: SocketAddr,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("port")
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("port")
}

fn connection_args(p: &Plane) -> Vec<String> {
    vec![
        "--gateway-url".into(),
        p.running.gateway_url.clone(),
        "--ca-pin".into(),
        p.running.ca_pin.clone(),
        "--join-public-key".into(),
        p.running.join_public_key.clone(),
        "--agent-config".into(),
        "/nonexistent/bcd.toml".into(),
    ]
}

fn enroll(p: &Plane, state: &Path, token: &str) -> std::process::Output {
    Command::new(BIN)
        .args(["site", "enroll"])
        .args(connection_args(p))
        .arg("--state-dir")
        .arg(state)
        .env("BCD_SITE_TOKEN", token)
        .output()
        .expect("run bcd site enroll")
}

fn run(p: &Plane, dir: &Path, name: &str) -> Agent {
    run_with_ttl(p, dir, name, LEASE_TTL_S)
}

fn run_with_ttl(p: &Plane, dir: &Path, name: &str, ttl_s: u64) -> Agent {
    let base = dir.join(name);
    let (tftp, artifacts) = (base.join("tftp"), base.join("artifacts"));
    std::fs::create_dir_all(&tftp).expect("tftp");
    std::fs::create_dir_all(&artifacts).expect("artifacts");
    // The default x64 UEFI loader, public: the services offer only loaders the TFTP root serves.
    let loader = tftp.join("snponly.efi");
    std::fs::write(&loader, b"x64 loader").expect("loader");
    std::fs::set_permissions(&loader, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("loader mode");
    let pxe_port = free_udp_port();
    let config = base.join("site.toml");
    std::fs::write(
        &config,
        format!(
            "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = {:?}\nartifacts = {:?}\n\
             dhcp_port = {}\npxe_port = {pxe_port}\ntftp_port = {}\nhttp_port = {}\nwatch_rogues = false\n\
             report_interval_s = 0\n",
            tftp.display().to_string(),
            artifacts.display().to_string(),
            free_udp_port(),
            free_udp_port(),
            free_tcp_port(),
        ),
    )
    .expect("site.toml");
    let log = std::fs::File::create(base.join("run.log")).expect("log");
    let child = Command::new(BIN)
        .args(["site", "run", "--lease-ttl", &format!("{ttl_s}s")])
        .args(connection_args(p))
        .arg("--config")
        .arg(&config)
        .arg("--state-dir")
        .arg(base.join("state"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn bcd site run");
    Agent {
        child,
        pxe: SocketAddr::from(([127, 0, 0, 1], pxe_port)),
    }
}

fn answers(to: SocketAddr) -> bool {
    answers_for(to, MAC)
}

fn answers_for(to: SocketAddr, mac: &str) -> bool {
    let mac: MacAddr = mac.parse().expect("mac");
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(9)
        .set_chaddr(&mac.0);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(MessageType::Request));
    o.insert(DhcpOption::ClientSystemArchitecture(Architecture::from(7)));
    o.insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
    ));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf)).expect("encode");
    let client = UdpSocket::bind("127.0.0.1:0").expect("client");
    client
        .set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    if client.send_to(&buf, to).is_err() {
        return false;
    }
    let mut rx = [0u8; 1500];
    client.recv_from(&mut rx).is_ok()
}

/// Polls `f` until true or `within` passed; returns the elapsed time when it became true.
fn until(within: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

async fn lease(p: &Plane) -> Option<(String, i64, bool)> {
    bc_store::sqlx::query_as(
        "SELECT holder, fence, expires_at > now() FROM boot_leases WHERE site_id = 'rack-run'",
    )
    .fetch_optional(p.store.pool())
    .await
    .expect("lease row")
}

fn agent_id(state: &Path) -> String {
    let s = bcd::state::StateDir::open(state).expect("state");
    let cert = s.certificate().expect("cert");
    bc_gateway::site::agent_id_of(&bc_proto::envelope::cert_public_point(&cert).expect("point"))
}

fn log_of(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name).join("run.log")).unwrap_or_default()
}

/// A site token for site `rack-run` with `uses` uses.
async fn site_token(p: &Plane, uses: u32) -> Result<String, Box<dyn std::error::Error>> {
    let v = p
        .admin
        .call(
            "site-tokens",
            "create",
            json!({"site": "rack-run", "uses": uses}),
        )
        .await?;
    Ok(v["token"].as_str().unwrap_or_default().to_string())
}

/// A machine of site `rack-run` that netboots `kernel`.
async fn netboot_machine(p: &Plane, mac: &str, kernel: &str) -> TestResult {
    p.admin
        .call(
            "machines",
            "create",
            json!({"mac": mac, "site": "rack-run", "boot": {"kernel": kernel}}),
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_site_run_processes_one_answers_the_standby_takes_over() -> TestResult {
    let p = plane().await;
    let dir: PathBuf = p.dir.path().join("agents");
    let token = site_token(&p, 2).await?;
    netboot_machine(&p, MAC, "ramdisk/vmlinuz").await?;
    // A second machine boots a control-plane artifact: the real binary fills its cache from `boot.artifacts`.
    let kernel: Vec<u8> = (0..600_000u32).map(|i| (i * 31 % 253) as u8).collect();
    let put = p
        .admin
        .put_artifact(kernel.clone(), Some("vmlinuz"))
        .await?;
    let reference = put["reference"].as_str().unwrap_or_default().to_string();
    netboot_machine(&p, "52:54:00:00:00:43", &reference).await?;
    for name in ["a", "b"] {
        let out = enroll(&p, &dir.join(name).join("state"), &token);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("enrolled as an agent of site rack-run"),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A join token is refused by `site enroll` with what to use instead.
    let jt = p.token(json!({"pool": "default"})).await;
    let out = enroll(&p, &dir.join("c/state"), &jt);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bcd join"));

    let id_a = agent_id(&dir.join("a/state"));
    let id_b = agent_id(&dir.join("b/state"));
    let a = run(&p, &dir, "a");
    let within = Duration::from_secs(15);
    assert!(
        until(within, || answers(a.pxe)).is_some(),
        "agent a never answered DHCP: {}",
        log_of(&dir, "a")
    );
    let cached = dir
        .join("a/artifacts/sha256")
        .join(reference.trim_start_matches("sha256:"));
    assert!(
        until(within, || std::fs::read(&cached).is_ok_and(|c| c == kernel)).is_some(),
        "bcd site run never cached the artifact: {}",
        log_of(&dir, "a")
    );
    assert!(log_of(&dir, "a").contains("artifact cached (verified)"));
    let b = run(&p, &dir, "b");
    // B asks several times while A renews; B never answers.
    for _ in 0..(LEASE_TTL_S * 10) {
        assert!(!answers(b.pxe), "standby answered: {}", log_of(&dir, "b"));
        assert!(answers(a.pxe));
        std::thread::sleep(Duration::from_millis(100));
    }
    let (holder, fence_a, valid) = lease(&p).await.expect("lease row");
    assert_eq!(holder, id_a);
    assert!(valid);

    // SIGKILL the holder: no release; the standby answers once the lease expired.
    let mut a = a;
    let killed = Instant::now();
    a.child.kill()?;
    a.child.wait()?;
    let took = until(Duration::from_secs(LEASE_TTL_S * 3), || answers(b.pxe));
    let takeover = killed.elapsed();
    assert!(
        took.is_some(),
        "standby never answered: {}",
        log_of(&dir, "b")
    );
    let (holder, fence_b, valid) = lease(&p).await.expect("lease row");
    assert_eq!(holder, id_b);
    assert!(valid && fence_b > fence_a, "fence {fence_a} -> {fence_b}");
    // A lease has at most one TTL left at the kill; the standby asks every TTL/3.
    let bound = Duration::from_millis(LEASE_TTL_S * 1000 * 4 / 3 + 700);
    assert!(
        takeover <= bound,
        "takeover took {takeover:?} (bound {bound:?})"
    );
    println!(
        "bcd site run takeover after SIGKILL of the holder: {} ms (lease TTL {} s)",
        takeover.as_millis(),
        LEASE_TTL_S
    );
    assert!(log_of(&dir, "b").contains("boot lease held: answering DHCP"));

    // SIGTERM: B stops answering and releases the lease at once.
    let status = Command::new("kill")
        .args(["-TERM", &b.child.id().to_string()])
        .status()?;
    assert!(status.success());
    let mut b = b;
    let exited = until(Duration::from_secs(10), || {
        matches!(b.child.try_wait(), Ok(Some(_)))
    });
    assert!(exited.is_some(), "bcd site run did not stop on SIGTERM");
    let (_, _, valid) = lease(&p).await.expect("lease row");
    assert!(
        !valid,
        "SIGTERM must release the lease: {}",
        log_of(&dir, "b")
    );
    assert!(!answers(b.pxe));
    Ok(())
}

/// The netboot table is pushed (a long poll of `Netboot` with the table's version), not only fetched on the
/// lease's rounds: with a 60 s lease (a round every 20 s), a machine created just after a round is served within
/// seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_netboot_entry_reaches_the_agent_between_lease_rounds() -> TestResult {
    let p = plane().await;
    let dir: PathBuf = p.dir.path().join("agents");
    let token = site_token(&p, 1).await?;
    netboot_machine(&p, MAC, "ramdisk/vmlinuz").await?;
    let out = enroll(&p, &dir.join("a").join("state"), &token);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = run_with_ttl(&p, &dir, "a", 60);
    assert!(
        until(Duration::from_secs(15), || answers(a.pxe)).is_some(),
        "agent a never answered DHCP: {}",
        log_of(&dir, "a")
    );
    // The agent has just fetched its table: its next lease round is about 20 s away.
    let second = "52:54:00:00:00:44";
    assert!(!answers_for(a.pxe, second));
    netboot_machine(&p, second, "ramdisk/vmlinuz").await?;
    let took = until(Duration::from_secs(5), || answers_for(a.pxe, second));
    let Some(took) = took else {
        return Err(format!(
            "the new entry was not served within 5 s (the next lease round is 20 s away): {}",
            log_of(&dir, "a")
        )
        .into());
    };
    println!(
        "netboot entry created -> served by bcd site run: {} ms (lease rounds every 20 s)",
        took.as_millis()
    );
    Ok(())
}
