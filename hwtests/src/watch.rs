//! The first time patterns show up in a growing file (a serial console, a daemon's log), timed from a start.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The first time each pattern appeared in a growing file (after its length at creation), measured from `t0`.
pub struct Watcher {
    pub path: PathBuf,
    pub from: usize,
    pub t0: Instant,
    pub seen: Vec<(String, Duration)>,
}

impl Watcher {
    pub fn new(path: PathBuf, t0: Instant) -> Self {
        let from = fs::metadata(&path).map_or(0, |m| m.len() as usize);
        Watcher {
            path,
            from,
            t0,
            seen: Vec::new(),
        }
    }

    /// Records, for each (label, all-of-these substrings) that matches a line now, the time it was first seen.
    pub fn poll(&mut self, patterns: &[(&str, &[&str])]) {
        let Ok(text) = fs::read(&self.path) else {
            return;
        };
        let text = String::from_utf8_lossy(text.get(self.from..).unwrap_or_default());
        for (label, needles) in patterns {
            if self.seen.iter().any(|(l, _)| l == label) {
                continue;
            }
            if text.lines().any(|l| needles.iter().all(|n| l.contains(n))) {
                self.seen.push((label.to_string(), self.t0.elapsed()));
            }
        }
    }

    pub fn has(&self, label: &str) -> bool {
        self.seen.iter().any(|(l, _)| l == label)
    }

    pub fn at(&self, label: &str) -> Option<Duration> {
        self.seen.iter().find(|(l, _)| l == label).map(|(_, t)| *t)
    }

    /// The text written since the watcher was made.
    pub fn text(&self) -> String {
        let text = fs::read(&self.path).unwrap_or_default();
        String::from_utf8_lossy(text.get(self.from..).unwrap_or_default()).into_owned()
    }
}
