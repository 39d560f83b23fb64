//! [`write_image`]: the synchronous pipeline, three threads over a fixed set of aligned buffers. The calling thread
//! reads (hashing the compressed bytes when asked) and decompresses into a buffer; a hasher thread hashes the image
//! bytes; a writer thread writes the buffer and hands it back. Decompression, hashing and device writes overlap,
//! and memory stays at `buffers × buffer_size` whatever the image size. Read-back works the same way with a reader
//! thread feeding the hashing caller.

use std::io::{self, BufRead, Cursor, Read};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use tracing::{debug, info, warn};

use super::{
    BlockSink, Compression, CompressionChoice, Decoder, DigestOver, Hasher, MAGIC_LEN, Progress,
    ProgressMeter, Scrub, StreamError, StreamFailure, StreamReport, StreamSpec, detect,
};
use crate::os::{AlignedBuf, DIRECT_ALIGN, round_up};

/// Stream `source` onto `sink` as `spec` says; see the module docs. `progress` is called at most once per
/// `spec.progress_interval` — from this thread while it decompresses, or from the writer thread as it writes, so a
/// report reflects the bytes on the device within an interval whatever the buffer size — and once more at the end
/// of a successful stream.
///
/// On failure the written range is zeroed (unless `spec.scrub_on_failure` is off) and the returned
/// [`StreamFailure`] says so: a device is never left with a half-written image reported as good.
pub fn write_image<R: BufRead, S: BlockSink>(
    source: R,
    sink: &mut S,
    spec: &StreamSpec,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<StreamReport, StreamFailure> {
    let mut submitted = 0u64;
    match run(source, sink, spec, progress, &mut submitted) {
        Ok(report) => Ok(report),
        Err(error) => {
            let scrub = if submitted == 0 {
                Scrub::NotNeeded
            } else if !spec.scrub_on_failure {
                Scrub::Disabled
            } else {
                match sink.zero_range(0, submitted).and_then(|()| sink.sync()) {
                    Ok(()) => Scrub::Zeroed { bytes: submitted },
                    Err(e) => Scrub::Failed(e.to_string()),
                }
            };
            warn!(error = %bc_error_chain::InlineErrorChain::new(&error), submitted, %scrub, "image stream failed");
            Err(StreamFailure {
                error,
                bytes_submitted: submitted,
                scrub,
            })
        }
    }
}

fn run<R: BufRead, S: BlockSink>(
    source: R,
    sink: &mut S,
    spec: &StreamSpec,
    progress: &mut (dyn FnMut(&Progress) + Send),
    submitted: &mut u64,
) -> Result<StreamReport, StreamError> {
    let start = Instant::now();
    let align = sink.alignment() as u64;
    validate(spec, align)?;
    let capacity = sink.capacity();
    if let Some(size) = spec.image_size {
        let needed = round_up(size, align);
        if needed > capacity {
            return Err(StreamError::TooLarge { needed, capacity });
        }
    }

    let hash_compressed = spec.digest.over == DigestOver::Compressed;
    let mut counted = CountingReader {
        inner: source,
        count: 0,
        hasher: hash_compressed.then(|| Hasher::new(spec.digest.algo)),
    };
    let mut prefix = [0u8; MAGIC_LEN];
    let prefix_len = read_up_to(&mut counted, &mut prefix).map_err(StreamError::Source)?;
    let compression = match spec.compression {
        CompressionChoice::Auto => detect(&prefix[..prefix_len]),
        CompressionChoice::Fixed(c) => c,
    };
    info!(?compression, "image stream started");
    // The decoder reads straight from the source's buffers (no intermediate copy).
    let buffered = Cursor::new(prefix[..prefix_len].to_vec()).chain(counted);
    let mut decoder =
        Decoder::new(compression, buffered).map_err(|source| StreamError::Decode {
            compression,
            source,
        })?;

    let hash_image = !hash_compressed || spec.read_back;
    let image_hasher = hash_image.then(|| Hasher::new(spec.digest.algo));
    let reports = Reports::new(
        start,
        ProgressMeter::new(
            start,
            spec.progress_interval,
            spec.source_size,
            spec.image_size,
        ),
        progress,
    );
    let reports = &reports;

    // decoder --filled--> hasher --hashed--> writer --empty--> decoder: three stages work on different buffers.
    let (filled_tx, filled_rx) = sync_channel::<Filled>(spec.buffers);
    let (hashed_tx, hashed_rx) = sync_channel::<Filled>(spec.buffers);
    let (empty_tx, empty_rx) = sync_channel::<AlignedBuf>(spec.buffers);
    let mut image_len = 0u64;

    let writer_sink = &mut *sink;
    let (decoded, image_digest) = std::thread::scope(|scope| {
        let hasher = scope.spawn(move || hash_loop(image_hasher, filled_rx, hashed_tx));
        let writer = scope.spawn(move || write_loop(writer_sink, hashed_rx, empty_tx, reports));
        let mut pool: Vec<AlignedBuf> = (0..spec.buffers)
            .map(|_| AlignedBuf::new(spec.buffer_size))
            .collect();
        // Image bytes decoded past the last aligned block of a buffer handed over early; they start the next one.
        let mut carry: Vec<u8> = Vec::with_capacity(align as usize);
        let result = (|| -> Result<(), StreamError> {
            loop {
                let mut buf = match pool.pop() {
                    Some(buf) => buf,
                    // The writer hung up: it failed, and its error is collected below.
                    None => match empty_rx.recv() {
                        Ok(buf) => buf,
                        Err(_) => return Ok(()),
                    },
                };
                buf.as_mut_slice()[..carry.len()].copy_from_slice(&carry);
                let from = carry.len();
                carry.clear();
                // A slow source hands over what it has (whole blocks) once a progress interval passed, so bytes
                // reach the device, and the progress report, without waiting for a whole buffer.
                let hand_over = Instant::now() + spec.progress_interval;
                let (mut filled, eof) = fill(
                    &mut decoder,
                    buf.as_mut_slice(),
                    from,
                    (align as usize, hand_over),
                    compression,
                    reports,
                )?;
                if !eof && filled < buf.len() {
                    let whole = filled - filled % align as usize;
                    carry.extend_from_slice(&buf.as_slice()[whole..filled]);
                    filled = whole;
                }
                image_len += filled as u64;
                if let Some(expected) = spec.image_size
                    && image_len > expected
                {
                    return Err(StreamError::OverLong { expected });
                }
                let end = round_up(image_len, align);
                if end > capacity {
                    return Err(StreamError::TooLarge {
                        needed: end,
                        capacity,
                    });
                }
                if filled > 0 {
                    let padded = round_up(filled as u64, align) as usize;
                    buf.as_mut_slice()[filled..padded].fill(0);
                    let offset = *submitted;
                    *submitted += padded as u64;
                    let job = Filled {
                        buf,
                        offset,
                        valid: filled,
                        len: padded,
                    };
                    if filled_tx.send(job).is_err() {
                        return Ok(());
                    }
                }
                if eof {
                    return Ok(());
                }
            }
        })();
        drop(filled_tx);
        let digest = hasher.join().unwrap_or(None);
        let writer_result = writer.join().unwrap_or(Err(StreamError::WriterPanicked));
        // A writer failure is the root cause when both failed (the decoder then only saw a hang-up).
        (writer_result.and(result), digest)
    });
    decoded?;

    // The compressed stream ended: nothing may follow it, and the source must have been complete.
    let mut rest = decoder.into_source();
    if compression != Compression::Raw && has_more(&mut rest).map_err(StreamError::Source)? {
        return Err(StreamError::TrailingData { compression });
    }
    let (_, counted) = rest.into_inner();
    if let Some(expected) = spec.source_size
        && counted.count != expected
    {
        return Err(StreamError::SourceLength {
            expected,
            got: counted.count,
        });
    }
    if let Some(expected) = spec.image_size
        && image_len < expected
    {
        return Err(StreamError::Truncated {
            expected,
            got: image_len,
        });
    }

    let digest = match spec.digest.over {
        DigestOver::Compressed => counted.hasher.map(Hasher::finalize),
        DigestOver::Decompressed => image_digest.clone(),
    }
    .ok_or_else(|| StreamError::Invalid("digest was not computed".into()))?;
    if digest != spec.digest.value {
        return Err(StreamError::DigestMismatch {
            algo: spec.digest.algo.name(),
            over: spec.digest.over,
            expected: hex::encode(&spec.digest.value),
            actual: hex::encode(&digest),
        });
    }
    let sync_start = Instant::now();
    sink.sync().map_err(StreamError::Sync)?;
    let sync_elapsed = sync_start.elapsed();
    let stream_elapsed = start.elapsed();

    let read_back_start = Instant::now();
    if spec.read_back {
        let expected = image_digest
            .clone()
            .ok_or_else(|| StreamError::Invalid("image digest missing".into()))?;
        read_back(sink, spec, image_len, &expected)?;
    }
    let read_back_elapsed = read_back_start.elapsed();

    reports.finish(*submitted, counted.count);
    info!(
        image_bytes = image_len,
        source_bytes = counted.count,
        ?stream_elapsed,
        ?read_back_elapsed,
        "image written and verified"
    );
    Ok(StreamReport {
        compression,
        image_bytes: image_len,
        source_bytes: counted.count,
        written_bytes: *submitted,
        algo: spec.digest.algo,
        digest,
        image_digest,
        read_back_verified: spec.read_back,
        stream_elapsed,
        sync_elapsed,
        read_back_elapsed,
    })
}

fn validate(spec: &StreamSpec, align: u64) -> Result<(), StreamError> {
    if align == 0 || !align.is_power_of_two() || align > DIRECT_ALIGN as u64 {
        return Err(StreamError::Invalid(format!(
            "sink alignment {align} is not a power of two up to 4096"
        )));
    }
    if spec.buffer_size == 0 || !spec.buffer_size.is_multiple_of(DIRECT_ALIGN) {
        return Err(StreamError::Invalid(format!(
            "buffer size {} is not a multiple of 4096",
            spec.buffer_size
        )));
    }
    if spec.buffers == 0 {
        return Err(StreamError::Invalid("at least one buffer is needed".into()));
    }
    if spec.digest.value.len() != spec.digest.algo.output_len() {
        return Err(StreamError::Invalid(format!(
            "expected {} digest has the wrong length",
            spec.digest.algo.name()
        )));
    }
    Ok(())
}

// === impl Reports ===

/// Progress shared by the decoding thread (source bytes) and the writer thread (bytes on the device). Either may
/// emit a report; the interval check in front is one clock read and an atomic load, so the hot loops pay nothing
/// measurable, and the callback runs under a lock taken only when a report is due.
struct Reports<'a> {
    start: Instant,
    /// Nanoseconds since `start` before which no report is due.
    next_due_ns: AtomicU64,
    every_ns: u64,
    written: AtomicU64,
    source_read: AtomicU64,
    emit: Mutex<(ProgressMeter, &'a mut ProgressFn<'a>)>,
}

