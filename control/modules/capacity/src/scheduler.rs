//! The `scheduler` role: places pending reservations. It keeps the free GPUs in memory ([`Capacity`]), claims
//! pending reservations of the shards it leases (its own membership, separate from the controllers'), decides
//! with the pure placer and books in one transaction per batch ([`Store::commit_placements`]). Woken by the API's
//! tx 1 notification; a tick converges without it. Capacity follows releases and inventory by notification, and
//! is reloaded in full periodically (read beside placement, see [`Refresh`]) and at once after any lost race.

use crate::notify::{self, Notice};
use bc_core::placer::{Capacity, FreeGpu};
use bc_core::reservation::ReservationRequest;
use bc_core::shards;
use bc_store::Store;
use bc_store::reservations::{CAPACITY_CHANNEL, Decision, PENDING_CHANNEL};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

pub const ROLE: &str = "scheduler";
const BATCH: i64 = 512;
/// How often all free capacity is read again (beside placement, see [`Refresh`]).
pub const FULL_RELOAD: Duration = Duration::from_secs(30);
const TICK: Duration = Duration::from_secs(1);

pub async fn run(
    store: Store,
    worker_id: String,
    lease: Duration,
    full_reload: Duration,
    metrics: crate::telemetry::ControlMetrics,
    mut stop: watch::Receiver<bool>,
) {
    let mut notices = notify::listen(&store, &[PENDING_CHANNEL, CAPACITY_CHANNEL], stop.clone());
    let mut capacity = Capacity::default();
    let mut loaded_at: Option<Instant> = None;
    let mut refresh: Option<Refresh> = None;
    let mut dirty: HashSet<String> = HashSet::new();
    let mut my_shards: Vec<i16> = Vec::new();
    let mut membership_due = Instant::now();
    let lease_ms = lease.as_millis() as i64;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Reservations the admission notifications named (claimed by primary key), and whether the queue must be
    // scanned (the tick, or notifications that may have been lost).
    let mut named: Vec<String> = Vec::new();
    let mut scan = true;
    loop {
        tokio::select! {
            _ = tick.tick() => scan = true,
            n = notices.recv() => match n {
                Some(n) => {
                    if heard(n, &mut dirty, &mut named) {
                        loaded_at = None;
                        scan = true;
                    }
                }
                None => return,
            },
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    let _ = store.leave_role(ROLE, &worker_id).await;
                    return;
                }
            }
        }
        // Drain whatever else arrived, so one round serves a burst.
        while let Ok(n) = notices.try_recv() {
            if heard(n, &mut dirty, &mut named) {
                loaded_at = None;
                scan = true;
            }
        }
        if Instant::now() >= membership_due {
            match membership(&store, &worker_id, lease_ms).await {
                Ok(s) => {
                    if s.len() != my_shards.len() {
                        tracing::info!(worker = worker_id, shards = s.len(), "scheduler shards");
                    }
                    my_shards = s;
                    membership_due = Instant::now() + lease / 4;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "scheduler membership failed");
                    membership_due = Instant::now() + Duration::from_millis(500);
                }
            }
        }
        if my_shards.is_empty() {
            // Another scheduler owns every shard; it claims what was named.
            named.clear();
            continue;
        }
        if loaded_at.is_none() {
            // No usable view (start, lost race, lost notifications): load it before placing anything.
            if let Some(r) = refresh.take() {
                r.task.abort();
            }
            match load(&store, None).await {
                Ok(devices) => {
                    capacity.clear();
                    fill(&mut capacity, devices);
                    dirty.clear();
                    loaded_at = Some(Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "capacity load failed");
                    continue;
                }
            }
        } else if refresh.is_none() && loaded_at.is_some_and(|t| t.elapsed() > full_reload) {
            refresh = Some(Refresh::start(&store));
        }
        if let Some(r) = refresh.take_if(|r| r.task.is_finished()) {
            match r.task.await {
                Ok(Ok(fresh)) => {
                    capacity = fresh;
                    // What changed while the snapshot was read is read again, node by node.
                    dirty.extend(r.touched);
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "capacity refresh failed; keeping the current view")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "capacity refresh task failed; keeping the current view")
                }
            }
            loaded_at = Some(Instant::now());
        }
        if !dirty.is_empty() {
            let nodes: Vec<String> = dirty.drain().collect();
            if let Some(r) = refresh.as_mut() {
                r.touched.extend(nodes.iter().cloned());
            }
            match load(&store, Some(&nodes)).await {
                Ok(devices) => {
                    for n in &nodes {
                        capacity.remove_node(n);
                    }
                    fill(&mut capacity, devices);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "capacity reload failed");
                    loaded_at = None;
                    continue;
                }
            }
        }
        let mut touched = refresh.as_mut().map(|r| &mut r.touched);
        let round = async {
            for ids in named.chunks(BATCH as usize) {
                let (tx, pending) = store.claim_pending_ids(ids, &my_shards).await?;
                place_batch(
                    &store,
                    &metrics,
                    &mut capacity,
                    tx,
                    pending,
                    touched.as_deref_mut(),
                )
                .await?;
            }
            named.clear();
            if scan {
                place_all(
                    &store,
                    &metrics,
                    &mut capacity,
                    &my_shards,
                    touched.as_deref_mut(),
                )
                .await?;
                scan = false;
            }
            Ok::<(), bc_store::StoreError>(())
        };
        if let Err(e) = round.await {
            tracing::warn!(error = %e, "placement round failed; reloading capacity and scanning the queue");
            loaded_at = None;
            named.clear();
            scan = true;
        }
    }
}

