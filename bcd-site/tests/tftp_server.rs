//! The TFTP server on loopback, fetched from by real clients (tftp-hpa and curl) and by a small client built
//! on our own codec for what those clients cannot exercise (windowsize, block-number rollover, retransmission,
//! the concurrency bound, write requests).
//!
//! Tests needing `tftp` or `curl` print why and return early when the binary is missing (apt-get install -y
//! tftp-hpa curl); a skip is not a pass.

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bcd_site::tftp::Limits;
use bcd_site::tftp::codec::{ErrorCode, Mode, Packet, Request, RequestOptions};
use bcd_site::tftp::server::{TftpCounters, run};
use tokio::net::UdpSocket;
use tokio::process::Command;
use tokio::sync::oneshot;
use tokio::time::timeout;

struct Fixture {
    _dir: tempfile::TempDir,
    _outside: tempfile::TempDir,
    root: std::path::PathBuf,
    addr: SocketAddr,
    counters: Arc<TftpCounters>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), bcd_site::tftp::root::RootError>>,
}

/// Deterministic, incompressible-looking content.
fn content(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn write_public(path: &Path, data: &[u8]) -> Result<()> {
    fs::write(path, data)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o644))?;
    Ok(())
}

async fn start(limits: Limits) -> Result<Fixture> {
    let dir = tempfile::tempdir()?;
    let outside = tempfile::tempdir()?;
    let root = dir.path().join("root");
    fs::create_dir_all(root.join("efi"))?;
    write_public(&root.join("small.bin"), &content(1000, 1))?;
    write_public(&root.join("exact.bin"), &content(512 * 4, 2))?;
    write_public(&root.join("efi/snponly.efi"), &content(1 << 20, 3))?;
    write_public(&root.join("empty.bin"), b"")?;
    // Exactly the server's 256 KiB read-ahead, and a multiple of 512 and of 8.
    write_public(&root.join("chunk.bin"), &content(256 * 1024, 5))?;
    write_public(&root.join("rollover.bin"), &content(70_000 * 8 + 3, 4))?;
    write_public(&outside.path().join("secret"), b"secret")?;
    fs::write(root.join("private.bin"), b"private")?;
    fs::set_permissions(root.join("private.bin"), fs::Permissions::from_mode(0o600))?;
    symlink(outside.path().join("secret"), root.join("escape"))?;

    let socket = UdpSocket::bind("127.0.0.1:0").await?;
    let addr = socket.local_addr()?;
    let counters = Arc::new(TftpCounters::default());
    let (stop, stopped) = oneshot::channel::<()>();
    let server_root = root.clone();
    let server_counters = counters.clone();
    let server = tokio::spawn(async move {
        run(socket, &server_root, limits, server_counters, async {
            let _ = stopped.await;
        })
        .await
    });
    Ok(Fixture {
        _dir: dir,
        _outside: outside,
        root,
        addr,
        counters,
        stop: Some(stop),
        server,
    })
}

impl Fixture {
    async fn stop(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        timeout(Duration::from_secs(5), self.server).await???;
        Ok(())
    }
}

async fn wait_counter(counter: &std::sync::atomic::AtomicU64, want: u64) -> Result<()> {
    for _ in 0..200 {
        if counter.load(Ordering::Relaxed) == want {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!(
        "counter is {}, expected {want}",
        counter.load(Ordering::Relaxed)
    )
}

fn have(tool: &str) -> bool {
    let found = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        bc_testkit::skip!("`{tool}` is not installed (apt-get install -y tftp-hpa curl)");
    }
    found
}

async fn tftp_hpa_get(f: &Fixture, remote: &str, local: &Path) -> Result<std::process::Output> {
    Ok(timeout(
        Duration::from_secs(30),
        Command::new("tftp")
            .args([
                "-m",
                "binary",
                "127.0.0.1",
                &f.addr.port().to_string(),
                "-c",
                "get",
                remote,
            ])
            .arg(local)
            .output(),
    )
    .await??)
}

async fn curl(
    f: &Fixture,
    path: &str,
    extra: &[&str],
    local: &Path,
) -> Result<std::process::Output> {
    Ok(timeout(
        Duration::from_secs(30),
        Command::new("curl")
            .args(["-sS", "--path-as-is", "--max-time", "20"])
            .args(extra)
            .arg("-o")
            .arg(local)
            .arg(format!("tftp://127.0.0.1:{}/{path}", f.addr.port()))
            .output(),
    )
    .await??)
}

#[tokio::test]
async fn tftp_hpa_fetches_byte_exact_without_options() -> Result<()> {
    if !have("tftp") {
        return Ok(());
    }
    let f = start(Limits::default()).await?;
    let out = tempfile::tempdir()?;
    for name in [
        "small.bin",
        "exact.bin",
        "efi/snponly.efi",
        "empty.bin",
        "chunk.bin",
    ] {
        let local = out.path().join("got");
        let o = tftp_hpa_get(&f, name, &local).await?;
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!stderr.contains("Error"), "{name}: tftp said {stderr}");
        assert_eq!(
            fs::read(&local)?,
            fs::read(f.root.join(name))?,
            "{name} differs"
        );
    }
    // The client exits on the last DATA; the server counts the transfer when the final ACK arrives.
    wait_counter(&f.counters.completed, 5).await?;
    f.stop().await
}

