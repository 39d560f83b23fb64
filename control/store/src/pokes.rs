//! Pokes: PostgreSQL notifications that wake a loop sooner than its tick. A writer sends one in (or right after)
//! the transaction whose change a loop must act on; a listener wakes the loop, which converges as on any tick.
//! Nothing depends on a poke arriving: every loop still runs on its own (slow) tick, so a lost notification (the
//! listening connection dropped) costs latency, never correctness.

use crate::{Store, StoreError};
use sqlx::postgres::PgListener;

/// Something for the gateways to deliver (a command queued, a new desired-state generation); payload: node id.
pub const OUTBOX: &str = "bc_outbox";
/// Something for the lifecycle controller (GPU inventory arrived, a command finished); payload: node id.
pub const LIFECYCLE: &str = "bc_lifecycle";

/// A listening connection.
pub struct Pokes {
    listener: PgListener,
}

/// What woke the listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poke {
    /// A notification on `channel`.
    On { channel: String },
    /// The connection was lost and re-established: notifications may have been missed.
    Reconnected,
}

impl Store {
    /// Listens on `channels` on a dedicated connection.
    pub async fn listen(&self, channels: &[&str]) -> Result<Pokes, StoreError> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen_all(channels.iter().copied()).await?;
        Ok(Pokes { listener })
    }

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

impl Pokes {
    /// The next poke. An error means the connection could not be re-established; call again later.
    pub async fn next(&mut self) -> Result<Poke, StoreError> {
        Ok(match self.listener.try_recv().await? {
            Some(n) => Poke::On {
                channel: n.channel().to_string(),
            },
            None => Poke::Reconnected,
        })
    }
}
