//! Image-stream benchmark: our pipeline (HTTP + zstd + sha256 + O_DIRECT writes + fsync, then read-back) against
//! `curl -s URL | zstd -dc | dd of=DEV bs=4M oflag=direct iflag=fullblock` on the same image, server and loop device
//! in the same run. Run through `scripts/bench-ramdisk-stream` (needs root, losetup, python3, curl, zstd).
//!
//! `bench_stream [--size-mib N] [--rounds N] [--over decompressed|compressed]` orchestrates;
//! `bench_stream once --url U --device D --sha256 HEX --over O --image-size N` is one run of ours in its own process
//! (so its peak RSS is measured alone) and prints one `ours ...` line.

use std::io::{BufWriter, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bcd_ramdisk::os::DirectDevice;
use bcd_ramdisk::stream::http::{FetchPolicy, client, stream_url};
use bcd_ramdisk::stream::{DigestAlgo, DigestOver, ExpectedDigest, StreamSpec};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("once") {
        return once(&args[1..]);
    }
    orchestrate(&args)
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

// === one run of ours ===

fn once(args: &[String]) -> Result<()> {
    let url = flag(args, "--url").context("--url")?.parse()?;
    let device = PathBuf::from(flag(args, "--device").context("--device")?);
    let digest = flag(args, "--sha256").context("--sha256")?;
    let over = match flag(args, "--over").unwrap_or("decompressed") {
        "compressed" => DigestOver::Compressed,
        _ => DigestOver::Decompressed,
    };
    let image_size: u64 = flag(args, "--image-size")
        .context("--image-size")?
        .parse()?;
    rustls::crypto::ring::default_provider()
        .install_default()
        .ok();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut spec = StreamSpec::new(ExpectedDigest::from_hex(DigestAlgo::Sha256, over, digest)?);
    spec.image_size = Some(image_size);
    let dev = DirectDevice::open(&device)?;
    let policy = FetchPolicy::default();
    let http = client(rustls::RootCertStore::empty(), &policy)?;
    let start = Instant::now();
    let (_, report) = rt
        .block_on(stream_url(&http, url, dev, spec, &policy, Box::new(|_| {})))
        .map_err(|f| anyhow::anyhow!("{f}: {:?}", f.error))?;
    let total = start.elapsed();
    let hwm_kib = std::fs::read_to_string("/proc/self/status")?
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    println!(
        "ours image_bytes={} stream_s={:.3} fsync_s={:.3} read_back_s={:.3} total_s={:.3} resumes={} vmhwm_kib={hwm_kib}",
        report.stream.image_bytes,
        report.stream.stream_elapsed.as_secs_f64(),
        report.stream.sync_elapsed.as_secs_f64(),
        report.stream.read_back_elapsed.as_secs_f64(),
        total.as_secs_f64(),
        report.resumes
    );
    Ok(())
}

// === orchestration ===

struct Guard {
    server: Option<Child>,
    loop_dev: Option<String>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dev) = self.loop_dev.take() {
            let _ = Command::new("losetup").args(["-d", &dev]).status();
        }
    }
}

