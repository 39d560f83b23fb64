//! Tunnel frames on a byte stream: the link between `better-compute tunnel` and the API process, after the HTTP
//! upgrade (`Upgrade: bc-tunnel/1`). Each frame is a 4-byte big-endian length then one encoded [`v1::TunnelFrame`]
//! (the same frames as the gateway's `TunnelService`, so a refusal's code and reason reach the operator unchanged).
//! A length over [`MAX_ENCODED`] or a frame that does not decode is an error naming it; nothing is buffered beyond
//! one frame.

use crate::v1;
use prost::Message as _;
/// The type of a data frame's bytes (`prost::bytes`), for the parties that build frames.
pub use prost::bytes;
use prost::bytes::{Buf as _, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The HTTP `Upgrade` token of the API's tunnel route.
pub const UPGRADE: &str = "bc-tunnel/1";

/// Largest `data` payload a party sends in one frame.
pub const MAX_DATA: usize = 64 * 1024;

/// Largest encoded frame accepted: a full data frame plus its tag and length, or a close with a long reason.
pub const MAX_ENCODED: usize = MAX_DATA + 1024;

/// HTTP/2 window of one tunnel stream: 1 Gbit/s × 50 ms is 6.25 MB; 8 MiB leaves room.
pub const STREAM_WINDOW: u32 = 8 << 20;

/// Largest HTTP/2 DATA frame a gateway and a daemon accept from each other (SETTINGS_MAX_FRAME_SIZE; the default is
/// 16 KiB): a whole tunnel message (a full data frame with its gRPC prefix) fits in one, not four.
pub const H2_MAX_FRAME: u32 = 128 * 1024;

/// Tunnels of one node at once, on the node and at a gateway.
pub const MAX_PER_NODE: u32 = 128;

/// Each end's backstop for a tunnel whose peer takes nothing: the node's for a tunnel that moves no byte either way
/// or whose gateway or local port stopped reading, `better-compute tunnel`'s for a local connection that stopped
/// reading. Longer than the control plane's idle limit (configurable, 1 h by default), which closes idle tunnels
/// first.
pub const IDLE_BACKSTOP: std::time::Duration = std::time::Duration::from_secs(2 * 3600);

/// HTTP/2 window of a daemon's connection: every tunnel at its full stream window plus one more for the Session
/// and the rest (HTTP/2's largest window is 2^31-1).
pub const CONNECTION_WINDOW: u32 = STREAM_WINDOW * (MAX_PER_NODE + 1);

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("tunnel link: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "tunnel frame of {0} bytes is larger than {MAX_ENCODED}: the peer is not speaking {UPGRADE}"
    )]
    TooLarge(usize),
    #[error("tunnel frame does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// The frame `f` as it goes on the link.
pub fn encode(f: &v1::TunnelFrame, out: &mut Vec<u8>) {
    let len = f.encoded_len();
    out.reserve(4 + len);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    f.encode(out).unwrap_or_default();
}

/// The first whole frame of `buf` and the bytes it used, or None when `buf` holds less than one frame.
pub fn decode(buf: &[u8]) -> Result<Option<(v1::TunnelFrame, usize)>, FrameError> {
    let Some(used) = whole_frame(buf)? else {
        return Ok(None);
    };
    Ok(Some((v1::TunnelFrame::decode(&buf[4..used])?, used)))
}

/// The length (with its 4-byte prefix) of the whole frame at the start of `buf`, or None when `buf` holds less.
fn whole_frame(buf: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(head) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(*head) as usize;
    if len > MAX_ENCODED {
        return Err(FrameError::TooLarge(len));
    }
    Ok((buf.len() >= 4 + len).then_some(4 + len))
}

/// What [`FrameReader`] reads at once: several full frames per read system call.
pub const READ_BUFFER: usize = 4 * MAX_ENCODED;

/// Reads frames from a link, several per read system call, into memory it gives back whenever no byte is pending:
/// an idle tunnel holds no buffer here. A frame's data is a slice of that memory, not a copy.
pub struct FrameReader<R> {
    inner: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> FrameReader<R> {
        FrameReader {
            inner,
            buf: BytesMut::new(),
        }
    }

    /// The next frame; Ok(None) at a clean end of the stream between frames.
    pub async fn next(&mut self) -> Result<Option<v1::TunnelFrame>, FrameError> {
        loop {
            if let Some(used) = whole_frame(&self.buf)? {
                let mut whole = self.buf.split_to(used);
                whole.advance(4);
                if self.buf.is_empty() {
                    // Nothing pending: the memory goes once the frames sliced from it are dropped.
                    self.buf = BytesMut::new();
                }
                return Ok(Some(v1::TunnelFrame::decode(whole.freeze())?));
            }
            // Less than a frame pending: read into spare capacity (reserving moves the pending bytes to the front
            // of new memory when the old is still shared with frames handed out).
            if self.buf.capacity() - self.buf.len() < MAX_ENCODED {
                self.buf.reserve(READ_BUFFER);
            }
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                return match self.buf.is_empty() {
                    true => Ok(None),
                    false => Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "the link ended inside a frame ({} bytes of it)",
                            self.buf.len()
                        ),
                    )
                    .into()),
                };
            }
        }
    }
}

