//! The `controllers` role's shard work: reservation expiry from the work queue, the outbox sink, and the sessions
//! of gateways gone silent, on the shards this process leases (the kernel keeps the role's membership and fenced
//! leases; see [`bc_kernel::Reconciler`]). It converges on its tick; the outbox notification only makes delivery
//! sooner.

use bc_core::gateways::GatewayWatch;
use bc_kernel::{Notice, ReconcileCx, STEP_DEADLINE};
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

/// At most this many nodes of silent gateways are taken offline per statement (the rest by the next, at once).
const SILENT_BATCH: i64 = 2_000;

/// Takes offline the nodes of the leased shards whose gateway went silent ([`bc_core::gateways`]): reads every
/// gateway's row into `watch` at `now_ms` (this process's monotonic clock) and writes what it decides. A failed
/// read or write makes the watch start again, so the process's own outage is never taken for a gateway's.
async fn silent_gateways(
    store: &Store,
    watch: &mut GatewayWatch,
    (worker, leases): (&str, &[ShardLease]),
    now_ms: i64,
) {
    let silent = match store.gateway_rows().await {
        Ok(rows) => watch.observe(now_ms, &rows),
        Err(e) => {
            tracing::warn!(error = %e, "reading the gateways' rows failed; their silence is timed again");
            return watch.forget();
        }
    };
    if silent.is_empty() {
        return;
    }
    let mut taken = Vec::new();
    loop {
        match store
            .offline_on_silent_gateways(ROLE, worker, leases, &silent, SILENT_BATCH)
            .await
        {
            Ok(batch) => {
                let done = (batch.len() as i64) < SILENT_BATCH;
                taken.extend(batch);
                if done {
                    break;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "taking silent gateways' nodes offline failed; their silence is timed again");
                return watch.forget();
            }
        }
    }
    for s in &silent {
        watch.swept(&s.id);
        let nodes: Vec<&str> = taken
            .iter()
            .filter(|(_, g)| *g == s.id)
            .map(|(n, _)| n.as_str())
            .collect();
        if let Some(first) = nodes.first() {
            tracing::warn!(
                gateway = s.id,
                nodes = nodes.len(),
                first,
                "nodes offline: their gateway has not refreshed its row for {:.1} s, past its lease",
                s.silent_ms as f64 / 1000.0
            );
        }
    }
}

/// Runs expiry, the outbox sink and the silent gateways' sweep on every tick and change of leases, and the outbox
/// sink alone when poked.
pub async fn run(mut cx: ReconcileCx) {
    let Ok(store) = cx.resources.require::<Store>().cloned() else {
        tracing::error!("controllers: no store; the role cannot run");
        return cx.stop.stopped().await;
    };
    let worker = cx.worker.id.clone();
    let mut tick = tokio::time::interval(cx.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut listening = true;
    let (mut watch, clock) = (GatewayWatch::new(), tokio::time::Instant::now());
    let mut swept_with = Vec::new();
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
        // Each database wait is bounded as a step is and cut short when the pool moves to another primary
        // (`Store::within`): a round waiting on a primary that hangs would otherwise hold this loop for good.
        if !outbox_only {
            let expired = store.within(
                "an expiry round",
                STEP_DEADLINE,
                store.run_due_expiries(ROLE, &worker, &leases, 500),
            );
            match expired.await {
                Ok(ended) => {
                    for r in ended {
                        tracing::info!(reservation = %r.id, nodes = ?r.nodes, "reservation expired; GPUs freed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "expiry round failed"),
            }
            if leases != swept_with {
                watch.sweep_again();
                swept_with.clone_from(&leases);
            }
            let now_ms = i64::try_from(clock.elapsed().as_millis()).unwrap_or(i64::MAX);
            let swept = store.within("sweeping silent gateways", STEP_DEADLINE, async {
                silent_gateways(&store, &mut watch, (&worker, &leases), now_ms).await;
                Ok(())
            });
            if let Err(e) = swept.await {
                tracing::warn!(error = %e, "sweeping silent gateways failed");
            }
        }
        loop {
            let drained = store.within(
                "draining the outbox",
                STEP_DEADLINE,
                store.drain_outbox(ROLE, &worker, &leases, 1000),
            );
            match drained.await {
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
