//! `scripts/bench gateway-flood`: the gateway under hostile connections while real nodes connect and join.
//!
//! Starts `better-compute dev` (release, fresh data directory) under the descriptor limits a service manager gives
//! by default (soft 1,024, hard the machine's), joins a few nodes, then runs phases. Each phase holds a flood open
//! (a flood connection the gateway closes is opened again a second later, at most 500 a second for each kind, so
//! the pressure stays) while real nodes
//! open Sessions (TCP, TLS with their certificate, HTTP/2, Hello → Welcome) and fresh nodes join (TLS, Join RPC),
//! and prints the real nodes' latency (p50/p99, every attempt counted; a failed one at its elapsed time), their
//! failures, and the gateway process's descriptors and RSS before, during and after the flood. Flood kinds:
//!   tcp  connections that never send a byte (the TLS handshake never finishes)
//!   tls  connections that finish the TLS handshake (no client certificate) and never send the HTTP/2 preface
//!   h2   connections that send the preface and SETTINGS, answer PING and SETTINGS, and never open a stream
//!        (so never a Join or a Hello)
//! The floods come from 127.0.0.2 and up (the whole 127/8 is loopback), 40 connections per address, so a
//! per-address cap alone does not stop them; one phase puts all three kinds on the real nodes' own address
//! 127.0.0.1, and the last restarts the control plane under a hard limit of 1,024 descriptors.
//! Ends with `gateway-flood: <p99> ms real-node connect p99`: the worst p99 of any flood phase, Sessions and joins.

use anyhow::Context as _;
use bc_bench::flood::{Flood, Kind, Reopen, loopback_sources};
use bc_bench::{Dev, cpu_ticks, percentile_ms, rss_kib};
use bc_proto::channel::{self, ServerTrust};
use bc_proto::v1;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Hostile connections of each kind.
const FLOOD: usize = 2_000;
/// Flood connections per source address (127.0.0.2, 127.0.0.3, …).
const PER_SOURCE: usize = 40;
/// Real nodes opening Sessions concurrently, and fresh nodes joining concurrently, during each phase.
const SESSIONS: usize = 8;
const JOINERS: usize = 2;
/// How long real nodes work in each phase, and the deadline of one attempt (a Session up, or a join answered).
const WORK: Duration = Duration::from_secs(10);
const ATTEMPT: Duration = Duration::from_secs(15);
/// A flood connection the gateway closed is opened again after a second, at most 500 a second for each kind.
const REOPEN: Reopen = Reopen {
    after: Duration::from_secs(1),
    per_second: 500.0,
};

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// One process's descriptors and RSS.
fn sample(pid: u32) -> String {
    format!("{} fds, {:.1} MiB", fds(pid), rss_kib(pid) as f64 / 1024.0)
}

// === real nodes ===

struct Cred {
    node_id: String,
    cert: CertificateDer<'static>,
    key_pem: String,
}

fn claims(name: &str) -> v1::HardwareClaims {
    v1::HardwareClaims {
        dmi: Some(v1::DmiClaims {
            system_uuid: name.to_string(),
            ..Default::default()
        }),
        hostname: name.to_string(),
        ..Default::default()
    }
}

/// A fresh node's key and Join request (node-side work, done before the clock starts).
fn join_request(
    config: &bcd::config::Config,
    token: &str,
    name: &str,
) -> anyhow::Result<(rcgen::KeyPair, v1::JoinRequest)> {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let req = bcd::join::request_for_key(config, &key, token, claims(name))?;
    Ok((key, req))
}

/// Opens a Session and waits for Welcome; the connection closes when this returns.
async fn session_once(cred: &Cred, ca: &CertificateDer<'static>, url: &str) -> anyhow::Result<()> {
    let key = PrivateKeyDer::from_pem_slice(cred.key_pem.as_bytes())?;
    let tls = channel::client_config(
        ServerTrust::Bundle(vec![ca.clone()]),
        Some((vec![cred.cert.clone()], key)),
    )?;
    let ch = channel::connect(url, tls).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(v1::NodeMessage {
        msg: Some(v1::node_message::Msg::Hello(v1::Hello {
            node_id: cred.node_id.clone(),
            agent_version: "bench".into(),
            ..Default::default()
        })),
    })
    .await?;
    let mut inbound = v1::session_service_client::SessionServiceClient::new(ch)
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    loop {
        match inbound.message().await? {
            Some(v1::GatewayMessage {
                msg: Some(v1::gateway_message::Msg::Welcome(_)),
            }) => return Ok(()),
            Some(_) => {}
            None => anyhow::bail!("the gateway ended the session before Welcome"),
        }
    }
}

