//! Boot HTTP over real sockets: iPXE scripts (golden files), loaders and artifacts with Range/HEAD, path escapes,
//! keep-alive and pipelining, fetched with reqwest and with the `curl` binary (skipped with a printed reason when
//! curl is absent). Regenerate the script goldens with `BC_UPDATE_GOLDEN=1 cargo test -p bcd-site --test boot_http`.

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use bcd_site::dhcp::MacAddr;
use bcd_site::http::{BootCatalog, BootHttp, DesiredBoot, HttpConfig, run};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{oneshot, watch};

const MAC: &str = "52:54:00:12:34:56";
const MAC2: &str = "52:54:00:00:00:02";

struct Server {
    addr: SocketAddr,
    catalog: watch::Sender<BootCatalog>,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<std::io::Result<()>>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    kernel: Vec<u8>,
    http: BootHttp,
}

fn write_public(path: &Path, data: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(path, data)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o644))?;
    Ok(())
}

fn catalog() -> Result<BootCatalog> {
    Ok([
        (
            MAC.parse::<MacAddr>()?,
            DesiredBoot {
                kernel: "ramdisk/vmlinuz".into(),
                initrd: Some("ramdisk/initrd.zst".into()),
                cmdline: "console=ttyS0,115200  bc.url=https://cp.example:8443 bc.boot=${mac}"
                    .into(),
            },
        ),
        (
            MAC2.parse::<MacAddr>()?,
            DesiredBoot {
                kernel: "http://10.0.0.1:8080/artifacts/os/vmlinuz".into(),
                initrd: None,
                cmdline: String::new(),
            },
        ),
    ]
    .into_iter()
    .collect())
}

async fn start() -> Result<Server> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let root = tempfile::tempdir()?;
    let outside = tempfile::tempdir()?;
    let artifacts = root.path().join("artifacts");
    let loaders = root.path().join("loaders");
    let kernel: Vec<u8> = (0..3 * 1024 * 1024 + 17)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    write_public(&artifacts.join("ramdisk/vmlinuz"), &kernel)?;
    write_public(&artifacts.join("ramdisk/initrd.zst"), b"initrd")?;
    write_public(&artifacts.join("empty"), b"")?;
    write_public(&loaders.join("snponly.efi"), b"MZ loader")?;
    fs::write(artifacts.join("private"), b"secret")?;
    fs::set_permissions(artifacts.join("private"), fs::Permissions::from_mode(0o600))?;
    write_public(&outside.path().join("secret"), b"outside")?;
    symlink(outside.path().join("secret"), artifacts.join("escape"))?;

    let http = BootHttp::new(HttpConfig::new(&artifacts, &loaders))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (catalog_tx, catalog_rx) = watch::channel(catalog()?);
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(run(listener, http.clone(), catalog_rx, async {
        let _ = stopped.await;
    }));
    Ok(Server {
        addr,
        catalog: catalog_tx,
        stop: Some(stop),
        done,
        _dirs: (root, outside),
        kernel,
        http,
    })
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.done).await??;
        Ok(())
    }
}

fn golden(name: &str, actual: &str) -> Result<()> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/{name}"));
    bc_testkit::assert_golden(path, actual);
    Ok(())
}

#[tokio::test]
async fn renders_scripts_from_the_catalog() -> Result<()> {
    let srv = start().await?;
    let client = reqwest::Client::new();
    for spelling in [
        "52:54:00:12:34:56",
        "52-54-00-12-34-56",
        "52:54:00:12:34:56".to_uppercase().as_str(),
        "52%3A54%3A00%3A12%3A34%3A56",
    ] {
        let resp = client
            .get(srv.url(&format!("/boot/{spelling}.ipxe")))
            .send()
            .await?;
        assert_eq!(resp.status(), 200, "{spelling}");
        golden("ipxe-ramdisk.ipxe", &resp.text().await?)?;
    }
    let resp = client
        .get(srv.url(&format!("/boot/{MAC2}.ipxe")))
        .send()
        .await?;
    golden("ipxe-absolute-no-initrd.ipxe", &resp.text().await?)?;

    let resp = client
        .get(srv.url("/boot/52:54:00:99:99:99.ipxe"))
        .send()
        .await?;
    assert_eq!(resp.status(), 404);
    let body = resp.text().await?;
    assert!(
        body.contains("no desired boot for 52:54:00:99:99:99"),
        "{body}"
    );
    let resp = client.get(srv.url("/boot/not-a-mac.ipxe")).send().await?;
    assert_eq!(resp.status(), 404);
    assert!(resp.text().await?.contains("invalid MAC"));

    // A catalog update takes effect with the next request; a bad entry is refused, not rendered.
    srv.catalog.send_modify(|c| {
        if let Ok(mac) = MAC.parse() {
            c.insert(
                mac,
                DesiredBoot {
                    kernel: "k".into(),
                    initrd: None,
                    cmdline: "a\nshell".into(),
                },
            );
        }
    });
    let resp = client
        .get(srv.url(&format!("/boot/{MAC}.ipxe")))
        .send()
        .await?;
    assert_eq!(resp.status(), 500);
    assert!(resp.text().await?.contains("control character"));
    assert!(srv.http.counters().scripts >= 5);
    srv.stop().await
}