#[tokio::test]
async fn curl_fetches_byte_exact_with_and_without_options() -> Result<()> {
    if !have("curl") {
        return Ok(());
    }
    let f = start(Limits::default()).await?;
    let out = tempfile::tempdir()?;
    let local = out.path().join("got");
    for (name, extra) in [
        ("efi/snponly.efi", &["--tftp-blksize", "1468"][..]),
        ("exact.bin", &["--tftp-blksize", "512"][..]),
        ("small.bin", &["--tftp-blksize", "8"][..]),
        ("efi/snponly.efi", &["--tftp-no-options"][..]),
        ("small.bin", &[][..]),
        ("chunk.bin", &["--tftp-blksize", "1468"][..]),
        // No empty file here: curl 7.88 fails on one with "(71) getpeername() failed" against dnsmasq's TFTP
        // too (tftp-hpa and our own client cover it).
    ] {
        let o = curl(&f, name, extra, &local).await?;
        assert!(
            o.status.success(),
            "{name} {extra:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(
            fs::read(&local)?,
            fs::read(f.root.join(name))?,
            "{name} {extra:?} differs"
        );
    }
    f.stop().await
}

#[tokio::test]
async fn real_clients_get_refusals_as_tftp_errors() -> Result<()> {
    if !have("curl") || !have("tftp") {
        return Ok(());
    }
    let f = start(Limits::default()).await?;
    let out = tempfile::tempdir()?;
    let local = out.path().join("got");
    // curl exit codes: 68 file not found, 69 permission problem on the TFTP server.
    for (path, code) in [
        ("missing.bin", 68),
        ("../root/small.bin", 69),
        ("escape", 69),
        ("private.bin", 69),
        ("efi", 69),
    ] {
        let o = curl(&f, path, &[], &local).await?;
        assert_eq!(
            o.status.code(),
            Some(code),
            "{path}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    for (path, expect) in [
        ("/etc/passwd", "Error code 2"),
        ("../etc/passwd", "Error code 2"),
        ("escape", "Error code 2"),
        ("private.bin", "Error code 2"),
        ("nope", "Error code 1"),
    ] {
        let o = tftp_hpa_get(&f, path, &local).await?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(text.contains(expect), "{path}: tftp said {text:?}");
    }
    f.stop().await
}

// === a client on our own codec ===

struct Fetched {
    data: Vec<u8>,
    oack: Vec<(String, String)>,
}

/// Fetches `name`; with `skip_acks` > 0 it stays silent for that many ACK opportunities to force retransmits.
async fn fetch(
    server: SocketAddr,
    name: &str,
    options: RequestOptions,
    mut skip_acks: u32,
) -> Result<Fetched> {
    let sock = UdpSocket::bind("127.0.0.1:0").await?;
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: name.into(),
        mode: Mode::Octet,
        options,
    })
    .encode(&mut out);
    sock.send_to(&out, server).await?;
    let mut buf = vec![0u8; 70_000];
    let (mut blksize, mut window) = (512usize, 1usize);
    let mut oack = Vec::new();
    let mut data = Vec::new();
    let mut expect: u16 = 1;
    let mut in_window = 0;
    loop {
        let (n, from) = timeout(Duration::from_secs(10), sock.recv_from(&mut buf)).await??;
        let ack = |block: u16, out: &mut Vec<u8>| Packet::Ack { block }.encode(out);
        match Packet::decode(&buf[..n])? {
            Packet::Oack(opts) => {
                for (k, v) in &opts {
                    match k.as_str() {
                        "blksize" => blksize = v.parse()?,
                        "windowsize" => window = v.parse()?,
                        _ => {}
                    }
                }
                oack = opts;
                if skip_acks > 0 {
                    skip_acks -= 1;
                    continue;
                }
                ack(0, &mut out);
                sock.send_to(&out, from).await?;
            }
            Packet::Data { block, data: chunk } => {
                if block != expect {
                    // Out of order or a retransmission: re-acknowledge what we have (RFC 7440).
                    ack(expect.wrapping_sub(1), &mut out);
                    sock.send_to(&out, from).await?;
                    in_window = 0;
                    continue;
                }
                data.extend_from_slice(chunk);
                expect = expect.wrapping_add(1);
                in_window += 1;
                let last = chunk.len() < blksize;
                if in_window == window || last {
                    in_window = 0;
                    if skip_acks > 0 && !last {
                        skip_acks -= 1;
                        // Pretend the window was lost: forget it and wait for the retransmission.
                        expect = expect.wrapping_sub(window as u16);
                        data.truncate(data.len() - window * blksize);
                        continue;
                    }
                    ack(block, &mut out);
                    sock.send_to(&out, from).await?;
                }
                if last {
                    return Ok(Fetched { data, oack });
                }
            }
            Packet::Error { code, message } => bail!("server error {code:?}: {message}"),
            other => bail!("unexpected {other:?}"),
        }
    }
}

