//! The lifecycle controller (`controllers` role): queues the acceptance check `diag.nvml` for adopting nodes
//! whose GPU inventory has arrived and for failed nodes due a re-check, and applies the decision of
//! [`bc_core::lifecycle::after_diag`] to each finished check. Every loop converges on its own tick.

use bc_core::lifecycle::{DiagOutcome, Transition, after_diag, timed_out};
use bc_core::node::NodeState;
use bc_store::Store;
use bc_store::sessions::DiagResult;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};

pub const DIAG_KIND: &str = "diag.nvml";

#[derive(Debug, Clone, Copy)]
pub struct LifecycleTiming {
    /// How often the controller looks without being poked: the fallback for a lost notification, and the
    /// granularity of command deadlines and re-checks.
    pub tick: Duration,
    /// How long after a failed check a failed node is checked again.
    pub recheck_after: Duration,
    /// How long a node has to answer a check.
    pub deadline: Duration,
}

impl Default for LifecycleTiming {
    fn default() -> LifecycleTiming {
        LifecycleTiming {
            tick: Duration::from_secs(5),
            recheck_after: Duration::from_secs(300),
            deadline: Duration::from_secs(120),
        }
    }
}

/// The desired state a newly adopted node starts from (bookings arrive with reservations).
fn initial_spec() -> serde_json::Value {
    serde_json::json!({"version": 1, "bookings": []})
}

/// Reads a finished check into an outcome; a result that is missing, unsigned or of another kind fails.
fn outcome(r: &DiagResult) -> DiagOutcome {
    match (r.state.as_str(), &r.result) {
        ("done", Some(v)) if v["kind"] == DIAG_KIND => {
            let passed = v["status"] == "pass";
            let reasons = v["checks"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|c| c["status"] == "fail")
                .map(|c| {
                    c["reason"]
                        .as_str()
                        .unwrap_or("a check failed without a reason")
                        .to_string()
                })
                .collect();
            DiagOutcome { passed, reasons }
        }
        ("done", _) => DiagOutcome {
            passed: false,
            reasons: vec![format!(
                "{DIAG_KIND} returned something that is not a {DIAG_KIND} report"
            )],
        },
        ("expired", _) => timed_out(DIAG_KIND),
        _ => DiagOutcome {
            passed: false,
            reasons: vec![
                r.error
                    .clone()
                    .unwrap_or_else(|| format!("{DIAG_KIND} failed")),
            ],
        },
    }
}

async fn step(
    store: &Store,
    t: &LifecycleTiming,
    shards: &[i16],
) -> Result<(), bc_store::StoreError> {
    if shards.is_empty() {
        return Ok(());
    }
    store.expire_commands().await?;
    let now_ms = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
    for (node_id, gpus) in store
        .nodes_needing_check(DIAG_KIND, t.recheck_after.as_millis() as i64, shards)
        .await?
    {
        let id = uuid::Uuid::now_v7().to_string();
        let args = serde_json::json!({"expected_gpu_count": gpus});
        store
            .queue_command(
                &id,
                &node_id,
                DIAG_KIND,
                &args,
                now_ms + t.deadline.as_millis() as i64,
            )
            .await?;
        tracing::info!(node_id, command = id, "acceptance check queued");
    }
    for r in store.unconsumed_results(DIAG_KIND, shards).await? {
        let Ok(state) = r.node_state.parse::<NodeState>() else {
            continue;
        };
        let o = outcome(&r);
        let (new_state, conditions, desired) = match after_diag(state, r.desired_generation, &o) {
            Transition::Adopt { desired_generation } => (
                Some(NodeState::Adopted),
                Vec::new(),
                (r.desired_generation < desired_generation)
                    .then(|| (desired_generation, initial_spec())),
            ),
            Transition::Fail { reasons } => (Some(NodeState::Failed), reasons, None),
            Transition::Stay { reasons } => (None, reasons, None),
        };
        let conditions = serde_json::json!(conditions);
        store
            .apply_lifecycle(
                &r.command_id,
                &r.node_id,
                state.as_str(),
                new_state.map(NodeState::as_str),
                &conditions,
                desired,
            )
            .await?;
        tracing::info!(node_id = r.node_id, from = %state, to = ?new_state, %conditions, "acceptance check applied");
    }
    Ok(())
}

/// Runs a step when poked (GPU inventory arrived, a check finished: see [`crate::pokes`]) and on every tick,
/// acting only on nodes of the shards this process leases (`shards`, kept current by the controllers' membership
/// loop).
pub async fn run(
    store: Store,
    timing: LifecycleTiming,
    shards: watch::Receiver<Vec<i16>>,
    poke: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(timing.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = async {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = poke.notified() => tick.reset(),
                }
            } => {
                let mine = shards.borrow().clone();
                if let Err(e) = step(&store, &timing, &mine).await {
                    tracing::warn!(error = %e, "lifecycle step failed; retrying next tick");
                }
            }
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return;
                }
            }
        }
    }
}
