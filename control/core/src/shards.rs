//! Shards and their owners. Work is split into [`SHARDS`] shards (the store computes a subject's shard with its
//! `bc_shard` function); each role spreads them over its live processes by rendezvous (highest random weight)
//! hashing, so a process joining or leaving moves only the shards it wins or held.

/// Shards per role.
pub const SHARDS: u16 = 256;

/// One of the [`SHARDS`] shards (stored as `smallint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shard(i16);

impl Shard {
    /// The shard numbered `n`, if there is one.
    pub fn new(n: i16) -> Option<Shard> {
        (0..SHARDS as i16).contains(&n).then_some(Shard(n))
    }

    pub fn get(self) -> i16 {
        self.0
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard:{}", self.0)
    }
}

/// A shard a process holds, with the fencing token it holds it with: work on the shard commits only while the
/// lease row still carries this fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLease {
    pub shard: Shard,
    pub fence: i64,
}

/// FNV-1a over the worker id, then the shard mixed in with splitmix64's finaliser: stable across builds and
/// platforms (unlike `std`'s hasher), well spread for short ids.
fn weight(worker: &str, shard: u16) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in worker.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = h ^ (u64::from(shard).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The live worker that owns `shard` (None when there are none). Ties break by worker id so every process
/// computes the same answer.
pub fn owner(shard: u16, workers: &[String]) -> Option<&str> {
    workers
        .iter()
        .max_by(|a, b| (weight(a, shard), a.as_str()).cmp(&(weight(b, shard), b.as_str())))
        .map(String::as_str)
}

/// The shards `me` owns among `workers` (which must include `me` for it to own any).
pub fn owned_by(me: &str, workers: &[String]) -> Vec<u16> {
    (0..SHARDS)
        .filter(|s| owner(*s, workers) == Some(me))
        .collect()
}

/// [`owned_by`] as shards.
pub fn shards_owned_by(me: &str, workers: &[String]) -> Vec<Shard> {
    owned_by(me, workers)
        .into_iter()
        .map(|s| Shard(s as i16))
        .collect()
}

/// The live worker that owns the item `key` (a pool id): rendezvous hashing over the worker and the key, like
/// shards, so a worker joining or leaving moves only the keys it wins or held.
pub fn key_owner<'a>(key: &str, workers: &'a [String]) -> Option<&'a str> {
    let weight = |worker: &str| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in worker.bytes().chain([0]).chain(key.bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut z = h;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    workers
        .iter()
        .max_by(|a, b| (weight(a), a.as_str()).cmp(&(weight(b), b.as_str())))
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("controllers/p{i}")).collect()
    }

    #[test]
    fn every_shard_has_exactly_one_owner_and_the_spread_is_even() {
        let workers = ws(3);
        let mut total = 0;
        for w in &workers {
            let mine = owned_by(w, &workers);
            assert!(
                (50..=120).contains(&mine.len()),
                "{w} owns {} of 256",
                mine.len()
            );
            total += mine.len();
        }
        assert_eq!(total, usize::from(SHARDS));
    }

    #[test]
    fn a_leaving_worker_moves_only_its_own_shards() {
        let all = ws(4);
        let rest: Vec<String> = all[1..].to_vec();
        for s in 0..SHARDS {
            let before = owner(s, &all).map(str::to_string);
            let after = owner(s, &rest).map(str::to_string);
            if before.as_deref() != Some(all[0].as_str()) {
                assert_eq!(before, after, "shard {s} moved though its owner stayed");
            }
        }
    }

    #[test]
    fn keys_spread_and_stay_with_their_owner() {
        let all = ws(3);
        let pools: Vec<String> = (0..60).map(|i| format!("pool-{i}")).collect();
        let mut counts = std::collections::HashMap::new();
        for p in &pools {
            *counts.entry(key_owner(p, &all)).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 3, "{counts:?}");
        assert!(counts.values().all(|n| *n >= 8), "{counts:?}");
        let rest = all[1..].to_vec();
        for p in &pools {
            if key_owner(p, &all) != Some(all[0].as_str()) {
                assert_eq!(key_owner(p, &all), key_owner(p, &rest), "{p} moved");
            }
        }
        assert_eq!(key_owner("p", &[]), None);
        assert_eq!(Shard::new(256), None);
        assert_eq!(Shard::new(255).map(Shard::get), Some(255));
    }

    #[test]
    fn no_workers_no_owner() {
        assert_eq!(owner(3, &[]), None);
        assert!(owned_by("x", &[]).is_empty());
    }
}