#[derive(Default)]
struct Outcomes {
    latencies: Vec<Duration>,
    failures: usize,
    reasons: BTreeMap<String, usize>,
}

impl Outcomes {
    fn record(
        &mut self,
        elapsed: Duration,
        result: Result<anyhow::Result<()>, tokio::time::error::Elapsed>,
    ) {
        self.latencies.push(elapsed);
        let reason = match result {
            Ok(Ok(())) => return,
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => format!("no answer within {} s", ATTEMPT.as_secs()),
        };
        self.failures += 1;
        let reason: String = reason.chars().take(160).collect();
        *self.reasons.entry(reason).or_default() += 1;
    }

    fn merge(&mut self, other: Outcomes) {
        self.latencies.extend(other.latencies);
        self.failures += other.failures;
        for (r, n) in other.reasons {
            *self.reasons.entry(r).or_default() += n;
        }
    }

    fn line(&mut self, what: &str) -> String {
        self.latencies.sort();
        format!(
            "{what}: {} attempts, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms, {} failed",
            self.latencies.len(),
            percentile_ms(&self.latencies, 0.50),
            percentile_ms(&self.latencies, 0.99),
            percentile_ms(&self.latencies, 1.0),
            self.failures
        )
    }
}

struct Plane {
    url: String,
    config: bcd::config::Config,
    token: String,
    ca: CertificateDer<'static>,
    nodes: Vec<Arc<Cred>>,
}

