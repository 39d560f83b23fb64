//! A daemon's own counters, gauges and histograms ([`Registry`]), and the [`Collector`] trait through which a
//! sampler (bcd's GPU and host sampler, the site's service counters) adds families at collection time.
//!
//! Handles are cheap clones around atomics: a hot path increments one without a lock. The control plane plugs in
//! with a few lines: `let lat = registry.histogram("bc_api_request_duration_seconds", "…", LATENCY_BUCKETS);` then
//! `lat.with(&[("method", m)]).observe(secs)` in a middleware, and hands the registry to [`crate::Telemetry`].

use crate::model::{Family, Kind, Labels};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Something that adds families at each collection (a GPU sampler, a bridge to counters kept elsewhere). `at_ms` is
/// the snapshot's time (Unix milliseconds): time is an input, so a collector never needs the clock.
pub trait Collector: Send + Sync {
    fn collect(&self, at_ms: i64, out: &mut Vec<Family>);
}

/// Latency buckets in seconds suited to API calls and BMC operations (1 ms … 60 s).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
enum Cell {
    Counter(AtomicU64),
    /// f64 bits.
    Gauge(AtomicU64),
    Histogram(HistogramCell),
}

#[derive(Debug)]
struct HistogramCell {
    bounds: Arc<[f64]>,
    /// Per bucket (not cumulative); the last is +Inf.
    counts: Vec<AtomicU64>,
    sum_bits: AtomicU64,
    count: AtomicU64,
}

#[derive(Debug)]
struct FamilyCells {
    name: String,
    help: String,
    unit: &'static str,
    kind: CellKind,
    children: Mutex<BTreeMap<Labels, Arc<Cell>>>,
}

#[derive(Debug, Clone)]
enum CellKind {
    Counter,
    Gauge,
    Histogram(Arc<[f64]>),
}

impl FamilyCells {
    fn child(&self, labels: &[(&str, &str)]) -> Arc<Cell> {
        let labels: Labels = labels.iter().map(|(n, v)| (*n, *v)).collect();
        lock(&self.children)
            .entry(labels)
            .or_insert_with(|| {
                Arc::new(match &self.kind {
                    CellKind::Counter => Cell::Counter(AtomicU64::new(0)),
                    CellKind::Gauge => Cell::Gauge(AtomicU64::new(0f64.to_bits())),
                    CellKind::Histogram(bounds) => Cell::Histogram(HistogramCell {
                        bounds: bounds.clone(),
                        counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                        sum_bits: AtomicU64::new(0f64.to_bits()),
                        count: AtomicU64::new(0),
                    }),
                })
            })
            .clone()
    }

    fn collect(&self, out: &mut Vec<Family>) {
        let children = lock(&self.children);
        match &self.kind {
            CellKind::Counter | CellKind::Gauge => {
                let kind = if matches!(self.kind, CellKind::Counter) {
                    Kind::Counter
                } else {
                    Kind::Gauge
                };
                let mut f = Family::new(&self.name, kind, self.unit, &self.help);
                for (labels, cell) in children.iter() {
                    let v = match &**cell {
                        Cell::Counter(c) => c.load(Ordering::Relaxed) as f64,
                        Cell::Gauge(g) => f64::from_bits(g.load(Ordering::Relaxed)),
                        Cell::Histogram(_) => continue,
                    };
                    f.push(labels.clone(), v);
                }
                out.push(f);
            }
            CellKind::Histogram(_) => {
                let help = &self.help;
                let mut buckets = Family::new(
                    format!("{}_bucket", self.name),
                    Kind::Counter,
                    self.unit,
                    help,
                );
                let mut sums =
                    Family::new(format!("{}_sum", self.name), Kind::Counter, self.unit, help);
                let mut counts =
                    Family::new(format!("{}_count", self.name), Kind::Counter, "1", help);
                for (labels, cell) in children.iter() {
                    let Cell::Histogram(h) = &**cell else {
                        continue;
                    };
                    let mut cumulative = 0u64;
                    for (i, c) in h.counts.iter().enumerate() {
                        cumulative += c.load(Ordering::Relaxed);
                        let le = h
                            .bounds
                            .get(i)
                            .map_or_else(|| "+Inf".to_string(), |b| format_le(*b));
                        buckets.push(labels.clone().with("le", le), cumulative as f64);
                    }
                    sums.push(
                        labels.clone(),
                        f64::from_bits(h.sum_bits.load(Ordering::Relaxed)),
                    );
                    counts.push(labels.clone(), h.count.load(Ordering::Relaxed) as f64);
                }
                out.extend([buckets, sums, counts]);
            }
        }
    }
}

