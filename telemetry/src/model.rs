//! What a sample is: a metric family (name, help, kind, unit) holding series, each a sorted label set and a value.
//! Collectors fill a `Vec<Family>`; every exporter reads the same families, so the exposition, remote write and
//! OTLP carry exactly the same series.

use std::fmt;

/// How a value behaves over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Goes up and down (a temperature, memory in use).
    Gauge,
    /// Only goes up, except when the source restarts (bytes sent, energy since boot).
    Counter,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// Label pairs sorted by name, names unique (what Prometheus requires of a series).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Labels(Vec<(String, String)>);

impl Labels {
    pub fn new() -> Labels {
        Labels(Vec::new())
    }

    /// Sets `name` to `value`, replacing an earlier value of the same name.
    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) {
        let name = name.into();
        let value = value.into();
        match self.0.binary_search_by(|(n, _)| n.as_str().cmp(&name)) {
            Ok(i) => self.0[i].1 = value,
            Err(i) => self.0.insert(i, (name, value)),
        }
    }

    /// A copy with `name` set (builder style).
    pub fn with(mut self, name: impl Into<String>, value: impl Into<String>) -> Labels {
        self.set(name, value);
        self
    }

    /// Adds every pair of `other` whose name this set does not have yet (own labels win).
    pub fn merge_missing(&mut self, other: &Labels) {
        for (n, v) in &other.0 {
            if self.get(n).is_none() {
                self.set(n.clone(), v.clone());
            }
        }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| self.0[i].1.as_str())
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<N: Into<String>, V: Into<String>> FromIterator<(N, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Labels {
        let mut l = Labels::new();
        for (n, v) in iter {
            l.set(n, v);
        }
        l
    }
}

impl fmt::Display for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (n, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{n}={v:?}")?;
        }
        f.write_str("}")
    }
}

/// One series' value at the snapshot's time.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub labels: Labels,
    pub value: f64,
}

/// A metric family: every series of one metric name.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub name: String,
    pub help: String,
    pub kind: Kind,
    /// UCUM-style unit for OTLP (`By`, `W`, `mJ`, `Cel`, `MHz`, `%`, `s`, `1`); empty when unitless.
    pub unit: &'static str,
    pub series: Vec<Series>,
}

impl Family {
    pub fn new(
        name: impl Into<String>,
        kind: Kind,
        unit: &'static str,
        help: impl Into<String>,
    ) -> Family {
        Family {
            name: name.into(),
            help: help.into(),
            kind,
            unit,
            series: Vec::new(),
        }
    }

    pub fn push(&mut self, labels: Labels, value: f64) {
        self.series.push(Series { labels, value });
    }

    /// Builder style: one series added.
    pub fn with(mut self, labels: Labels, value: f64) -> Family {
        self.push(labels, value);
        self
    }
}

/// Every family collected at one instant (milliseconds since the Unix epoch).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub timestamp_ms: i64,
    pub families: Vec<Family>,
}

impl Snapshot {
    /// Number of series (= samples) in the snapshot.
    pub fn series_count(&self) -> usize {
        self.families.iter().map(|f| f.series.len()).sum()
    }

    /// The value of the series `name` whose labels include every pair of `matching` (tests, the bench).
    pub fn value(&self, name: &str, matching: &[(&str, &str)]) -> Option<f64> {
        self.families
            .iter()
            .filter(|f| f.name == name)
            .flat_map(|f| f.series.iter())
            .find(|s| matching.iter().all(|(n, v)| s.labels.get(n) == Some(*v)))
            .map(|s| s.value)
    }
}

/// True for a name Prometheus accepts as a metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`).
pub fn valid_metric_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_' || b == b':')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
}

/// True for a name Prometheus accepts as a label name (`[a-zA-Z_][a-zA-Z0-9_]*`, not starting with `__`).
pub fn valid_label_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !s.starts_with("__")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stay_sorted_and_unique() {
        let mut l: Labels = [("b", "2"), ("a", "1")].into_iter().collect();
        l.set("b", "3");
        l.set("c", "4");
        assert_eq!(
            l.iter().collect::<Vec<_>>(),
            vec![("a", "1"), ("b", "3"), ("c", "4")]
        );
        let mut m = Labels::new().with("a", "own");
        m.merge_missing(&l);
        assert_eq!(m.get("a"), Some("own"));
        assert_eq!(m.get("c"), Some("4"));
    }

    #[test]
    fn names_are_checked_like_prometheus() {
        assert!(valid_metric_name("DCGM_FI_DEV_GPU_UTIL"));
        assert!(valid_metric_name("node:cpu"));
        assert!(!valid_metric_name("1abc"));
        assert!(!valid_metric_name("a-b"));
        assert!(valid_label_name("GPU_I_ID"));
        assert!(!valid_label_name("__name__"));
        assert!(!valid_label_name("a.b"));
    }
}
