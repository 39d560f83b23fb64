//! TFTP packets, sans I/O: RFC 1350 (RRQ, WRQ, DATA, ACK, ERROR), RFC 2347 (OACK and options), with the
//! option values of RFC 2348 (blksize), 2349 (timeout, tsize) and 7440 (windowsize) parsed into
//! [`RequestOptions`]. [`Packet::decode`] never panics on any input.

#![deny(clippy::disallowed_methods)]

use std::fmt;

const OP_RRQ: u16 = 1;
const OP_WRQ: u16 = 2;
const OP_DATA: u16 = 3;
const OP_ACK: u16 = 4;
const OP_ERROR: u16 = 5;
const OP_OACK: u16 = 6;

/// TFTP error codes (RFC 1350, RFC 2347).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    NotDefined,
    FileNotFound,
    AccessViolation,
    DiskFull,
    IllegalOperation,
    UnknownTransferId,
    FileExists,
    NoSuchUser,
    OptionRefused,
    Other(u16),
}

impl From<u16> for ErrorCode {
    fn from(n: u16) -> Self {
        match n {
            0 => ErrorCode::NotDefined,
            1 => ErrorCode::FileNotFound,
            2 => ErrorCode::AccessViolation,
            3 => ErrorCode::DiskFull,
            4 => ErrorCode::IllegalOperation,
            5 => ErrorCode::UnknownTransferId,
            6 => ErrorCode::FileExists,
            7 => ErrorCode::NoSuchUser,
            8 => ErrorCode::OptionRefused,
            n => ErrorCode::Other(n),
        }
    }
}

impl From<ErrorCode> for u16 {
    fn from(c: ErrorCode) -> Self {
        match c {
            ErrorCode::NotDefined => 0,
            ErrorCode::FileNotFound => 1,
            ErrorCode::AccessViolation => 2,
            ErrorCode::DiskFull => 3,
            ErrorCode::IllegalOperation => 4,
            ErrorCode::UnknownTransferId => 5,
            ErrorCode::FileExists => 6,
            ErrorCode::NoSuchUser => 7,
            ErrorCode::OptionRefused => 8,
            ErrorCode::Other(n) => n,
        }
    }
}

/// Transfer mode of a request. Only `octet` is served; the others are parsed so they can be refused by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Octet,
    Netascii,
    Mail,
}

/// The options of RFC 2347–2349 and 7440 as the client sent them (values not yet checked against limits).
/// Unknown options are dropped: a server answers only the options it understands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOptions {
    pub blksize: Option<u64>,
    pub timeout: Option<u64>,
    pub tsize: Option<u64>,
    pub windowsize: Option<u64>,
}

/// A read or write request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub filename: String,
    pub mode: Mode,
    pub options: RequestOptions,
}

/// One TFTP packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet<'a> {
    Rrq(Request),
    Wrq(Request),
    Data { block: u16, data: &'a [u8] },
    Ack { block: u16 },
    Error { code: ErrorCode, message: String },
    Oack(Vec<(String, String)>),
}

/// Why bytes are not a TFTP packet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("packet of {len} bytes is too short")]
    TooShort { len: usize },
    #[error("unknown opcode {opcode}")]
    UnknownOpcode { opcode: u16 },
    #[error("{field} is not NUL-terminated")]
    Unterminated { field: &'static str },
    #[error("{field} is not UTF-8")]
    NotUtf8 { field: &'static str },
    #[error("empty file name")]
    EmptyFilename,
    #[error("unknown transfer mode {mode:?}")]
    UnknownMode { mode: String },
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Octet => "octet",
            Mode::Netascii => "netascii",
            Mode::Mail => "mail",
        })
    }
}

/// Splits off one NUL-terminated UTF-8 string.
fn take_str<'a>(buf: &'a [u8], field: &'static str) -> Result<(&'a str, &'a [u8]), DecodeError> {
    let nul = buf
        .iter()
        .position(|&b| b == 0)
        .ok_or(DecodeError::Unterminated { field })?;
    let s = std::str::from_utf8(&buf[..nul]).map_err(|_| DecodeError::NotUtf8 { field })?;
    Ok((s, &buf[nul + 1..]))
}

