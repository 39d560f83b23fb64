//! Which gateways went silent. A gateway refreshes its row while it runs (a third of its lease); one killed, or cut
//! off from the database, stops, and the sessions it held would stay online in their rows with nobody to close
//! them. The `controllers` role reads the rows every tick and feeds them to a [`GatewayWatch`], which names the
//! gateways whose row has not changed for longer than their lease.
//!
//! Silence is measured on the watcher's own clock, from the moment it first saw a row's current refresh, never by
//! comparing the row's timestamp with a clock: so clocks that disagree, or a watcher that could not read for a
//! while (its own outage, which it reports with [`GatewayWatch::forget`]), never make a live gateway look silent. A
//! watcher that starts, or forgets, waits a whole lease before it names anyone (Kubernetes' node lifecycle
//! controller keeps its own probe time the same way). A silent gateway whose nodes were taken offline is
//! [`GatewayWatch::swept`] and named no more until its row changes or the watcher's shards do
//! ([`GatewayWatch::sweep_again`]): a gateway that stays dead costs nothing after its sweep.

use std::collections::BTreeMap;

/// One gateway's row as read: its id, when it last refreshed (as the database wrote it, compared only for
/// equality) and the lease it published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayRow {
    pub id: String,
    /// The row's refresh time in microseconds, an opaque version: only its changes matter.
    pub refreshed_us: i64,
    /// How long the gateway may go without refreshing before its sessions are taken for dead.
    pub lease_ms: i64,
}

/// A gateway silent past its lease: the refresh the watcher has seen unchanged, and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Silent {
    pub id: String,
    /// The refresh the decision is about: the store takes a gateway's sessions offline only while its row still
    /// carries it (a gateway that came back meanwhile refreshed it).
    pub refreshed_us: i64,
    /// Milliseconds the watcher has seen this refresh unchanged.
    pub silent_ms: i64,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    refreshed_us: i64,
    /// The watcher's clock when it first read this refresh.
    since_ms: i64,
    /// Its nodes on the watcher's shards were taken offline during this refresh's silence.
    swept: bool,
}

/// The refreshes a watcher has seen, per gateway.
#[derive(Debug, Default)]
pub struct GatewayWatch {
    seen: BTreeMap<String, Seen>,
}

impl GatewayWatch {
    pub fn new() -> GatewayWatch {
        GatewayWatch::default()
    }

    /// One reading of every gateway's row at `now_ms` (the watcher's monotonic clock, in milliseconds): returns the
    /// gateways whose refresh this watcher has seen unchanged for longer than their lease, by id. A gateway whose
    /// row is gone is forgotten.
    pub fn observe(&mut self, now_ms: i64, rows: &[GatewayRow]) -> Vec<Silent> {
        self.seen
            .retain(|id, _| rows.iter().any(|r| r.id.as_str() == id.as_str()));
        let mut silent = Vec::new();
        for r in rows {
            let fresh = Seen {
                refreshed_us: r.refreshed_us,
                since_ms: now_ms,
                swept: false,
            };
            let seen = self.seen.entry(r.id.clone()).or_insert(fresh);
            if seen.refreshed_us != r.refreshed_us {
                *seen = fresh;
            }
            let silent_ms = now_ms.saturating_sub(seen.since_ms);
            if silent_ms > r.lease_ms.max(0) && !seen.swept {
                silent.push(Silent {
                    id: r.id.clone(),
                    refreshed_us: r.refreshed_us,
                    silent_ms,
                });
            }
        }
        silent
    }

    /// Gateway `id`'s nodes on the watcher's shards were taken offline: it is not named again while its row stays
    /// as it is.
    pub fn swept(&mut self, id: &str) {
        if let Some(seen) = self.seen.get_mut(id) {
            seen.swept = true;
        }
    }

    /// The watcher's shards changed: the silent gateways are named again, for the nodes of the shards it gained.
    pub fn sweep_again(&mut self) {
        for seen in self.seen.values_mut() {
            seen.swept = false;
        }
    }

    /// The watcher could not read the rows (or write what it decided): it cannot tell a gateway's silence from its
    /// own, so it starts again, and names nobody until it has watched a whole lease.
    pub fn forget(&mut self) {
        self.seen.clear();
    }
}

