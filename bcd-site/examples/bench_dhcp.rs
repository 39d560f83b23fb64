//! Proxy-DHCP benchmark: our server and dnsmasq (the peer), each in a network namespace joined by a veth pair to
//! a client namespace running `pxegen.py`, in the same invocation. Prints answers/s, p50 and p99 for both, the
//! ratio, and a final `proxy-dhcp: <answers/s> answers/s` line.
//!
//! Needs root, iproute2, python3 and dnsmasq. The namespaces and the veth pair are created here under names
//! carrying this process's PID and deleted on exit, error, panic or Ctrl-C; no packet leaves them.
//!
//! usage: bench_dhcp [--duration S] [--window N] [--rounds N] [--pxegen PATH] [--dnsmasq-conf PATH]
//! (internal: bench_dhcp serve --iface IF --ip IP, run inside the server namespace)

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bcd_site::dhcp::server::{DhcpCounters, DhcpSockets, ServerConfig, bind_udp, run};
use bcd_site::dhcp::{NetbootTable, ServerInfo};
use std::io::Read as _;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
const CLIENT_IP: &str = "10.213.0.2/24";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        // One thread: the hot path is one socket; a second core is left to the load generator.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        return rt.block_on(serve(&args[1..]));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(bench(&args))
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

// === serve (inside the server namespace) ===

async fn serve(args: &[String]) -> Result<()> {
    let iface = flag(args, "--iface").context("--iface")?;
    let ip: Ipv4Addr = flag(args, "--ip").context("--ip")?.parse()?;
    let sockets = DhcpSockets {
        dhcp: bind_udp(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 67), Some(iface))?,
        pxe: bind_udp(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 4011), Some(iface))?,
        watch: None,
    };
    // pxegen.py's clients are 02:0b:<xid>: a prefix rule covers them.
    let table: NetbootTable = ["02:0b:".parse()?].into_iter().collect();
    let (_table_tx, table_rx) = watch::channel(table);
    let counters = Arc::new(DhcpCounters::default());
    let info = ServerInfo {
        server_ip: ip,
        http_port: 8080,
        files: Default::default(),
        offer: Default::default(),
    };
    println!("ready");
    // Stop when the parent closes our stdin.
    let stop = async {
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            std::io::stdin().read_to_end(&mut sink)
        })
        .await;
    };
    run(
        sockets,
        table_rx,
        ServerConfig::new(info),
        counters.clone(),
        stop,
    )
    .await;
    let c = counters.snapshot();
    println!(
        "counters received={} replied={} decode_failed={} send_failed={} ignored={:?}",
        c.received, c.replied, c.decode_failed, c.send_failed, c.ignored
    );
    Ok(())
}

// === bench (the parent) ===

/// Deletes the namespaces it names when dropped (the veth pair goes with them).
struct Namespaces {
    names: Vec<String>,
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

async fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().await?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
struct Load {
    answers_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    sent: u64,
    answered: u64,
}

fn parse_pxegen(line: &str) -> Result<Load> {
    let field = |name: &str| -> Result<f64> {
        let v = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
            .with_context(|| format!("no {name} in pxegen output {line:?}"))?;
        Ok(v.trim_end_matches("ms").parse()?)
    };
    Ok(Load {
        answers_per_s: field("answers/s")?,
        p50_ms: field("p50")?,
        p99_ms: field("p99")?,
        sent: field("sent")? as u64,
        answered: field("answered")? as u64,
    })
}

struct Setup {
    srv: String,
    cli: String,
    srv_if: String,
    cli_if: String,
    pxegen: PathBuf,
    duration: u64,
    window: u32,
}

async fn drive(s: &Setup) -> Result<Load> {
    let out = Command::new("ip")
        .args(["netns", "exec", &s.cli, "python3"])
        .arg(&s.pxegen)
        .args([
            &s.cli_if,
            &s.duration.to_string(),
            "max",
            &s.window.to_string(),
        ])
        .kill_on_drop(true)
        .output()
        .await?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pxegen failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = text.lines().last().context("pxegen printed nothing")?;
    parse_pxegen(line)
}

async fn run_dnsmasq(s: &Setup, conf: &PathBuf, tmp: &std::path::Path) -> Result<Load> {
    let mut child: Child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &s.srv,
            "dnsmasq",
            "--keep-in-foreground",
            "-C",
        ])
        .arg(conf)
        .arg(format!("--interface={}", s.srv_if))
        .arg("--dhcp-range=10.213.0.0,proxy")
        .arg(format!("--pid-file={}", tmp.join("dnsmasq.pid").display()))
        .arg(format!(
            "--log-facility={}",
            tmp.join("dnsmasq.log").display()
        ))
        .arg(format!(
            "--dhcp-leasefile={}",
            tmp.join("dnsmasq.leases").display()
        ))
        .kill_on_drop(true)
        .spawn()
        .context("starting dnsmasq")?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    if let Some(status) = child.try_wait()? {
        bail!(
            "dnsmasq exited early ({status}); see {}",
            tmp.join("dnsmasq.log").display()
        );
    }
    let load = drive(s).await;
    let _ = child.kill().await;
    load
}