fn decode_request(body: &[u8]) -> Result<Request, DecodeError> {
    let (filename, rest) = take_str(body, "file name")?;
    if filename.is_empty() {
        return Err(DecodeError::EmptyFilename);
    }
    let (mode, mut rest) = take_str(rest, "mode")?;
    let mode = match mode.to_ascii_lowercase().as_str() {
        "octet" => Mode::Octet,
        "netascii" => Mode::Netascii,
        "mail" => Mode::Mail,
        _ => {
            return Err(DecodeError::UnknownMode {
                mode: mode.to_owned(),
            });
        }
    };
    let mut options = RequestOptions::default();
    // Options are name/value pairs; a trailing fragment without its value is ignored, as are unknown names and
    // values that are not numbers (RFC 2347: the server omits options it does not accept).
    while !rest.is_empty() {
        let Ok((name, after_name)) = take_str(rest, "option name") else {
            break;
        };
        let Ok((value, after_value)) = take_str(after_name, "option value") else {
            break;
        };
        rest = after_value;
        let slot = match name.to_ascii_lowercase().as_str() {
            "blksize" => &mut options.blksize,
            "timeout" => &mut options.timeout,
            "tsize" => &mut options.tsize,
            "windowsize" => &mut options.windowsize,
            _ => continue,
        };
        if slot.is_none() {
            *slot = value.parse().ok();
        }
    }
    Ok(Request {
        filename: filename.to_owned(),
        mode,
        options,
    })
}

impl<'a> Packet<'a> {
    /// Decodes one datagram. Never panics.
    pub fn decode(buf: &'a [u8]) -> Result<Packet<'a>, DecodeError> {
        let [a, b, body @ ..] = buf else {
            return Err(DecodeError::TooShort { len: buf.len() });
        };
        let opcode = u16::from_be_bytes([*a, *b]);
        let block = || match body {
            [x, y, ..] => Ok(u16::from_be_bytes([*x, *y])),
            _ => Err(DecodeError::TooShort { len: buf.len() }),
        };
        match opcode {
            OP_RRQ => Ok(Packet::Rrq(decode_request(body)?)),
            OP_WRQ => Ok(Packet::Wrq(decode_request(body)?)),
            OP_DATA => Ok(Packet::Data {
                block: block()?,
                data: &body[2..],
            }),
            OP_ACK => Ok(Packet::Ack { block: block()? }),
            OP_ERROR => {
                let code = block()?.into();
                // Clients often send messages without the final NUL; take what is there.
                let text = &body[2..];
                let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
                Ok(Packet::Error {
                    code,
                    message: String::from_utf8_lossy(&text[..end]).into_owned(),
                })
            }
            OP_OACK => {
                let mut opts = Vec::new();
                let mut rest = body;
                while !rest.is_empty() {
                    let (name, r) = take_str(rest, "option name")?;
                    let (value, r) = take_str(r, "option value")?;
                    opts.push((name.to_owned(), value.to_owned()));
                    rest = r;
                }
                Ok(Packet::Oack(opts))
            }
            opcode => Err(DecodeError::UnknownOpcode { opcode }),
        }
    }

    /// Encodes this packet into `out` (cleared first).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        match self {
            Packet::Rrq(r) | Packet::Wrq(r) => {
                let op = if matches!(self, Packet::Rrq(_)) {
                    OP_RRQ
                } else {
                    OP_WRQ
                };
                out.extend_from_slice(&op.to_be_bytes());
                push_str(out, &r.filename);
                push_str(out, &r.mode.to_string());
                let o = &r.options;
                for (name, value) in [
                    ("blksize", o.blksize),
                    ("timeout", o.timeout),
                    ("tsize", o.tsize),
                    ("windowsize", o.windowsize),
                ] {
                    if let Some(v) = value {
                        push_str(out, name);
                        push_str(out, &v.to_string());
                    }
                }
            }
            Packet::Data { block, data } => encode_data(*block, data, out),
            Packet::Ack { block } => {
                out.extend_from_slice(&OP_ACK.to_be_bytes());
                out.extend_from_slice(&block.to_be_bytes());
            }
            Packet::Error { code, message } => encode_error(*code, message, out),
            Packet::Oack(opts) => {
                out.extend_from_slice(&OP_OACK.to_be_bytes());
                for (name, value) in opts {
                    push_str(out, name);
                    push_str(out, value);
                }
            }
        }
    }
}

