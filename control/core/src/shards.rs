//! Shards and their owners. Work is split into [`SHARDS`] shards (the store computes a subject's shard with its
//! `bc_shard` function); each role spreads them over its live processes by rendezvous (highest random weight)
//! hashing, so a process joining or leaving moves only the shards it wins or held.

/// Shards per role.
pub const SHARDS: u16 = 256;

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
    fn no_workers_no_owner() {
        assert_eq!(owner(3, &[]), None);
        assert!(owned_by("x", &[]).is_empty());
    }
}