/// The caller's progress callback, callable from either pipeline thread.
type ProgressFn<'f> = dyn FnMut(&Progress) + Send + 'f;

impl<'a> Reports<'a> {
    fn new(start: Instant, meter: ProgressMeter, callback: &'a mut ProgressFn<'a>) -> Reports<'a> {
        Reports {
            start,
            next_due_ns: AtomicU64::new(0),
            every_ns: u64::try_from(meter.interval().as_nanos()).unwrap_or(u64::MAX),
            written: AtomicU64::new(0),
            source_read: AtomicU64::new(0),
            emit: Mutex::new((meter, callback)),
        }
    }

    /// The writer put `n` more bytes on the device.
    fn wrote(&self, n: u64) {
        self.written.fetch_add(n, Ordering::Relaxed);
        let _ = self.tick();
    }

    /// The decoder has consumed `total` source bytes; returns the time it read.
    fn read(&self, total: u64) -> Instant {
        self.source_read.store(total, Ordering::Relaxed);
        self.tick()
    }

    fn tick(&self) -> Instant {
        let now = Instant::now();
        let at =
            u64::try_from(now.saturating_duration_since(self.start).as_nanos()).unwrap_or(u64::MAX);
        if at < self.next_due_ns.load(Ordering::Relaxed) {
            return now;
        }
        // The other thread is reporting right now: this moment is covered.
        let Ok(mut emit) = self.emit.try_lock() else {
            return now;
        };
        if at < self.next_due_ns.load(Ordering::Relaxed) {
            return now;
        }
        self.next_due_ns
            .store(at.saturating_add(self.every_ns), Ordering::Relaxed);
        let (meter, callback) = &mut *emit;
        let (written, read) = (
            self.written.load(Ordering::Relaxed),
            self.source_read.load(Ordering::Relaxed),
        );
        if let Some(p) = meter.observe(now, written, read, false) {
            callback(&p);
        }
        now
    }

    /// The final report of a successful stream.
    fn finish(&self, written: u64, source_read: u64) {
        if let Ok(mut emit) = self.emit.lock() {
            let (meter, callback) = &mut *emit;
            if let Some(p) = meter.observe(Instant::now(), written, source_read, true) {
                callback(&p);
            }
        }
    }
}

