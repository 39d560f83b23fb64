//! The gateway role's row in the store: its relay URL and lease, published at start and refreshed every third of
//! the lease, and the sessions its previous run left online, closed once the reconnects after its start are over
//! (docs/session.md, "A gateway that dies").

use bc_store::Store;

/// How long a gateway's row promises it is alive: three shard leases (30 s by default; a dead process's shards move
/// within one). The gateway refreshes its row every third of it, and the `controllers` role takes the sessions of a
/// gateway whose row stayed unchanged past it for dead ([`bc_core::gateways`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatewayLease(std::time::Duration);

impl GatewayLease {
    pub(crate) fn of(shard_lease: std::time::Duration) -> GatewayLease {
        GatewayLease(shard_lease.saturating_mul(3))
    }

    pub(crate) fn ms(self) -> i64 {
        i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX)
    }

    fn refresh_every(self) -> std::time::Duration {
        self.0 / 3
    }
}

/// The reason the `node.offline` rows of [`end_previous_run`] give.
const PREVIOUS_RUN_ENDED: &str =
    "its gateway restarted without closing the session, and the node did not reconnect";

/// Closes the sessions the gateway's previous run left online whose node has not reconnected since, when
/// [`bc_core::gateways::close_previous_run_now`] says: a lease after the start once the reconnects to this gateway
/// are over. Then it reads the sessions online under its id and closes those it does not hold (a node that
/// reconnected has a newer epoch, which the close leaves as it is). A node that died with the gateway goes offline
/// about a lease later, as one whose gateway stays dead does; a fleet reconnecting after a crash is not written twice,
/// and nothing is read while it reconnects (a full read of the nodes took 0.3–0.6 s of the database in the 50,000
/// sessions' storm).
pub(crate) async fn end_previous_run(
    store: Store,
    (id, registry): (String, bc_gateway::session::Registry),
    lease: GatewayLease,
    mut stop: bc_kernel::Stop,
) {
    let started = tokio::time::Instant::now();
    let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let mut last_open = (registry.opened(), started);
    loop {
        tokio::select! {
            _ = tokio::time::sleep((lease.0 / 12).max(std::time::Duration::from_millis(100))) => {}
            _ = stop.stopped() => return,
        }
        let now = tokio::time::Instant::now();
        if registry.opened() != last_open.0 {
            last_open = (registry.opened(), now);
        }
        if bc_core::gateways::close_previous_run_now(
            ms(now - started),
            ms(now - last_open.1),
            lease.ms(),
        ) {
            break;
        }
    }
    let previous: Vec<(String, i64)> = match store.sessions_on_gateway(&id).await {
        Ok(online) => online
            .into_iter()
            .filter(|(n, e)| !u64::try_from(*e).is_ok_and(|e| registry.holds(n, e)))
            .collect(),
        Err(e) => {
            tracing::warn!(error = %bc_error_chain::chain(&e), "reading the previous run's sessions failed; they stay \
                 online until their nodes reconnect or the gateway restarts again");
            return stop.stopped().await;
        }
    };
    let mut closed = 0;
    for chunk in previous.chunks(1_000) {
        let closes: Vec<(&str, i64, Option<i64>)> =
            chunk.iter().map(|(n, e)| (n.as_str(), *e, None)).collect();
        match store
            .close_sessions_because(&closes, Some(PREVIOUS_RUN_ENDED))
            .await
        {
            Ok(n) => closed += n,
            Err(e) => {
                // Those nodes stay online in their rows until they reconnect or the gateway restarts again.
                tracing::warn!(error = %bc_error_chain::chain(&e), "closing the previous run's sessions failed");
                return stop.stopped().await;
            }
        }
    }
    tracing::info!(
        sessions = previous.len(),
        closed,
        "the previous run's sessions whose node did not reconnect are closed"
    );
    // A task of the plane that ends is taken for a role that failed: this one waits for the stop.
    stop.stopped().await
}

/// Keeps gateway `id`'s row (its relay URL and lease) fresh until the plane stops.
pub(crate) async fn publish_gateway(
    store: Store,
    (id, relay_url): (String, String),
    lease: GatewayLease,
    mut stop: bc_kernel::Stop,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(lease.refresh_every()) => {}
            _ = stop.stopped() => return,
        }
        if let Err(e) = store.publish_gateway(&id, &relay_url, lease.ms()).await {
            tracing::warn!(error = %bc_error_chain::chain(&e), gateway_id = id, "refreshing the gateway's row failed");
        }
    }
}
