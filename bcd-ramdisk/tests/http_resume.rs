//! HTTP source tests against a tiny HTTP/1.1 server on 127.0.0.1 that can drop connections mid-transfer, ignore
//! Range, or change the file between connections. The sink is a real `O_DIRECT` file in a temp dir.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bcd_ramdisk::os::DirectDevice;
use bcd_ramdisk::stream::http::{FetchPolicy, HttpError, client, stream_url};
use bcd_ramdisk::stream::{
    Compression, DigestAlgo, DigestOver, ExpectedDigest, Scrub, StreamError, StreamSpec, digest_of,
};

#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    /// Drop the first connection after `cut` body bytes; serve Range requests properly after that.
    DropOnce { cut: usize },
    /// Drop every connection after `cut` bytes and answer Range with 200 and the whole file.
    IgnoreRangeDropOnce { cut: usize },
    /// Drop the first connection; the second connection sees a different ETag and length.
    ChangeAfterFirst { cut: usize },
    /// Drop every connection after `cut` bytes of that response.
    AlwaysDrop { cut: usize },
}

struct Server {
    url: String,
    connections: Arc<AtomicUsize>,
    ranges: Arc<Mutex<Vec<String>>>,
}

fn serve(body: Vec<u8>, behaviour: Behaviour) -> Server {
    serve_with(body, behaviour, None)
}

/// Serve over TLS with `tls` when given (the scheme of the URL follows).
fn serve_with(
    body: Vec<u8>,
    behaviour: Behaviour,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!(
        "{scheme}://{}/image.zst",
        listener.local_addr().expect("addr")
    );
    let connections = Arc::new(AtomicUsize::new(0));
    let ranges = Arc::new(Mutex::new(Vec::new()));
    let (conns, rs) = (connections.clone(), ranges.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(tcp) = stream else { return };
            let n = conns.fetch_add(1, Ordering::SeqCst);
            match &tls {
                None => {
                    let mut tcp = tcp;
                    let _ = handle(&mut tcp, &body, behaviour, n, &rs);
                    let _ = tcp.shutdown(std::net::Shutdown::Both);
                }
                Some(config) => {
                    let Ok(conn) = rustls::ServerConnection::new(config.clone()) else {
                        return;
                    };
                    let mut tls = rustls::StreamOwned::new(conn, tcp);
                    // A cut connection ends without close_notify, like a broken path.
                    if let Ok(false) = handle(&mut tls, &body, behaviour, n, &rs) {
                        tls.conn.send_close_notify();
                        let _ = tls.flush();
                    }
                    let _ = tls.sock.shutdown(std::net::Shutdown::Both);
                }
            }
        }
    });
    Server {
        url,
        connections,
        ranges,
    }
}

/// Answer one request; returns whether the body was cut short.
fn handle<S: Read + Write>(
    stream: &mut S,
    body: &[u8],
    behaviour: Behaviour,
    n: usize,
    ranges: &Mutex<Vec<String>>,
) -> std::io::Result<bool> {
    // A GET has no body and the client waits for the answer, so nothing is lost by dropping this reader.
    let mut reader = BufReader::new(&mut *stream);
    let mut range_start = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("range: bytes=") {
            ranges.lock().expect("lock").push(v.trim().to_string());
            range_start = v.trim().trim_end_matches('-').parse::<usize>().ok();
        }
    }
    drop(reader);
    let (etag, entity): (&str, Vec<u8>) = match behaviour {
        Behaviour::ChangeAfterFirst { .. } if n > 0 => ("\"v2\"", [body, b"more"].concat()),
        _ => ("\"v1\"", body.to_vec()),
    };
    let honour_range = !matches!(behaviour, Behaviour::IgnoreRangeDropOnce { .. });
    let (status, start) = match range_start {
        Some(s) if honour_range => ("206 Partial Content", s),
        _ => ("200 OK", 0),
    };
    let part = &entity[start.min(entity.len())..];
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nETag: {etag}\r\nAccept-Ranges: bytes\r\nConnection: close\r\n",
        part.len()
    );
    if status.starts_with("206") {
        head += &format!(
            "Content-Range: bytes {start}-{}/{}\r\n",
            entity.len() - 1,
            entity.len()
        );
    }
    head += "\r\n";
    stream.write_all(head.as_bytes())?;
    let cut = match behaviour {
        Behaviour::DropOnce { cut } | Behaviour::ChangeAfterFirst { cut } if n == 0 => Some(cut),
        Behaviour::IgnoreRangeDropOnce { cut } if n == 0 => Some(cut),
        Behaviour::AlwaysDrop { cut } => Some(cut),
        _ => None,
    };
    match cut {
        Some(cut) => {
            stream.write_all(&part[..cut.min(part.len())])?;
            stream.flush()?;
            Ok(true)
        }
        None => {
            stream.write_all(part)?;
            stream.flush()?;
            Ok(false)
        }
    }
}

