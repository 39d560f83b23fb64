//! The per-node series budget and series ends, sans I/O.
//!
//! [`SeriesBook::admit`] takes a collected snapshot and returns what to export: every series already live, new
//! series while fewer than the budget are live (the rest are refused and counted as overflow, so a label explosion
//! cannot flood the database), and the series that were live before but are absent now, which the exporters mark
//! stale (remote write: Prometheus's stale NaN; OTLP: the no-recorded-value flag) and which then free their place.

use crate::model::{Family, Kind, Labels, Snapshot};
use std::collections::HashMap;

/// A series' identity: metric name and labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesKey {
    pub name: String,
    pub labels: Labels,
}

/// A series that ended: its family's kind and unit, for the stale marker.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    pub key: SeriesKey,
    pub kind: Kind,
    pub unit: &'static str,
}

/// What one snapshot exports after the budget.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Admitted {
    pub snapshot: Snapshot,
    /// Series live before and absent now (marked stale once).
    pub ended: Vec<Ended>,
    /// Series refused this time because the budget was full.
    pub overflow: u64,
}

impl Admitted {
    pub fn sample_count(&self) -> usize {
        self.snapshot.series_count() + self.ended.len()
    }
}

/// The series live at the last snapshot, and the budget.
#[derive(Debug, Clone)]
pub struct SeriesBook {
    max_series: usize,
    live: HashMap<SeriesKey, (Kind, &'static str)>,
}

impl SeriesBook {
    pub fn new(max_series: usize) -> SeriesBook {
        SeriesBook {
            max_series,
            live: HashMap::new(),
        }
    }

    pub fn live(&self) -> usize {
        self.live.len()
    }

    pub fn max_series(&self) -> usize {
        self.max_series
    }

    /// Applies the budget to `snapshot`. Series live before keep their places; new ones take the places left, in
    /// collection order. `exempt` families (the exporter's own health, which must always get through) do not count
    /// against it.
    pub fn admit(&mut self, snapshot: Snapshot, exempt: &[&str]) -> Admitted {
        let mut keyed: Vec<(Family, Vec<SeriesKey>, bool)> =
            Vec::with_capacity(snapshot.families.len());
        let mut continuing = 0usize;
        for f in snapshot.families {
            let is_exempt = exempt.contains(&f.name.as_str());
            let keys: Vec<SeriesKey> = f
                .series
                .iter()
                .map(|s| SeriesKey {
                    name: f.name.clone(),
                    labels: s.labels.clone(),
                })
                .collect();
            if !is_exempt {
                continuing += keys.iter().filter(|k| self.live.contains_key(*k)).count();
            }
            keyed.push((f, keys, is_exempt));
        }
        let new_places = self.max_series.saturating_sub(continuing);
        let mut new_taken = 0usize;
        let mut next: HashMap<SeriesKey, (Kind, &'static str)> =
            HashMap::with_capacity(self.live.len());
        let mut overflow = 0u64;
        let mut families: Vec<Family> = Vec::with_capacity(keyed.len());
        for (mut f, keys, is_exempt) in keyed {
            let mut kept = Vec::with_capacity(f.series.len());
            for (s, key) in f.series.into_iter().zip(keys) {
                if next.contains_key(&key) {
                    // A collector reported the same series twice: keep the first.
                    continue;
                }
                let admitted = if is_exempt || self.live.contains_key(&key) {
                    true
                } else if new_taken < new_places {
                    new_taken += 1;
                    true
                } else {
                    false
                };
                if admitted {
                    next.insert(key, (f.kind, f.unit));
                    kept.push(s);
                } else {
                    overflow += 1;
                }
            }
            f.series = kept;
            families.push(f);
        }
        let mut ended: Vec<Ended> = self
            .live
            .iter()
            .filter(|(k, _)| !next.contains_key(*k))
            .map(|(k, (kind, unit))| Ended {
                key: k.clone(),
                kind: *kind,
                unit,
            })
            .collect();
        ended.sort_by(|a, b| a.key.cmp(&b.key));
        self.live = next;
        Admitted {
            snapshot: Snapshot {
                timestamp_ms: snapshot.timestamp_ms,
                families,
            },
            ended,
            overflow,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(t: i64, n: usize) -> Snapshot {
        let mut f = Family::new("m", Kind::Gauge, "", "");
        for i in 0..n {
            f.push(Labels::new().with("i", i.to_string()), i as f64);
        }
        Snapshot {
            timestamp_ms: t,
            families: vec![f],
        }
    }

    #[test]
    fn budget_refuses_new_series_and_counts_them() {
        let mut b = SeriesBook::new(3);
        let a = b.admit(snap(1, 5), &[]);
        assert_eq!(a.snapshot.series_count(), 3);
        assert_eq!(a.overflow, 2);
        assert_eq!(b.live(), 3);
        // The same three keep their places; the other two stay refused.
        let a = b.admit(snap(2, 5), &[]);
        assert_eq!(a.snapshot.series_count(), 3);
        assert_eq!(a.overflow, 2);
        assert!(a.ended.is_empty());
    }

    #[test]
    fn ended_series_are_reported_once_and_free_their_place() {
        let mut b = SeriesBook::new(3);
        b.admit(snap(1, 3), &[]);
        let a = b.admit(snap(2, 1), &[]);
        assert_eq!(a.ended.len(), 2);
        let a = b.admit(snap(3, 1), &[]);
        assert!(a.ended.is_empty());
        assert_eq!(b.live(), 1);
    }

    #[test]
    fn a_continuing_series_keeps_its_place_against_a_new_one_listed_first() {
        let mut b = SeriesBook::new(1);
        b.admit(snap(1, 1), &[]); // i=0 is live
        let mut f = Family::new("m", Kind::Gauge, "", "");
        f.push(Labels::new().with("i", "new"), 1.0);
        f.push(Labels::new().with("i", "0"), 2.0);
        let a = b.admit(
            Snapshot {
                timestamp_ms: 2,
                families: vec![f],
            },
            &[],
        );
        assert_eq!(a.overflow, 1);
        assert_eq!(a.snapshot.value("m", &[("i", "0")]), Some(2.0));
        assert!(a.ended.is_empty());
    }

    #[test]
    fn exempt_families_always_pass() {
        let mut b = SeriesBook::new(0);
        let a = b.admit(snap(1, 2), &["m"]);
        assert_eq!(a.snapshot.series_count(), 2);
        assert_eq!(a.overflow, 0);
    }
}
