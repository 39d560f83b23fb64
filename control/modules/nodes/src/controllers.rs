//! The `controllers` role's shard work: reservation expiry from the work queue and the outbox sink, on the shards
//! this process leases (the kernel keeps the role's membership and fenced leases; see [`bc_kernel::Reconciler`]).
//! It converges on its tick; the outbox notification only makes delivery sooner.

use bc_kernel::{Notice, ReconcileCx};
use bc_store::Store;
use bc_store::work::ShardLease;

pub const ROLE: &str = "controllers";
/// Notified (by the booking transactions) when outbox rows were written.
pub const OUTBOX_WRITTEN: &str = bc_store::reservations::OUTBOX_WRITTEN_CHANNEL;

/// The leases the kernel holds, as the store's queries take them.
pub(crate) fn store_leases(cx: &ReconcileCx) -> Vec<ShardLease> {
    cx.shards
        .borrow()
        .iter()
        .map(|l| ShardLease {
            shard: l.shard.get(),
            fence: l.fence,
        })
        .collect()
}

/// Runs expiry and the outbox sink on every tick and change of leases, and the outbox sink alone when poked.
pub async fn run(mut cx: ReconcileCx) {
    let Ok(store) = cx.resources.require::<Store>().cloned() else {
        tracing::error!("controllers: no store; the role cannot run");
        return cx.stop.stopped().await;
    };
    let worker = cx.worker.id.clone();
    let mut tick = tokio::time::interval(cx.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut listening = true;
    loop {
        let mut outbox_only = false;
        tokio::select! {
            _ = tick.tick() => {}
            n = cx.pokes.recv(), if listening => match n {
                Some(Notice::Message { .. } | Notice::Resync) => outbox_only = true,
                None => listening = false,
            },
            changed = cx.shards.changed() => {
                if changed.is_err() {
                    return cx.stop.stopped().await;
                }
            }
            _ = cx.stop.stopped() => return,
        }
        while cx.pokes.try_recv().is_ok() {}
        let leases = store_leases(&cx);
        if leases.is_empty() {
            continue;
        }
        if !outbox_only {
            match store.run_due_expiries(ROLE, &worker, &leases, 500).await {
                Ok(ended) => {
                    for r in ended {
                        tracing::info!(reservation = %r.id, nodes = ?r.nodes, "reservation expired; GPUs freed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "expiry round failed"),
            }
        }
        loop {
            match store.drain_outbox(ROLE, &worker, &leases, 1000).await {
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

/// A process-unique worker id: host, pid and a random suffix (a restarted process is a new worker).
pub fn worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &suffix[..8])
}
