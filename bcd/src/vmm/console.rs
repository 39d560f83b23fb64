//! The serial console log of an instance, kept bounded. QEMU appends to `console.log` (its file chardev with
//! `append=on`, so the file can be cut under it); when the file outgrows the bound, bcd copies it to
//! `console.log.1` and truncates it (logrotate's copytruncate: bytes the guest writes between the copy and the
//! truncation are lost, a few at most). The log on disk is thus never more than twice the bound.
//!
//! bcd writes one line of its own before each start ([`START_MARK`]), so "cloud-init finished in the current boot"
//! can be read from the files alone, by this process or by a restarted one ([`cloud_init_done`]).

use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};

pub const FILE: &str = "console.log";
pub const PREVIOUS: &str = "console.log.1";
/// The line bcd appends before each start.
pub const START_MARK: &str = "=== bcd: VM started ===";

fn previous_of(path: &Path) -> PathBuf {
    path.with_file_name(PREVIOUS)
}

/// Appends the start mark (creating the file if needed).
pub fn mark_start(path: &Path) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(f, "\n{START_MARK}")
}

/// Cuts the log when it is over `max_bytes`: its contents move to `console.log.1` (replacing the older one) and it
/// starts again empty. Returns whether it rotated.
pub fn rotate_if_over(path: &Path, max_bytes: u64) -> std::io::Result<bool> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= max_bytes {
        return Ok(false);
    }
    let prev = previous_of(path);
    let tmp = path.with_file_name(format!(".{PREVIOUS}.tmp"));
    {
        let mut src = std::fs::File::open(path)?;
        // Keep only the newest max_bytes in the older file, so it too stays within the bound.
        src.seek(std::io::SeekFrom::Start(len.saturating_sub(max_bytes)))?;
        let mut dst = std::fs::File::create(&tmp)?;
        std::io::copy(&mut (&mut src).take(max_bytes), &mut dst)?;
    }
    std::fs::rename(&tmp, &prev)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(0)?;
    Ok(true)
}

/// The last `max_bytes` of the log (older file first).
pub fn tail(path: &Path, max_bytes: usize) -> std::io::Result<Vec<u8>> {
    let read = |p: &Path| match std::fs::read(p) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    };
    let mut all = read(&previous_of(path))?;
    all.extend(read(path)?);
    let cut = all.len().saturating_sub(max_bytes);
    Ok(all.split_off(cut))
}

/// Whether cloud-init's final message (`Cloud-init v. <version> finished at …`) appears after the last start
/// mark, also when kernel messages landed inside it ([`rejoined`]). Pure.
pub fn cloud_init_done_in(log: &[u8]) -> bool {
    let text = String::from_utf8_lossy(log);
    let boot = match text.rfind(START_MARK) {
        Some(i) => &text[i..],
        None => &text[..],
    };
    let finished = |l: &str| l.contains("Cloud-init v. ") && l.contains(" finished at ");
    boot.lines().any(finished) || rejoined(boot.lines()).iter().any(|l| finished(l))
}

/// Kernel messages inside one line that are looked past before the line is given up as cut.
const MAX_INSERTED: usize = 16;

/// The console's lines with each kernel message that landed inside another line taken out and that line made whole
/// again. A program's console output (journald's copy of cloud-init's lines) waits in the tty's buffer and goes to
/// the UART a FIFO at a time, while the kernel writes its messages to the UART directly; a warning printed meanwhile
/// (an RCU stall or a clocksource change on a starved TCG guest) splits the line:
/// `… Cloud-init v. 22.4.2 fin[   40.1] rcu: INFO: …` then `[   40.1] rcu: …` then `ished at …`.
fn rejoined<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out = Vec::new();
    // The start of a line cut by a kernel message, and how many kernel lines came since.
    let mut cut: Option<(String, usize)> = None;
    for line in lines {
        let head = match cut.take() {
            Some((head, n)) if stamp_at(line, 0) => {
                if n < MAX_INSERTED {
                    cut = Some((head, n + 1));
                    continue;
                }
                out.push(head);
                String::new()
            }
            Some((head, _)) => head,
            None => String::new(),
        };
        let whole = head + line;
        match (1..whole.len()).find(|&i| stamp_at(&whole, i)) {
            Some(i) => cut = Some((whole[..i].to_string(), 0)),
            None => out.push(whole),
        }
    }
    out.extend(cut.map(|(head, _)| head));
    out
}

