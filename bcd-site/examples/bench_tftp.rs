//! TFTP benchmark: time for `curl --tftp-blksize 1468` to fetch a loader from our server and from dnsmasq's TFTP
//! (the peer), alternating fetches in the same invocation, inside a network namespace of its own (dnsmasq needs
//! port 69; the namespace's private loopback keeps it off the host's). Prints p10, median and p90 per server, the
//! ratio of the medians (dnsmasq time / our time: above 1 means we are faster) and of the p90s, the load average
//! at the start and the end, and each server's CPU time per transfer (utime + stime from /proc, which noise barely
//! moves), ending with `tftp: <ms> ms` (our median). 300 fetches per server by default: at 30 the median and p90
//! were a handful of samples and two runs on a quiet machine gave ratios of 0.55 and 1.08.
//!
//! Needs root, iproute2, curl and dnsmasq. The namespace is created and deleted here under a name carrying this
//! process's PID, on every exit path.
//!
//! usage: bench_tftp [--file PATH] [--fetches N] [--blksize N] [--samples CSV] [--trace LOG] [--ack-spin-us N]
//! (the file defaults to /usr/lib/ipxe/snponly.efi when the `ipxe` package is installed, else 1 MiB of noise;
//! `--samples` writes every fetch's time, `--trace` our server's debug log (per transfer: ACKs caught spinning or
//! asleep, contended spins), `--ack-spin-us` sets our server's `[tftp] ack_spin_us`)

use std::io::Read as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bcd_site::tftp::Limits;
use bcd_site::tftp::server::{TftpCounters, run};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::UdpSocket;
use tokio::process::Command;

const OUR_PORT: u16 = 6969;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if args.first().map(String::as_str) == Some("serve") {
        return rt.block_on(serve(&args[1..]));
    }
    rt.block_on(bench(&args))
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

async fn serve(args: &[String]) -> Result<()> {
    let root = PathBuf::from(flag(args, "--root").context("--root")?);
    let mut limits = Limits::default();
    if let Some(us) = flag(args, "--ack-spin-us") {
        limits.ack_spin = Duration::from_micros(us.parse()?);
    }
    // --trace FILE: the server's debug log (one line per transfer: time, ACKs caught spinning / asleep).
    let _trace = match flag(args, "--trace") {
        Some(path) => {
            let file = std::fs::File::create(path)?;
            let subscriber = tracing_subscriber::fmt()
                .with_writer(std::sync::Mutex::new(file))
                .with_ansi(false)
                .with_env_filter("bcd_site::tftp=debug")
                .finish();
            Some(tracing::subscriber::set_default(subscriber))
        }
        None => None,
    };
    let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, OUR_PORT)).await?;
    println!("ready");
    let stop = async {
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            std::io::stdin().read_to_end(&mut sink)
        })
        .await;
    };
    let counters = Arc::new(TftpCounters::default());
    run(socket, &root, limits, counters, stop).await?;
    Ok(())
}

/// Deletes the namespace when dropped.
struct Namespace(String);

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .stderr(Stdio::null())
            .status();
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

/// One curl fetch inside the namespace; returns curl's own `time_total` in milliseconds.
async fn fetch(ns: &str, url: &str, blksize: &str, out: &Path) -> Result<f64> {
    let o = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "curl",
            "-sS",
            "--max-time",
            "30",
            "--tftp-blksize",
            blksize,
        ])
        .args(["-w", "%{time_total}", "-o"])
        .arg(out)
        .arg(url)
        .kill_on_drop(true)
        .output()
        .await?;
    if !o.status.success() {
        bail!("curl {url}: {}", String::from_utf8_lossy(&o.stderr).trim());
    }
    let secs: f64 = String::from_utf8_lossy(&o.stdout).trim().parse()?;
    Ok(secs * 1000.0)
}

/// (p10, median, p90).
fn summary(mut ms: Vec<f64>) -> (f64, f64, f64) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    (at(0.1), at(0.5), at(0.9))
}

/// CPU time a process has used, in clock ticks (utime + stime, fields 14 and 15 of /proc/PID/stat).
fn cpu_ticks(pid: Option<u32>) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid?)).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Microseconds per transfer from a tick difference (USER_HZ is 100 on Linux).
fn cpu_us(before: Option<u64>, after: Option<u64>, transfers: usize) -> Option<f64> {
    Some((after? - before?) as f64 * 10_000.0 / transfers.max(1) as f64)
}

async fn bench(args: &[String]) -> Result<()> {
    let fetches: usize = flag(args, "--fetches").unwrap_or("300").parse()?;
    let blksize = flag(args, "--blksize").unwrap_or("1468").to_owned();
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("root");
    std::fs::create_dir(&root)?;
    let source = flag(args, "--file").map(PathBuf::from).or_else(|| {
        let p = PathBuf::from("/usr/lib/ipxe/snponly.efi");
        p.exists().then_some(p)
    });
    let name = match &source {
        Some(p) => {
            let name = p
                .file_name()
                .context("file name")?
                .to_string_lossy()
                .into_owned();
            std::fs::copy(p, root.join(&name))?;
            name
        }
        None => {
            let mut x: u32 = 0x9e37_79b9;
            let noise: Vec<u8> = (0..1 << 20)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            std::fs::write(root.join("noise.bin"), noise)?;
            "noise.bin".to_owned()
        }
    };
    let file = root.join(&name);
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
    }
    let size = std::fs::metadata(&file)?.len();
    let ns = format!("bcd-tbench-{}", std::process::id());
    let _guard = Namespace(ns.clone());
    let mut server_args = Vec::new();
    for f in ["--ack-spin-us", "--trace"] {
        if let Some(v) = flag(args, f) {
            server_args.extend([f.to_owned(), v.to_owned()]);
        }
    }
    let run = Run {
        ns: &ns,
        root: &root,
        name: &name,
        size,
        fetches,
        blksize: &blksize,
        tmp: dir.path(),
        server_args,
        samples: flag(args, "--samples").map(PathBuf::from),
    };
    tokio::select! {
        r = measure(run) => r,
        // SIGTERM too (`kill`, a timeout): the namespace guard and the servers' kill-on-drop run either way.
        _ = bc_proto::runtime::shutdown_signal() => bail!("interrupted (SIGINT or SIGTERM)"),
    }
}

