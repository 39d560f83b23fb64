//! Decompression: raw, gzip (multi-member), xz (multi-stream) or zstd (multi-frame), chosen by the caller or by
//! the stream's magic bytes.

use std::io::{self, BufRead, Read};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    Raw,
    Gzip,
    Xz,
    Zstd,
}

/// What the request says about compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressionChoice {
    /// Decide from the first bytes of the stream ([`detect`]).
    Auto,
    Fixed(Compression),
}

/// Bytes [`detect`] needs to see to recognise every format.
pub const MAGIC_LEN: usize = 6;

/// Compression recognised from the stream's first bytes; anything unrecognised is `Raw`.
pub fn detect(prefix: &[u8]) -> Compression {
    if prefix.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if prefix.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Compression::Xz
    } else if prefix.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::Raw
    }
}

/// A decoder over a buffered source that can hand the source back when the compressed stream ends, so the caller
/// can check nothing follows it.
pub enum Decoder<R: BufRead> {
    Raw(R),
    Gzip(flate2::bufread::MultiGzDecoder<R>),
    Xz(liblzma::bufread::XzDecoder<R>),
    Zstd(zstd::stream::read::Decoder<'static, R>),
}

impl<R: BufRead> Decoder<R> {
    pub fn new(compression: Compression, source: R) -> io::Result<Self> {
        Ok(match compression {
            Compression::Raw => Self::Raw(source),
            Compression::Gzip => Self::Gzip(flate2::bufread::MultiGzDecoder::new(source)),
            Compression::Xz => Self::Xz(liblzma::bufread::XzDecoder::new_multi_decoder(source)),
            Compression::Zstd => Self::Zstd(zstd::stream::read::Decoder::with_buffer(source)?),
        })
    }

    /// The source, positioned after the last byte the decoder consumed.
    pub fn into_source(self) -> R {
        match self {
            Self::Raw(r) => r,
            Self::Gzip(d) => d.into_inner(),
            Self::Xz(d) => d.into_inner(),
            Self::Zstd(d) => d.finish(),
        }
    }
}

impl<R: BufRead> Read for Decoder<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Raw(r) => r.read(buf),
            Self::Gzip(d) => d.read(buf),
            Self::Xz(d) => d.read(buf),
            Self::Zstd(d) => d.read(buf),
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::Compression;
    use std::io::Write;

    /// `data` compressed with `compression` by the same libraries the pipeline decodes with.
    pub fn compress(compression: Compression, data: &[u8]) -> Vec<u8> {
        match compression {
            Compression::Raw => data.to_vec(),
            Compression::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(data).expect("in-memory gzip");
                e.finish().expect("in-memory gzip")
            }
            Compression::Xz => {
                let mut e = liblzma::write::XzEncoder::new(Vec::new(), 1);
                e.write_all(data).expect("in-memory xz");
                e.finish().expect("in-memory xz")
            }
            Compression::Zstd => zstd::encode_all(data, 3).expect("in-memory zstd"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::compress;
    use super::*;

    #[test]
    fn detects_each_format_by_magic() {
        for c in [Compression::Gzip, Compression::Xz, Compression::Zstd] {
            assert_eq!(detect(&compress(c, b"hello")), c);
        }
        assert_eq!(detect(b"\x00\x00\x00\x00\x00\x00"), Compression::Raw);
        assert_eq!(detect(b""), Compression::Raw);
        assert_eq!(detect(&[0x1f]), Compression::Raw);
    }

    #[test]
    fn concatenated_members_and_frames_decode_whole() {
        for c in [Compression::Gzip, Compression::Xz, Compression::Zstd] {
            let mut data = compress(c, b"first ");
            data.extend(compress(c, b"second"));
            let mut out = String::new();
            Decoder::new(c, &data[..])
                .and_then(|mut d| d.read_to_string(&mut out))
                .expect("decodes");
            assert_eq!(out, "first second", "{c:?}");
        }
    }

    #[test]
    fn truncated_compressed_streams_are_errors() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7919 % 251) as u8).collect();
        for c in [Compression::Gzip, Compression::Xz, Compression::Zstd] {
            let full = compress(c, &data);
            let cut = &full[..full.len() - 5];
            let mut out = Vec::new();
            let res = Decoder::new(c, cut).and_then(|mut d| d.read_to_end(&mut out));
            assert!(
                res.is_err(),
                "{c:?} accepted a truncated stream ({} bytes out)",
                out.len()
            );
        }
    }
}