// === writer thread ===

struct Filled {
    buf: AlignedBuf,
    offset: u64,
    /// Image bytes in the buffer (hashed).
    valid: usize,
    /// Bytes to write: `valid` padded to the sink's alignment.
    len: usize,
}

/// Hash each buffer's image bytes in order and pass it on; returns the digest once the decoder is done.
fn hash_loop(
    mut hasher: Option<Hasher>,
    filled: Receiver<Filled>,
    hashed: SyncSender<Filled>,
) -> Option<Vec<u8>> {
    for job in filled {
        if let Some(h) = hasher.as_mut() {
            h.update(&job.buf.as_slice()[..job.valid]);
        }
        // The writer failed and hung up: stop, the decoder sees the hang-up next.
        if hashed.send(job).is_err() {
            return None;
        }
    }
    hasher.map(Hasher::finalize)
}

fn write_loop<S: BlockSink>(
    sink: &mut S,
    full: Receiver<Filled>,
    empty: SyncSender<AlignedBuf>,
    reports: &Reports<'_>,
) -> Result<(), StreamError> {
    for Filled {
        buf, offset, len, ..
    } in full
    {
        write_fully(sink, &buf.as_slice()[..len], offset)?;
        reports.wrote(len as u64);
        // The decoder may have stopped taking buffers after a failure of its own.
        if empty.send(buf).is_err() {
            break;
        }
    }
    Ok(())
}