/// Whether a kernel message's timestamp (`[   40.123456]`) starts at byte `i` of `s`.
fn stamp_at(s: &str, i: usize) -> bool {
    let Some(rest) = s.get(i..).and_then(|r| r.strip_prefix('[')) else {
        return false;
    };
    let rest = rest.trim_start_matches(' ');
    let Some((secs, rest)) = rest.split_once('.') else {
        return false;
    };
    let frac_len = rest.bytes().take_while(u8::is_ascii_digit).count();
    !secs.is_empty()
        && secs.bytes().all(|b| b.is_ascii_digit())
        && frac_len > 0
        && rest[frac_len..].starts_with(']')
}

/// [`cloud_init_done_in`] over both files of the log.
pub fn cloud_init_done(path: &Path) -> bool {
    tail(path, usize::MAX).is_ok_and(|b| cloud_init_done_in(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_stays_within_twice_its_bound_and_keeps_the_newest_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE);
        // A writer that appends like QEMU's chardev (O_APPEND), held open across rotations.
        let mut qemu = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open");
        let mut written = Vec::new();
        for i in 0..200u32 {
            let line = format!("line {i:04} {}\n", "x".repeat(40));
            qemu.write_all(line.as_bytes()).expect("write");
            written.extend_from_slice(line.as_bytes());
            rotate_if_over(&path, 1000).expect("rotate");
            let on_disk = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0)
                + std::fs::metadata(previous_of(&path))
                    .map(|m| m.len())
                    .unwrap_or(0);
            assert!(on_disk <= 2000 + 60, "{on_disk} bytes on disk");
        }
        let t = tail(&path, 500).expect("tail");
        assert_eq!(t.len(), 500);
        assert!(
            written.ends_with(&t),
            "the tail is the newest bytes, in order"
        );
    }

    #[test]
    fn cloud_init_done_counts_only_the_current_boot() {
        let done = "[   31.2] cloud-init[412]: Cloud-init v. 22.4.2 finished at Tue, 01 Dec 2026 10:00:00 +0000. \
                    Datasource DataSourceNoCloud [seed=/dev/nvme1n1][dsmode=net].  Up 31.20 seconds\n";
        let first = format!("{START_MARK}\nbooting\n{done}");
        assert!(cloud_init_done_in(first.as_bytes()));
        let second = format!("{first}\n{START_MARK}\nSeaBIOS\n");
        assert!(!cloud_init_done_in(second.as_bytes()));
        assert!(!cloud_init_done_in(b"Cloud-init v. 22.4.2 running 'init'"));
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE);
        mark_start(&path).expect("mark");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(done.as_bytes()))
            .expect("append");
        assert!(cloud_init_done(&path));
        mark_start(&path).expect("mark");
        assert!(!cloud_init_done(&path));
    }

    #[test]
    fn kernel_messages_inside_the_final_line_do_not_hide_it() {
        let tail = "ished at Tue, 01 Dec 2026 10:00:00 +0000. Datasource DataSourceNoCloud [seed=/dev/vdb][dsmode=net].  \
                    Up 40.10 seconds\r\n";
        // An RCU stall report (two kernel lines) inside the line.
        let stall = format!(
            "{START_MARK}\n[   40.100000] cloud-init[412]: Cloud-init v. 22.4.2 fin[   40.123456] rcu: INFO: \
             rcu_sched self-detected stall on CPU\r\n[   40.123460] rcu: \t1-....: (5249 ticks this GP)\r\n{tail}"
        );
        assert!(cloud_init_done_in(stall.as_bytes()));
        // Cut twice.
        let twice = format!(
            "[ 40.1] cloud-init[412]: Cloud-init v. 22.4.2 fin[ 40.2] clocksource: tsc unstable\r\nis\
             [ 40.3] hrtimer: interrupt took 2301 ns\r\n{}",
            &tail[2..]
        );
        assert!(cloud_init_done_in(twice.as_bytes()));
        // Joined pieces are not a finish when they do not say so, and a line cut for good stays cut.
        let running =
            "[ 13.7] cloud-init[169]: Cloud-init v. 22.4.2 run[ 13.8] x\r\nning 'init-local'\r\n";
        assert!(!cloud_init_done_in(running.as_bytes()));
        let lost = format!(
            "[ 40.1] cloud-init[412]: Cloud-init v. 22.4.2 fin[ 40.2] x\r\n{}{tail}",
            "[ 40.3] y\r\n".repeat(MAX_INSERTED + 1)
        );
        assert!(!cloud_init_done_in(lost.as_bytes()));
        // The bracketed fields of the line itself are not kernel timestamps.
        assert!(!stamp_at("cloud-init[412]", 10));
        assert!(!stamp_at("[seed=/dev/vdb]", 0));
        assert!(!stamp_at("[12.]", 0));
        assert!(stamp_at("x[    0.000000] Linux", 1));
    }
}
