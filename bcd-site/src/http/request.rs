//! The request head, sans I/O: [`parse`] turns the bytes a client sent into a [`RequestHead`] or a
//! [`Rejection`] (the response to send before closing), by RFC 9112:
//! - `Host` (§3.2): an HTTP/1.1 request without one, any request with two, or one with a value that is no
//!   `uri-host [ ":" port ]`, is refused with 400.
//! - The request target (§3.2): origin-form (`/path?query`) and absolute-form (`http://host/path`, §3.2.2: the
//!   path is served as if it came in origin-form, the `Host` field is not consulted) are accepted; anything else
//!   (asterisk-form, authority-form, a relative path) is answered 400 once the method was found servable.
//! - Heads over [`MAX_HEAD`] bytes or with more than [`MAX_HEADERS`] fields get 431.
//!
//! Rejections never echo what the client sent.

#![deny(clippy::disallowed_methods)]

use super::conditional::Conditions;

/// Request heads larger than this are refused with 431.
pub const MAX_HEAD: usize = 16 * 1024;
/// Header fields one request may carry.
pub const MAX_HEADERS: usize = 48;

/// The parts of a request head this server uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// The request target as sent, for the debug log.
    pub raw_target: String,
    /// The target in origin form (`/path?query`), also when it came in absolute form; `None` when it came in
    /// neither.
    pub target: Option<String>,
    /// HTTP/1.x minor version.
    pub version: u8,
    pub keep_alive: bool,
    /// The client announced a body (`Content-Length` other than 0, or `Transfer-Encoding`).
    pub has_body: bool,
    pub range: Option<String>,
    pub if_range: Option<String>,
    pub conditions: Conditions,
}

impl RequestHead {
    /// HEAD: the response carries the headers of a GET and no body.
    pub fn head_only(&self) -> bool {
        self.method == "HEAD"
    }
}

/// A request refused before routing: answer `status` with `message`, then close the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub message: &'static str,
}

/// What [`parse`] found in the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// More bytes are needed.
    Partial,
    /// A whole head of `len` bytes (what follows belongs to the next request).
    Complete { head: Box<RequestHead>, len: usize },
}

/// Parses the request head at the start of `buf`. Pure.
pub fn parse(buf: &[u8]) -> Result<Parsed, Rejection> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => Ok(Parsed::Complete {
            head: Box::new(head(&req)?),
            len,
        }),
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Err(Rejection {
            status: 431,
            message: "request head too large",
        }),
        Ok(httparse::Status::Partial) => Ok(Parsed::Partial),
        Err(httparse::Error::TooManyHeaders) => Err(Rejection {
            status: 431,
            message: "too many request headers",
        }),
        Err(_) => Err(Rejection {
            status: 400,
            message: "malformed request head",
        }),
    }
}