fn opts(blksize: Option<u64>, windowsize: Option<u64>, timeout: Option<u64>) -> RequestOptions {
    RequestOptions {
        blksize,
        timeout,
        tsize: Some(0),
        windowsize,
    }
}

#[tokio::test]
async fn windowsize_and_block_number_rollover() -> Result<()> {
    rollover_with(Limits::default()).await
}

/// The same transfers with the loader cache off: the chunked read-ahead path (files above the cache limit).
#[tokio::test]
async fn windowsize_and_rollover_without_the_cache() -> Result<()> {
    rollover_with(Limits {
        cache_max_file: 0,
        ..Limits::default()
    })
    .await
}

/// A loader replaced between two fetches is served fresh, not from the cache.
#[tokio::test]
async fn a_replaced_loader_is_not_served_from_the_cache() -> Result<()> {
    let f = start(Limits::default()).await?;
    let first = fetch(f.addr, "small.bin", opts(Some(1468), None, None), 0).await?;
    assert_eq!(first.data, fs::read(f.root.join("small.bin"))?);
    let fresh = content(3000, 9);
    let tmp = f.root.join("small.bin.new");
    write_public(&tmp, &fresh)?;
    fs::rename(&tmp, f.root.join("small.bin"))?;
    let second = fetch(f.addr, "small.bin", opts(Some(1468), None, None), 0).await?;
    assert_eq!(second.data, fresh);
    f.stop().await
}

async fn rollover_with(limits: Limits) -> Result<()> {
    let f = start(limits).await?;
    let want = fs::read(f.root.join("efi/snponly.efi"))?;
    let got = fetch(
        f.addr,
        "efi/snponly.efi",
        opts(Some(1468), Some(16), None),
        0,
    )
    .await?;
    assert_eq!(got.data, want);
    assert!(got.oack.contains(&("windowsize".into(), "16".into())));
    let empty = fetch(f.addr, "empty.bin", opts(Some(1468), Some(4), None), 0).await?;
    assert!(empty.data.is_empty());
    assert!(empty.oack.contains(&("tsize".into(), "0".into())));
    assert!(got.oack.contains(&("tsize".into(), want.len().to_string())));

    // 70,001 blocks of 8 bytes: block numbers wrap past 65535 to 0.
    let want = fs::read(f.root.join("rollover.bin"))?;
    let got = fetch(f.addr, "rollover.bin", opts(Some(8), Some(64), None), 0).await?;
    assert_eq!(got.data.len(), want.len());
    assert_eq!(got.data, want);
    f.stop().await
}

