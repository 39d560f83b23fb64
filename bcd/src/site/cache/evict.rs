//! Which cached artifacts an eviction pass deletes: a pure decision over what the cache holds, what the netboot
//! table references and the cap ([`plan_eviction`]); [`super::ArtifactCache::evict`] applies it. No clock, RNG or
//! file system here (clippy's `disallowed-methods`): "last used" times come in with the input.

#![deny(clippy::disallowed_methods)]

use std::collections::BTreeSet;
use std::time::SystemTime;

/// A verified artifact in the cache, as eviction sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedArtifact {
    pub sha256: String,
    pub size: u64,
    /// When a table last referenced it (or when it was written).
    pub last_used: SystemTime,
}

/// What an eviction pass deletes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EvictionPlan {
    /// (hash, size), least recently used first.
    pub evict: Vec<(String, u64)>,
    /// Bytes cached once the plan is applied, downloads still to come included.
    pub bytes_after: u64,
    /// Bytes of the referenced artifacts (cached or still to come).
    pub referenced_bytes: u64,
    /// The referenced artifacts alone exceed the cap: they are all kept.
    pub over_cap: bool,
}

/// Picks the artifacts to delete so that the cache (plus `incoming` bytes of downloads still to come) fits in
/// `max_bytes`: unreferenced ones only, least recently used first (ties by hash, so the choice is stable).
pub fn plan_eviction(
    cached: &[CachedArtifact],
    referenced: &BTreeSet<String>,
    incoming: u64,
    max_bytes: u64,
) -> EvictionPlan {
    let mut total = cached
        .iter()
        .map(|c| c.size)
        .fold(incoming, u64::saturating_add);
    let referenced_bytes = cached
        .iter()
        .filter(|c| referenced.contains(&c.sha256))
        .map(|c| c.size)
        .fold(incoming, u64::saturating_add);
    let mut candidates: Vec<&CachedArtifact> = cached
        .iter()
        .filter(|c| !referenced.contains(&c.sha256))
        .collect();
    candidates.sort_by(|a, b| {
        a.last_used
            .cmp(&b.last_used)
            .then_with(|| a.sha256.cmp(&b.sha256))
    });
    let mut evict = Vec::new();
    for c in candidates {
        if total <= max_bytes {
            break;
        }
        total = total.saturating_sub(c.size);
        evict.push((c.sha256.clone(), c.size));
    }
    EvictionPlan {
        evict,
        bytes_after: total,
        referenced_bytes,
        over_cap: total > max_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn art(sha: char, size: u64, used_s: u64) -> CachedArtifact {
        CachedArtifact {
            sha256: sha.to_string().repeat(64),
            size,
            last_used: SystemTime::UNIX_EPOCH + Duration::from_secs(used_s),
        }
    }

    fn refs(shas: &[char]) -> BTreeSet<String> {
        shas.iter().map(|c| c.to_string().repeat(64)).collect()
    }

    #[test]
    fn eviction_takes_least_recently_used_unreferenced_first() {
        let cached = [
            art('a', 40, 300),
            art('b', 30, 100),
            art('c', 20, 200),
            art('d', 10, 50),
        ];
        // 100 bytes under a cap of 100: nothing to do.
        assert_eq!(plan_eviction(&cached, &refs(&[]), 0, 100).evict, vec![]);
        // Cap 60, 'd' referenced: 'b' (oldest unreferenced) then 'c' go; 'd' stays although it is older.
        let p = plan_eviction(&cached, &refs(&['d']), 0, 60);
        let gone: Vec<char> = p
            .evict
            .iter()
            .filter_map(|(s, _)| s.chars().next())
            .collect();
        assert_eq!(gone, vec!['b', 'c']);
        assert_eq!(p.bytes_after, 50);
        assert!(!p.over_cap);
        // Downloads still to come count against the cap.
        let p = plan_eviction(&cached, &refs(&['d']), 25, 60);
        assert_eq!(p.evict.len(), 3, "{p:?}");
        assert_eq!(p.bytes_after, 35);
        // The referenced ones alone exceed the cap: everything else goes, they are kept, and that is reported.
        let p = plan_eviction(&cached, &refs(&['a', 'b']), 0, 50);
        let gone: Vec<char> = p
            .evict
            .iter()
            .filter_map(|(s, _)| s.chars().next())
            .collect();
        assert_eq!(gone, vec!['d', 'c']);
        assert_eq!(
            (p.bytes_after, p.referenced_bytes, p.over_cap),
            (70, 70, true)
        );
        // Same last use: the hash decides, so the choice is stable.
        let tie = [art('f', 10, 7), art('e', 10, 7)];
        let p = plan_eviction(&tie, &refs(&[]), 0, 10);
        assert_eq!(p.evict, vec![("e".repeat(64), 10)]);
    }
}