/// Real nodes at work for WORK: SESSIONS nodes each opening Sessions one after another, JOINERS fresh joins one
/// after another. Returns (sessions, joins).
async fn real_nodes(plane: &Arc<Plane>, phase: usize) -> (Outcomes, Outcomes) {
    let until = Instant::now() + WORK;
    let mut sessions = tokio::task::JoinSet::new();
    for i in 0..SESSIONS.min(plane.nodes.len()) {
        let plane = plane.clone();
        sessions.spawn(async move {
            let cred = &plane.nodes[i];
            let mut out = Outcomes::default();
            while Instant::now() < until {
                let t = Instant::now();
                let r =
                    tokio::time::timeout(ATTEMPT, session_once(cred, &plane.ca, &plane.url)).await;
                out.record(t.elapsed(), r);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            out
        });
    }
    let mut joins = tokio::task::JoinSet::new();
    for j in 0..JOINERS {
        let plane = plane.clone();
        joins.spawn(async move {
            let mut out = Outcomes::default();
            let mut i = 0;
            while Instant::now() < until {
                i += 1;
                let name = format!("flood-join-{phase}-{j}-{i}");
                let Ok((_key, req)) = join_request(&plane.config, &plane.token, &name) else {
                    out.record(
                        Duration::ZERO,
                        Ok(Err(anyhow::anyhow!("building a join request"))),
                    );
                    break;
                };
                let t = Instant::now();
                let r = tokio::time::timeout(ATTEMPT, async {
                    bcd::join::send(&plane.config, req)
                        .await
                        .map(|_| ())
                        .map_err(|s| anyhow::anyhow!("{}: {}", s.code(), s.message()))
                })
                .await;
                out.record(t.elapsed(), r);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            out
        });
    }
    let mut s = Outcomes::default();
    while let Some(Ok(o)) = sessions.join_next().await {
        s.merge(o);
    }
    let mut j = Outcomes::default();
    while let Some(Ok(o)) = joins.join_next().await {
        j.merge(o);
    }
    (s, j)
}

struct Phase {
    name: &'static str,
    kinds: &'static [Kind],
    /// Flood from the real nodes' own address instead of 127.0.0.2 and up.
    shared_source: bool,
}

/// Runs one phase; returns the worst p99 (ms) of its Sessions and joins, and its failures.
async fn run_phase(
    plane: &Arc<Plane>,
    pid: u32,
    gateway: SocketAddr,
    index: usize,
    phase: &Phase,
) -> anyhow::Result<(f64, usize)> {
    println!("phase {index}: {}", phase.name);
    let before = sample(pid);
    let sources: Vec<Ipv4Addr> = if phase.shared_source {
        vec![Ipv4Addr::LOCALHOST]
    } else {
        loopback_sources(FLOOD.div_ceil(PER_SOURCE))
    };
    let tls = channel::client_config(ServerTrust::Bundle(vec![plane.ca.clone()]), None)?;
    let floods: Vec<(Kind, Flood)> = phase
        .kinds
        .iter()
        .map(|&kind| {
            let f = Flood::start(
                kind,
                FLOOD,
                PER_SOURCE,
                &sources,
                gateway,
                tls.clone(),
                REOPEN,
            );
            (kind, f)
        })
        .collect();
    // Let the floods open (or fail to): up to 20 s, until every connection was tried once.
    let t = Instant::now();
    for (_, f) in &floods {
        f.wait_opened(FLOOD, Duration::from_secs(20).saturating_sub(t.elapsed()))
            .await;
    }
    let held_at_start: Vec<String> = floods
        .iter()
        .map(|(k, f)| format!("{} {}", k.name(), f.held()))
        .collect();
    let during = sample(pid);
    // The real nodes run on a runtime of their own: their latency is the gateway's, not the load tool's queue.
    let (gw0, tool0, t0) = (
        cpu_ticks(pid),
        cpu_ticks(std::process::id()),
        Instant::now(),
    );
    let nodes = plane.clone();
    let (mut sessions, mut joins) = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        Ok::<_, anyhow::Error>(rt.block_on(real_nodes(&nodes, index)))
    })
    .await??;
    let secs = t0.elapsed().as_secs_f64();
    let (gw_cpu, tool_cpu) = (
        (cpu_ticks(pid) - gw0) as f64 / secs,
        (cpu_ticks(std::process::id()) - tool0) as f64 / secs,
    );
    let peak = sample(pid);
    let mut flood_lines = Vec::new();
    for (kind, f) in floods {
        flood_lines.push(format!(
            "{} held {} at the end, closed by the gateway {}, connects failed {}",
            kind.name(),
            f.held(),
            f.closed_by_gateway(),
            f.connect_failures()
        ));
        f.stop().await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = sample(pid);
    if !held_at_start.is_empty() {
        println!(
            "  flood of {FLOOD} per kind from {} source address(es), held when real nodes started: {}",
            sources.len(),
            held_at_start.join(", ")
        );
        for l in flood_lines {
            println!("  flood {l}");
        }
    }
    println!(
        "  gateway process: before {before}; flood held {during}; end of phase {peak}; 2 s after {after}"
    );
    println!(
        "  CPU while the real nodes worked: gateway process {gw_cpu:.0}% of a core, this load tool {tool_cpu:.0}%"
    );
    println!(
        "  {}",
        sessions.line("real-node Session connect (TCP+TLS+HTTP/2+Hello→Welcome)")
    );
    println!("  {}", joins.line("real-node join (TCP+TLS+Join)"));
    for (reason, n) in sessions.reasons.iter().chain(joins.reasons.iter()).take(6) {
        println!("    failure ×{n}: {reason}");
    }
    let p99 = percentile_ms(&sessions.latencies, 0.99).max(percentile_ms(&joins.latencies, 0.99));
    Ok((p99, sessions.failures + joins.failures))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    let bin =
        PathBuf::from(std::env::var("BC_BIN_DIR").unwrap_or_else(|_| "target/release".into()));
    let data = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let gateway: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let dev = Dev::start_limited(&bin, data.path(), &gateway.to_string(), 1024, None)?;
    let env = dev.env.clone();
    let token: serde_json::Value = reqwest::Client::new()
        .post(format!(
            "{}/api/compute/join-tokens/create",
            env["BC_API_URL"]
        ))
        .bearer_auth(&env["BC_API_KEY"])
        .json(&serde_json::json!({"pool": "default", "uses": 100_000, "ttl_seconds": 7200}))
        .send()
        .await?
        .json()
        .await?;
    let token = token["token"].as_str().context("token")?.to_string();
    let config = bcd::config::ConfigWire {
        gateway_url: Some(env["BC_GATEWAY_URL"].clone()),
        ca_pin: Some(env["BC_CA_PIN"].clone()),
        join_public_key: Some(env["BC_JOIN_KEY"].clone()),
        state_dir: Some(data.path().join("bcd")),
        gpu_backend: Some("none".into()),
        hardware_root: None,
        cdi_dir: None,
        tunnels: None,
    }
    .validate("bench")?;
    let mut nodes = Vec::new();
    for i in 0..SESSIONS {
        let (key, req) = join_request(&config, &token, &format!("flood-node-{i}"))?;
        let r = bcd::join::send(&config, req)
            .await
            .map_err(|s| anyhow::anyhow!("join: {s:?}"))?;
        nodes.push(Arc::new(Cred {
            node_id: r.node_id,
            cert: CertificateDer::from(r.cert_der),
            key_pem: key.serialize_pem(),
        }));
    }
    let ca_pem = std::fs::read_to_string(data.path().join("state/ca.crt"))?;
    let plane = Arc::new(Plane {
        url: env["BC_GATEWAY_URL"].clone(),
        config,
        token,
        ca: CertificateDer::from_pem_slice(ca_pem.as_bytes())?,
        nodes,
    });
    println!(
        "better-compute dev (all roles) started with descriptor limit soft 1024; running with {}; {} nodes joined",
        nofile_limit(dev.child.id()),
        plane.nodes.len()
    );
    let phases = [
        Phase {
            name: "no flood (baseline)",
            kinds: &[],
            shared_source: false,
        },
        Phase {
            name: "tcp flood: connections that never finish the TLS handshake",
            kinds: &[Kind::Tcp],
            shared_source: false,
        },
        Phase {
            name: "tls flood: TLS done, no HTTP/2 preface",
            kinds: &[Kind::Tls],
            shared_source: false,
        },
        Phase {
            name: "h2 flood: preface sent, no request (no Join, no Hello)",
            kinds: &[Kind::H2],
            shared_source: false,
        },
        Phase {
            name: "all three floods at once, from the real nodes' own address 127.0.0.1",
            kinds: &[Kind::Tcp, Kind::Tls, Kind::H2],
            shared_source: true,
        },
    ];
    let mut worst = 0.0f64;
    let mut failures = 0;
    let mut dev = dev;
    for (i, phase) in phases.iter().enumerate() {
        let (p99, failed) = run_phase(&plane, dev.child.id(), gateway, i + 1, phase).await?;
        if !phase.kinds.is_empty() {
            worst = worst.max(p99);
            failures += failed;
        }
    }
    // The last phase: a control plane that cannot raise its descriptor limit (hard 1,024), all floods at once.
    dev.stop()?;
    dev = Dev::start_limited(&bin, data.path(), &gateway.to_string(), 1024, Some(1024))?;
    println!(
        "control plane restarted with descriptor limit hard 1024: running with {}",
        nofile_limit(dev.child.id())
    );
    let limited = Phase {
        name: "all three floods at once (6,000), control plane restarted under a hard limit of 1,024 descriptors",
        kinds: &[Kind::Tcp, Kind::Tls, Kind::H2],
        shared_source: false,
    };
    let (p99, failed) =
        run_phase(&plane, dev.child.id(), gateway, phases.len() + 1, &limited).await?;
    worst = worst.max(p99);
    failures += failed;
    dev.stop()?;
    println!(
        "real-node failures under flood, all phases: {failures} (goal: 0); worst phase p99 {worst:.0} ms (goal: < 2000)"
    );
    println!("gateway-flood: {worst:.0} ms real-node connect p99");
    Ok(())
}

/// A process's descriptor limits as /proc shows them.
fn nofile_limit(pid: u32) -> String {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
    let Some(line) = limits.lines().find(|l| l.starts_with("Max open files")) else {
        return "unknown descriptor limits".into();
    };
    let f: Vec<&str> = line.split_whitespace().collect();
    format!(
        "soft {}, hard {}",
        f.get(3).unwrap_or(&"?"),
        f.get(4).unwrap_or(&"?")
    )
}