#[tokio::test]
async fn serves_files_with_ranges_and_head() -> Result<()> {
    let srv = start().await?;
    let client = reqwest::Client::new();
    let url = srv.url("/artifacts/ramdisk/vmlinuz");
    let len = srv.kernel.len();

    let resp = client.get(&url).send().await?;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.content_length(), Some(len as u64));
    let etag = resp
        .headers()
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .context("etag")?;
    assert_eq!(resp.bytes().await?.as_ref(), srv.kernel.as_slice());

    let resp = client.head(&url).send().await?;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok()),
        Some(len.to_string().as_str())
    );
    assert!(resp.bytes().await?.is_empty());

    let resp = client
        .get(&url)
        .header("range", "bytes=100-199")
        .send()
        .await?;
    assert_eq!(resp.status(), 206);
    assert_eq!(
        resp.headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok()),
        Some(format!("bytes 100-199/{len}").as_str())
    );
    assert_eq!(resp.bytes().await?.as_ref(), &srv.kernel[100..200]);

    let resp = client.get(&url).header("range", "bytes=-10").send().await?;
    assert_eq!(resp.status(), 206);
    assert_eq!(resp.bytes().await?.as_ref(), &srv.kernel[len - 10..]);

    let resp = client
        .get(&url)
        .header("range", format!("bytes={len}-"))
        .send()
        .await?;
    assert_eq!(resp.status(), 416);
    assert_eq!(
        resp.headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok()),
        Some(format!("bytes */{len}").as_str())
    );

    // If-Range: a matching validator honours the range, a stale one gets the whole file.
    let resp = client
        .get(&url)
        .header("range", "bytes=0-9")
        .header("if-range", &etag)
        .send()
        .await?;
    assert_eq!(resp.status(), 206);
    let resp = client
        .get(&url)
        .header("range", "bytes=0-9")
        .header("if-range", "\"stale\"")
        .send()
        .await?;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.content_length(), Some(len as u64));

    let resp = client.get(srv.url("/artifacts/empty")).send().await?;
    assert_eq!(
        (resp.status().as_u16(), resp.content_length()),
        (200, Some(0))
    );
    let resp = client.get(srv.url("/ipxe/snponly.efi")).send().await?;
    assert_eq!(resp.bytes().await?.as_ref(), b"MZ loader");

    for (path, status) in [
        ("/artifacts/private", 403),
        ("/artifacts/escape", 403),
        ("/artifacts/missing", 404),
        ("/artifacts/ramdisk", 403),
        ("/nothing-here", 404),
    ] {
        assert_eq!(
            client.get(srv.url(path)).send().await?.status(),
            status,
            "{path}"
        );
    }
    assert_eq!(client.post(&url).send().await?.status(), 405);
    assert_eq!(client.put(&url).body("x").send().await?.status(), 413);

    // Concurrent whole-file fetches all see the exact bytes.
    let mut fetches = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (client, url) = (client.clone(), url.clone());
        fetches.spawn(async move { client.get(&url).send().await?.bytes().await });
    }
    while let Some(body) = fetches.join_next().await {
        assert_eq!(body??.as_ref(), srv.kernel.as_slice());
    }
    let c = srv.http.counters();
    assert!(c.bytes_sent >= 10 * len as u64, "{c:?}");
    srv.stop().await
}