fn orchestrate(args: &[String]) -> Result<()> {
    let size_mib: u64 = flag(args, "--size-mib").unwrap_or("1024").parse()?;
    let rounds: usize = flag(args, "--rounds").unwrap_or("3").parse()?;
    let over = flag(args, "--over").unwrap_or("decompressed").to_string();
    let size = size_mib << 20;
    let dir = tempfile::tempdir()?;
    let raw_path = dir.path().join("image.raw");
    let zst_path = dir.path().join("image.raw.zst");
    let t = Instant::now();
    let (raw_sha, zst_sha) = build_image(&raw_path, &zst_path, size)?;
    std::fs::remove_file(&raw_path)?;
    let zst_len = std::fs::metadata(&zst_path)?.len();
    println!(
        "image: {size} bytes (half zeros, half random), {zst_len} bytes with zstd -3, built in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let digest = if over == "compressed" {
        zst_sha
    } else {
        raw_sha
    };

    let mut guard = Guard {
        server: None,
        loop_dev: None,
    };
    let port = bc_testkit::free_port()?;
    guard.server = Some(
        Command::new("python3")
            .args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--directory",
            ])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting python3 -m http.server")?,
    );
    wait_for_port(port)?;
    let url = format!("http://127.0.0.1:{port}/image.raw.zst");

    let backing = dir.path().join("disk.img");
    std::fs::File::create(&backing)?.set_len(size + (64 << 20))?;
    let out = Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&backing)
        .output()?;
    if !out.status.success() {
        bail!("losetup: {}", String::from_utf8_lossy(&out.stderr));
    }
    let dev = String::from_utf8(out.stdout)?.trim().to_string();
    guard.loop_dev = Some(dev.clone());
    println!(
        "server: python3 -m http.server on 127.0.0.1:{port}; device: {dev} (loop over a file in {})",
        dir.path().display()
    );

    let me = std::env::current_exe()?;
    let mb = size as f64 / 1e6;
    let peer_cmd = |extra: &str| {
        format!(
            "set -o pipefail; curl -sf {url} | zstd -dc | dd of={dev} bs=4M oflag=direct iflag=fullblock{extra} status=none"
        )
    };
    let run_peer = |extra: &str| -> Result<f64> {
        let t = Instant::now();
        let status = Command::new("bash")
            .arg("-c")
            .arg(peer_cmd(extra))
            .status()?;
        if !status.success() {
            bail!("peer pipeline failed: {status}");
        }
        Ok(t.elapsed().as_secs_f64())
    };
    println!("peer: {}", peer_cmd(""));
    let (mut peer_rates, mut peer_sync_rates, mut ours_rates, mut ours_rb_rates, mut hwm) =
        (vec![], vec![], vec![], vec![], 0u64);
    for round in 1..=rounds {
        let peer_s = run_peer("")?;
        let out = Command::new(&me)
            .args([
                "once", "--url", &url, "--device", &dev, "--sha256", &digest, "--over", &over,
            ])
            .args(["--image-size", &size.to_string()])
            .output()?;
        if !out.status.success() {
            bail!("our run failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let peer_sync_s = run_peer(" conv=fsync")?;
        let line = String::from_utf8(out.stdout)?;
        let field = |k: &str| -> Result<f64> {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
                .context(format!("missing {k} in {line:?}"))?
                .parse::<f64>()
                .map_err(Into::into)
        };
        let (stream_s, fsync_s, total_s) =
            (field("stream_s")?, field("fsync_s")?, field("total_s")?);
        hwm = hwm.max(field("vmhwm_kib")? as u64);
        peer_rates.push(mb / peer_s);
        peer_sync_rates.push(mb / peer_sync_s);
        ours_rates.push(mb / stream_s);
        ours_rb_rates.push(mb / total_s);
        println!(
            "round {round}: peer {:.0} MB/s ({peer_s:.2}s), peer+conv=fsync {:.0} MB/s ({peer_sync_s:.2}s); ours {:.0} MB/s \
             ({stream_s:.2}s download+decompress+sha256+write+fsync, of which fsync {fsync_s:.2}s), {:.0} MB/s with \
             read-back ({total_s:.2}s)",
            mb / peer_s,
            mb / peer_sync_s,
            mb / stream_s,
            mb / total_s
        );
    }
    let peer = median(&mut peer_rates);
    let peer_sync = median(&mut peer_sync_rates);
    let ours = median(&mut ours_rates);
    let ours_rb = median(&mut ours_rb_rates);
    println!("digest over the {over} bytes; medians of {rounds} rounds; MB = 10^6 bytes of image");
    println!("peer curl|zstd|dd: {peer:.0} MB/s; with conv=fsync: {peer_sync:.0} MB/s");
    println!(
        "ours incl. read-back verification: {ours_rb:.0} MB/s (ratio {:.2} vs peer)",
        ours_rb / peer
    );
    println!("ratio {:.2} vs curl|zstd|dd conv=fsync", ours / peer_sync);
    println!("ours peak RSS: {:.1} MiB", hwm as f64 / 1024.0);
    println!("image-stream: {ours:.0} MB/s");
    println!("ratio {:.2} vs curl|zstd|dd", ours / peer);
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Write `size` bytes (first half zeros, second half xorshift noise) and its zstd -3 compression; return the
/// sha256 hex of both.
fn build_image(raw: &Path, zst: &Path, size: u64) -> Result<(String, String)> {
    use bcd_ramdisk::stream::Hasher;
    let mut raw_out = BufWriter::new(std::fs::File::create(raw)?);
    let mut hasher = Hasher::new(DigestAlgo::Sha256);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut chunk = vec![0u8; 1 << 20];
    for i in 0..size.div_ceil(chunk.len() as u64) {
        let n = (size - i * chunk.len() as u64).min(chunk.len() as u64) as usize;
        if i * (chunk.len() as u64) < size / 2 {
            chunk.fill(0);
        } else {
            for w in chunk.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes());
            }
        }
        hasher.update(&chunk[..n]);
        raw_out.write_all(&chunk[..n])?;
    }
    raw_out.flush()?;
    drop(raw_out);
    let status = Command::new("zstd")
        .args(["-3", "-q", "-f", "-T0", "-o"])
        .arg(zst)
        .arg(raw)
        .status()?;
    if !status.success() {
        bail!("zstd failed");
    }
    let mut zst_hasher = Hasher::new(DigestAlgo::Sha256);
    let mut f = std::fs::File::open(zst)?;
    loop {
        let n = f.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        zst_hasher.update(&chunk[..n]);
    }
    Ok((
        hex::encode(hasher.finalize()),
        hex::encode(zst_hasher.finalize()),
    ))
}

fn wait_for_port(port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("http.server did not start on port {port}")
}