fn head(req: &httparse::Request<'_, '_>) -> Result<RequestHead, Rejection> {
    let bad = |message| Rejection {
        status: 400,
        message,
    };
    let method = req.method.unwrap_or_default().to_owned();
    let raw_target = req.path.unwrap_or_default().to_owned();
    let version = req.version.unwrap_or(1);
    let fields = &*req.headers;
    let values = |name: &'static str| values(fields, name);
    // One field value (the first line's); a value that is not UTF-8 counts as absent.
    let header = |name: &'static str| values(name).next().and_then(Result::ok).map(str::to_owned);
    // A list-valued field sent as several lines is one list (RFC 9110 §5.3).
    let list = |name: &'static str| {
        let parts: Vec<&str> = values(name).filter_map(Result::ok).collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    };

    let mut hosts = values("host");
    match (hosts.next(), hosts.next()) {
        (None, _) if version >= 1 => {
            return Err(bad(
                "an HTTP/1.1 request must carry a Host header (RFC 9112 section 3.2)",
            ));
        }
        (Some(_), Some(_)) => return Err(bad("more than one Host header (RFC 9112 section 3.2)")),
        (Some(Err(_)), None) => return Err(bad("the Host header is not valid")),
        (Some(Ok(host)), None) if !valid_host(host) => {
            return Err(bad("the Host header is not a host[:port]"));
        }
        _ => {}
    }
    let target = origin_form(&raw_target).map_err(bad)?;

    let connection = list("connection").unwrap_or_default().to_ascii_lowercase();
    let has_token = |t: &str| connection.split(',').any(|c| c.trim() == t);
    let keep_alive = if version >= 1 {
        !has_token("close")
    } else {
        has_token("keep-alive")
    };
    let has_body = values("transfer-encoding").next().is_some()
        || values("content-length").any(|v| v != Ok("0"));
    // A date field sent twice is invalid and ignored (RFC 9110 §13.1.3, §13.1.4).
    let single = |name: &'static str| {
        let mut v = values(name);
        match (v.next(), v.next()) {
            (Some(Ok(one)), None) => Some(one.to_owned()),
            _ => None,
        }
    };
    Ok(RequestHead {
        method,
        raw_target,
        target,
        version,
        keep_alive,
        has_body,
        range: header("range"),
        if_range: header("if-range"),
        conditions: Conditions {
            if_match: list("if-match"),
            if_none_match: list("if-none-match"),
            if_modified_since: single("if-modified-since"),
            if_unmodified_since: single("if-unmodified-since"),
        },
    })
}

/// The values of every `name` field line, trimmed; `Err` for one that is not UTF-8.
fn values<'h>(
    fields: &'h [httparse::Header<'h>],
    name: &'static str,
) -> impl Iterator<Item = Result<&'h str, std::str::Utf8Error>> + 'h {
    fields
        .iter()
        .filter(move |h| h.name.eq_ignore_ascii_case(name))
        .map(|h| std::str::from_utf8(h.value).map(str::trim))
}

/// `uri-host [ ":" port ]` (RFC 9110 §7.2), checked by characters: reg-name, IPv4 or an IP literal in brackets,
/// and a decimal port. Empty is valid (a target without authority).
fn valid_host(host: &str) -> bool {
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((literal, after)) => {
                if literal.is_empty()
                    || !literal
                        .bytes()
                        .all(|b| b.is_ascii_hexdigit() || b":.vV".contains(&b) || sub_delim(b))
                {
                    return false;
                }
                match after {
                    "" => return true,
                    p => match p.strip_prefix(':') {
                        Some(port) => ("", port),
                        None => return false,
                    },
                }
            }
            None => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, port)) => (name, port),
            None => (host, ""),
        },
    };
    name.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~%".contains(&b) || sub_delim(b))
        && port.bytes().all(|b| b.is_ascii_digit())
}

fn sub_delim(b: u8) -> bool {
    b"!$&'()*+,;=".contains(&b)
}

/// The origin-form of `target`: itself when it starts with `/`, the path and query of an `http(s)://` URI
/// (`/` when it has none), `None` for the other forms. An absolute URI with an empty host is invalid (RFC 9110
/// §4.2.1).
fn origin_form(target: &str) -> Result<Option<String>, &'static str> {
    if target.starts_with('/') {
        return Ok(Some(target.to_owned()));
    }
    let Some((scheme, rest)) = target.split_once("://") else {
        return Ok(None);
    };
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err("the request target is an absolute URI of a scheme other than http(s)");
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host.is_empty() || host.starts_with(':') {
        return Err("the request target is an http URI without a host");
    }
    Ok(Some(match path.chars().next() {
        Some('/') => path.to_owned(),
        _ => format!("/{path}"),
    }))
}

