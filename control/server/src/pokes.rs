//! Wakes this process's loops on PostgreSQL notifications ([`bc_store::pokes`]): the gateway's pull of waiting
//! messages on `bc_outbox`, the lifecycle controller on `bc_lifecycle`. The loops also run on their own ticks, so a
//! notification lost while the listening connection was down costs latency only; after a reconnect every loop is
//! woken once to catch up.

use bc_gateway::session::Registry;
use bc_proto::channel::Backoff;
use bc_store::Store;
use bc_store::pokes::{LIFECYCLE, OUTBOX, Poke};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};

pub async fn run(
    store: Store,
    outbox: Option<Registry>,
    lifecycle: Option<Arc<Notify>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut channels = Vec::new();
    if outbox.is_some() {
        channels.push(OUTBOX);
    }
    if lifecycle.is_some() {
        channels.push(LIFECYCLE);
    }
    if channels.is_empty() {
        // Nothing in this process to wake; a role task must not end on its own (`Running::wait_any`).
        let _ = stop.wait_for(|s| *s).await;
        return;
    }
    let wake = |channel: Option<&str>| {
        if let Some(r) = &outbox
            && channel.is_none_or(|c| c == OUTBOX)
        {
            r.poke_pending();
        }
        if let Some(n) = &lifecycle
            && channel.is_none_or(|c| c == LIFECYCLE)
        {
            n.notify_one();
        }
    };
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    loop {
        let listening = tokio::select! {
            l = store.listen(&channels) => l,
            _ = stop.wait_for(|s| *s) => return,
        };
        match listening {
            Ok(mut pokes) => {
                backoff.reset();
                // Whatever was written before we listened.
                wake(None);
                loop {
                    let next = tokio::select! {
                        p = pokes.next() => p,
                        _ = stop.wait_for(|s| *s) => return,
                    };
                    match next {
                        Ok(Poke::On { channel }) => wake(Some(&channel)),
                        Ok(Poke::Reconnected) => wake(None),
                        Err(e) => {
                            tracing::warn!(error = %e, "notification listener lost its connection; the loops run on their ticks meanwhile");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for notifications; the loops run on their ticks meanwhile")
            }
        }
        let wait = backoff.next_delay(rand::random::<f64>());
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
