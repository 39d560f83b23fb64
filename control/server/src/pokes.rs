//! Wakes this process's loops on PostgreSQL notifications ([`bc_store::pokes`]): the gateway's pull of waiting
//! messages on `bc_outbox`, the lifecycle controller on `bc_lifecycle`. The loops also run on their own ticks, so a
//! notification lost while the listening connection was down costs latency only; after a reconnect every loop is
//! woken once to catch up.

use crate::notify::{self, Notice};
use bc_gateway::session::Registry;
use bc_store::Store;
use bc_store::pokes::{LIFECYCLE, OUTBOX};
use std::sync::Arc;
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
    // One listening mechanism for the whole control plane: `notify::listen` reconnects by itself and reports a
    // possible loss as `Resync`, after which every loop is woken once to catch up.
    let mut notices = notify::listen(&store, &channels, stop);
    while let Some(n) = notices.recv().await {
        match n {
            Notice::Message { channel, .. } => wake(Some(&channel)),
            Notice::Resync => wake(None),
        }
    }
}