/// The path a request target names, percent-decoded (query and fragment dropped): what the routes match and the
/// file roots resolve. Refused (the 400's reason): a path that does not decode to UTF-8, or holds NUL.
pub fn target_path(target: &str) -> Result<String, &'static str> {
    let raw = target.split(['?', '#']).next().unwrap_or_default();
    let path = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| "path is not valid UTF-8")?;
    if path.contains('\0') {
        return Err("path contains NUL");
    }
    Ok(path.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Result<RequestHead, Rejection> {
        match parse(text.as_bytes())? {
            Parsed::Complete { head, len } => {
                assert_eq!(len, text.len());
                Ok(*head)
            }
            Parsed::Partial => panic!("partial: {text:?}"),
        }
    }

    fn status(text: &str) -> u16 {
        parsed(text).map_or_else(|r| r.status, |_| 200)
    }

    #[test]
    fn host_is_required_once_in_http_1_1() {
        assert_eq!(status("GET / HTTP/1.1\r\nHost: a\r\n\r\n"), 200);
        assert_eq!(status("GET / HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(status("GET / HTTP/1.0\r\n\r\n"), 200);
        assert_eq!(status("GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n"), 400);
        assert_eq!(status("GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n"), 400);
        for ok in [
            "",
            "10.0.0.2",
            "10.0.0.2:8080",
            "boot.example",
            "[fe80::1]",
            "[::1]:80",
        ] {
            assert_eq!(
                status(&format!("GET / HTTP/1.1\r\nHost: {ok}\r\n\r\n")),
                200,
                "{ok}"
            );
        }
        for bad in ["a b", "a/b", "a:x", "[::1", "[::1]x", "a@b", "[]"] {
            assert_eq!(
                status(&format!("GET / HTTP/1.1\r\nHost: {bad}\r\n\r\n")),
                400,
                "{bad}"
            );
        }
    }

    #[test]
    fn absolute_form_is_served_as_its_path() -> Result<(), Rejection> {
        let target =
            |t: &str| parsed(&format!("GET {t} HTTP/1.1\r\nHost: x\r\n\r\n")).map(|h| h.target);
        assert_eq!(target("/ipxe/a.efi")?, Some("/ipxe/a.efi".into()));
        assert_eq!(
            target("http://10.0.0.2/ipxe/a.efi")?,
            Some("/ipxe/a.efi".into())
        );
        assert_eq!(
            target("HTTP://10.0.0.2:8080/ipxe/a.efi?x=1")?,
            Some("/ipxe/a.efi?x=1".into())
        );
        assert_eq!(target("http://10.0.0.2")?, Some("/".into()));
        assert_eq!(target("http://h?q")?, Some("/?q".into()));
        assert_eq!(target("*")?, None);
        assert_eq!(target("10.0.0.2:80")?, None);
        assert_eq!(target("http:///ipxe/a.efi").map_err(|r| r.status), Err(400));
        assert_eq!(target("ftp://h/ipxe/a.efi").map_err(|r| r.status), Err(400));
        Ok(())
    }

    #[test]
    fn lists_join_lines_and_dates_must_be_single() -> Result<(), Rejection> {
        let h = parsed(
            "GET / HTTP/1.1\r\nHost: x\r\nIf-None-Match: \"a\"\r\nIf-None-Match: W/\"b\"\r\n\
             If-Modified-Since: Sun, 06 Nov 1994 08:49:37 GMT\r\nIf-Unmodified-Since: x\r\n\
             If-Unmodified-Since: y\r\n\r\n",
        )?;
        assert_eq!(
            h.conditions.if_none_match.as_deref(),
            Some("\"a\", W/\"b\"")
        );
        assert_eq!(
            h.conditions.if_modified_since.as_deref(),
            Some("Sun, 06 Nov 1994 08:49:37 GMT")
        );
        assert_eq!(h.conditions.if_unmodified_since, None);
        Ok(())
    }

    #[test]
    fn limits_and_garbage() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\nHost: x\r\n"), Ok(Parsed::Partial));
        let big = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(parse(big.as_bytes()).map_err(|r| r.status), Err(431));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: 1\r\n")).collect();
        let many = format!("GET / HTTP/1.1\r\nHost: x\r\n{many}\r\n");
        assert_eq!(parse(many.as_bytes()).map_err(|r| r.status), Err(431));
        assert_eq!(
            parse(b"\x00\x01 nonsense\r\n\r\n").map_err(|r| r.status),
            Err(400)
        );
    }
}