fn format_le(b: f64) -> String {
    // Prometheus's own client renders bucket bounds with the shortest round-trip form ("0.005", "1", "2.5").
    let s = format!("{b}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

/// The daemon's metrics: families of counters, gauges and histograms, and the collectors added to them.
#[derive(Clone, Default)]
pub struct Registry {
    families: Arc<Mutex<Vec<Arc<FamilyCells>>>>,
    collectors: Arc<Mutex<Vec<Arc<dyn Collector>>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("families", &lock(&self.families).len())
            .field("collectors", &lock(&self.collectors).len())
            .finish()
    }
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    fn family(
        &self,
        name: &str,
        help: &str,
        unit: &'static str,
        kind: CellKind,
    ) -> Arc<FamilyCells> {
        let mut fams = lock(&self.families);
        if let Some(f) = fams.iter().find(|f| f.name == name) {
            return f.clone();
        }
        let f = Arc::new(FamilyCells {
            name: name.to_string(),
            help: help.to_string(),
            unit,
            kind,
            children: Mutex::new(BTreeMap::new()),
        });
        fams.push(f.clone());
        f
    }

    /// A counter family; `.with(labels)` gives one series of it. Registering a name twice returns the same family.
    pub fn counter(&self, name: &str, help: &str) -> CounterVec {
        CounterVec(self.family(name, help, "", CellKind::Counter))
    }

    pub fn gauge(&self, name: &str, help: &str, unit: &'static str) -> GaugeVec {
        GaugeVec(self.family(name, help, unit, CellKind::Gauge))
    }

    /// A histogram family with these upper bounds (sorted ascending; +Inf is implied), in seconds for latencies.
    pub fn histogram(&self, name: &str, help: &str, bounds: &[f64]) -> HistogramVec {
        let mut b: Vec<f64> = bounds.iter().copied().filter(|x| x.is_finite()).collect();
        b.sort_by(f64::total_cmp);
        b.dedup();
        HistogramVec(self.family(name, help, "s", CellKind::Histogram(b.into())))
    }

    /// Adds a collector called at every collection.
    pub fn register(&self, c: Arc<dyn Collector>) {
        lock(&self.collectors).push(c);
    }

    /// Every family: the registry's own, then each collector's.
    pub fn collect(&self, at_ms: i64) -> Vec<Family> {
        let mut out = Vec::new();
        let fams: Vec<Arc<FamilyCells>> = lock(&self.families).clone();
        for f in fams {
            f.collect(&mut out);
        }
        let collectors: Vec<Arc<dyn Collector>> = lock(&self.collectors).clone();
        for c in collectors {
            c.collect(at_ms, &mut out);
        }
        out
    }
}

// === handles ===

#[derive(Debug, Clone)]
pub struct CounterVec(Arc<FamilyCells>);
#[derive(Debug, Clone)]
pub struct GaugeVec(Arc<FamilyCells>);
#[derive(Debug, Clone)]
pub struct HistogramVec(Arc<FamilyCells>);

/// One counter series.
#[derive(Debug, Clone)]
pub struct Counter(Arc<Cell>);
/// One gauge series.
#[derive(Debug, Clone)]
pub struct Gauge(Arc<Cell>);
/// One histogram series.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<Cell>);

impl CounterVec {
    pub fn with(&self, labels: &[(&str, &str)]) -> Counter {
        Counter(self.0.child(labels))
    }
}

impl GaugeVec {
    pub fn with(&self, labels: &[(&str, &str)]) -> Gauge {
        Gauge(self.0.child(labels))
    }
}

impl HistogramVec {
    pub fn with(&self, labels: &[(&str, &str)]) -> Histogram {
        Histogram(self.0.child(labels))
    }
}

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        if let Cell::Counter(c) = &*self.0 {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn get(&self) -> u64 {
        match &*self.0 {
            Cell::Counter(c) => c.load(Ordering::Relaxed),
            _ => 0,
        }
    }
}

impl Gauge {
    pub fn set(&self, v: f64) {
        if let Cell::Gauge(g) = &*self.0 {
            g.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    pub fn get(&self) -> f64 {
        match &*self.0 {
            Cell::Gauge(g) => f64::from_bits(g.load(Ordering::Relaxed)),
            _ => 0.0,
        }
    }
}

impl Histogram {
    pub fn observe(&self, v: f64) {
        let Cell::Histogram(h) = &*self.0 else { return };
        if !v.is_finite() {
            return;
        }
        let i = h
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(h.bounds.len());
        h.counts[i].fetch_add(1, Ordering::Relaxed);
        h.count.fetch_add(1, Ordering::Relaxed);
        let _ = h
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
    }

    pub fn count(&self) -> u64 {
        match &*self.0 {
            Cell::Histogram(h) => h.count.load(Ordering::Relaxed),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_gauges_histograms_collect() {
        let r = Registry::new();
        let c = r.counter("bc_requests_total", "requests");
        c.with(&[("method", "a")]).add(3);
        c.with(&[("method", "a")]).inc();
        r.gauge("bc_depth", "depth", "1").with(&[]).set(2.5);
        let h = r.histogram("bc_latency_seconds", "latency", &[0.1, 1.0]);
        h.with(&[("method", "a")]).observe(0.05);
        h.with(&[("method", "a")]).observe(0.5);
        h.with(&[("method", "a")]).observe(5.0);
        let s = crate::model::Snapshot {
            timestamp_ms: 0,
            families: r.collect(0),
        };
        assert_eq!(s.value("bc_requests_total", &[("method", "a")]), Some(4.0));
        assert_eq!(s.value("bc_depth", &[]), Some(2.5));
        assert_eq!(
            s.value("bc_latency_seconds_bucket", &[("le", "0.1")]),
            Some(1.0)
        );
        assert_eq!(
            s.value("bc_latency_seconds_bucket", &[("le", "1.0")]),
            Some(2.0)
        );
        assert_eq!(
            s.value("bc_latency_seconds_bucket", &[("le", "+Inf")]),
            Some(3.0)
        );
        assert_eq!(s.value("bc_latency_seconds_count", &[]), Some(3.0));
        assert_eq!(s.value("bc_latency_seconds_sum", &[]), Some(5.55));
    }
}