#[tokio::test]
async fn keeps_alive_and_answers_pipelined_requests_in_order() -> Result<()> {
    let srv = start().await?;
    let mut tcp = tokio::net::TcpStream::connect(srv.addr).await?;
    tcp.write_all(
        b"GET /artifacts/ramdisk/initrd.zst HTTP/1.1\r\nHost: x\r\n\r\nHEAD /ipxe/snponly.efi HTTP/1.1\r\nHost: x\r\n\r\nGET /artifacts/empty HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await?;
    let mut all = Vec::new();
    tcp.read_to_end(&mut all).await?;
    let text = String::from_utf8_lossy(&all);
    assert_eq!(text.matches("HTTP/1.1 ").count(), 3, "{text}");
    assert_eq!(text.matches("HTTP/1.1 200 OK\r\n").count(), 3, "{text}");
    assert!(text.contains("\r\n\r\ninitrdHTTP/1.1 200 OK"), "{text}");
    assert!(
        text.contains("Content-Length: 9\r\n"),
        "HEAD keeps the GET length: {text}"
    );
    assert!(text.ends_with("Connection: close\r\n\r\n"), "{text}");

    // Garbage gets a 400 and a closed connection, not a panic.
    let mut tcp = tokio::net::TcpStream::connect(srv.addr).await?;
    tcp.write_all(b"\x00\x01 nonsense\r\n\r\n").await?;
    let mut all = Vec::new();
    tcp.read_to_end(&mut all).await?;
    assert!(
        all.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&all)
    );
    srv.stop().await
}

fn curl(args: &[&str]) -> Result<Option<(String, Vec<u8>)>> {
    let out = match Command::new("curl")
        .args(["-sS", "--max-time", "20", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
    {
        Ok(out) => out,
        Err(e) => bc_testkit::skip!("curl not runnable ({e})"),
    };
    if !out.status.success() {
        bail!("curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut body = out.stdout;
    let split = body
        .iter()
        .rposition(|b| *b == b'\n')
        .context("curl output")?;
    let code = String::from_utf8_lossy(&body[split + 1..]).into_owned();
    body.truncate(split);
    Ok(Some((code, body)))
}

#[tokio::test]
async fn curl_sees_ranges_head_and_refused_escapes() -> Result<()> {
    let srv = start().await?;
    let url = srv.url("/artifacts/ramdisk/vmlinuz");
    let (kernel, base) = (srv.kernel.clone(), srv.url(""));
    let checks = tokio::task::spawn_blocking(move || -> Result<bool> {
        let Some((code, body)) = curl(&["-r", "1000-1999", &url])? else {
            return Ok(false);
        };
        assert_eq!(code, "206");
        assert_eq!(body, &kernel[1000..2000]);
        let Some((code, head)) = curl(&["-I", &url])? else {
            return Ok(false);
        };
        let head = String::from_utf8_lossy(&head);
        assert_eq!(code, "200");
        assert!(
            head.contains(&format!("Content-Length: {}", kernel.len())),
            "{head}"
        );
        assert!(head.contains("Accept-Ranges: bytes"), "{head}");
        let Some((code, body)) = curl(&[&url])? else {
            return Ok(false);
        };
        assert_eq!((code.as_str(), body.len()), ("200", kernel.len()));
        assert!(body == kernel);
        let Some((code, _)) = curl(&["-r", "99999999-", &url])? else {
            return Ok(false);
        };
        assert_eq!(code, "416");
        for path in [
            "/artifacts/../artifacts/empty",
            "/artifacts/%2e%2e/%2e%2e/etc/passwd",
            "/artifacts//etc/passwd",
            "/artifacts/escape",
            "/ipxe/../artifacts/empty",
        ] {
            let Some((code, body)) = curl(&["--path-as-is", &format!("{base}{path}")])? else {
                return Ok(false);
            };
            assert_eq!(code, "403", "{path}: {}", String::from_utf8_lossy(&body));
        }
        Ok(true)
    })
    .await??;
    if checks {
        assert!(srv.http.counters().refused >= 6);
    }
    srv.stop().await
}

#[tokio::test]
async fn shutdown_returns_with_idle_keep_alive_connections_open() -> Result<()> {
    let srv = start().await?;
    let client = reqwest::Client::new();
    assert_eq!(
        client
            .get(srv.url("/ipxe/snponly.efi"))
            .send()
            .await?
            .status(),
        200
    );
    // The client still holds an idle keep-alive connection; shutdown must not wait for it.
    tokio::time::timeout(std::time::Duration::from_secs(3), srv.stop()).await??;
    Ok(())
}

#[tokio::test]
async fn slow_request_heads_time_out_and_idle_connections_close() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = HttpConfig::new(dir.path(), dir.path());
    config.header_timeout = std::time::Duration::from_millis(200);
    config.idle_timeout = std::time::Duration::from_millis(300);
    let http = BootHttp::new(config)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (_catalog_tx, catalog_rx) = watch::channel(BootCatalog::new());
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(run(listener, http.clone(), catalog_rx, async {
        let _ = stopped.await;
    }));

    // Idle for 150 ms (within the idle timeout), then half a head: the head timeout counts from its first byte.
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    tcp.write_all(b"GET /ipxe/x HTTP/1.1\r\n").await?;
    let started = std::time::Instant::now();
    let mut all = Vec::new();
    tcp.read_to_end(&mut all).await?;
    assert!(
        all.starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&all)
    );
    assert!(started.elapsed() >= std::time::Duration::from_millis(150));

    // An idle keep-alive connection is closed silently after the idle timeout.
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    let mut all = Vec::new();
    tcp.read_to_end(&mut all).await?;
    assert!(all.is_empty());
    assert_eq!(http.counters().bad_requests, 1);
    let _ = stop.send(());
    done.await??;
    Ok(())
}

/// Sends `request` on a fresh connection and returns everything the server sent until it closed.
async fn raw(addr: SocketAddr, request: &str) -> Result<String> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(request.as_bytes()).await?;
    let mut all = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut all)).await??;
    Ok(String::from_utf8_lossy(&all).into_owned())
}