#[tokio::test]
async fn lost_acks_are_retransmitted_and_silence_is_capped() -> Result<()> {
    let f = start(Limits {
        timeout: Duration::from_millis(200),
        max_retries: 2,
        ..Limits::default()
    })
    .await?;
    let want = fs::read(f.root.join("small.bin"))?;
    // Skip the OACK's ACK once and a data window's ACK once: the server resends both.
    let got = fetch(f.addr, "small.bin", opts(Some(100), Some(2), None), 2).await?;
    assert_eq!(got.data, want);

    // A client that never answers: the transfer gives up after the retry cap and frees its slot.
    let sock = UdpSocket::bind("127.0.0.1:0").await?;
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: "small.bin".into(),
        mode: Mode::Octet,
        options: RequestOptions::default(),
    })
    .encode(&mut out);
    sock.send_to(&out, f.addr).await?;
    let mut buf = [0u8; 1024];
    let mut copies = 0;
    while let Ok(r) = timeout(Duration::from_millis(600), sock.recv_from(&mut buf)).await {
        r?;
        copies += 1;
    }
    assert_eq!(copies, 3, "first send plus max_retries retransmissions");
    wait_counter(&f.counters.failed, 1).await?;
    f.stop().await
}

fn rrq(name: &str, options: RequestOptions) -> Vec<u8> {
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: name.into(),
        mode: Mode::Octet,
        options,
    })
    .encode(&mut out);
    out
}

/// Sends a plain read request for `name` from a new socket on `from` and waits (2 s) for the first answer: the
/// socket, the answer's length in `buf` and where it came from.
async fn ask(
    from: &str,
    to: SocketAddr,
    name: &str,
    buf: &mut [u8],
) -> Result<(UdpSocket, usize, SocketAddr)> {
    let sock = UdpSocket::bind((from, 0)).await?;
    sock.send_to(&rrq(name, RequestOptions::default()), to)
        .await?;
    let (n, peer) = timeout(Duration::from_secs(2), sock.recv_from(buf)).await??;
    Ok((sock, n, peer))
}

