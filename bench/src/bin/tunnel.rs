//! `scripts/bench tunnel`: one tunnel's throughput against `ssh -L` (OpenSSH: sshd on a generated host key, key
//! authentication, in the bench's own folder) and against raw TCP, on loopback and across a link to a network
//! namespace that adds 50 ms of RTT and a 1 Gbit/s rate (netem, or `bc_bench::delay`'s user-space line where the
//! kernel lacks netem; there the window, not the CPU, should decide); 1 KiB echo latency through the tunnel vs
//! direct; the heartbeat delay while a tunnel is saturated; the control plane's memory per open idle tunnel. Ends
//! with `tunnel: <r> ratio vs ssh -L on loopback`.
//!
//! The control plane (api and gateway roles, one process: this one) runs on an embedded PostgreSQL with a 100 ms
//! heartbeat so that the delay is visible; the nodes are real `bcd run` processes (one here, one in the
//! namespace); the operator's side is the real `better-compute tunnel` process. Each transfer is a download: the
//! service on the node's side sends the bytes asked for (the node → gateway direction, the heartbeats' own).
//!
//! BC_BIN_DIR: where `bcd` and `better-compute` are (target/release). BC_TUNNEL_BENCH_BYTES (256 MiB) and
//! BC_TUNNEL_BENCH_WAN_BYTES (128 MiB): bytes per transfer; five rounds on loopback and three across
//! the namespace, medians printed; each rate counts the bytes after the first, whose delay is printed beside it.

use anyhow::{Context as _, bail};
use bc_bench::peers::{Kill, Sshd, Wan, wait_listening};
use bc_control::config::{Roles, ServeConfig, SessionTiming};
use bc_store::embedded::Durability;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The session's heartbeat interval the gateway asks for: bcd takes no less than a second (it clamps the Welcome's
/// interval to 1–300 s), so that is what the lateness is measured against.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// The node-side service's port inside the namespace (a fresh namespace: nothing else listens there).
const WAN_SERVICE_PORT: u16 = 15001;
const WAN_SSH_PORT: u16 = 15022;
/// Downloads per path on loopback, taken in turn (raw, tunnel, ssh, raw, …); the median is printed. A run's
/// ratio moves with the machine's state by about ±0.1 (BENCHMARKS.md), so loopback takes more rounds than the
/// namespace, whose figures the link's shape decides.
const LOOPBACK_ROUNDS: usize = 5;
/// Idle tunnels opened for the memory figure (under the gateway's 128 per node).
const IDLE_TUNNELS: usize = 100;

/// The node-side service: `S` + u64 (big-endian) asks for that many bytes, then the connection closes; `E` echoes
/// until EOF.
fn serve(addr: &str) -> anyhow::Result<()> {
    let l = std::net::TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
    for s in l.incoming() {
        let Ok(mut s) = s else { continue };
        std::thread::spawn(move || {
            let _ = s.set_nodelay(true);
            let mut mode = [0u8; 1];
            if s.read_exact(&mut mode).is_err() {
                return;
            }
            match mode[0] {
                b'S' => {
                    let mut n = [0u8; 8];
                    if s.read_exact(&mut n).is_err() {
                        return;
                    }
                    let mut left = u64::from_be_bytes(n);
                    let buf = vec![0x5au8; 256 << 10];
                    while left > 0 {
                        let k = left.min(buf.len() as u64) as usize;
                        if s.write_all(&buf[..k]).is_err() {
                            return;
                        }
                        left -= k as u64;
                    }
                }
                _ => {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = s.shutdown(std::net::Shutdown::Write);
        });
    }
    Ok(())
}

/// One download: the time from connect to the first byte (for a tunnel: the API's checks, the audit row, the
/// node's dial), and the rate of the bytes after the first read.
struct Transfer {
    first_byte: Duration,
    mbs: f64,
}

/// Downloads `n` bytes from the service at `addr`.
fn download(addr: SocketAddr, n: u64) -> anyhow::Result<Transfer> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut head = vec![b'S'];
    head.extend_from_slice(&n.to_be_bytes());
    s.write_all(&head)?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut got, mut first) = (0u64, None);
    loop {
        let k = s.read(&mut buf)?;
        if k == 0 {
            break;
        }
        if first.is_none() {
            first = Some((Instant::now(), k as u64));
        }
        got += k as u64;
    }
    if got != n {
        bail!("{addr}: {got} of {n} bytes arrived");
    }
    let (at, k) = first.context("no bytes arrived")?;
    Ok(Transfer {
        first_byte: at - t0,
        mbs: (n - k) as f64 / at.elapsed().as_secs_f64() / 1e6,
    })
}