/// Write all of `data` at `offset`, continuing after short writes and `EINTR`.
fn write_fully<S: BlockSink>(sink: &mut S, data: &[u8], offset: u64) -> Result<(), StreamError> {
    let mut done = 0usize;
    while done < data.len() {
        let at = offset + done as u64;
        match sink.write_at(&data[done..], at) {
            Ok(0) => {
                let source = io::Error::new(io::ErrorKind::WriteZero, "device accepted no bytes");
                return Err(StreamError::Write {
                    offset: at,
                    len: data.len() - done,
                    source,
                });
            }
            Ok(n) => {
                if n < data.len() - done {
                    debug!(
                        offset = at,
                        wrote = n,
                        asked = data.len() - done,
                        "short write"
                    );
                }
                done += n;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(StreamError::Write {
                    offset: at,
                    len: data.len() - done,
                    source,
                });
            }
        }
    }
    Ok(())
}

// === decoder side ===

/// Counts (and optionally hashes) the source bytes as the decoder pulls them. Errors from the source are tagged
/// so they can be told apart from decoder errors after passing through the decompressor.
struct CountingReader<R> {
    inner: R,
    count: u64,
    hasher: Option<Hasher>,
}

#[derive(Debug, thiserror::Error)]
#[error("source read failed")]
struct SourceFailed(#[source] io::Error);

impl<R: BufRead> CountingReader<R> {
    fn tag(e: io::Error) -> io::Error {
        io::Error::other(SourceFailed(e))
    }
}

impl<R: BufRead> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(buf.len());
        buf[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl<R: BufRead> BufRead for CountingReader<R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        // Retry EINTR first, then hand out the (now filled) buffer; a second fill_buf does no I/O.
        loop {
            match self.inner.fill_buf() {
                Ok([]) => return Ok(&[]),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Self::tag(e)),
            }
        }
        self.inner.fill_buf().map_err(Self::tag)
    }

    fn consume(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(h) = self.hasher.as_mut() {
            // The bytes being consumed are still at the front of the inner buffer.
            if let Ok(buf) = self.inner.fill_buf() {
                h.update(&buf[..n.min(buf.len())]);
            }
        }
        self.count += n as u64;
        self.inner.consume(n);
    }
}

type Buffered<R> = std::io::Chain<Cursor<Vec<u8>>, CountingReader<R>>;

fn source_count<R: BufRead>(decoder: &Decoder<Buffered<R>>) -> u64 {
    let buffered = match decoder {
        Decoder::Raw(r) => r,
        Decoder::Gzip(d) => d.get_ref(),
        Decoder::Xz(d) => d.get_ref(),
        Decoder::Zstd(d) => d.get_ref(),
    };
    buffered.get_ref().1.count
}