/// Writes one frame and flushes it.
pub async fn write<W: AsyncWrite + Unpin>(
    w: &mut W,
    f: &v1::TunnelFrame,
) -> Result<(), FrameError> {
    let mut out = Vec::new();
    encode(f, &mut out);
    w.write_all(&out).await?;
    w.flush().await?;
    Ok(())
}

/// How [`write_reading_ahead`]'s write to a local peer ended.
#[derive(Debug)]
pub enum Written {
    /// The write went through, or failed.
    Done(std::io::Result<()>),
    /// What was read ahead ends the tunnel (a close, the link's end or its failure): the write is abandoned.
    Abandoned,
    /// The peer took nothing for the backstop.
    TimedOut,
}

/// Whether a frame leaves the tunnel open for what follows it: data or a half-close (a close ends it).
pub fn carries_on(f: &v1::TunnelFrame) -> bool {
    matches!(
        f.frame,
        Some(v1::tunnel_frame::Frame::Data(_) | v1::tunnel_frame::Frame::HalfClose(_))
    )
}

/// Writes `data` to `w`, a local peer that may stop reading, while `next` (a cancel-safe read of the link's next
/// frame) runs beside it: what it reads is returned for the caller to handle next, and when `ends` holds for it the
/// write is abandoned, so a close behind a blocked write ends the tunnel at once. The write has `backstop` as its
/// deadline. A tunnel's end relays with this toward its local side: the node toward its local port, the CLI toward
/// the operator's program.
pub async fn write_reading_ahead<W, T>(
    w: &mut W,
    data: &[u8],
    next: impl Future<Output = T>,
    ends: impl Fn(&T) -> bool,
    backstop: std::time::Duration,
) -> (Written, Option<T>)
where
    W: AsyncWrite + Unpin,
{
    let write = w.write_all(data);
    let deadline = tokio::time::sleep(backstop);
    tokio::pin!(write, deadline, next);
    let mut read = None;
    loop {
        tokio::select! {
            r = &mut write => return (Written::Done(r), read),
            n = &mut next, if read.is_none() => {
                let end = ends(&n);
                read = Some(n);
                if end {
                    return (Written::Abandoned, read);
                }
            }
            () = &mut deadline => return (Written::TimedOut, read),
        }
    }
}

/// A frame of `f`.
pub fn frame(f: v1::tunnel_frame::Frame) -> v1::TunnelFrame {
    v1::TunnelFrame { frame: Some(f) }
}

/// A `close` frame.
pub fn close(code: v1::TunnelCloseCode, reason: impl Into<String>) -> v1::TunnelFrame {
    frame(v1::tunnel_frame::Frame::Close(v1::TunnelClose {
        code: code as i32,
        reason: reason.into(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use v1::tunnel_frame::Frame;

    #[tokio::test]
    async fn the_frame_reader_reads_frames_split_anywhere_and_holds_nothing_between_them() {
        let frames = [
            frame(Frame::Data(vec![1u8; MAX_DATA].into())),
            frame(Frame::Data(vec![2u8; 10].into())),
            close(v1::TunnelCloseCode::DialRefused, "nothing listens"),
        ];
        let mut wire = Vec::new();
        for f in &frames {
            encode(f, &mut wire);
        }
        // Delivered in odd pieces: every boundary falls inside a header or a body somewhere.
        let (mut tx, rx) = tokio::io::duplex(7 * 1024);
        let writer = tokio::spawn(async move {
            for piece in wire.chunks(3_001) {
                tx.write_all(piece).await.expect("write");
            }
        });
        let mut r = FrameReader::new(rx);
        for f in &frames {
            assert_eq!(r.next().await.expect("a frame").as_ref(), Some(f));
        }
        assert_eq!(
            r.buf.capacity(),
            0,
            "nothing held once every byte read is a frame"
        );
        writer.await.expect("writer");
        assert!(r.next().await.expect("clean end").is_none());
        // A stream that ends inside a frame is an error, not a clean end.
        let mut cut = Vec::new();
        encode(&frames[0], &mut cut);
        cut.truncate(100);
        let mut r = FrameReader::new(cut.as_slice());
        assert!(r.next().await.is_err());
        // A length over the limit is refused before anything that large is read.
        let big = ((MAX_ENCODED + 1) as u32).to_be_bytes();
        let mut r = FrameReader::new(&big[..]);
        assert!(matches!(r.next().await, Err(FrameError::TooLarge(_))));
    }

    #[tokio::test]
    async fn frames_round_trip_and_a_bad_length_is_named() {
        let frames = [
            frame(Frame::Data(vec![7u8; MAX_DATA].into())),
            frame(Frame::HalfClose(v1::TunnelHalfClose {})),
            close(v1::TunnelCloseCode::DialRefused, "nothing listens"),
        ];
        let mut wire = Vec::new();
        for f in &frames {
            encode(f, &mut wire);
        }
        let mut at = 0;
        for f in &frames {
            assert_eq!(decode(&wire[at..at + 3]).ok().flatten(), None);
            let (got, used) = decode(&wire[at..]).ok().flatten().expect("a frame");
            assert_eq!(&got, f);
            at += used;
        }
        let mut r = FrameReader::new(wire.as_slice());
        for f in &frames {
            assert_eq!(r.next().await.ok().flatten().as_ref(), Some(f));
        }
        assert!(matches!(r.next().await, Ok(None)));
        let big = ((MAX_ENCODED + 1) as u32).to_be_bytes();
        let e = decode(&big)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("larger than"), "{e}");
    }
}
