use std::io::{self, Read};

use proptest::prelude::*;

use super::write_image;
use crate::stream::test_support::compress;
use crate::stream::{
    BlockSink, Compression, CompressionChoice, DigestAlgo, DigestOver, ExpectedDigest, Scrub,
    StreamError, StreamSpec, digest_of,
};

/// An in-memory device that can accept only part of each write, fail a write, or corrupt what it reads back.
pub(crate) struct MemSink {
    pub data: Vec<u8>,
    pub align: usize,
    pub max_write: usize,
    pub fail_write_at: Option<u64>,
    pub corrupt_reads: bool,
    pub syncs: usize,
    pub short_writes: usize,
}

impl MemSink {
    pub fn new(capacity: usize, align: usize) -> Self {
        Self {
            data: vec![0xAA; capacity],
            align,
            max_write: usize::MAX,
            fail_write_at: None,
            corrupt_reads: false,
            syncs: 0,
            short_writes: 0,
        }
    }
}

impl BlockSink for MemSink {
    fn alignment(&self) -> usize {
        self.align
    }
    fn capacity(&self) -> u64 {
        self.data.len() as u64
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize> {
        if self.fail_write_at.is_some_and(|at| offset >= at) {
            return Err(io::Error::other("injected write failure"));
        }
        let n = buf.len().min(self.max_write);
        if n < buf.len() {
            self.short_writes += 1;
        }
        let end = offset as usize + n;
        if end > self.data.len() {
            return Err(io::Error::other("write past the end"));
        }
        self.data[offset as usize..end].copy_from_slice(&buf[..n]);
        Ok(n)
    }
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = (offset as usize).min(self.data.len());
        let n = buf.len().min(self.data.len() - start);
        buf[..n].copy_from_slice(&self.data[start..start + n]);
        if self.corrupt_reads && n > 0 {
            buf[0] ^= 1;
        }
        Ok(n)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.syncs += 1;
        Ok(())
    }
    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.data[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

/// A reader that hands out at most `chunk` bytes per call, returns `Interrupted` every few calls, and optionally
/// fails for good after `fail_after` bytes.
struct ChoppyReader {
    data: Vec<u8>,
    pos: usize,
    chunk: usize,
    calls: usize,
    fail_after: Option<usize>,
}

impl Read for ChoppyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.calls += 1;
        if self.calls.is_multiple_of(3) {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "signal"));
        }
        if self.fail_after.is_some_and(|at| self.pos >= at) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "peer went away",
            ));
        }
        let n = buf.len().min(self.chunk).min(self.data.len() - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

fn image(len: usize) -> Vec<u8> {
    // Half compressible, half not, like a real disk image.
    let mut x = 0x9E37_79B9u32;
    (0..len)
        .map(|i| {
            if i < len / 2 {
                (i / 4096) as u8
            } else {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            }
        })
        .collect()
}

fn spec_for(compressed: &[u8], raw: &[u8], algo: DigestAlgo, over: DigestOver) -> StreamSpec {
    let covered = if over == DigestOver::Compressed {
        compressed
    } else {
        raw
    };
    let mut spec = StreamSpec::new(ExpectedDigest {
        algo,
        over,
        value: digest_of(algo, covered),
    });
    spec.buffer_size = 64 << 10;
    spec.buffers = 2;
    spec
}

fn run(
    source: &[u8],
    sink: &mut MemSink,
    spec: &StreamSpec,
) -> Result<super::StreamReport, super::StreamFailure> {
    write_image(source, sink, spec, &mut |_| {})
}

#[test]
fn each_compression_round_trips_with_unaligned_tail() {
    let raw = image(300_001);
    for c in [
        Compression::Raw,
        Compression::Gzip,
        Compression::Xz,
        Compression::Zstd,
    ] {
        for (algo, over) in [
            (DigestAlgo::Sha256, DigestOver::Compressed),
            (DigestAlgo::Sha512, DigestOver::Decompressed),
        ] {
            let compressed = compress(c, &raw);
            let spec = spec_for(&compressed, &raw, algo, over);
            let mut sink = MemSink::new(1 << 20, 4096);
            let report = run(&compressed, &mut sink, &spec).expect("stream succeeds");
            assert_eq!(report.compression, c);
            assert_eq!(report.image_bytes, raw.len() as u64);
            assert_eq!(report.source_bytes, compressed.len() as u64);
            assert_eq!(report.written_bytes, 303_104, "padded to 4096");
            assert!(report.read_back_verified);
            assert_eq!(&sink.data[..raw.len()], &raw[..], "{c:?}");
            assert!(
                sink.data[raw.len()..303_104].iter().all(|&b| b == 0),
                "tail padded with zeros"
            );
            assert!(
                sink.data[303_104..].iter().all(|&b| b == 0xAA),
                "nothing written past the padded end"
            );
            assert_eq!(sink.syncs, 1);
        }
    }
}

#[test]
fn fixed_compression_overrides_detection() {
    let raw = image(10_000);
    let compressed = compress(Compression::Zstd, &raw);
    let mut spec = spec_for(
        &compressed,
        &compressed,
        DigestAlgo::Sha256,
        DigestOver::Decompressed,
    );
    spec.compression = CompressionChoice::Fixed(Compression::Raw);
    let mut sink = MemSink::new(1 << 20, 512);
    let report = run(&compressed, &mut sink, &spec).expect("raw copy of the compressed bytes");
    assert_eq!(report.compression, Compression::Raw);
    assert_eq!(&sink.data[..compressed.len()], &compressed[..]);
}

#[test]
fn short_writes_are_continued() {
    let raw = image(200_000);
    let spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    let mut sink = MemSink::new(1 << 20, 512);
    sink.max_write = 1536;
    run(&raw, &mut sink, &spec).expect("short writes are retried");
    assert!(sink.short_writes > 100);
    assert_eq!(&sink.data[..raw.len()], &raw[..]);
}

#[test]
fn interrupted_reads_are_resumed() {
    let raw = image(150_000);
    let compressed = compress(Compression::Gzip, &raw);
    let spec = spec_for(
        &compressed,
        &raw,
        DigestAlgo::Sha256,
        DigestOver::Compressed,
    );
    let reader = ChoppyReader {
        data: compressed,
        pos: 0,
        chunk: 777,
        calls: 0,
        fail_after: None,
    };
    let mut sink = MemSink::new(1 << 20, 4096);
    write_image(io::BufReader::new(reader), &mut sink, &spec, &mut |_| {})
        .expect("EINTR and small reads are not errors");
    assert_eq!(&sink.data[..raw.len()], &raw[..]);
}

#[test]
fn source_failure_mid_way_is_reported_and_scrubbed() {
    let raw = image(400_000);
    let compressed = compress(Compression::Zstd, &raw);
    let spec = spec_for(
        &compressed,
        &raw,
        DigestAlgo::Sha256,
        DigestOver::Decompressed,
    );
    let reader = ChoppyReader {
        data: compressed,
        pos: 0,
        chunk: 4096,
        calls: 0,
        fail_after: Some(100_000),
    };
    let mut sink = MemSink::new(1 << 20, 4096);
    let failure = write_image(io::BufReader::new(reader), &mut sink, &spec, &mut |_| {})
        .expect_err("reset is an error");
    assert!(
        matches!(failure.error, StreamError::Source(ref e) if e.kind() == io::ErrorKind::ConnectionReset)
    );
    assert!(matches!(
        failure.scrub,
        Scrub::Zeroed { .. } | Scrub::NotNeeded
    ));
    assert!(
        sink.data[..failure.bytes_submitted as usize]
            .iter()
            .all(|&b| b == 0)
    );
}

#[test]
fn truncation_is_an_error() {
    let raw = image(100_000);
    // Raw: only the expected size can tell.
    let mut spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    spec.image_size = Some(raw.len() as u64);
    let mut sink = MemSink::new(1 << 20, 4096);
    let f = run(&raw[..99_000], &mut sink, &spec).expect_err("truncated raw");
    assert!(
        matches!(
            f.error,
            StreamError::Truncated {
                expected: 100_000,
                got: 99_000
            }
        ),
        "{f}"
    );
    assert!(matches!(f.scrub, Scrub::Zeroed { .. }));
    assert!(
        sink.data[..f.bytes_submitted as usize]
            .iter()
            .all(|&b| b == 0),
        "scrubbed"
    );
    // Compressed: the decoder sees the cut.
    for c in [Compression::Gzip, Compression::Xz, Compression::Zstd] {
        let compressed = compress(c, &raw);
        let spec = spec_for(
            &compressed,
            &raw,
            DigestAlgo::Sha256,
            DigestOver::Decompressed,
        );
        let f = run(
            &compressed[..compressed.len() - 3],
            &mut MemSink::new(1 << 20, 4096),
            &spec,
        )
        .expect_err("truncated compressed stream");
        assert!(
            matches!(f.error, StreamError::Decode { .. }),
            "{c:?}: {:?}",
            f.error
        );
    }
    // Source length known (HTTP): a short source is an error even when it decodes.
    let mut spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    spec.source_size = Some(raw.len() as u64 + 1);
    let f = run(&raw, &mut MemSink::new(1 << 20, 4096), &spec).expect_err("short source");
    assert!(matches!(f.error, StreamError::SourceLength { .. }));
}

#[test]
fn over_long_streams_are_errors() {
    let raw = image(100_000);
    let mut spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    spec.image_size = Some(90_000);
    let f = run(&raw, &mut MemSink::new(1 << 20, 4096), &spec).expect_err("longer than stated");
    assert!(matches!(
        f.error,
        StreamError::OverLong { expected: 90_000 }
    ));

    let mut with_trailer = compress(Compression::Zstd, &raw);
    with_trailer.extend_from_slice(b"garbage after the frame");
    let spec = spec_for(
        &with_trailer,
        &raw,
        DigestAlgo::Sha256,
        DigestOver::Decompressed,
    );
    let f = run(&with_trailer, &mut MemSink::new(1 << 20, 4096), &spec).expect_err("trailing data");
    assert!(
        matches!(
            f.error,
            StreamError::TrailingData { .. } | StreamError::Decode { .. }
        ),
        "{:?}",
        f.error
    );

    let spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    let f =
        run(&raw, &mut MemSink::new(64 << 10, 4096), &spec).expect_err("larger than the device");
    assert!(matches!(
        f.error,
        StreamError::TooLarge {
            capacity: 65_536,
            ..
        }
    ));
}

#[test]
fn wrong_digest_fails_and_scrubs() {
    let raw = image(100_000);
    let compressed = compress(Compression::Xz, &raw);
    for over in [DigestOver::Compressed, DigestOver::Decompressed] {
        let mut spec = spec_for(&compressed, &raw, DigestAlgo::Sha256, over);
        spec.digest.value[0] ^= 0xff;
        let mut sink = MemSink::new(1 << 20, 4096);
        let f = run(&compressed, &mut sink, &spec).expect_err("digest mismatch");
        assert!(matches!(f.error, StreamError::DigestMismatch { over: o, .. } if o == over));
        assert_eq!(f.scrub, Scrub::Zeroed { bytes: 102_400 });
        assert!(
            sink.data[..102_400].iter().all(|&b| b == 0),
            "no half-written image left behind"
        );
    }
}

#[test]
fn read_back_mismatch_is_detected() {
    let raw = image(50_000);
    let spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    let mut sink = MemSink::new(1 << 20, 4096);
    sink.corrupt_reads = true;
    let f = run(&raw, &mut sink, &spec).expect_err("device lies on read-back");
    assert!(matches!(f.error, StreamError::ReadBackMismatch { .. }));
}

#[test]
fn write_failure_is_reported() {
    let raw = image(300_000);
    let spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    let mut sink = MemSink::new(1 << 20, 4096);
    sink.fail_write_at = Some(128 << 10);
    let f = run(&raw, &mut sink, &spec).expect_err("device error");
    assert!(
        matches!(
            f.error,
            StreamError::Write {
                offset: 131_072,
                ..
            }
        ),
        "{:?}",
        f.error
    );
}

#[test]
fn progress_is_reported_with_a_final_done() {
    let raw = image(300_000);
    let mut spec = spec_for(&raw, &raw, DigestAlgo::Sha256, DigestOver::Decompressed);
    spec.progress_interval = std::time::Duration::ZERO;
    spec.source_size = Some(raw.len() as u64);
    let mut reports = Vec::new();
    write_image(
        &raw[..],
        &mut MemSink::new(1 << 20, 4096),
        &spec,
        &mut |p| reports.push(p.clone()),
    )
    .expect("stream");
    let last = reports.last().expect("at least one report");
    assert!(last.done);
    assert_eq!(last.source_read, raw.len() as u64);
    assert!(reports.windows(2).all(|w| w[0].written <= w[1].written));
}

#[test]
fn empty_image_is_fine() {
    let spec = spec_for(b"", b"", DigestAlgo::Sha256, DigestOver::Decompressed);
    let mut sink = MemSink::new(4096, 4096);
    let r = run(b"", &mut sink, &spec).expect("empty stream");
    assert_eq!(r.written_bytes, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn any_image_any_shape_round_trips(
        len in 0usize..150_000,
        comp in prop::sample::select(vec![Compression::Raw, Compression::Gzip, Compression::Xz, Compression::Zstd]),
        align in prop::sample::select(vec![512usize, 4096]),
        max_write in 1usize..20_000,
        buffer_pages in 1usize..8,
        buffers in 1usize..4,
    ) {
        let raw = image(len);
        let compressed = compress(comp, &raw);
        let mut spec = spec_for(&compressed, &raw, DigestAlgo::Sha256, DigestOver::Compressed);
        spec.buffer_size = buffer_pages * 4096;
        spec.buffers = buffers;
        spec.image_size = Some(len as u64);
        let mut sink = MemSink::new(160 << 10, align);
        sink.max_write = max_write;
        let report = run(&compressed, &mut sink, &spec).expect("round trip");
        prop_assert_eq!(report.image_bytes, len as u64);
        prop_assert_eq!(&sink.data[..len], &raw[..]);
        prop_assert_eq!(report.written_bytes % align as u64, 0);
    }
}

/// A source that yields `chunk` bytes every `every` (a slow download).
struct Trickle<'a> {
    data: &'a [u8],
    at: usize,
    chunk: usize,
    every: std::time::Duration,
}

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.at >= self.data.len() {
            return Ok(0);
        }
        std::thread::sleep(self.every);
        let n = buf.len().min(self.chunk).min(self.data.len() - self.at);
        buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[test]
fn a_slow_source_reports_bytes_on_the_device_before_a_buffer_fills() {
    // 768 KiB at about 4 MiB/s (≈ 190 ms) into a 4 MiB buffer: before, the only report with bytes written was
    // the final one, as the image never filled a buffer.
    let raw = image(768 << 10);
    let compressed = compress(Compression::Zstd, &raw);
    let mut spec = spec_for(
        &compressed,
        &raw,
        DigestAlgo::Sha256,
        DigestOver::Compressed,
    );
    spec.buffer_size = 4 << 20;
    spec.buffers = 2;
    spec.progress_interval = std::time::Duration::from_millis(20);
    let source = io::BufReader::with_capacity(
        4096,
        Trickle {
            data: &compressed,
            at: 0,
            chunk: 4096,
            every: std::time::Duration::from_millis(1),
        },
    );
    let mut sink = MemSink::new(1 << 20, 4096);
    let start = std::time::Instant::now();
    let mut reports = Vec::new();
    let report = write_image(source, &mut sink, &spec, &mut |p| {
        reports.push((start.elapsed(), p.clone()))
    })
    .expect("stream");
    assert_eq!(report.image_bytes, raw.len() as u64);
    assert_eq!(
        &sink.data[..raw.len()],
        &raw[..],
        "carried tails land in order"
    );
    let (first_at, _) = reports.first().expect("reports");
    assert!(
        *first_at < std::time::Duration::from_millis(100),
        "the first report comes at once: {first_at:?}"
    );
    let before_end: Vec<u64> = reports
        .iter()
        .filter(|(_, p)| !p.done)
        .map(|(_, p)| p.written)
        .collect();
    assert!(
        before_end.iter().any(|w| *w > 0 && *w < raw.len() as u64),
        "bytes on the device are reported while the stream runs: {before_end:?}"
    );
    assert!(
        reports.windows(2).all(|w| w[0].1.written <= w[1].1.written),
        "written never goes back"
    );
}