/// A client that acknowledges every block well inside the timeout, but slowly, is cut off at
/// `max_transfer_time` with error 0 and frees its slot; its `timeout` option of 255 s (above
/// `max_client_timeout`) is declined. Before both limits one such client held a slot for as long as it liked.
#[tokio::test]
async fn a_slow_steady_client_is_cut_off_at_the_transfer_deadline() -> Result<()> {
    let f = start(Limits {
        timeout: Duration::from_millis(800),
        max_transfer_time: Duration::from_secs(1),
        ..Limits::default()
    })
    .await?;
    let sock = UdpSocket::bind("127.0.0.1:0").await?;
    // 1,000 bytes in 8-byte blocks: 126 blocks, 25 s at one ACK every 200 ms.
    sock.send_to(&rrq("small.bin", opts(Some(8), None, Some(255))), f.addr)
        .await?;
    let began = tokio::time::Instant::now();
    let mut buf = [0u8; 1024];
    let mut out = Vec::new();
    let mut blocks = 0;
    let message = loop {
        let (n, from) = timeout(Duration::from_secs(3), sock.recv_from(&mut buf)).await??;
        let block = match Packet::decode(&buf[..n])? {
            Packet::Oack(o) => {
                assert!(
                    !o.iter().any(|(k, _)| k == "timeout"),
                    "a 255 s timeout must be declined: {o:?}"
                );
                0
            }
            Packet::Data { block, data } => {
                blocks += 1;
                assert_eq!(data.len(), 8, "the transfer must not finish: block {block}");
                block
            }
            Packet::Error { code, message } => {
                assert_eq!(code, ErrorCode::NotDefined);
                break message;
            }
            other => bail!("unexpected {other:?}"),
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        Packet::Ack { block }.encode(&mut out);
        sock.send_to(&out, from).await?;
    };
    let took = began.elapsed();
    assert!(message.contains("longer than"), "{message}");
    assert!(
        (Duration::from_millis(900)..Duration::from_millis(2500)).contains(&took),
        "cut off after {took:?} and {blocks} blocks"
    );
    wait_counter(&f.counters.failed, 1).await?;
    f.stop().await
}

/// One address runs at most `max_per_client` transfers; another address is still served meanwhile.
#[tokio::test]
async fn one_address_gets_at_most_its_share_of_the_slots() -> Result<()> {
    let f = start(Limits {
        max_per_client: 1,
        timeout: Duration::from_secs(5),
        ..Limits::default()
    })
    .await?;
    let mut buf = [0u8; 1024];
    // The first transfer from 127.0.0.1 starts and stalls (never acknowledged).
    let (_holder, n, _) = ask("127.0.0.1", f.addr, "small.bin", &mut buf).await?;
    assert!(matches!(
        Packet::decode(&buf[..n])?,
        Packet::Data { block: 1, .. }
    ));
    // A second from the same address, another port, is refused and told why.
    let (_same, n, _) = ask("127.0.0.1", f.addr, "small.bin", &mut buf).await?;
    match Packet::decode(&buf[..n])? {
        Packet::Error { code, message } => {
            assert_eq!(code, ErrorCode::NotDefined);
            assert!(
                message.contains("too many transfers from this address"),
                "{message}"
            );
        }
        other => bail!("a second transfer from one address was not refused: {other:?}"),
    }
    // Another address is served while the first still holds its slot.
    let (_other, n, _) = ask("127.0.0.2", f.addr, "small.bin", &mut buf).await?;
    assert!(matches!(
        Packet::decode(&buf[..n])?,
        Packet::Data { block: 1, .. }
    ));
    f.stop().await
}

#[tokio::test]
async fn concurrency_is_bounded_and_writes_refused() -> Result<()> {
    let f = start(Limits {
        max_transfers: 1,
        timeout: Duration::from_secs(5),
        ..Limits::default()
    })
    .await?;
    let mut buf = [0u8; 1024];
    // First transfer starts and stalls (we never ACK).
    let (holder, _, holder_peer) = ask("127.0.0.1", f.addr, "small.bin", &mut buf).await?;
    // A second is refused while the slot is taken.
    let (second, n, _) = ask("127.0.0.2", f.addr, "small.bin", &mut buf).await?;
    assert!(matches!(
        Packet::decode(&buf[..n])?,
        Packet::Error {
            code: ErrorCode::NotDefined,
            ..
        }
    ));
    // The holder aborts; its slot frees and the next request is served.
    let mut out = Vec::new();
    Packet::Error {
        code: ErrorCode::NotDefined,
        message: "bye".into(),
    }
    .encode(&mut out);
    holder.send_to(&out, holder_peer).await?;
    let mut served = false;
    for _ in 0..50 {
        if f.counters.failed.load(Ordering::Relaxed) == 1 {
            served = fetch(f.addr, "small.bin", RequestOptions::default(), 0)
                .await
                .is_ok();
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served, "slot was not released");

    // Writes are refused with an access violation.
    Packet::Wrq(Request {
        filename: "new.bin".into(),
        mode: Mode::Octet,
        options: RequestOptions::default(),
    })
    .encode(&mut out);
    second.send_to(&out, f.addr).await?;
    let (n, _) = timeout(Duration::from_secs(2), second.recv_from(&mut buf)).await??;
    assert!(matches!(
        Packet::decode(&buf[..n])?,
        Packet::Error {
            code: ErrorCode::AccessViolation,
            ..
        }
    ));
    assert!(!f.root.join("new.bin").exists());
    // Netascii is refused rather than served wrongly.
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: "small.bin".into(),
        mode: Mode::Netascii,
        options: RequestOptions::default(),
    })
    .encode(&mut out);
    second.send_to(&out, f.addr).await?;
    let (n, _) = timeout(Duration::from_secs(2), second.recv_from(&mut buf)).await??;
    let reply = Packet::decode(&buf[..n]).context("decoding reply")?;
    assert!(
        matches!(
            reply,
            Packet::Error {
                code: ErrorCode::IllegalOperation,
                ..
            }
        ),
        "{reply:?}"
    );
    f.stop().await
}

