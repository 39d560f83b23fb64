#![no_main]
//! An image's bytes come from an image server (the site's cache, a mirror): the pipeline detects the compression
//! and decodes as it writes, before the digest over the bytes as served can be checked at the end, so the decoders
//! see whatever a server sends. Whatever the bytes (the digest made to match them, so they get that far): nothing
//! panics, nothing is written past the device, and the device ends either holding exactly the decoded image (its
//! digest as reported, the rest of the last block zeros) or, after a failure, zeros where anything was written and
//! its old contents elsewhere: never a partial image reported as good or left behind.
use bcd_ramdisk::stream::{
    BlockSink, DigestAlgo, DigestOver, ExpectedDigest, Scrub, StreamSpec, digest_of, write_image,
};
use libfuzzer_sys::fuzz_target;
use std::io;

/// What the device held before: any byte that is not 0 and not this is the pipeline's.
const OLD: u8 = 0xAA;
/// The device: 256 KiB (a decompression bomb stops at it), 512-byte sectors.
const CAPACITY: usize = 256 << 10;

struct Mem(Vec<u8>);

impl BlockSink for Mem {
    fn alignment(&self) -> usize {
        512
    }
    fn capacity(&self) -> u64 {
        self.0.len() as u64
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let at = usize::try_from(offset).map_err(io::Error::other)?;
        let end = at.checked_add(buf.len()).filter(|e| *e <= self.0.len());
        let Some(end) = end else {
            panic!("write past the device: {} bytes at {offset}", buf.len());
        };
        self.0[at..end].copy_from_slice(buf);
        Ok(buf.len())
    }
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let at = usize::try_from(offset)
            .map_err(io::Error::other)?
            .min(self.0.len());
        let n = buf.len().min(self.0.len() - at);
        buf[..n].copy_from_slice(&self.0[at..at + n]);
        Ok(n)
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let at = usize::try_from(offset).map_err(io::Error::other)?;
        let end = usize::try_from(offset + len).map_err(io::Error::other)?;
        self.0[at..end].fill(0);
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut spec = StreamSpec::new(ExpectedDigest {
        algo: DigestAlgo::Sha256,
        over: DigestOver::Compressed,
        value: digest_of(DigestAlgo::Sha256, data),
    });
    spec.buffer_size = 64 << 10;
    spec.buffers = 2;
    let mut sink = Mem(vec![OLD; CAPACITY]);
    match write_image(data, &mut sink, &spec, &mut |_| {}) {
        Ok(report) => {
            let image = usize::try_from(report.image_bytes).expect("fits");
            let written = usize::try_from(report.written_bytes).expect("fits");
            assert_eq!(report.source_bytes, data.len() as u64);
            assert!(image <= written && written <= CAPACITY && written % 512 == 0);
            if let Some(d) = &report.image_digest {
                assert_eq!(*d, digest_of(DigestAlgo::Sha256, &sink.0[..image]));
            }
            assert!(sink.0[image..written].iter().all(|b| *b == 0), "padding");
            assert!(
                sink.0[written..].iter().all(|b| *b == OLD),
                "past the image"
            );
        }
        Err(failure) => match &failure.scrub {
            Scrub::NotNeeded => assert!(sink.0.iter().all(|b| *b == OLD), "{failure}"),
            Scrub::Zeroed { bytes } => {
                let bytes = usize::try_from(*bytes).expect("fits");
                assert!(sink.0[..bytes].iter().all(|b| *b == 0), "{failure}");
                assert!(sink.0[bytes..].iter().all(|b| *b == OLD), "{failure}");
            }
            other => panic!("scrubbing an in-memory device cannot fail: {other:?} ({failure})"),
        },
    }
});
