//! One client connection: read a request head, route it, write the response (file bodies by `sendfile`), repeat
//! while the connection is kept alive.

use std::fmt::Write as _;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::conditional::{self, Precondition, Validators};
use super::range::{self, RangeDecision};
use super::request::{self, Parsed, Rejection, RequestHead};
use super::{BootCatalog, HttpConfig, HttpCounters, render_script};
use crate::dhcp::MacAddr;
use crate::tftp::codec::ErrorCode;
use crate::tftp::root::ServeRoot;

/// Bytes asked of one `sendfile` call; the kernel sends what the socket buffer takes.
const SENDFILE_CHUNK: usize = 8 << 20;

#[derive(Debug)]
pub(super) struct Shared {
    pub artifacts: ServeRoot,
    pub loaders: ServeRoot,
    pub config: HttpConfig,
    pub counters: std::sync::Arc<HttpCounters>,
}

enum Body {
    Text(String),
    /// 304: no body and no `Content-Length`.
    None,
    File {
        file: File,
        first: u64,
        len: u64,
    },
}

struct Response {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Body,
    /// Close after this response whatever the client asked.
    close: bool,
}

impl Response {
    fn text(status: u16, body: impl Into<String>) -> Self {
        let mut body = body.into();
        body.push('\n');
        Response {
            status,
            headers: vec![("Content-Type", "text/plain; charset=utf-8".into())],
            body: Body::Text(body),
            close: false,
        }
    }

    fn body_len(&self) -> u64 {
        match &self.body {
            Body::Text(t) => t.len() as u64,
            Body::None => 0,
            Body::File { len, .. } => *len,
        }
    }
}

