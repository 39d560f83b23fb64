//! The `controllers` role's shared machinery: membership (a worker row renewed every quarter lease), the shards
//! this process leases (rendezvous hashing over the live workers, made real by fenced leases), and the loops that
//! work by shard: reservation expiry from the work queue and the outbox sink. The lifecycle controller reads the
//! leased shards from the watch channel this loop publishes. Every loop converges on its tick; the outbox
//! notification only makes delivery sooner.

use crate::notify::{self, Notice};
use bc_core::shards;
use bc_store::Store;
use bc_store::work::ShardLease;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

pub const ROLE: &str = "controllers";
/// Notified (by the booking transactions) when outbox rows were written.
pub const OUTBOX_WRITTEN: &str = bc_store::reservations::OUTBOX_WRITTEN_CHANNEL;

pub async fn run(
    store: Store,
    worker_id: String,
    lease: Duration,
    shards_out: watch::Sender<Vec<i16>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut notices = notify::listen(&store, &[OUTBOX_WRITTEN], stop.clone());
    let lease_ms = lease.as_millis() as i64;
    let tick_every = (lease / 4).max(Duration::from_millis(100));
    let mut tick = tokio::time::interval(tick_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leases: Vec<ShardLease> = Vec::new();
    let mut membership_due = Instant::now();
    loop {
        let mut outbox_only = false;
        tokio::select! {
            _ = tick.tick() => {}
            n = notices.recv() => match n {
                Some(Notice::Message { .. } | Notice::Resync) => outbox_only = true,
                None => return,
            },
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    shards_out.send_replace(Vec::new());
                    if let Err(e) = store.leave_role(ROLE, &worker_id).await {
                        tracing::warn!(error = %e, "leaving the controllers role failed; leases will expire");
                    }
                    return;
                }
            }
        }
        while notices.try_recv().is_ok() {}
        if Instant::now() >= membership_due {
            match membership(&store, &worker_id, lease_ms).await {
                Ok(held) => {
                    let mine: Vec<i16> = held.iter().map(|l| l.shard).collect();
                    if mine.len() != leases.len() {
                        tracing::info!(
                            worker = worker_id,
                            shards = mine.len(),
                            "controller shards"
                        );
                    }
                    leases = held;
                    shards_out.send_replace(mine);
                    membership_due = Instant::now() + tick_every;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "controllers membership failed");
                    membership_due = Instant::now() + Duration::from_millis(500);
                }
            }
        }
        if leases.is_empty() {
            continue;
        }
        if !outbox_only {
            match store.run_due_expiries(ROLE, &worker_id, &leases, 500).await {
                Ok(ended) => {
                    for r in ended {
                        tracing::info!(reservation = r.id, nodes = ?r.nodes, "reservation expired; GPUs freed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "expiry round failed"),
            }
        }
        loop {
            match store.drain_outbox(ROLE, &worker_id, &leases, 1000).await {
                Ok(n) if n >= 1000 => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox sink failed");
                    break;
                }
            }
        }
    }
}

async fn membership(
    store: &Store,
    me: &str,
    lease_ms: i64,
) -> Result<Vec<ShardLease>, bc_store::StoreError> {
    let workers = store.heartbeat_worker(ROLE, me, lease_ms).await?;
    let want: Vec<i16> = shards::owned_by(me, &workers)
        .into_iter()
        .map(|s| s as i16)
        .collect();
    store.sync_leases(ROLE, me, &want, lease_ms).await
}

/// A process-unique worker id: host, pid and a random suffix (a restarted process is a new worker).
pub fn worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &suffix[..8])
}