/// This namespace's TCP receive buffers, which bound the downloads' windows here.
fn rmem_here() -> String {
    let v = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_rmem").unwrap_or_default();
    format!(
        "net.ipv4.tcp_rmem={}",
        v.split_whitespace().collect::<Vec<_>>().join(" ")
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// 1 KiB echo round trips on one connection: (p50, p99) in microseconds.
fn echo_latency(addr: SocketAddr, rounds: usize) -> anyhow::Result<(f64, f64)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(b"E")?;
    let msg = vec![0x42u8; 1024];
    let mut back = vec![0u8; 1024];
    let mut times = Vec::with_capacity(rounds);
    for i in 0..rounds + 50 {
        let t0 = Instant::now();
        s.write_all(&msg)?;
        s.read_exact(&mut back)?;
        if i >= 50 {
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| times[((times.len() as f64 * p) as usize).min(times.len() - 1)];
    Ok((q(0.50), q(0.99)))
}

/// A node: `bcd join` then `bcd run` (under `prefix`, e.g. in the namespace), its allowlist `[port]`.
async fn node(
    bin: &Path,
    dir: &Path,
    name: &str,
    running: &bc_control::Running,
    admin: &bc_control::client::ApiClient,
    port: u16,
    prefix: &[String],
) -> anyhow::Result<(String, Kill)> {
    let state = dir.join(name);
    std::fs::create_dir_all(&state)?;
    let fixture = state.join("gpus.json");
    std::fs::write(
        &fixture,
        bcd::gpu::fixture::synthetic(1, &format!("tunnelbench{name}")),
    )?;
    let cfg = state.join("bcd.toml");
    std::fs::write(
        &cfg,
        format!(
            "gateway_url = {:?}\nca_pin = {:?}\njoin_public_key = {:?}\nstate_dir = {:?}\ngpu_backend = \"fixture:{}\"\n\
             cdi_dir = {:?}\n[tunnels]\nallow = [{port}]\n",
            running.gateway_url,
            running.ca_pin,
            running.join_public_key,
            state,
            fixture.display(),
            state.join("cdi"),
        ),
    )?;
    let token = admin
        .call(
            "join-tokens",
            "create",
            serde_json::json!({"pool": "default", "uses": 1}),
        )
        .await?;
    let bcd = bin.join("bcd");
    let command = |args: &[&str]| -> Command {
        let mut c = match prefix.split_first() {
            Some((p, rest)) => {
                let mut c = Command::new(p);
                c.args(rest).arg(&bcd);
                c
            }
            None => Command::new(&bcd),
        };
        c.arg("--config").arg(&cfg).args(args);
        c
    };
    let join = command(&["join"])
        .env(
            "BCD_JOIN_TOKEN",
            token["token"].as_str().unwrap_or_default(),
        )
        .output()?;
    if !join.status.success() {
        bail!(
            "bcd join ({name}): {}",
            String::from_utf8_lossy(&join.stderr)
        );
    }
    let id = bcd::state::StateDir::open(&state)?
        .identity()?
        .context("no identity after join")?
        .node_id;
    let child = command(&["run"])
        .env("BCD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(state.join("bcd.log"))?)
        .spawn()?;
    Ok((id, Kill(child)))
}

/// `better-compute tunnel <node> <port> --listen <local>`, the operator's real CLI process.
fn cli(
    bin: &Path,
    api: &str,
    key: &str,
    node: &str,
    port: u16,
) -> anyhow::Result<(SocketAddr, Kill)> {
    let local: SocketAddr = format!("127.0.0.1:{}", bc_testkit::free_port()?).parse()?;
    let child = Command::new(bin.join("better-compute"))
        .args([
            "tunnel",
            node,
            &port.to_string(),
            "--listen",
            &local.to_string(),
        ])
        .env("BC_API_URL", api)
        .env("BC_API_KEY", key)
        .env("BC_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    let child = Kill(child);
    wait_listening(local, Duration::from_secs(10))?;
    Ok((local, child))
}

/// Throughput of each named path, `rounds` rounds alternating: medians in MB/s.
fn throughput(paths: &[(&str, SocketAddr)], n: u64, rounds: usize) -> anyhow::Result<Vec<f64>> {
    let mut all = vec![(Vec::new(), Vec::new()); paths.len()];
    for _ in 0..rounds {
        for (i, (_, addr)) in paths.iter().enumerate() {
            let t = download(*addr, n)?;
            all[i].0.push(t.mbs);
            all[i].1.push(t.first_byte.as_secs_f64() * 1e3);
        }
    }
    let mut medians = Vec::new();
    for ((name, _), (rates, firsts)) in paths.iter().zip(all) {
        let (m, f) = (median(rates), median(firsts));
        println!(
            "  {name:<30} {m:8.1} MB/s after the first byte, which came {f:.1} ms after connect"
        );
        medians.push(m);
    }
    Ok(medians)
}

/// The worst lateness of heartbeats at the gateway (gap between two minus the interval) while `during` runs.
fn heartbeat_delay(
    registry: &bc_gateway::session::Registry,
    node: &str,
    during: impl FnOnce() -> anyhow::Result<()> + Send,
) -> anyhow::Result<Duration> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let watch = scope.spawn(|| {
            let (mut last, mut worst) = (registry.last_seen_ms(node).unwrap_or(0), 0i64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(2));
                let seen = registry.last_seen_ms(node).unwrap_or(0);
                if seen != last {
                    worst = worst.max(seen - last);
                    last = seen;
                }
            }
            worst
        });
        let r = during();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let worst = watch.join().unwrap_or(0);
        r.map(|()| {
            Duration::from_millis(u64::try_from(worst).unwrap_or(0)).saturating_sub(HEARTBEAT)
        })
    })
}

fn process_rss_kib() -> u64 {
    bc_bench::rss_kib(std::process::id())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, addr] = args.as_slice()
        && flag == "--serve"
    {
        return serve(addr);
    }
    bc_proto::install_crypto_provider();
    let bin =
        PathBuf::from(std::env::var("BC_BIN_DIR").unwrap_or_else(|_| "target/release".into()));
    let env_u64 = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (n, n_wan) = (
        env_u64("BC_TUNNEL_BENCH_BYTES", 256 << 20),
        env_u64("BC_TUNNEL_BENCH_WAN_BYTES", 128 << 20),
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "tunnel bench: {n} bytes per loopback transfer, {n_wan} across the namespace; load {}",
        load.trim()
    );
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    // The namespace first (the gateway listens on its link address, which both nodes use); deleted last.
    let wan = Wan::create(Duration::from_millis(50), 1_000_000_000)?;
    let db = bc_bench::BenchDb::start(dir, Durability::Throwaway, &[], 32).await?;
    let (store, key) = (db.store.clone(), db.admin_key.clone());
    let config = ServeConfig {
        gateway_listen: SocketAddr::new(wan.here.into(), 0),
        gateway_hosts: vec![wan.here.to_string()],
        session_timing: Some(SessionTiming {
            heartbeat: HEARTBEAT,
            liveness_interval: Duration::from_secs(5),
            pending_interval: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            revocation_interval: Duration::from_secs(10),
        }),
        ..ServeConfig::loopback(
            dir.join("state"),
            "bench.bc",
            Roles {
                api: true,
                gateway: true,
                ..Roles::default()
            },
        )
    };
    let running = bc_control::start(&config, store.clone()).await?;
    let api = format!("http://{}", running.api_addr.context("api")?);
    let admin = bc_control::client::ApiClient::new(&api, &key);
    let me = std::env::current_exe()?;
    // The node-side services: here on loopback, there in the namespace.
    let lo_port = bc_testkit::free_port()?;
    let lo_service = Kill(
        Command::new(&me)
            .args(["--serve", &format!("127.0.0.1:{lo_port}")])
            .spawn()?,
    );
    let mut ns_cmd = Command::new("ip");
    ns_cmd
        .args(["netns", "exec", &wan.name])
        .arg(&me)
        .args(["--serve", &format!("0.0.0.0:{WAN_SERVICE_PORT}")]);
    let wan_service = Kill(ns_cmd.spawn()?);
    let lo_addr: SocketAddr = format!("127.0.0.1:{lo_port}").parse()?;
    let wan_addr = SocketAddr::new(wan.there.into(), WAN_SERVICE_PORT);
    wait_listening(lo_addr, Duration::from_secs(10))?;
    wait_listening(wan_addr, Duration::from_secs(10))?;
    admin
        .call(
            "tunnels",
            "set-ports",
            serde_json::json!({"pool": "default", "ports": [lo_port, WAN_SERVICE_PORT]}),
        )
        .await?;
    let (lo_node, _lo_bcd) = node(&bin, dir, "lo", &running, &admin, lo_port, &[]).await?;
    let (wan_node, _wan_bcd) = node(
        &bin,
        dir,
        "wan",
        &running,
        &admin,
        WAN_SERVICE_PORT,
        &wan.prefix(),
    )
    .await?;
    let registry = running.sessions.clone().context("gateway")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while registry.last_seen_ms(&lo_node).is_none() || registry.last_seen_ms(&wan_node).is_none() {
        if Instant::now() > deadline {
            bail!(
                "the nodes did not connect within 60 s (logs in {})",
                dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (lo_tunnel, _lo_cli) = cli(&bin, &api, &key, &lo_node, lo_port)?;
    let (wan_tunnel, _wan_cli) = cli(&bin, &api, &key, &wan_node, WAN_SERVICE_PORT)?;
    let prefix: Vec<String> = wan.prefix();
    let prefix: Vec<&str> = prefix.iter().map(String::as_str).collect();
    let sshd_lo = Sshd::start(
        &dir.join("ssh-lo"),
        format!("127.0.0.1:{}", bc_testkit::free_port()?).parse()?,
        &[],
    )?;
    let ssh_lo_local: SocketAddr = format!("127.0.0.1:{}", bc_testkit::free_port()?).parse()?;
    let _ssh_lo = sshd_lo.forward(ssh_lo_local, lo_addr)?;
    let sshd_wan = Sshd::start(
        &dir.join("ssh-wan"),
        SocketAddr::new(wan.there.into(), WAN_SSH_PORT),
        &prefix,
    )?;
    let ssh_wan_local: SocketAddr = format!("127.0.0.1:{}", bc_testkit::free_port()?).parse()?;
    let _ssh_wan = sshd_wan.forward(
        ssh_wan_local,
        format!("127.0.0.1:{WAN_SERVICE_PORT}").parse()?,
    )?;
    let wan_name = wan.name.clone();
    let shaper = wan.shaper.clone();
    let line = wan.line.as_ref().map(|l| l.counters.clone());
    let measured = tokio::task::spawn_blocking(move || -> anyhow::Result<f64> {
        // First, while the allocator holds little free memory: after the transfers it would serve the tunnels'
        // buffers from freed memory, and RSS would not move.
        let before = process_rss_kib();
        let mut held = Vec::new();
        for _ in 0..IDLE_TUNNELS {
            let mut s = TcpStream::connect(lo_tunnel)?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            s.write_all(b"Ex")?;
            let mut one = [0u8; 1];
            s.read_exact(&mut one)?;
            held.push(s);
        }
        std::thread::sleep(Duration::from_secs(2));
        let after = process_rss_kib();
        println!("control plane (api + gateway, this process) RSS: {before} KiB, {after} KiB with {IDLE_TUNNELS} idle tunnels open: {:.1} KiB per idle tunnel",
            after.saturating_sub(before) as f64 / IDLE_TUNNELS as f64);
        drop(held);
        // Their ends close (the audit rows written) before the transfers.
        std::thread::sleep(Duration::from_secs(1));
        println!("loopback, one download of {n} bytes each, median of {LOOPBACK_ROUNDS}:");
        let lo = throughput(&[("raw TCP", lo_addr), ("tunnel (better-compute tunnel)", lo_tunnel), ("ssh -L", ssh_lo_local)], n, LOOPBACK_ROUNDS)?;
        println!("50 ms RTT, 1 Gbit/s ({shaper}; namespace {wan_name}, where {}; here {}), one download of {n_wan} bytes each, median of 3:",
            bc_bench::peers::WAN_WMEM, rmem_here());
        let far = throughput(&[("raw TCP", wan_addr), ("tunnel (better-compute tunnel)", wan_tunnel), ("ssh -L", ssh_wan_local)], n_wan, 3)?;
        let far_label = "at 50 ms";
        if let Some([out, back]) = &line {
            let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
            println!("  the delay line carried {} packets ({} bytes) out and {} back, dropped {} and {} at its queue limit",
                get(&out.packets), get(&out.bytes), get(&back.packets), get(&out.dropped), get(&back.dropped));
        }
        println!("  ratios: tunnel/ssh -L {:.2} on loopback, {:.2} {far_label}; tunnel/raw TCP {:.2} on loopback, {:.2} {far_label} (goals: ≥ 1.0, ≥ 1.0 at 50 ms, -, ≥ 0.8 at 50 ms)",
            lo[1] / lo[2], far[1] / far[2], lo[1] / lo[0], far[1] / far[0]);
        let (t50, t99) = echo_latency(lo_tunnel, 2000)?;
        let (d50, d99) = echo_latency(lo_addr, 2000)?;
        println!("1 KiB echo, 2000 round trips: tunnel p50 {t50:.0} µs p99 {t99:.0} µs; direct p50 {d50:.0} µs p99 {d99:.0} µs");
        let idle = heartbeat_delay(&registry, &lo_node, || {
            std::thread::sleep(Duration::from_secs(3));
            Ok(())
        })?;
        let busy = heartbeat_delay(&registry, &lo_node, || download(lo_tunnel, n).map(|_| ()))?;
        println!("heartbeat ({} ms interval) worst lateness at the gateway: {} ms idle, {} ms while a tunnel downloads {n} bytes (goal < 100 ms)",
            HEARTBEAT.as_millis(), idle.as_millis(), busy.as_millis());
        Ok(lo[1] / lo[2])
    })
    .await??;
    drop((lo_service, wan_service));
    println!("tunnel: {measured:.2} ratio vs ssh -L on loopback");
    Ok(())
}