/// Serves one connection until the client closes it, an error, a timeout or shutdown between requests.
pub(super) async fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    catalog: watch::Receiver<BootCatalog>,
    mut stop: watch::Receiver<bool>,
) {
    let counters = &shared.counters;
    let mut buf: Vec<u8> = Vec::with_capacity(2048);
    loop {
        let req = match read_request(&mut stream, &mut buf, &shared.config, &mut stop).await {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(resp) => {
                counters.bad_requests.fetch_add(1, Ordering::Relaxed);
                if let Some(resp) = resp {
                    let _ = write_response(&mut stream, resp, false, shared).await;
                }
                return;
            }
        };
        counters.requests.fetch_add(1, Ordering::Relaxed);
        let mut resp = route(&req, peer, shared, &catalog).await;
        let keep_alive = req.keep_alive && !req.has_body && !resp.close;
        resp.close = !keep_alive;
        debug!(%peer, method = %req.method, target = %req.raw_target, status = resp.status, "boot HTTP");
        if let Err(e) = write_response(&mut stream, resp, req.head_only(), shared).await {
            counters.aborted.fetch_add(1, Ordering::Relaxed);
            debug!(%peer, target = %req.raw_target, error = %bc_error_chain::InlineErrorChain::new(&e), "boot HTTP response cut");
            return;
        }
        if !keep_alive {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

/// `Ok(None)`: the client closed (or went idle, or shutdown) between requests. `Err(Some(resp))`: answer then close.
async fn read_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    config: &HttpConfig,
    stop: &mut watch::Receiver<bool>,
) -> Result<Option<RequestHead>, Option<Response>> {
    // The head timeout runs from its first byte; waiting for that byte is the idle timeout.
    let mut head_started = (!buf.is_empty()).then(tokio::time::Instant::now);
    loop {
        if !buf.is_empty() {
            match request::parse(buf) {
                Ok(Parsed::Complete { head, len }) => {
                    buf.drain(..len);
                    return Ok(Some(*head));
                }
                Ok(Parsed::Partial) => {}
                Err(Rejection { status, message }) => {
                    return Err(Some(closing(Response::text(status, message))));
                }
            }
        }
        let idle = buf.is_empty();
        let limit = if idle {
            config.idle_timeout
        } else {
            let started = *head_started.get_or_insert_with(tokio::time::Instant::now);
            config.header_timeout.saturating_sub(started.elapsed())
        };
        let read = async {
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await?;
            buf.extend_from_slice(&chunk[..n]);
            Ok::<usize, io::Error>(n)
        };
        let n = tokio::select! {
            r = tokio::time::timeout(limit, read) => r,
            _ = stop.changed(), if idle => return Ok(None),
        };
        match n {
            Ok(Ok(0)) if idle => return Ok(None),
            Ok(Ok(0)) | Ok(Err(_)) => return Err(None),
            Ok(Ok(_)) => {}
            Err(_) if idle => return Ok(None),
            Err(_) => return Err(Some(closing(Response::text(408, "request head timed out")))),
        }
    }
}

fn closing(mut r: Response) -> Response {
    r.close = true;
    r
}

async fn route(
    req: &RequestHead,
    peer: SocketAddr,
    shared: &Shared,
    catalog: &watch::Receiver<BootCatalog>,
) -> Response {
    let counters = &shared.counters;
    let refused = |r: Response| {
        counters.refused.fetch_add(1, Ordering::Relaxed);
        r
    };
    if req.has_body {
        return refused(closing(Response::text(
            413,
            "this server takes no request bodies",
        )));
    }
    if req.method != "GET" && req.method != "HEAD" {
        let mut r = Response::text(
            405,
            format!("method {} is not served; use GET or HEAD", req.method),
        );
        r.headers.push(("Allow", "GET, HEAD".into()));
        return refused(r);
    }
    let Some(target) = &req.target else {
        return refused(Response::text(
            400,
            "the request target must be a path (/ipxe/<loader>) or an http URI",
        ));
    };
    let path = match super::request::target_path(target) {
        Ok(path) => path,
        Err(why) => return refused(Response::text(400, why)),
    };
    if let Some(name) = path.strip_prefix("/boot/") {
        return boot_script(name, peer, counters, catalog);
    }
    if let Some(name) = path.strip_prefix("/ipxe/") {
        return file(&shared.loaders, name, req, counters).await;
    }
    if let Some(name) = path.strip_prefix("/artifacts/") {
        return file(&shared.artifacts, name, req, counters).await;
    }
    counters.not_found.fetch_add(1, Ordering::Relaxed);
    Response::text(
        404,
        "no such route: served are /boot/<mac>.ipxe, /ipxe/<loader>, /artifacts/<path>",
    )
}

fn boot_script(
    name: &str,
    peer: SocketAddr,
    counters: &HttpCounters,
    catalog: &watch::Receiver<BootCatalog>,
) -> Response {
    let not_found = |msg: String| {
        counters.not_found.fetch_add(1, Ordering::Relaxed);
        Response::text(404, msg)
    };
    let Some(mac) = name.strip_suffix(".ipxe") else {
        return not_found("boot scripts are named /boot/<mac>.ipxe".into());
    };
    let mac: MacAddr = match mac.parse() {
        Ok(mac) => mac,
        Err(e) => {
            return not_found(format!(
                "invalid MAC in /boot/<mac>.ipxe: expected six hex bytes separated by ':' or '-' ({})",
                e.why
            ));
        }
    };
    let rendered = match catalog.borrow().get(&mac) {
        None => {
            return not_found(format!(
                "no desired boot for {mac}: the control plane has not marked this machine for netboot"
            ));
        }
        Some(boot) => render_script(&mac, boot),
    };
    match rendered {
        Ok(script) => {
            counters.scripts.fetch_add(1, Ordering::Relaxed);
            info!(%mac, %peer, "served iPXE script");
            Response {
                status: 200,
                headers: vec![("Content-Type", "text/plain; charset=utf-8".into())],
                body: Body::Text(script),
                close: false,
            }
        }
        Err(e) => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            warn!(%mac, error = %bc_error_chain::InlineErrorChain::new(&e), "refusing to render iPXE script");
            Response::text(500, e.to_string())
        }
    }
}

async fn file(
    root: &ServeRoot,
    name: &str,
    req: &RequestHead,
    counters: &HttpCounters,
) -> Response {
    let root = root.clone();
    let owned = name.to_owned();
    let opened = tokio::task::spawn_blocking(move || {
        let (file, len) = root.open(&owned)?;
        let modified = file.metadata().ok().and_then(|m| m.modified().ok());
        Ok::<_, crate::tftp::root::Refusal>((file, len, modified))
    })
    .await;
    // Bodies name neither the file nor the path: what the client sent is not echoed (it is in the debug log).
    let (file, len, modified) = match opened {
        Ok(Ok(found)) => found,
        Ok(Err(refusal)) => {
            let status = match refusal.code {
                ErrorCode::FileNotFound => {
                    counters.not_found.fetch_add(1, Ordering::Relaxed);
                    404
                }
                ErrorCode::AccessViolation => {
                    counters.refused.fetch_add(1, Ordering::Relaxed);
                    403
                }
                _ => 500,
            };
            debug!(name, detail = %refusal.detail, status, "boot HTTP file refused");
            return Response::text(status, refusal.message);
        }
        Err(e) => {
            warn!(name, error = %bc_error_chain::InlineErrorChain::new(&e), "boot HTTP file open task failed");
            return Response::text(500, "the file could not be opened");
        }
    };
    let secs = modified
        .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let validators = Validators::for_file(secs, len);
    let last_modified = validators.last_modified();
    let mut headers = vec![
        ("Content-Type", "application/octet-stream".to_owned()),
        ("Accept-Ranges", "bytes".to_owned()),
        ("ETag", validators.etag.clone()),
        ("Last-Modified", last_modified),
    ];
    // Only GET and HEAD reach here.
    match conditional::evaluate(&req.conditions, true, &validators) {
        Precondition::Proceed => {}
        Precondition::NotModified => {
            counters.not_modified.fetch_add(1, Ordering::Relaxed);
            headers.retain(|(n, _)| *n != "Content-Type");
            return Response {
                status: 304,
                headers,
                body: Body::None,
                close: false,
            };
        }
        Precondition::Failed => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            return Response::text(412, "precondition failed: the file has changed");
        }
    }
    // If-Range: the range applies only to the representation the client already has.
    let range_header = match &req.if_range {
        Some(v) if !conditional::if_range_holds(v, &validators) => None,
        _ => req.range.as_deref(),
    };
    let (status, first, count) = match range::decide(range_header, len) {
        RangeDecision::Full => (200, 0, len),
        RangeDecision::Partial { first, last } => {
            headers.push(("Content-Range", format!("bytes {first}-{last}/{len}")));
            (206, first, last - first + 1)
        }
        RangeDecision::Unsatisfiable => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            headers.retain(|(n, _)| *n != "Content-Type");
            headers.push(("Content-Range", format!("bytes */{len}")));
            let mut r = Response::text(
                416,
                format!("range not satisfiable: the file has {len} bytes"),
            );
            r.headers.extend(headers);
            return r;
        }
    };
    counters.files.fetch_add(1, Ordering::Relaxed);
    Response {
        status,
        headers,
        body: Body::File {
            file,
            first,
            len: count,
        },
        close: false,
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        304 => "Not Modified",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        412 => "Precondition Failed",
        416 => "Range Not Satisfiable",
        431 => "Request Header Fields Too Large",
        _ => "Internal Server Error",
    }
}

