//! Progress of an image stream: bytes, rate and ETA. The meter is pure: the caller passes the time.

#![deny(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

/// One progress report.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// Image bytes written to the device so far.
    pub written: u64,
    /// Bytes read from the source (compressed) so far.
    pub source_read: u64,
    /// Source length when known (HTTP Content-Length).
    pub source_total: Option<u64>,
    /// Image length when known (the request's expected size).
    pub image_total: Option<u64>,
    /// Average source throughput since the start, bytes per second.
    pub rate_bps: f64,
    /// Time left at the average rate, when a total is known.
    pub eta: Option<Duration>,
    pub elapsed: Duration,
    /// True for the last report of a successful stream.
    pub done: bool,
}

impl std::fmt::Display for Progress {
    /// One console line: `512.0 MiB written, 300.0/600.0 MiB read, 950.0 MB/s, ETA 1s`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIB: f64 = (1 << 20) as f64;
        write!(f, "{:.1} MiB written", self.written as f64 / MIB)?;
        if let Some(total) = self.image_total {
            write!(f, " of {:.1} MiB", total as f64 / MIB)?;
        }
        write!(f, ", {:.1}", self.source_read as f64 / MIB)?;
        if let Some(total) = self.source_total {
            write!(f, "/{:.1}", total as f64 / MIB)?;
        }
        write!(f, " MiB read, {:.1} MB/s", self.rate_bps / 1e6)?;
        match self.eta {
            _ if self.done => write!(f, ", done in {}s", self.elapsed.as_secs()),
            Some(eta) => write!(f, ", ETA {}s", eta.as_secs()),
            None => Ok(()),
        }
    }
}

/// Turns byte counters into [`Progress`] reports at most once per `interval`.
#[derive(Debug)]
pub struct ProgressMeter {
    start: Instant,
    interval: Duration,
    last_emit: Option<Instant>,
    source_total: Option<u64>,
    image_total: Option<u64>,
}

impl ProgressMeter {
    pub fn new(
        start: Instant,
        interval: Duration,
        source_total: Option<u64>,
        image_total: Option<u64>,
    ) -> Self {
        Self {
            start,
            interval,
            last_emit: None,
            source_total,
            image_total,
        }
    }

    /// The least time between two reports.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// A report if `interval` has passed since the last one (or `done`), else `None`.
    pub fn observe(
        &mut self,
        now: Instant,
        written: u64,
        source_read: u64,
        done: bool,
    ) -> Option<Progress> {
        if !done
            && self
                .last_emit
                .is_some_and(|last| now.saturating_duration_since(last) < self.interval)
        {
            return None;
        }
        self.last_emit = Some(now);
        let elapsed = now.saturating_duration_since(self.start);
        let secs = elapsed.as_secs_f64();
        // Rate and ETA follow the source when its length is known (that is what the network delivers); otherwise
        // the image bytes written.
        let (done_bytes, total) = match (self.source_total, self.image_total) {
            (Some(total), _) => (source_read, Some(total)),
            (None, total) => (written, total),
        };
        let rate_bps = if secs > 0.0 {
            done_bytes as f64 / secs
        } else {
            0.0
        };
        let eta = match total {
            Some(_) if done => Some(Duration::ZERO),
            Some(total) if rate_bps > 0.0 => Some(Duration::from_secs_f64(
                total.saturating_sub(done_bytes) as f64 / rate_bps,
            )),
            _ => None,
        };
        Some(Progress {
            written,
            source_read,
            source_total: self.source_total,
            image_total: self.image_total,
            rate_bps,
            eta,
            elapsed,
            done,
        })
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests pick one real instant as their origin
mod tests {
    use super::*;

    #[test]
    fn rate_eta_and_throttle() {
        let t0 = Instant::now();
        let mut m = ProgressMeter::new(t0, Duration::from_secs(1), Some(1000), None);
        let p = m
            .observe(t0 + Duration::from_secs(2), 4000, 200, false)
            .expect("first report");
        assert_eq!(p.rate_bps, 100.0);
        assert_eq!(p.eta, Some(Duration::from_secs(8)));
        assert!(
            m.observe(t0 + Duration::from_millis(2500), 5000, 250, false)
                .is_none()
        );
        let last = m
            .observe(t0 + Duration::from_millis(2600), 9000, 1000, true)
            .expect("done is always reported");
        assert_eq!(last.eta, Some(Duration::ZERO));
        assert!(last.done);
    }

    #[test]
    fn console_line() {
        let p = Progress {
            written: 512 << 20,
            source_read: 300 << 20,
            source_total: Some(600 << 20),
            image_total: Some(1 << 30),
            rate_bps: 950e6,
            eta: Some(Duration::from_millis(1500)),
            elapsed: Duration::from_secs(3),
            done: false,
        };
        assert_eq!(
            p.to_string(),
            "512.0 MiB written of 1024.0 MiB, 300.0/600.0 MiB read, 950.0 MB/s, ETA 1s"
        );
        let done = Progress {
            done: true,
            eta: Some(Duration::ZERO),
            source_total: None,
            image_total: None,
            ..p
        };
        assert_eq!(
            done.to_string(),
            "512.0 MiB written, 300.0 MiB read, 950.0 MB/s, done in 3s"
        );
    }

    #[test]
    fn unknown_total_has_no_eta() {
        let t0 = Instant::now();
        let mut m = ProgressMeter::new(t0, Duration::ZERO, None, None);
        let p = m
            .observe(t0 + Duration::from_secs(1), 10, 5, false)
            .expect("report");
        assert_eq!(p.eta, None);
        assert_eq!(p.rate_bps, 10.0);
    }
}
