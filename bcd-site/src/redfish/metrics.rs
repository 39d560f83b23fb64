//! Outcomes and latencies of BMC operations, counted process-wide ([`operations`]) so whoever runs them (the
//! one-call forms here, the site agent) is counted the same way and a telemetry exporter reads one place. Atomics
//! only: recording never blocks an operation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Operations counted.
pub const OPS: [&str; 3] = ["inspect", "power", "boot_once"];
/// Latency bucket upper bounds, seconds (+Inf implied).
pub const BUCKETS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Debug, Default)]
struct OpCells {
    ok: AtomicU64,
    failed: AtomicU64,
    /// Per bucket (not cumulative), the last is +Inf.
    buckets: [AtomicU64; 11],
    micros: AtomicU64,
}

/// Every operation's counters.
#[derive(Debug, Default)]
pub struct Operations {
    cells: [OpCells; 3],
}

/// A copy of one operation's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpSnapshot {
    pub ok: u64,
    pub failed: u64,
    /// Cumulative counts per [`BUCKETS`] bound, then +Inf.
    pub cumulative: [u64; 11],
    pub total_micros: u64,
}

impl Operations {
    /// Records one operation (`op` one of [`OPS`]; others are ignored).
    pub fn record(&self, op: &str, ok: bool, took: Duration) {
        let Some(i) = OPS.iter().position(|o| *o == op) else {
            return;
        };
        let c = &self.cells[i];
        if ok { &c.ok } else { &c.failed }.fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        let b = BUCKETS
            .iter()
            .position(|u| secs <= *u)
            .unwrap_or(BUCKETS.len());
        c.buckets[b].fetch_add(1, Ordering::Relaxed);
        c.micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self, op: &str) -> OpSnapshot {
        let Some(i) = OPS.iter().position(|o| *o == op) else {
            return OpSnapshot::default();
        };
        let c = &self.cells[i];
        let mut s = OpSnapshot {
            ok: c.ok.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            total_micros: c.micros.load(Ordering::Relaxed),
            ..OpSnapshot::default()
        };
        let mut sum = 0;
        for (slot, b) in s.cumulative.iter_mut().zip(&c.buckets) {
            sum += b.load(Ordering::Relaxed);
            *slot = sum;
        }
        s
    }
}

static OPERATIONS: std::sync::OnceLock<Operations> = std::sync::OnceLock::new();

/// The process's BMC operation counters.
pub fn operations() -> &'static Operations {
    OPERATIONS.get_or_init(Operations::default)
}

/// Runs `f`, recording its outcome and latency under `op`.
pub async fn timed<T, E>(
    op: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let started = std::time::Instant::now();
    let r = f.await;
    operations().record(op, r.is_ok(), started.elapsed());
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_outcomes_and_buckets() {
        let o = Operations::default();
        o.record("power", true, Duration::from_millis(200));
        o.record("power", false, Duration::from_secs(200));
        o.record("nope", true, Duration::ZERO);
        let s = o.snapshot("power");
        assert_eq!((s.ok, s.failed), (1, 1));
        assert_eq!(s.cumulative[0], 0);
        assert_eq!(s.cumulative[1], 1);
        assert_eq!(s.cumulative[10], 2);
        assert_eq!(o.snapshot("inspect"), OpSnapshot::default());
    }
}