async fn write_response(
    stream: &mut TcpStream,
    resp: Response,
    head_only: bool,
    shared: &Shared,
) -> io::Result<()> {
    let mut head = String::with_capacity(256);
    let _ = write!(head, "HTTP/1.1 {} {}\r\n", resp.status, reason(resp.status));
    let _ = write!(
        head,
        "Server: bcd-site\r\nDate: {}\r\n",
        httpdate::fmt_http_date(SystemTime::now())
    );
    if !matches!(resp.body, Body::None) {
        let _ = write!(head, "Content-Length: {}\r\n", resp.body_len());
    }
    for (name, value) in &resp.headers {
        let _ = write!(head, "{name}: {value}\r\n");
    }
    head.push_str(if resp.close {
        "Connection: close\r\n\r\n"
    } else {
        "Connection: keep-alive\r\n\r\n"
    });
    let timeout = shared.config.write_timeout;
    let mut out = head.into_bytes();
    match resp.body {
        Body::Text(text) if !head_only => out.extend_from_slice(text.as_bytes()),
        Body::File { file, first, len } if !head_only => {
            timed(timeout, stream.write_all(&out)).await?;
            let sent = send_file(stream, &file, first, len, timeout, shared).await;
            return sent;
        }
        _ => {}
    }
    timed(timeout, stream.write_all(&out)).await
}

async fn timed<T>(limit: Duration, f: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "client stopped reading"))?
}

/// `sendfile(2)` from `file` at `first` for `len` bytes, waiting for socket writability in between.
async fn send_file(
    stream: &TcpStream,
    file: &File,
    first: u64,
    len: u64,
    timeout: Duration,
    shared: &Shared,
) -> io::Result<()> {
    let mut offset = first;
    let end = first + len;
    while offset < end {
        let want = usize::try_from(end - offset)
            .unwrap_or(usize::MAX)
            .min(SENDFILE_CHUNK);
        let n = timed(
            timeout,
            stream.async_io(Interest::WRITABLE, || {
                rustix::fs::sendfile(stream, file, Some(&mut offset), want).map_err(io::Error::from)
            }),
        )
        .await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while being sent",
            ));
        }
        shared
            .counters
            .bytes_sent
            .fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}