fn image() -> Vec<u8> {
    let mut x = 0x2545_F491u32;
    (0..3_000_000usize)
        .map(|i| {
            if i < 1_500_000 {
                0
            } else {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            }
        })
        .collect()
}

fn device(dir: &tempfile::TempDir) -> DirectDevice {
    let path = dir.path().join("disk.img");
    let f = std::fs::File::create(&path).expect("create");
    f.set_len(8 << 20).expect("size");
    DirectDevice::open(&path).expect("O_DIRECT on the temp dir's file system")
}

fn policy() -> FetchPolicy {
    FetchPolicy {
        max_retries: 3,
        retry: bc_backoff::ExponentialBackoff::new(
            Duration::from_millis(10),
            Duration::from_millis(50),
            bc_backoff::Jitter::Fraction(0.5),
        ),
        idle_timeout: Duration::from_secs(5),
        ..FetchPolicy::default()
    }
}

fn spec(compressed: &[u8], raw: &[u8]) -> StreamSpec {
    let mut spec = StreamSpec::new(ExpectedDigest {
        algo: DigestAlgo::Sha256,
        over: DigestOver::Compressed,
        value: digest_of(DigestAlgo::Sha256, compressed),
    });
    spec.image_size = Some(raw.len() as u64);
    spec.buffer_size = 256 << 10;
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_after_a_dropped_connection() {
    let raw = image();
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    let server = serve(
        compressed.clone(),
        Behaviour::DropOnce {
            cut: compressed.len() / 2,
        },
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(rustls::RootCertStore::empty(), &policy()).expect("client");
    let url = server.url.parse().expect("url");
    let (mut dev, report) = stream_url(
        &client,
        url,
        device(&dir),
        spec(&compressed, &raw),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect("stream completes after one resume");
    assert_eq!(report.resumes, 1);
    assert_eq!(server.connections.load(Ordering::SeqCst), 2);
    assert_eq!(
        *server.ranges.lock().expect("lock"),
        vec![format!("{}-", compressed.len() / 2)]
    );
    assert_eq!(report.stream.compression, Compression::Zstd);
    assert!(report.stream.read_back_verified);
    assert_eq!(report.stream.source_bytes, compressed.len() as u64);
    let mut on_disk = vec![0u8; raw.len()];
    use bcd_ramdisk::stream::BlockSink;
    let mut buf = bcd_ramdisk::os::AlignedBuf::new(raw.len());
    let n = dev.read_at(buf.as_mut_slice(), 0).expect("read back");
    assert!(n >= raw.len());
    on_disk.copy_from_slice(&buf.as_slice()[..raw.len()]);
    assert!(on_disk == raw, "device holds the image");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_ignoring_range_is_handled_by_skipping() {
    let raw = image();
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    let server = serve(
        compressed.clone(),
        Behaviour::IgnoreRangeDropOnce {
            cut: compressed.len() / 3,
        },
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(rustls::RootCertStore::empty(), &policy()).expect("client");
    let (_, report) = stream_url(
        &client,
        server.url.parse().expect("url"),
        device(&dir),
        spec(&compressed, &raw),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect("whole-file reply is skipped up to the resume point");
    assert_eq!(report.resumes, 1);
    assert_eq!(report.stream.source_bytes, compressed.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_file_is_refused_and_device_scrubbed() {
    let raw = image();
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    let server = serve(
        compressed.clone(),
        Behaviour::ChangeAfterFirst {
            cut: compressed.len() / 2,
        },
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(rustls::RootCertStore::empty(), &policy()).expect("client");
    let failure = stream_url(
        &client,
        server.url.parse().expect("url"),
        device(&dir),
        spec(&compressed, &raw),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect_err("a changed file is not spliced");
    assert!(
        matches!(
            &failure.error,
            StreamError::Http(HttpError::Response { .. })
        ),
        "{:?}",
        failure.error
    );
    assert!(
        matches!(failure.scrub, Scrub::Zeroed { .. } | Scrub::NotNeeded),
        "{}",
        failure.scrub
    );
    let disk = std::fs::read(dir.path().join("disk.img")).expect("read disk");
    assert!(
        disk.iter().all(|&b| b == 0),
        "nothing of the partial image remains"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_budget_runs_out() {
    let raw = image();
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    // Every connection drops right after the headers: no progress, so the budget is spent.
    let server = serve(compressed.clone(), Behaviour::AlwaysDrop { cut: 0 });
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(rustls::RootCertStore::empty(), &policy()).expect("client");
    let failure = stream_url(
        &client,
        server.url.parse().expect("url"),
        device(&dir),
        spec(&compressed, &raw),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect_err("gives up");
    assert!(
        matches!(
            &failure.error,
            StreamError::Http(HttpError::RetriesExhausted { attempts: 4, .. })
        ),
        "{:?}",
        failure.error
    );
    assert_eq!(
        server.connections.load(Ordering::SeqCst),
        4,
        "first attempt + 3 retries"
    );
}

/// Streams `url` (serving `compressed`, the image `raw`) onto a fresh device in `dir` under `policy`, which must
/// fail, and within 20 s: a stream that waits for ever fails the test.
async fn failed_within_20_s(
    url: &str,
    policy: &FetchPolicy,
    dir: &tempfile::TempDir,
    compressed: &[u8],
    raw: &[u8],
) -> bcd_ramdisk::stream::StreamFailure {
    let client = client(rustls::RootCertStore::empty(), policy).expect("client");
    tokio::time::timeout(
        Duration::from_secs(20),
        stream_url(
            &client,
            url.parse().expect("url"),
            device(dir),
            spec(compressed, raw),
            policy,
            Box::new(|_| {}),
        ),
    )
    .await
    .expect("the stream must end within 20 s, not wait for ever")
    .expect_err("the stream cannot succeed")
}

/// A server that accepts and then never answers: each attempt is given up after `idle_timeout` and the retry
/// budget ends the download. Before, the request waited for the response head with no deadline at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_is_given_up() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let url = format!("http://{}/image.zst", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            let Ok(tcp) = stream else { return };
            count.fetch_add(1, Ordering::SeqCst);
            held.push(tcp);
        }
    });
    let policy = FetchPolicy {
        max_retries: 1,
        idle_timeout: Duration::from_millis(500),
        ..policy()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = image();
    let began = std::time::Instant::now();
    let failure = failed_within_20_s(&url, &policy, &dir, b"", &raw).await;
    match &failure.error {
        StreamError::Http(HttpError::RetriesExhausted {
            attempts: 2, last, ..
        }) => {
            assert!(matches!(**last, HttpError::Idle { .. }), "{last:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "first attempt + 1 retry"
    );
    assert_eq!(failure.scrub, Scrub::NotNeeded);
}

/// A server that trickles the image (64 KiB every 100 ms) past the command's deadline: the download stops at the
/// deadline and the pipeline zeroes what it wrote, so the control plane's retry finds no half-written image and no
/// writer still running. Before, the stream ran on after the control plane had given up on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_the_commands_deadline_stops_and_zeroes_what_it_wrote() {
    let mut x = 0x9E37_79B9u32;
    let raw: Vec<u8> = (0..3_000_000usize)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as u8) | 1
        })
        .collect();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let url = format!("http://{}/image.raw", listener.local_addr().expect("addr"));
    let body = raw.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut tcp) = stream else { return };
            let mut reader = BufReader::new(tcp.try_clone().expect("clone"));
            let mut line = String::new();
            while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) && line != "\r\n" {
                line.clear();
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = tcp.write_all(head.as_bytes());
            for chunk in body.chunks(64 << 10) {
                if tcp.write_all(chunk).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    });
    let policy = FetchPolicy {
        deadline: Some(std::time::Instant::now() + Duration::from_millis(1500)),
        ..policy()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let began = std::time::Instant::now();
    let failure = failed_within_20_s(&url, &policy, &dir, &raw, &raw).await;
    let elapsed = began.elapsed();
    match &failure.error {
        StreamError::Http(HttpError::Deadline { received, .. }) => {
            assert!(*received > 0 && *received < raw.len() as u64, "{received}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        failure
            .to_string()
            .contains("the command's deadline passed")
            || bc_error_chain::chain(&failure).contains("the command's deadline passed"),
        "{}",
        bc_error_chain::chain(&failure)
    );
    assert!(
        elapsed >= Duration::from_millis(1400) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    match failure.scrub {
        Scrub::Zeroed { bytes } => assert!(bytes > 0),
        other => panic!("the written range must be zeroed: {other:?}"),
    }
    let on_disk = std::fs::read(dir.path().join("disk.img")).expect("read");
    assert!(
        on_disk.iter().all(|b| *b == 0),
        "the raw image has no zero byte; the disk must hold none of it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_is_a_clear_error() {
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(rustls::RootCertStore::empty(), &policy()).expect("client");
    let raw = image();
    let failure = stream_url(
        &client,
        format!("http://127.0.0.1:{port}/x").parse().expect("url"),
        device(&dir),
        spec(b"", &raw),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect_err("connection refused");
    assert!(matches!(
        failure.error,
        StreamError::Http(HttpError::RetriesExhausted { .. })
    ));
    assert_eq!(failure.scrub, Scrub::NotNeeded);
}

fn tls_pair() -> (Arc<rustls::ServerConfig>, rustls::RootCertStore) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])
        .expect("self-signed cert");
    let cert = certified.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .expect("server config");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).expect("root");
    (Arc::new(server), roots)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_pinned_root_resumes_after_a_broken_tls_connection() {
    let raw = image();
    let compressed = zstd::encode_all(&raw[..], 3).expect("zstd");
    let (server_config, roots) = tls_pair();
    let server = serve_with(
        compressed.clone(),
        Behaviour::DropOnce {
            cut: compressed.len() / 2,
        },
        Some(server_config),
    );
    assert!(server.url.starts_with("https://"));
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(roots, &policy()).expect("client");
    let (_, report) = stream_url(
        &client,
        server.url.parse().expect("url"),
        device(&dir),
        spec(&compressed, &raw),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect("TLS download resumes");
    assert_eq!(report.resumes, 1);
    assert_eq!(server.connections.load(Ordering::SeqCst), 2);
    assert!(report.stream.read_back_verified);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_an_unknown_ca_fails_fast_without_retries() {
    let (server_config, _) = tls_pair();
    let (_, other_roots) = tls_pair();
    let server = serve_with(
        b"x".to_vec(),
        Behaviour::DropOnce { cut: 0 },
        Some(server_config),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(other_roots, &policy()).expect("client");
    let failure = stream_url(
        &client,
        server.url.parse().expect("url"),
        device(&dir),
        spec(b"x", b"x"),
        &policy(),
        Box::new(|_| {}),
    )
    .await
    .expect_err("untrusted server");
    assert!(
        matches!(&failure.error, StreamError::Http(HttpError::Request { .. })),
        "a certificate error is not retried: {:?}",
        failure.error
    );
    assert_eq!(server.connections.load(Ordering::SeqCst), 1);
    assert_eq!(failure.scrub, Scrub::NotNeeded);
}
