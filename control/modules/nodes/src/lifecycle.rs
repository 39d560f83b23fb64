//! The lifecycle controller (`controllers` role): queues the acceptance check `diag.nvml` for the nodes
//! [`bc_core::lifecycle::needs_check`] picks (adopting nodes whose GPU inventory has arrived, failed nodes due a
//! re-check), and applies the decision of [`bc_core::lifecycle::after_diag`] to each finished check. Every step
//! takes `now` as an argument (deadlines, expiry and re-checks are decided at it, never at the database's clock);
//! the loop converges on its own tick.

use bc_core::api::nodes::CommandState;
use bc_core::lifecycle::{DiagOutcome, Transition, after_diag, needs_check, timed_out};
use bc_core::node::NodeState;
use bc_kernel::ReconcileCx;
use bc_proto::payloads::diag::DiagReport;
use bc_store::Store;
use bc_store::lifecycle::DiagResult;
use std::time::Duration;

pub const DIAG_KIND: &str = bc_proto::payloads::diag::KIND;

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
    let report = match (r.state, &r.result) {
        (CommandState::Done, Some(v)) => {
            DiagReport::from_value(v.clone()).map_err(|e| e.to_string())
        }
        (CommandState::Done, None) => Err("no result".to_string()),
        (CommandState::Expired, _) => return timed_out(DIAG_KIND),
        _ => {
            return DiagOutcome {
                passed: false,
                reasons: vec![
                    r.error
                        .clone()
                        .unwrap_or_else(|| format!("{DIAG_KIND} failed")),
                ],
            };
        }
    };
    match report {
        Ok(report) => DiagOutcome {
            passed: report.passed(),
            reasons: report
                .failures()
                .map(|c| {
                    c.reason
                        .clone()
                        .unwrap_or_else(|| format!("check {} failed without a reason", c.check))
                })
                .collect(),
        },
        Err(why) => DiagOutcome {
            passed: false,
            reasons: vec![format!(
                "{DIAG_KIND} returned something that is not a {DIAG_KIND} report ({why})"
            )],
        },
    }
}

/// At most this many checks are queued per step (the rest on the next).
const MAX_QUEUED: usize = 1000;

/// One pass at `now_ms` over the nodes of `shards`: expires commands past their deadline, queues the checks due,
/// applies the finished ones.
pub async fn step(
    store: &Store,
    t: &LifecycleTiming,
    shards: &[i16],
    now_ms: i64,
) -> Result<(), bc_store::StoreError> {
    if shards.is_empty() {
        return Ok(());
    }
    store.expire_commands(now_ms).await?;
    let recheck_ms = i64::try_from(t.recheck_after.as_millis()).unwrap_or(i64::MAX);
    let deadline_ms = i64::try_from(t.deadline.as_millis()).unwrap_or(i64::MAX);
    let due = store
        .check_candidates(DIAG_KIND, shards)
        .await?
        .into_iter()
        .filter(|(_, _, c)| needs_check(c, now_ms, recheck_ms))
        .take(MAX_QUEUED);
    for (node_id, gpus, _) in due {
        let id = uuid::Uuid::now_v7().to_string();
        let args = serde_json::json!({"expected_gpu_count": gpus});
        store
            .queue_command(
                &id,
                node_id.as_str(),
                DIAG_KIND,
                &args,
                now_ms.saturating_add(deadline_ms),
            )
            .await?;
        tracing::info!(%node_id, command = id, "acceptance check queued");
    }
    for r in store.unconsumed_results(DIAG_KIND, shards).await? {
        let state = r.node_state;
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

/// Runs a step when poked (GPU inventory arrived, a check finished: `bc_lifecycle`) and on every tick, acting only
/// on nodes of the shards this process leases in the `controllers` role.
pub async fn run(mut cx: ReconcileCx) {
    let Some((store, timing)) = cx
        .resources
        .get::<crate::Nodes>()
        .map(|n| (n.store.clone(), n.lifecycle))
    else {
        tracing::error!("lifecycle: the nodes module did not start; the controller cannot run");
        return cx.stop.stopped().await;
    };
    let mut tick = tokio::time::interval(cx.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut listening = true;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            n = cx.pokes.recv(), if listening => match n {
                Some(_) => tick.reset(),
                None => listening = false,
            },
            _ = cx.stop.stopped() => return,
        }
        while cx.pokes.try_recv().is_ok() {}
        let mine: Vec<i16> = cx.shards.borrow().iter().map(|l| l.shard.get()).collect();
        // Bounded as a step is, and cut short when the pool moves to another primary (`Store::within`).
        let stepped = store.within(
            "a lifecycle step",
            bc_kernel::STEP_DEADLINE,
            step(&store, &timing, &mine, crate::now_ms()),
        );
        if let Err(e) = stepped.await {
            tracing::warn!(error = %e, "lifecycle step failed; retrying next tick");
        }
    }
}
