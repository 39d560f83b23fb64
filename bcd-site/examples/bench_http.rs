//! Boot HTTP benchmark: `wrk -c100 -t2 -d20s --timeout 30s` fetching one 50 MiB file from nginx (the peer,
//! `../shared/peers/nginx-peer.conf`) and from our server, both on 127.0.0.1, in the same invocation. Prints MB/s
//! for each (wrk's units: 1 MB = 2^20 bytes), `ratio <r> vs nginx` (ours / nginx, above 1 means faster) and a last
//! line `boot-http: <MB/s> MB/s`.
//!
//! Needs nginx (nginx-light) and wrk. Our server runs in this process on a 2-worker runtime; nginx runs with the
//! peer configuration, its listen port rewritten to a free one, from a temporary prefix deleted on exit.
//!
//! usage: bench_http [--size-mib 50] [--duration 20] [--connections 100] [--threads 2] [--rounds 1]
//!                   [--nginx-conf ../shared/peers/nginx-peer.conf]

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bcd_site::http::{BootCatalog, BootHttp, HttpConfig, run};

fn flag(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let size_mib: u64 = flag(&args, "--size-mib", "50").parse()?;
    let duration: u64 = flag(&args, "--duration", "20").parse()?;
    let conns: u32 = flag(&args, "--connections", "100").parse()?;
    let threads: u32 = flag(&args, "--threads", "2").parse()?;
    let rounds: u32 = flag(&args, "--rounds", "1").parse()?;
    let conf_src = flag(
        &args,
        "--nginx-conf",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/peers/nginx-peer.conf"
        ),
    );
    for tool in ["nginx", "wrk"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()?
            .code()
            != Some(0)
        {
            bail!("{tool} is required (apt-get install -y nginx-light wrk)");
        }
    }

    let prefix = tempfile::tempdir()?;
    let www = prefix.path().join("www");
    for dir in ["www", "logs", "tmp"] {
        fs::create_dir_all(prefix.path().join(dir))?;
    }
    // nginx workers run as nobody: the tree must be world readable.
    fs::set_permissions(prefix.path(), fs::Permissions::from_mode(0o755))?;
    fs::set_permissions(&www, fs::Permissions::from_mode(0o755))?;
    let file = www.join("initrd.img");
    {
        let mut f = fs::File::create(&file)?;
        let mut block = vec![0u8; 1 << 20];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..size_mib {
            for b in block.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            f.write_all(&block)?;
        }
    }
    fs::set_permissions(&file, fs::Permissions::from_mode(0o644))?;
    // Warm the page cache for both servers alike.
    let _ = fs::read(&file)?;

    let nginx_port = bc_testkit::free_port()?;
    let conf = fs::read_to_string(&conf_src).with_context(|| format!("reading {conf_src}"))?;
    if !conf.contains("127.0.0.1:8080") {
        bail!("{conf_src}: expected `listen 127.0.0.1:8080`");
    }
    let conf_path = prefix.path().join("nginx.conf");
    fs::write(
        &conf_path,
        conf.replace("127.0.0.1:8080", &format!("127.0.0.1:{nginx_port}")),
    )?;
    let mut nginx = Command::new("nginx")
        .arg("-p")
        .arg(prefix.path())
        .arg("-c")
        .arg(&conf_path)
        .stdout(Stdio::null())
        .spawn()
        .context("starting nginx")?;
    let nginx_result = bench_both(&www, nginx_port, size_mib, duration, conns, threads, rounds);
    // SIGTERM through nginx itself so the master takes its workers down (a SIGKILL would orphan them).
    let stopped = Command::new("nginx")
        .arg("-p")
        .arg(prefix.path())
        .arg("-c")
        .arg(&conf_path)
        .args(["-s", "stop"])
        .stderr(Stdio::null())
        .status();
    if !stopped.is_ok_and(|s| s.success()) {
        let _ = nginx.kill();
    }
    let _ = nginx.wait();
    nginx_result
}

fn bench_both(
    www: &Path,
    nginx_port: u16,
    size_mib: u64,
    duration: u64,
    conns: u32,
    threads: u32,
    rounds: u32,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let http = BootHttp::new(HttpConfig::new(www, www))?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let our_port = listener.local_addr()?.port();
    let (_catalog_tx, catalog) = tokio::sync::watch::channel(BootCatalog::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(run(listener, http, catalog, async {
        let _ = stop_rx.await;
    }));
    std::thread::sleep(Duration::from_millis(300));
    println!(
        "file {size_mib} MiB, wrk -c{conns} -t{threads} -d{duration}s --timeout 30s, {rounds} round(s)"
    );
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let n = wrk(
            &format!("http://127.0.0.1:{nginx_port}/initrd.img"),
            duration,
            conns,
            threads,
        )?;
        println!("round {round}: nginx {n:.0} MB/s");
        theirs.push(n);
        let o = wrk(
            &format!("http://127.0.0.1:{our_port}/artifacts/initrd.img"),
            duration,
            conns,
            threads,
        )?;
        println!("round {round}: bcd-site {o:.0} MB/s");
        ours.push(o);
    }
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
    let (o, n) = (median(&mut ours), median(&mut theirs));
    println!("nginx: {n:.0} MB/s");
    println!("bcd-site: {o:.0} MB/s");
    println!("ratio {:.3} vs nginx", o / n);
    println!("boot-http: {o:.0} MB/s");
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Runs wrk and returns its `Transfer/sec` in MB/s (2^20 bytes); non-2xx answers or socket errors fail the run.
fn wrk(url: &str, duration: u64, conns: u32, threads: u32) -> Result<f64> {
    let out = Command::new("wrk")
        .args([
            format!("-c{conns}"),
            format!("-t{threads}"),
            format!("-d{duration}s"),
            "--timeout".into(),
            "30s".into(),
            url.into(),
        ])
        .output()
        .context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    if text.contains("Non-2xx") || text.contains("Socket errors") {
        bail!("wrk saw errors against {url}:\n{text}");
    }
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("Transfer/sec:"))
        .context("no Transfer/sec in wrk output")?;
    let value = line
        .split_whitespace()
        .nth(1)
        .context("Transfer/sec value")?;
    let (num, unit) = value.split_at(
        value
            .find(|c: char| c.is_ascii_alphabetic())
            .unwrap_or(value.len()),
    );
    let num: f64 = num.parse().with_context(|| format!("parsing {value}"))?;
    let mb = match unit {
        "B" => num / 1048576.0,
        "KB" => num / 1024.0,
        "MB" => num,
        "GB" => num * 1024.0,
        "TB" => num * 1048576.0,
        _ => bail!("unknown unit in {value}"),
    };
    Ok(mb)
}
