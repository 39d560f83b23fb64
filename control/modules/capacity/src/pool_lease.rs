//! What a placer holds under the scheduler's own membership (workers `scheduler/<id>`), and how it claims by it.
//! The `shard` placer leases reservation shards (`scheduler/shard:<n>`, rendezvous over the live schedulers) and
//! claims the pending reservations of those shards. The `pool-lease` placer leases pools (`scheduler/pool:<pool>`,
//! rendezvous over the live schedulers by pool id): one process holds each pool and is its only booking writer,
//! however many run, because every claim-and-book transaction locks its pool leases `FOR SHARE` with the fence it
//! holds them with ([`crate::queries::claim_pending_in_pools`]); a takeover (which bumps the fence) waits for that
//! transaction, and a process whose lease moved on books nothing.

use crate::queries::{self, PoolLease};
use crate::scheduler::BATCH;
use crate::{Placer, ROLE};
use bc_store::reservations::Pending;
use bc_store::sqlx::{Postgres, Transaction};
use bc_store::{Store, StoreError};
use std::time::Duration;

/// The shards or pools this process holds.
pub enum Held {
    Shards(Vec<i16>),
    Pools(Vec<PoolLease>),
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Held {
    pub fn new(placer: Placer) -> Held {
        match placer {
            Placer::Shard => Held::Shards(Vec::new()),
            Placer::PoolLease => Held::Pools(Vec::new()),
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            Held::Shards(s) => s.is_empty(),
            Held::Pools(p) => p.is_empty(),
        }
    }

    /// Renews this process's scheduler membership and makes its leases match what rendezvous hashing over the
    /// live schedulers gives it.
    pub async fn renew(
        &mut self,
        store: &Store,
        me: &str,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let workers = store.heartbeat_worker(ROLE, me, ms(lease)).await?;
        match self {
            Held::Shards(shards) => {
                let want: Vec<i16> = bc_core::shards::owned_by(me, &workers)
                    .into_iter()
                    .map(|s| s as i16)
                    .collect();
                let held = store.sync_leases(ROLE, me, &want, ms(lease)).await?;
                if held.len() != shards.len() {
                    tracing::info!(worker = me, shards = held.len(), "scheduler shards");
                }
                *shards = held.into_iter().map(|l| l.shard).collect();
            }
            Held::Pools(pools) => {
                let want: Vec<String> = queries::pools(store)
                    .await?
                    .into_iter()
                    .filter(|p| bc_core::shards::key_owner(p, &workers) == Some(me))
                    .collect();
                let held = queries::sync_pool_leases(store, me, &want, ms(lease)).await?;
                if held != *pools {
                    let names: Vec<&str> = held.iter().map(|l| l.pool.as_str()).collect();
                    tracing::info!(worker = me, pools = ?names, "scheduler pools");
                }
                *pools = held;
            }
        }
        Ok(())
    }

    /// Claims pending reservations of what it holds (those among `ids`, or the queue's oldest), in a transaction
    /// the placement commits.
    pub async fn claim(
        &mut self,
        store: &Store,
        me: &str,
        ids: Option<&[String]>,
    ) -> Result<(Transaction<'static, Postgres>, Vec<Pending>), StoreError> {
        match self {
            Held::Shards(shards) => match ids {
                Some(ids) => store.claim_pending_ids(ids, shards).await,
                None => store.claim_pending(shards, BATCH).await,
            },
            Held::Pools(pools) => {
                let (tx, valid, pending) =
                    queries::claim_pending_in_pools(store, me, pools, ids, BATCH).await?;
                if valid.len() != pools.len() {
                    // A lease ran out or moved on: book nothing in it, and stop claiming it.
                    tracing::info!(
                        worker = me,
                        held = valid.len(),
                        "a pool lease was lost; no longer booking in it"
                    );
                    pools.retain(|l| valid.contains(&l.pool));
                }
                Ok((tx, pending))
            }
        }
    }

    /// Leaves the scheduler role at once (a clean shutdown): the worker row and its leases expire now.
    pub async fn leave(&self, store: &Store, me: &str) {
        if let Err(e) = store.leave_role(ROLE, me).await {
            tracing::warn!(error = %e, "leaving the scheduler role failed; its leases will expire");
        }
        if let Held::Pools(_) = self
            && let Err(e) = queries::leave_pools(store, me).await
        {
            tracing::warn!(error = %e, "letting go of the pool leases failed; they will expire");
        }
    }
}