fn get(path: &str, headers: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: boot\r\n{headers}Connection: close\r\n\r\n")
}

/// A header's value in a raw response.
fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    let head = response.split("\r\n\r\n").next()?;
    head.lines().skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test]
async fn long_names_get_404_and_no_echo() -> Result<()> {
    let srv = start().await?;
    let long = "a".repeat(300);
    let deep = "d/".repeat(2100);
    for path in [
        format!("/ipxe/{long}.efi"),
        format!("/artifacts/{long}"),
        format!("/artifacts/{deep}x"),
        format!("/boot/{long}.ipxe"),
        format!("/boot/{long}"),
        format!("/{long}"),
    ] {
        let resp = raw(srv.addr, &get(&path, "")).await?;
        assert!(resp.starts_with("HTTP/1.1 404 "), "{}: {resp}", &path[..20]);
        assert!(
            !resp.contains("aaaaaaaaaa") && !resp.contains("d/d/d/d/"),
            "the name is echoed: {resp}"
        );
    }
    // Short ones are not echoed either.
    let resp = raw(srv.addr, &get("/artifacts/no-such-kernel", "")).await?;
    assert!(resp.starts_with("HTTP/1.1 404 "), "{resp}");
    assert!(!resp.contains("no-such-kernel"), "{resp}");
    assert!(resp.ends_with("file not found\n"), "{resp}");
    srv.stop().await
}

#[tokio::test]
async fn host_must_be_sent_once() -> Result<()> {
    let srv = start().await?;
    let path = "/ipxe/snponly.efi";
    for (request, status) in [
        (
            format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n"),
            400,
        ),
        (
            format!("GET {path} HTTP/1.1\r\nHost: a\r\nHost: a\r\nConnection: close\r\n\r\n"),
            400,
        ),
        (
            format!("GET {path} HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n"),
            400,
        ),
        (
            format!("GET {path} HTTP/1.1\r\nHost: a b\r\nConnection: close\r\n\r\n"),
            400,
        ),
        (format!("GET {path} HTTP/1.0\r\n\r\n"), 200),
        (
            format!("GET {path} HTTP/1.1\r\nHost: 10.0.0.2:8080\r\nConnection: close\r\n\r\n"),
            200,
        ),
    ] {
        let resp = raw(srv.addr, &request).await?;
        assert!(
            resp.starts_with(&format!("HTTP/1.1 {status} ")),
            "{request:?}: {resp}"
        );
        if status == 400 {
            assert!(resp.contains("Host"), "{resp}");
            assert!(header(&resp, "connection") == Some("close"), "{resp}");
        }
    }
    assert!(srv.http.counters().bad_requests >= 4);
    srv.stop().await
}

#[tokio::test]
async fn absolute_form_targets_are_served() -> Result<()> {
    let srv = start().await?;
    let resp = raw(
        srv.addr,
        &get(&format!("http://{}/ipxe/snponly.efi", srv.addr), ""),
    )
    .await?;
    assert!(resp.starts_with("HTTP/1.1 200 "), "{resp}");
    assert!(resp.ends_with("\r\n\r\nMZ loader"), "{resp}");
    // The URI's host, not the Host field, names the server (RFC 9112 §3.2.2): another Host is no error.
    let resp = raw(
        srv.addr,
        &get("HTTP://10.0.0.2:8080/artifacts/ramdisk/initrd.zst?x=1", ""),
    )
    .await?;
    assert!(resp.ends_with("\r\n\r\ninitrd"), "{resp}");
    let resp = raw(srv.addr, &get(&format!("http://{}", srv.addr), "")).await?;
    assert!(
        resp.starts_with("HTTP/1.1 404 "),
        "the root is no route: {resp}"
    );
    for target in [
        "*",
        "ipxe/snponly.efi",
        "ftp://h/ipxe/snponly.efi",
        "http:///ipxe/snponly.efi",
    ] {
        let resp = raw(srv.addr, &get(target, "")).await?;
        assert!(resp.starts_with("HTTP/1.1 400 "), "{target}: {resp}");
    }
    srv.stop().await
}