/// RFC 7440: with a window, an ACK of the block before the window reports a gap and is answered at once, not
/// after the retransmission timeout.
#[tokio::test]
async fn window_gap_ack_triggers_immediate_resend() -> Result<()> {
    let f = start(Limits {
        timeout: Duration::from_secs(5),
        ..Limits::default()
    })
    .await?;
    let sock = UdpSocket::bind("127.0.0.1:0").await?;
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: "small.bin".into(),
        mode: Mode::Octet,
        options: RequestOptions {
            blksize: Some(8),
            windowsize: Some(4),
            ..RequestOptions::default()
        },
    })
    .encode(&mut out);
    sock.send_to(&out, f.addr).await?;
    let mut buf = [0u8; 1024];
    let (n, peer) = timeout(Duration::from_secs(2), sock.recv_from(&mut buf)).await??;
    assert!(matches!(Packet::decode(&buf[..n])?, Packet::Oack(_)));
    Packet::Ack { block: 0 }.encode(&mut out);
    sock.send_to(&out, peer).await?;
    for expect in 1..=4u16 {
        let (n, _) = timeout(Duration::from_secs(2), sock.recv_from(&mut buf)).await??;
        assert!(
            matches!(Packet::decode(&buf[..n])?, Packet::Data { block, .. } if block == expect)
        );
    }
    // "Block 1 never arrived": ACK 0.
    sock.send_to(&out, peer).await?;
    let (n, _) = timeout(Duration::from_secs(1), sock.recv_from(&mut buf))
        .await
        .context("no immediate resend after the gap ACK")??;
    assert!(matches!(
        Packet::decode(&buf[..n])?,
        Packet::Data { block: 1, .. }
    ));
    f.stop().await
}

/// A lockstep client on its own thread (blocking std socket) that answers the first `slow` DATA blocks after
/// `delay` and every later one at once. Returns the bytes received.
fn lockstep_client(server: SocketAddr, name: &str, slow: u16, delay: Duration) -> Result<Vec<u8>> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut out = Vec::new();
    Packet::Rrq(Request {
        filename: name.into(),
        mode: Mode::Octet,
        options: RequestOptions::default(),
    })
    .encode(&mut out);
    sock.send_to(&out, server)?;
    let mut buf = [0u8; 1024];
    let mut data = Vec::new();
    let mut expect: u16 = 1;
    loop {
        let (n, from) = sock.recv_from(&mut buf)?;
        let Packet::Data { block, data: chunk } = Packet::decode(&buf[..n])? else {
            bail!("expected DATA");
        };
        if block == expect {
            data.extend_from_slice(chunk);
            expect = expect.wrapping_add(1);
        }
        if block <= slow {
            std::thread::sleep(delay);
        }
        out.clear();
        Packet::Ack { block }.encode(&mut out);
        sock.send_to(&out, from)?;
        if chunk.len() < 512 && block + 1 == expect {
            return Ok(data);
        }
    }
}

/// A client slower than the spin budget at first is not spun for (its ACKs are awaited asleep), and once it
/// answers quickly it is spun for again: the estimate of its answer time follows every ACK. Before, four slow ACKs
/// in a row stopped spinning for the rest of the transfer.
#[tokio::test]
async fn spinning_resumes_when_a_slow_client_speeds_up() -> Result<()> {
    let f = start(Limits {
        ack_spin: Duration::from_micros(1000),
        ..Limits::default()
    })
    .await?;
    // 1 MiB at 512 bytes: 2,049 blocks, the first 8 answered 5 ms late.
    let want = fs::read(f.root.join("efi/snponly.efi"))?;
    let addr = f.addr;
    let got = tokio::task::spawn_blocking(move || {
        lockstep_client(addr, "efi/snponly.efi", 8, Duration::from_millis(5))
    })
    .await??;
    assert!(got == want, "bytes differ");
    wait_counter(&f.counters.completed, 1).await?;
    let spun = f.counters.acks_spun.load(Ordering::Relaxed);
    let slept = f.counters.acks_slept.load(Ordering::Relaxed);
    assert_eq!(spun + slept, 2049, "every ACK counted once");
    assert!(slept >= 6, "the slow ACKs were awaited asleep: {slept}");
    assert!(
        spun > 200,
        "the fast part was not spun for: {spun} spun, {slept} slept"
    );
    f.stop().await
}