/// One benchmark invocation's settings.
struct Run<'a> {
    ns: &'a str,
    root: &'a Path,
    name: &'a str,
    size: u64,
    fetches: usize,
    blksize: &'a str,
    tmp: &'a Path,
    /// Passed to our server (`--ack-spin-us`, `--trace`).
    server_args: Vec<String>,
    /// Where to write every fetch's time (CSV: index, dnsmasq ms, bcd-site ms).
    samples: Option<PathBuf>,
}

/// The 1-minute load average, from /proc/loadavg.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

async fn measure(run: Run<'_>) -> Result<()> {
    let Run {
        ns,
        root,
        name,
        size,
        fetches,
        blksize,
        tmp,
        ..
    } = run;
    ip(&["netns", "add", ns]).await?;
    ip(&["-n", ns, "link", "set", "lo", "up"]).await?;
    let got = tmp.join("got");
    let want = std::fs::read(root.join(name))?;
    println!(
        "# {name} ({size} bytes), curl --tftp-blksize {blksize}, {fetches} fetches per server, alternating; \
         load average {} at the start",
        load_average()
    );

    let mut dnsmasq = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "dnsmasq",
            "--keep-in-foreground",
            "--port=0",
            "--enable-tftp",
        ])
        .arg(format!("--tftp-root={}", root.display()))
        .args(["--listen-address=127.0.0.1", "--bind-interfaces"])
        .arg(format!("--pid-file={}", tmp.join("dnsmasq.pid").display()))
        .arg(format!(
            "--log-facility={}",
            tmp.join("dnsmasq.log").display()
        ))
        .kill_on_drop(true)
        .spawn()
        .context("starting dnsmasq")?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut ours_child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(std::env::current_exe()?)
        .args(["serve", "--root"])
        .arg(root)
        .args(&run.server_args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting our TFTP server")?;
    let mut lines = BufReader::new(ours_child.stdout.take().context("stdout")?).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await??;
    if first.as_deref() != Some("ready") {
        bail!("our TFTP server did not start: {first:?}");
    }
    let their_url = format!("tftp://127.0.0.1/{name}");
    let our_url = format!("tftp://127.0.0.1:{OUR_PORT}/{name}");
    for (who, url) in [("dnsmasq", &their_url), ("bcd-site", &our_url)] {
        fetch(ns, url, blksize, &got).await?;
        if std::fs::read(&got)? != want {
            bail!("{who} served different bytes");
        }
    }
    // Alternate fetches so that load from elsewhere on the machine hits both servers alike.
    let mut theirs = Vec::new();
    let mut ours = Vec::new();
    let (their_pid, our_pid) = (dnsmasq.id(), ours_child.id());
    let (their_cpu0, our_cpu0) = (cpu_ticks(their_pid), cpu_ticks(our_pid));
    for _ in 0..fetches {
        theirs.push(fetch(ns, &their_url, blksize, Path::new("/dev/null")).await?);
        ours.push(fetch(ns, &our_url, blksize, Path::new("/dev/null")).await?);
    }
    let load_end = load_average();
    if let Some(path) = &run.samples {
        let mut csv = String::from("fetch,dnsmasq_ms,bcd_site_ms\n");
        for (i, (t, o)) in theirs.iter().zip(&ours).enumerate() {
            csv.push_str(&format!("{i},{t:.3},{o:.3}\n"));
        }
        std::fs::write(path, csv)?;
    }
    let their_cpu = cpu_us(their_cpu0, cpu_ticks(their_pid), fetches);
    let our_cpu = cpu_us(our_cpu0, cpu_ticks(our_pid), fetches);
    let _ = dnsmasq.kill().await;
    drop(ours_child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(5), ours_child.wait()).await;

    let (d10, d50, d90) = summary(theirs);
    let (o10, o50, o90) = summary(ours);
    let cpu = |c: Option<f64>| c.map_or("cpu n/a".to_owned(), |c| format!("cpu {c:.0} µs"));
    println!(
        "dnsmasq:  p10 {d10:.2} ms, median {d50:.2} ms, p90 {d90:.2} ms, {} per transfer",
        cpu(their_cpu)
    );
    println!(
        "bcd-site: p10 {o10:.2} ms, median {o50:.2} ms, p90 {o90:.2} ms, {} per transfer",
        cpu(our_cpu)
    );
    if let (Some(t), Some(o)) = (their_cpu, our_cpu) {
        println!(
            "cpu ratio {:.2} (their CPU per transfer / ours)",
            t / o.max(1.0)
        );
    }
    println!(
        "p10 ratio {:.2}, p90 ratio {:.2} (theirs / ours)",
        d10 / o10.max(0.001),
        d90 / o90.max(0.001)
    );
    println!("load average {load_end} at the end");
    println!(
        "ratio {:.2} vs dnsmasq (their median time / ours)",
        d50 / o50.max(0.001)
    );
    println!("# {name}: {size} bytes at blksize {blksize}");
    println!("tftp: {o50:.1} ms");
    Ok(())
}
