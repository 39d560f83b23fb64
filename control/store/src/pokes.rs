//! Pokes: PostgreSQL notifications that wake a loop sooner than its tick. A writer sends one in (or right after)
//! the transaction whose change a loop must act on; a listener wakes the loop, which converges as on any tick.
//! Nothing depends on a poke arriving: every loop still runs on its own (slow) tick, so a lost notification (the
//! listening connection dropped) costs latency, never correctness. The listening side is bc-control's `notify`.

use crate::{Store, StoreError};

/// Something for the gateways to deliver (a command queued, a new desired-state generation); payload: node id.
pub const OUTBOX: &str = "bc_outbox";
/// Something for the lifecycle controller (GPU inventory arrived, a command finished); payload: node id.
pub const LIFECYCLE: &str = "bc_lifecycle";

impl Store {
    /// Sends a poke now (outside any transaction of the caller's).
    pub async fn poke(&self, channel: &str, payload: &str) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(channel)
            .bind(payload)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