/// When a restarted gateway closes the sessions its previous run left online whose node has not reconnected: once
/// a lease has passed since it started and no session has opened on it for a third of a lease (the fleet's
/// reconnects are over: closing in the middle of a reconnect storm competes with it for the database, and closes
/// sessions that would have come back), and at the latest four leases after it started (a fleet that never goes
/// quiet). All in milliseconds: since the start, since the last session opened (or the start), the lease.
pub fn close_previous_run_now(since_start_ms: i64, since_last_open_ms: i64, lease_ms: i64) -> bool {
    let lease_ms = lease_ms.max(0);
    since_start_ms >= lease_ms.saturating_mul(4)
        || (since_start_ms >= lease_ms && since_last_open_ms >= lease_ms / 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, refreshed_us: i64) -> GatewayRow {
        GatewayRow {
            id: id.into(),
            refreshed_us,
            lease_ms: 30_000,
        }
    }

    fn ids(s: &[Silent]) -> Vec<&str> {
        s.iter().map(|s| s.id.as_str()).collect()
    }

    #[test]
    fn a_gateway_is_silent_once_its_row_stays_unchanged_past_its_lease_on_the_watchers_clock() {
        let mut w = GatewayWatch::new();
        // A row already old when first read is not silent yet: the watcher times the silence itself.
        assert!(w.observe(1_000, &[row("gw0", 5), row("gw1", 7)]).is_empty());
        assert!(
            w.observe(31_000, &[row("gw0", 5), row("gw1", 8)])
                .is_empty()
        );
        let s = w.observe(31_001, &[row("gw0", 5), row("gw1", 8)]);
        assert_eq!(
            s,
            [Silent {
                id: "gw0".into(),
                refreshed_us: 5,
                silent_ms: 30_001
            }]
        );
        // gw1 refreshed at 31,000: silent only a lease after that.
        assert_eq!(
            ids(&w.observe(61_001, &[row("gw0", 5), row("gw1", 8)])),
            ["gw0", "gw1"]
        );
        // A refresh (a restart, or the gateway back) ends the silence at once.
        assert_eq!(
            ids(&w.observe(61_002, &[row("gw0", 6), row("gw1", 8)])),
            ["gw1"]
        );
    }

    #[test]
    fn a_watcher_that_forgot_or_lost_a_row_waits_a_whole_lease_again() {
        let mut w = GatewayWatch::new();
        w.observe(0, &[row("gw0", 5)]);
        assert_eq!(ids(&w.observe(40_000, &[row("gw0", 5)])), ["gw0"]);
        // Its own outage: the same unchanged row is no evidence until a lease has passed since.
        w.forget();
        assert!(w.observe(90_000, &[row("gw0", 5)]).is_empty());
        assert_eq!(ids(&w.observe(120_001, &[row("gw0", 5)])), ["gw0"]);
        // A row that went away is forgotten: coming back, it starts from its first reading.
        assert!(w.observe(120_002, &[]).is_empty());
        assert!(w.observe(130_000, &[row("gw0", 5)]).is_empty());
    }

    #[test]
    fn a_swept_gateway_is_named_again_only_when_its_row_or_the_watchers_shards_change() {
        let mut w = GatewayWatch::new();
        w.observe(0, &[row("gw0", 5)]);
        assert_eq!(ids(&w.observe(30_001, &[row("gw0", 5)])), ["gw0"]);
        w.swept("gw0");
        assert!(w.observe(40_000, &[row("gw0", 5)]).is_empty());
        // The watcher leased other shards: their nodes of gw0 are still to take.
        w.sweep_again();
        assert_eq!(ids(&w.observe(40_001, &[row("gw0", 5)])), ["gw0"]);
        w.swept("gw0");
        // gw0 came back, then went silent again: a new silence, a new sweep.
        assert!(w.observe(40_002, &[row("gw0", 6)]).is_empty());
        assert_eq!(ids(&w.observe(70_003, &[row("gw0", 6)])), ["gw0"]);
        w.swept("unknown");
    }

    #[test]
    fn a_restarted_gateway_closes_its_previous_runs_sessions_after_a_lease_once_its_reconnects_are_over()
     {
        let lease = 30_000;
        // Not before a lease, however quiet.
        assert!(!close_previous_run_now(29_999, 29_999, lease));
        // A lease on, and quiet for a third of one.
        assert!(close_previous_run_now(30_000, 10_000, lease));
        // A lease on, but sessions still opening: wait.
        assert!(!close_previous_run_now(60_000, 9_999, lease));
        // Four leases on, whatever the reconnects.
        assert!(close_previous_run_now(120_000, 0, lease));
        assert!(!close_previous_run_now(119_999, 0, lease));
    }

    #[test]
    fn each_gateway_is_judged_by_its_own_lease() {
        let mut w = GatewayWatch::new();
        let short = GatewayRow {
            lease_ms: 6_000,
            ..row("gw-short", 1)
        };
        w.observe(0, &[short.clone(), row("gw-long", 1)]);
        assert_eq!(
            ids(&w.observe(6_001, &[short.clone(), row("gw-long", 1)])),
            ["gw-short"]
        );
        // A clock that went backwards (it should not: the watcher's is monotonic) names nobody.
        assert!(w.observe(-5, &[short, row("gw-long", 1)]).is_empty());
    }
}
