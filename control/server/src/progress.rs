//! Progress of a long transfer on stderr: one line rewritten in place on a terminal (`\r`, at most 10 times a
//! second), plain lines otherwise (a start line, one every 10 s, a last line), so a pipe or a journal gets a few
//! readable lines and no control characters. Hand-written rather than indicatif: one counter and one line do not
//! need a terminal library and its five crates.

use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

/// How often a terminal's line is redrawn, and a plain line is written.
const TTY_EVERY: Duration = Duration::from_millis(100);
const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// One transfer's progress: `label` (e.g. `uploading vmlinuz`), `total` bytes when known.
pub struct Progress {
    label: String,
    total: Option<u64>,
    done: u64,
    tty: bool,
    started: Instant,
    shown: Instant,
}

impl Progress {
    /// Starts it, writing the first line (on a terminal, the line it then redraws).
    pub fn start(label: impl Into<String>, total: Option<u64>) -> Progress {
        Progress::new(label.into(), total, std::io::stderr().is_terminal())
    }

    fn new(label: String, total: Option<u64>, tty: bool) -> Progress {
        let now = Instant::now();
        let p = Progress {
            label,
            total,
            done: 0,
            tty,
            started: now,
            shown: now,
        };
        p.write(false);
        p
    }

    /// `n` more bytes went.
    pub fn add(&mut self, n: u64) {
        self.done += n;
        let every = if self.tty { TTY_EVERY } else { PLAIN_EVERY };
        if self.shown.elapsed() >= every {
            self.shown = Instant::now();
            self.write(false);
        }
    }

    /// The last line (and the end of a terminal's redrawn one).
    pub fn finish(self) {
        self.write(true);
    }

    fn write(&self, last: bool) {
        let line = self.line(self.started.elapsed());
        let mut err = std::io::stderr().lock();
        let _ = if self.tty {
            write!(err, "\r\x1b[2K{line}{}", if last { "\n" } else { "" })
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }

    /// `uploading x: 120.0 MiB / 400.0 MiB (30%), 55.1 MiB/s`.
    fn line(&self, elapsed: Duration) -> String {
        let rate = self.done as f64 / elapsed.as_secs_f64().max(0.001);
        match self.total {
            Some(t) if t > 0 => format!(
                "{}: {} / {} ({}%), {}/s",
                self.label,
                bytes(self.done),
                bytes(t),
                self.done.saturating_mul(100) / t,
                bytes(rate as u64)
            ),
            _ => format!(
                "{}: {}, {}/s",
                self.label,
                bytes(self.done),
                bytes(rate as u64)
            ),
        }
    }
}

/// Bytes in binary units with one decimal (`512 B`, `1.5 KiB`, `400.0 MiB`).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_the_bytes_the_share_and_the_rate() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(400 << 20), "400.0 MiB");
        let mut p = Progress::new("uploading x".into(), Some(400 << 20), false);
        p.done = 120 << 20;
        assert_eq!(
            p.line(Duration::from_secs(2)),
            "uploading x: 120.0 MiB / 400.0 MiB (30%), 60.0 MiB/s"
        );
        p.total = None;
        assert_eq!(
            p.line(Duration::from_secs(1)),
            "uploading x: 120.0 MiB, 120.0 MiB/s"
        );
    }
}
