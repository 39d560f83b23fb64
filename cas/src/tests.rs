use super::*;
use proptest::prelude::*;
use std::io;

/// Wraps the real transport and misbehaves as told: writes at most `short` bytes at a time, fails the write that
/// reaches byte `fail_at`, fails `sync` or `persist`, or answers a write with 0 bytes.
struct Faulty {
    inner: TempFile,
    short: usize,
    fail_at: Option<u64>,
    fail_sync: bool,
    fail_persist: bool,
    zero_write: bool,
    written: u64,
    writes: usize,
}

impl Faulty {
    fn new(store: &Store) -> Faulty {
        Faulty {
            inner: TempFile::new_in(store.root()).expect("temporary file"),
            short: usize::MAX,
            fail_at: None,
            fail_sync: false,
            fail_persist: false,
            zero_write: false,
            written: 0,
            writes: 0,
        }
    }
}

impl Transport for Faulty {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writes += 1;
        if self.zero_write {
            return Ok(0);
        }
        let n = buf.len().min(self.short);
        if self.fail_at.is_some_and(|at| self.written + n as u64 > at) {
            return Err(io::Error::other("injected: no space left on device"));
        }
        // A write interrupted by a signal is repeated, not an error.
        if self.writes.is_multiple_of(3) {
            return Err(io::Error::from(io::ErrorKind::Interrupted));
        }
        let n = self.inner.write(&buf[..n])?;
        self.written += n as u64;
        Ok(n)
    }

    fn sync(&mut self) -> io::Result<()> {
        if self.fail_sync {
            return Err(io::Error::other("injected: fsync failed"));
        }
        self.inner.sync()
    }

    fn persist(self, path: &Path) -> io::Result<()> {
        if self.fail_persist {
            return Err(io::Error::other("injected: rename failed"));
        }
        self.inner.persist(path)
    }

    fn temp_path(&self) -> &Path {
        self.inner.temp_path()
    }
}

/// Files in the root other than `sha256/` (temporaries left behind).
fn leftovers(store: &Store) -> Vec<String> {
    std::fs::read_dir(store.root())
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != SHA256_DIR)
                .collect()
        })
        .unwrap_or_default()
}

fn stored(store: &Store) -> usize {
    std::fs::read_dir(store.dir()).map_or(0, |r| r.count())
}

fn content(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

#[test]
fn verified_content_lands_complete_and_public() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::new(dir.path());
    let data = content(3 * BUFFER_FOR_TESTS + 17);
    let sha = Sha256Hex::of(&data);
    let mut w = store.begin(Expect::exact(sha.clone(), data.len() as u64))?;
    // Small chunks, then one larger than the buffer.
    for c in data[..BUFFER_FOR_TESTS].chunks(1000) {
        w.write(c)?;
    }
    w.write(&data[BUFFER_FOR_TESTS..])?;
    assert_eq!(w.received(), data.len() as u64);
    let s = w.commit()?;
    assert_eq!(s.sha256, sha);
    assert_eq!(s.path, store.path(&sha));
    assert_eq!(std::fs::read(&s.path)?, data);
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&s.path)?.permissions().mode() & 0o777,
        0o644
    );
    assert!(leftovers(&store).is_empty());
    Ok(())
}

const BUFFER_FOR_TESTS: usize = writer::BUFFER;

#[test]
fn an_upload_is_named_by_its_hash() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::new(dir.path());
    let mut w = store.begin(Expect::upload(None, 1 << 30))?;
    w.write(b"vmlinuz")?;
    let s = w.commit()?;
    assert_eq!(s.sha256, Sha256Hex::of(b"vmlinuz"));
    assert_eq!(s.size, 7);
    assert_eq!(std::fs::read(store.path(&s.sha256))?, b"vmlinuz");
    Ok(())
}

#[test]
fn wrong_content_is_refused_and_leaves_nothing() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::new(dir.path());
    let data = content(12_000);
    let sha = Sha256Hex::of(&data);
    let exact = || Expect::exact(sha.clone(), data.len() as u64);

    let mut tampered = data.clone();
    tampered[7] ^= 1;
    let mut w = store.begin(exact())?;
    w.write(&tampered)?;
    let e = w.commit().expect_err("tampered");
    assert!(
        matches!(&e, CasError::HashMismatch { want, .. } if *want == sha),
        "{e:?}"
    );
    assert!(e.to_string().contains("corrupt or tampered"), "{e}");

    let mut w = store.begin(exact())?;
    w.write(&data[..5000])?;
    let e = w.commit().expect_err("short");
    assert!(
        matches!(
            e,
            CasError::Truncated {
                got: 5000,
                size: 12_000
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "truncated: 5000 of 12000 bytes");

    let mut w = store.begin(exact())?;
    w.write(&data)?;
    let e = w.write(b"x").expect_err("one byte too many");
    assert!(matches!(e, CasError::TooLong { size: 12_000 }), "{e:?}");
    drop(w);

    let mut w = store.begin(Expect::upload(None, 100))?;
    w.write(&data[..100])?;
    let e = w.write(b"x").expect_err("over the cap");
    assert!(matches!(e, CasError::TooLarge { max: 100 }), "{e:?}");
    drop(w);
    let e = store
        .begin(Expect::upload(Some(101), 100))
        .expect_err("announced over the cap");
    assert!(matches!(e, CasError::TooLarge { max: 100 }), "{e:?}");
    assert!(e.is_content());

    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));
    assert_eq!(stored(&store), 0);
    Ok(())
}