/// Files one notification: capacity changes mark nodes dirty, admissions name reservations to claim. True when
/// notifications may have been lost (a reconnect): the caller reloads and scans.
fn heard(n: Notice, dirty: &mut HashSet<String>, named: &mut Vec<String>) -> bool {
    match n {
        Notice::Message { channel, payload } => {
            let ids = payload
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string);
            if channel == CAPACITY_CHANNEL {
                dirty.extend(ids);
            } else {
                named.extend(ids);
            }
            false
        }
        Notice::Resync => true,
    }
}

/// The periodic full reload of capacity, read beside placement (at 80,000 devices it takes 100–250 ms, which
/// would otherwise stall every admission behind it each [`FULL_RELOAD`]). Nodes booked on or notified while it
/// reads are re-read one by one once it lands, so the swap loses no change.
struct Refresh {
    task: tokio::task::JoinHandle<Result<Capacity, bc_store::StoreError>>,
    touched: HashSet<String>,
}

impl Refresh {
    fn start(store: &Store) -> Refresh {
        let store = store.clone();
        Refresh {
            task: tokio::spawn(async move {
                let devices = load(&store, None).await?;
                let mut capacity = Capacity::default();
                fill(&mut capacity, devices);
                Ok(capacity)
            }),
            touched: HashSet::new(),
        }
    }
}

async fn membership(
    store: &Store,
    me: &str,
    lease_ms: i64,
) -> Result<Vec<i16>, bc_store::StoreError> {
    let workers = store.heartbeat_worker(ROLE, me, lease_ms).await?;
    let want: Vec<i16> = shards::owned_by(me, &workers)
        .into_iter()
        .map(|s| s as i16)
        .collect();
    let held = store.sync_leases(ROLE, me, &want, lease_ms).await?;
    Ok(held.into_iter().map(|l| l.shard).collect())
}

async fn load(
    store: &Store,
    nodes: Option<&[String]>,
) -> Result<Vec<bc_store::reservations::FreeDevice>, bc_store::StoreError> {
    store.free_devices(nodes).await
}

fn fill(capacity: &mut Capacity, devices: Vec<bc_store::reservations::FreeDevice>) {
    let mut by_slot: BTreeMap<(String, String), Vec<FreeGpu>> = BTreeMap::new();
    for d in devices {
        by_slot
            .entry((d.node_id, d.model))
            .or_default()
            .push(FreeGpu {
                device_id: d.device_id,
                uuid: d.uuid,
                idx: d.idx,
                clique: d.clique,
            });
    }
    for ((node, model), gpus) in by_slot {
        capacity.set_node(&node, &model, gpus);
    }
}