/// Fill `buf` from the decoder, after the `from` bytes already there; returns the bytes filled and whether the
/// stream ended. Returns early, with less than a full buffer, once `hand_over.1` has passed with at least one whole
/// block (`hand_over.0` bytes) in it.
fn fill<R: BufRead>(
    decoder: &mut Decoder<Buffered<R>>,
    buf: &mut [u8],
    from: usize,
    hand_over: (usize, Instant),
    compression: Compression,
    reports: &Reports<'_>,
) -> Result<(usize, bool), StreamError> {
    let mut filled = from;
    while filled < buf.len() {
        match decoder.read(&mut buf[filled..]) {
            Ok(0) => return Ok((filled, true)),
            Ok(n) => {
                filled += n;
                let now = reports.read(source_count(decoder));
                if filled >= hand_over.0 && now >= hand_over.1 {
                    return Ok((filled, false));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(e, compression)),
        }
    }
    Ok((filled, false))
}

fn classify(e: io::Error, compression: Compression) -> StreamError {
    if e.get_ref().is_some_and(|inner| inner.is::<SourceFailed>()) {
        let inner = e
            .into_inner()
            .and_then(|b| b.downcast::<SourceFailed>().ok());
        if let Some(failed) = inner {
            return StreamError::Source(failed.0);
        }
        return StreamError::Source(io::Error::other("source read failed"));
    }
    StreamError::Decode {
        compression,
        source: e,
    }
}

fn read_up_to<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn has_more<B: BufRead>(r: &mut B) -> io::Result<bool> {
    loop {
        match r.fill_buf() {
            Ok(b) => return Ok(!b.is_empty()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

// === read-back ===

/// Read `[0, image_len)` back with the sink's (`O_DIRECT`) reads on a reader thread while this thread hashes, and
/// compare with `expected`.
fn read_back<S: BlockSink>(
    sink: &mut S,
    spec: &StreamSpec,
    image_len: u64,
    expected: &[u8],
) -> Result<(), StreamError> {
    const READ_BUFFERS: usize = 3;
    let align = sink.alignment() as u64;
    let (full_tx, full_rx) = sync_channel::<Result<(AlignedBuf, usize), StreamError>>(READ_BUFFERS);
    let (empty_tx, empty_rx) = sync_channel::<AlignedBuf>(READ_BUFFERS);
    for _ in 0..READ_BUFFERS {
        // Cannot block: the channel holds READ_BUFFERS.
        let _ = empty_tx.send(AlignedBuf::new(spec.buffer_size));
    }
    let mut hasher = Hasher::new(spec.digest.algo);
    std::thread::scope(|scope| -> Result<(), StreamError> {
        scope.spawn(move || {
            let mut offset = 0u64;
            while offset < image_len {
                let Ok(mut buf) = empty_rx.recv() else { return };
                let want = (buf.len() as u64).min(round_up(image_len - offset, align)) as usize;
                let item = read_fully(sink, &mut buf.as_mut_slice()[..want], offset).map(|()| {
                    let valid = (image_len - offset).min(want as u64) as usize;
                    (buf, valid)
                });
                let failed = item.is_err();
                if full_tx.send(item).is_err() || failed {
                    return;
                }
                offset += want as u64;
            }
        });
        for item in full_rx {
            let (buf, valid) = item?;
            hasher.update(&buf.as_slice()[..valid]);
            let _ = empty_tx.send(buf);
        }
        Ok(())
    })?;
    let actual = hasher.finalize();
    if actual != expected {
        return Err(StreamError::ReadBackMismatch {
            algo: spec.digest.algo.name(),
            len: image_len,
            expected: hex::encode(expected),
            actual: hex::encode(actual),
        });
    }
    Ok(())
}

fn read_fully<S: BlockSink>(
    sink: &mut S,
    chunk: &mut [u8],
    offset: u64,
) -> Result<(), StreamError> {
    let mut got = 0;
    while got < chunk.len() {
        let at = offset + got as u64;
        match sink.read_at(&mut chunk[got..], at) {
            Ok(0) => {
                let source = io::Error::new(io::ErrorKind::UnexpectedEof, "device ended early");
                return Err(StreamError::ReadBack {
                    offset: at,
                    len: chunk.len() - got,
                    source,
                });
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(StreamError::ReadBack {
                    offset: at,
                    len: chunk.len() - got,
                    source,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
mod tests;