#[tokio::test]
async fn conditional_requests_get_304_and_412() -> Result<()> {
    let srv = start().await?;
    let path = "/artifacts/ramdisk/initrd.zst";
    let full = raw(srv.addr, &get(path, "")).await?;
    assert!(full.starts_with("HTTP/1.1 200 "), "{full}");
    let etag = header(&full, "etag").context("etag")?.to_owned();
    let modified = header(&full, "last-modified")
        .context("last-modified")?
        .to_owned();
    let earlier = httpdate::fmt_http_date(
        httpdate::parse_http_date(&modified)? - std::time::Duration::from_secs(1),
    );

    let status = |resp: &str| resp.get(9..12).unwrap_or_default().to_owned();
    for (headers, want) in [
        (format!("If-None-Match: {etag}\r\n"), "304"),
        (format!("If-None-Match: W/{etag}\r\n"), "304"),
        (format!("If-None-Match: \"x\", {etag}\r\n"), "304"),
        ("If-None-Match: *\r\n".to_owned(), "304"),
        ("If-None-Match: \"stale\"\r\n".to_owned(), "200"),
        (format!("If-Modified-Since: {modified}\r\n"), "304"),
        (format!("If-Modified-Since: {earlier}\r\n"), "200"),
        ("If-Modified-Since: not a date\r\n".to_owned(), "200"),
        // If-None-Match wins: no match means the file, whatever If-Modified-Since says.
        (
            format!("If-None-Match: \"stale\"\r\nIf-Modified-Since: {modified}\r\n"),
            "200",
        ),
        (
            format!("If-None-Match: {etag}\r\nIf-Modified-Since: {earlier}\r\n"),
            "304",
        ),
        (format!("If-Match: {etag}\r\n"), "200"),
        ("If-Match: \"stale\"\r\n".to_owned(), "412"),
        (format!("If-Match: W/{etag}\r\n"), "412"),
        (format!("If-Unmodified-Since: {earlier}\r\n"), "412"),
        (format!("If-Unmodified-Since: {modified}\r\n"), "200"),
    ] {
        let resp = raw(srv.addr, &get(path, &headers)).await?;
        assert_eq!(status(&resp), want, "{headers:?}: {resp}");
        if want == "304" {
            assert!(resp.ends_with("\r\n\r\n"), "a 304 has no body: {resp}");
            assert_eq!(header(&resp, "etag"), Some(etag.as_str()), "{resp}");
            assert_eq!(header(&resp, "content-length"), None, "{resp}");
        }
    }
    // HEAD too, and a 304 keeps the connection usable for the next pipelined request.
    let resp = raw(
        srv.addr,
        &format!(
            "HEAD {path} HTTP/1.1\r\nHost: b\r\nIf-None-Match: {etag}\r\n\r\nGET {path} HTTP/1.1\r\nHost: b\r\nIf-None-Match: {etag}\r\n\r\nGET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
        ),
    )
    .await?;
    assert_eq!(
        resp.matches("HTTP/1.1 304 Not Modified\r\n").count(),
        2,
        "{resp}"
    );
    assert!(resp.ends_with("\r\n\r\ninitrd"), "{resp}");
    // A range of a current copy is served; a conditional GET that fails is not a range request.
    let resp = raw(
        srv.addr,
        &get(path, &format!("Range: bytes=0-1\r\nIf-Range: {etag}\r\n")),
    )
    .await?;
    assert!(
        resp.starts_with("HTTP/1.1 206 ") && resp.ends_with("in"),
        "{resp}"
    );
    let resp = raw(
        srv.addr,
        &get(
            path,
            &format!("Range: bytes=0-1\r\nIf-Range: {modified}\r\n"),
        ),
    )
    .await?;
    assert!(resp.starts_with("HTTP/1.1 206 "), "{resp}");
    let resp = raw(
        srv.addr,
        &get(path, &format!("Range: bytes=0-1\r\nIf-Range: W/{etag}\r\n")),
    )
    .await?;
    assert!(resp.starts_with("HTTP/1.1 200 "), "weak If-Range: {resp}");
    // Preconditions are not evaluated when the answer would not be 2xx.
    let resp = raw(srv.addr, &get("/artifacts/missing", "If-None-Match: *\r\n")).await?;
    assert!(resp.starts_with("HTTP/1.1 404 "), "{resp}");
    assert_eq!(srv.http.counters().not_modified, 8);
    srv.stop().await
}