#[test]
fn references_are_checked() {
    for bad in [
        "../../etc/passwd",
        &"A".repeat(64),
        &"a".repeat(63),
        "",
        &"g".repeat(64),
    ] {
        let e = Sha256Hex::parse(bad).expect_err(bad);
        assert!(matches!(&e, CasError::BadDigest(s) if s == bad), "{e:?}");
    }
    let ok = "0123456789abcdef".repeat(4);
    assert_eq!(
        ok.parse::<Sha256Hex>().map(Sha256Hex::into_string).ok(),
        Some(ok)
    );
}

#[test]
fn io_failures_name_the_step_and_leave_nothing() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::new(dir.path());
    let data = content(3000);
    let sha = Sha256Hex::of(&data);
    let exact = || Expect::exact(sha.clone(), data.len() as u64);
    type Fault = fn(&mut Faulty);
    let faults: [(Fault, &str, &str); 4] = [
        (|f| f.fail_at = Some(1500), "writing", "no space left"),
        (|f| f.zero_write = true, "writing", "write zero"),
        (|f| f.fail_sync = true, "syncing", "fsync failed"),
        (
            |f| f.fail_persist = true,
            "moving into place",
            "rename failed",
        ),
    ];
    for (inject, what, cause) in faults {
        let mut t = Faulty::new(&store);
        inject(&mut t);
        let mut w = store.begin_with(exact(), t)?;
        let e = w.write(&data).and_then(|()| w.commit().map(drop));
        let e = e.expect_err(what);
        assert!(!e.is_content());
        let shown = format!(
            "{e}: {}",
            std::error::Error::source(&e)
                .map(ToString::to_string)
                .unwrap_or_default()
        );
        assert!(shown.starts_with(what) && shown.contains(cause), "{shown}");
        assert!(
            leftovers(&store).is_empty(),
            "{what}: {:?}",
            leftovers(&store)
        );
        assert_eq!(stored(&store), 0, "{what}");
    }
    Ok(())
}

#[test]
fn a_failure_never_replaces_content_already_stored() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::new(dir.path());
    let data = content(2000);
    let sha = Sha256Hex::of(&data);
    let mut w = store.begin(Expect::exact(sha.clone(), 2000))?;
    w.write(&data)?;
    w.commit()?;
    let mut w = store.begin(Expect::exact(sha.clone(), 2000))?;
    w.write(&data[..1000])?;
    assert!(w.commit().is_err());
    assert_eq!(std::fs::read(store.path(&sha))?, data);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the chunking and however short the transport writes, the stored bytes are the bytes given.
    #[test]
    fn short_writes_and_any_chunking_store_the_same_bytes(
        data in proptest::collection::vec(any::<u8>(), 0..100_000),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
        short in 1usize..40_000,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        let mut t = Faulty::new(&store);
        t.short = short;
        let sha = Sha256Hex::of(&data);
        let mut w = store.begin_with(Expect::exact(sha.clone(), data.len() as u64), t).expect("begin");
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(data.len() + 1)).collect();
        at.sort_unstable();
        let mut from = 0;
        for to in at.into_iter().chain([data.len()]) {
            w.write(&data[from..to]).expect("write");
            from = to;
        }
        let s = w.commit().expect("commit");
        prop_assert_eq!(&s.sha256, &sha);
        prop_assert_eq!(std::fs::read(&s.path).expect("read"), data);
        prop_assert!(leftovers(&store).is_empty());
    }

    /// A write error at any byte fails the write and leaves nothing behind once the writer is dropped.
    #[test]
    fn an_error_at_any_byte_leaves_nothing(
        len in 1usize..100_000,
        fail in any::<prop::sample::Index>(),
        chunk in 1usize..40_000,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        let data = content(len);
        let mut t = Faulty::new(&store);
        t.fail_at = Some(fail.index(len) as u64);
        let mut w = store.begin_with(Expect::upload(Some(len as u64), u64::MAX), t).expect("begin");
        let result = data.chunks(chunk).try_for_each(|c| w.write(c)).and_then(|()| w.commit().map(drop));
        prop_assert!(matches!(result, Err(CasError::Io { what: "writing", .. })), "{:?}", result);
        prop_assert!(leftovers(&store).is_empty());
        prop_assert_eq!(stored(&store), 0);
    }
}