fn push_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(s.as_bytes());
    out.push(0);
}

/// Encodes a DATA packet without building a [`Packet`] (the hot path).
pub fn encode_data(block: u16, data: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&OP_DATA.to_be_bytes());
    out.extend_from_slice(&block.to_be_bytes());
    out.extend_from_slice(data);
}

/// Encodes an ERROR packet. The message must not contain NUL (it would end early on the wire).
pub fn encode_error(code: ErrorCode, message: &str, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&OP_ERROR.to_be_bytes());
    out.extend_from_slice(&u16::from(code).to_be_bytes());
    out.extend(message.bytes().filter(|&b| b != 0));
    out.push(0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_rrq_with_options_case_insensitively() -> Result<(), DecodeError> {
        let raw = b"\x00\x01boot/snponly.efi\x00OCTET\x00BLKSIZE\x001468\x00tsize\x000\x00windowsize\x004\x00timeout\x003\x00x-vendor\x00y\x00";
        let Packet::Rrq(r) = Packet::decode(raw)? else {
            panic!("not an RRQ");
        };
        assert_eq!(r.filename, "boot/snponly.efi");
        assert_eq!(r.mode, Mode::Octet);
        assert_eq!(
            r.options,
            RequestOptions {
                blksize: Some(1468),
                timeout: Some(3),
                tsize: Some(0),
                windowsize: Some(4),
            }
        );
        Ok(())
    }

    #[test]
    fn rejects_malformed_requests() {
        assert_eq!(
            Packet::decode(b"\x00"),
            Err(DecodeError::TooShort { len: 1 })
        );
        assert!(matches!(
            Packet::decode(b"\x00\x01file"),
            Err(DecodeError::Unterminated { .. })
        ));
        assert_eq!(
            Packet::decode(b"\x00\x01\0octet\0"),
            Err(DecodeError::EmptyFilename)
        );
        assert!(matches!(
            Packet::decode(b"\x00\x01f\0binary\0"),
            Err(DecodeError::UnknownMode { .. })
        ));
        assert!(matches!(
            Packet::decode(b"\x00\x09"),
            Err(DecodeError::UnknownOpcode { opcode: 9 })
        ));
        assert!(matches!(
            Packet::decode(b"\x00\x04\x01"),
            Err(DecodeError::TooShort { .. })
        ));
    }

    #[test]
    fn encodes_what_clients_expect() {
        let mut out = Vec::new();
        encode_error(ErrorCode::FileNotFound, "no such file", &mut out);
        assert_eq!(out, b"\x00\x05\x00\x01no such file\0");
        Packet::Oack(vec![("tsize".into(), "42".into())]).encode(&mut out);
        assert_eq!(out, b"\x00\x06tsize\x0042\0");
        encode_data(0x0102, b"abc", &mut out);
        assert_eq!(out, b"\x00\x03\x01\x02abc");
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..700)) {
            let _ = Packet::decode(&bytes);
        }

        #[test]
        fn requests_round_trip(
            name in "[a-zA-Z0-9._/-]{1,40}",
            blksize in proptest::option::of(8u64..65465),
            tsize in proptest::option::of(any::<u64>()),
            windowsize in proptest::option::of(1u64..65536),
        ) {
            let req = Request {
                filename: name,
                mode: Mode::Octet,
                options: RequestOptions { blksize, timeout: None, tsize, windowsize },
            };
            let mut out = Vec::new();
            Packet::Rrq(req.clone()).encode(&mut out);
            prop_assert_eq!(Packet::decode(&out), Ok(Packet::Rrq(req)));
        }
    }
}