async fn run_ours(s: &Setup) -> Result<(Load, String)> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new("ip")
        .args(["netns", "exec", &s.srv])
        .arg(exe)
        .args([
            "serve",
            "--iface",
            &s.srv_if,
            "--ip",
            &SERVER_IP.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting our proxy")?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await??;
    if first.as_deref() != Some("ready") {
        bail!("our proxy did not start: {first:?}");
    }
    let load = drive(s).await;
    drop(child.stdin.take());
    let counters = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await??
        .unwrap_or_default();
    let _ = child.wait().await;
    Ok((load?, counters))
}

async fn bench(args: &[String]) -> Result<()> {
    let peers = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/peers");
    let pxegen = flag(args, "--pxegen").map_or_else(|| peers.join("pxegen.py"), PathBuf::from);
    let conf = flag(args, "--dnsmasq-conf")
        .map_or_else(|| peers.join("dnsmasq-proxy.conf"), PathBuf::from);
    let duration: u64 = flag(args, "--duration").unwrap_or("10").parse()?;
    let window: u32 = flag(args, "--window").unwrap_or("32").parse()?;
    let rounds: u32 = flag(args, "--rounds").unwrap_or("1").parse()?;
    for (what, path) in [("pxegen.py", &pxegen), ("dnsmasq config", &conf)] {
        if !path.exists() {
            bail!("{what} not found at {}", path.display());
        }
    }
    let pid = std::process::id();
    let s = Setup {
        srv: format!("bcd-bench-srv-{pid}"),
        cli: format!("bcd-bench-cli-{pid}"),
        srv_if: format!("bbs{pid}"),
        cli_if: format!("bbc{pid}"),
        pxegen,
        duration,
        window,
    };
    // Created before the first namespace so that whatever exists is deleted on every exit path.
    let _guard = Namespaces {
        names: vec![s.srv.clone(), s.cli.clone()],
    };
    let tmp = tempfile::tempdir()?;
    tokio::select! {
        r = measure(&s, &conf, tmp.path(), rounds) => r,
        // SIGTERM too (`kill`, a timeout): the namespace guard and the servers' kill-on-drop run either way.
        _ = bc_proto::runtime::shutdown_signal() => bail!("interrupted (SIGINT or SIGTERM)"),
    }
}

async fn measure(s: &Setup, conf: &PathBuf, tmp: &std::path::Path, rounds: u32) -> Result<()> {
    ip(&["netns", "add", &s.srv]).await?;
    ip(&["netns", "add", &s.cli]).await?;
    ip(&[
        "link", "add", &s.srv_if, "netns", &s.srv, "type", "veth", "peer", "name", &s.cli_if,
        "netns", &s.cli,
    ])
    .await?;
    ip(&[
        "-n",
        &s.srv,
        "addr",
        "add",
        &format!("{SERVER_IP}/24"),
        "dev",
        &s.srv_if,
    ])
    .await?;
    ip(&["-n", &s.cli, "addr", "add", CLIENT_IP, "dev", &s.cli_if]).await?;
    for (ns, dev) in [(&s.srv, &s.srv_if), (&s.cli, &s.cli_if)] {
        ip(&["-n", ns, "link", "set", "lo", "up"]).await?;
        ip(&["-n", ns, "link", "set", dev, "up"]).await?;
    }
    println!(
        "# pxegen.py {} {} max {} per run; netboot rule 02:0b: (pxegen's MACs); {} round(s), peer first",
        s.cli_if, s.duration, s.window, rounds
    );
    let mut theirs = Vec::new();
    let mut ours = Vec::new();
    for round in 1..=rounds {
        let d = run_dnsmasq(s, conf, tmp).await?;
        println!(
            "round {round} dnsmasq:  {:>8.0} answers/s  p50 {:.3} ms  p99 {:.3} ms  (sent {}, answered {})",
            d.answers_per_s, d.p50_ms, d.p99_ms, d.sent, d.answered
        );
        theirs.push(d);
        let (o, counters) = run_ours(s).await?;
        println!(
            "round {round} bcd-site: {:>8.0} answers/s  p50 {:.3} ms  p99 {:.3} ms  (sent {}, answered {})",
            o.answers_per_s, o.p50_ms, o.p99_ms, o.sent, o.answered
        );
        println!("round {round} bcd-site {counters}");
        ours.push(o);
    }
    let median = |v: &mut Vec<Load>| {
        v.sort_by(|a, b| a.answers_per_s.total_cmp(&b.answers_per_s));
        v[v.len() / 2]
    };
    let (d, o) = (median(&mut theirs), median(&mut ours));
    println!(
        "dnsmasq: {:.0} answers/s, p50 {:.3} ms, p99 {:.3} ms",
        d.answers_per_s, d.p50_ms, d.p99_ms
    );
    println!(
        "bcd-site: {:.0} answers/s, p50 {:.3} ms, p99 {:.3} ms",
        o.answers_per_s, o.p50_ms, o.p99_ms
    );
    println!(
        "ratio {:.2} vs dnsmasq",
        o.answers_per_s / d.answers_per_s.max(1.0)
    );
    println!("proxy-dhcp: {:.0} answers/s", o.answers_per_s);
    Ok(())
}
