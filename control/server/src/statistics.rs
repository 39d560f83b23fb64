//! Keeps the planner's statistics of the hot tables (those every module declared with `Module::hot_tables`, the
//! kernel's [`bc_store::statistics::HOT_TABLES`] among them) in step with their growth while autovacuum has not caught up
//! (a fresh database, a fleet joining): every [`INTERVAL`] one catalog query, and an ANALYZE of a table only when it
//! outgrew its estimate ([`bc_store::statistics`] says why and when). Runs in every process of the `controllers`
//! or `scheduler` role; several doing it at once cost one skipped ANALYZE.

use bc_store::Store;
use std::time::Duration;
use tokio::sync::watch;

/// How often the estimates are checked: statements prepared on empty tables are replanned this soon after the
/// tables fill.
pub const INTERVAL: Duration = Duration::from_secs(2);

pub async fn run(store: Store, tables: Vec<&'static str>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return;
                }
            }
        }
        // Bounded, and cut short when the pool moves to another primary (`Store::within`).
        let refreshed = store.within(
            "checking planner statistics",
            bc_kernel::STEP_DEADLINE,
            store.refresh_stale_statistics(&tables),
        );
        match refreshed.await {
            Ok(tables) if !tables.is_empty() => tracing::info!(
                ?tables,
                "analyzed tables that outgrew the planner's estimate"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "checking planner statistics failed"),
        }
    }
}