/// Scans the queue and places pending reservations batch by batch until none are left.
async fn place_all(
    store: &Store,
    metrics: &crate::telemetry::ControlMetrics,
    capacity: &mut Capacity,
    my_shards: &[i16],
    mut touched: Option<&mut HashSet<String>>,
) -> Result<(), bc_store::StoreError> {
    loop {
        let (tx, pending) = store.claim_pending(my_shards, BATCH).await?;
        let n = pending.len();
        place_batch(
            store,
            metrics,
            capacity,
            tx,
            pending,
            touched.as_deref_mut(),
        )
        .await?;
        // A short batch drained the queue; anything admitted since then has notified us already.
        if (n as i64) < BATCH {
            return Ok(());
        }
    }
}

/// Decides a claimed batch with the placer and commits it. A lost race (a device booked meanwhile) leaves the
/// reservation pending and returns an error so the caller reloads capacity and scans again. The nodes it books
/// on go into `touched` (while a capacity refresh is in flight).
async fn place_batch(
    store: &Store,
    metrics: &crate::telemetry::ControlMetrics,
    capacity: &mut Capacity,
    tx: bc_store::sqlx::Transaction<'static, bc_store::sqlx::Postgres>,
    pending: Vec<bc_store::reservations::Pending>,
    touched: Option<&mut HashSet<String>>,
) -> Result<(), bc_store::StoreError> {
    let claimed = Instant::now();
    if pending.is_empty() {
        tx.rollback().await?;
        return Ok(());
    }
    {
        let mut decisions = Vec::with_capacity(pending.len());
        for p in &pending {
            let req: ReservationRequest = match serde_json::from_value(p.request.clone()) {
                Ok(r) => r,
                Err(e) => {
                    decisions.push(Decision::Fail {
                        id: p.id.clone(),
                        error: format!("stored request is unreadable: {e}"),
                    });
                    continue;
                }
            };
            match capacity.place(&req) {
                Ok(placement) => {
                    capacity.take(&placement);
                    let model = &placement.model;
                    let devices = placement
                        .parts
                        .iter()
                        .flat_map(|(node, gpus)| {
                            gpus.iter().map(move |g| {
                                (
                                    g.device_id.clone(),
                                    node.clone(),
                                    serde_json::json!({
                                        "node": node, "uuid": g.uuid, "index": g.idx, "model": model,
                                    }),
                                )
                            })
                        })
                        .collect();
                    decisions.push(Decision::Place {
                        id: p.id.clone(),
                        devices,
                        duration_s: i64::from(req.duration_s),
                    });
                }
                Err(e) => decisions.push(Decision::Fail {
                    id: p.id.clone(),
                    error: e.0,
                }),
            }
        }
        if let Some(touched) = touched {
            for d in &decisions {
                if let Decision::Place { devices, .. } = d {
                    touched.extend(devices.iter().map(|(_, node, _)| node.clone()));
                }
            }
        }
        let retry = store.commit_placements(tx, &decisions).await?;
        let since_claim = claimed.elapsed();
        for (p, d) in pending.iter().zip(&decisions) {
            if matches!(d, Decision::Place { id, .. } if !retry.contains(id)) {
                metrics.observe_placement(p.age + since_claim);
            }
        }
        let placed = decisions
            .iter()
            .filter(|d| matches!(d, Decision::Place { .. }))
            .count();
        tracing::debug!(
            claimed = pending.len(),
            placed,
            retry = retry.len(),
            "placement batch"
        );
        if !retry.is_empty() {
            return Err(bc_store::StoreError::Conflict(format!(
                "{} reservations lost a race for devices; retrying with fresh capacity",
                retry.len()
            )));
        }
        Ok(())
    }
}
