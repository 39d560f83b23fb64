//! The `scheduler` role's placer: places pending reservations. It keeps the free GPUs in memory ([`View`]),
//! claims pending reservations of what it holds under the scheduler's own membership (never the controllers'):
//! the shards it leases (`shard` placer) or the pools it leases ([`crate::pool_lease`]), decides with the pure
//! placer and books in one transaction per batch ([`Store::commit_placements`]). Woken by the API's tx 1
//! notification; a tick converges without it. Capacity follows releases and inventory by notification, and is
//! reloaded in full periodically (read beside placement, see [`Refresh`]) and at once after any lost race.

use crate::pool_lease::Held;
use crate::view::View;
use crate::{PlacementObserver, Placer};
use bc_core::reservation::ReservationRequest;
use bc_kernel::{Notice, ReconcileCx, STEP_DEADLINE};
use bc_store::Store;
use bc_store::reservations::{CAPACITY_CHANNEL, Decision};
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

pub(crate) const BATCH: i64 = 512;
/// How often all free capacity is read again (beside placement, see [`Refresh`]).
pub const FULL_RELOAD: Duration = Duration::from_secs(30);
const TICK: Duration = Duration::from_secs(1);

/// What one placer loop needs.
pub struct Run {
    pub store: Store,
    pub worker: String,
    pub lease: Duration,
    pub full_reload: Duration,
    pub observer: PlacementObserver,
    pub placer: Placer,
}

/// The placer's state between rounds.
struct Loop {
    capacity: View,
    loaded_at: Option<Instant>,
    refresh: Option<Refresh>,
    dirty: HashSet<String>,
    /// Reservations the admission notifications named (claimed by primary key).
    named: Vec<String>,
    /// Whether the queue must be scanned (the tick, or notifications that may have been lost).
    scan: bool,
}

pub async fn run(run: Run, mut cx: ReconcileCx) {
    let mut held = Held::new(run.placer);
    let mut membership_due = Instant::now();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut s = Loop {
        capacity: View::default(),
        loaded_at: None,
        refresh: None,
        dirty: HashSet::new(),
        named: Vec::new(),
        scan: true,
    };
    let mut listening = true;
    loop {
        tokio::select! {
            _ = tick.tick() => s.scan = true,
            n = cx.pokes.recv(), if listening => match n {
                Some(n) => s.heard(n),
                None => listening = false,
            },
            _ = cx.stop.stopped() => {
                held.leave(&run.store, &run.worker).await;
                return;
            }
        }
        // Drain whatever else arrived, so one round serves a burst.
        while let Ok(n) = cx.pokes.try_recv() {
            s.heard(n);
        }
        // Each database wait is bounded as a step is (bc_kernel::STEP_DEADLINE) and cut short when the pool moves
        // to another primary: a round waiting on a primary that hangs would otherwise hold the scheduler for good.
        let store = run.store.clone();
        if Instant::now() >= membership_due {
            let renewed = store.within(
                "scheduler membership",
                STEP_DEADLINE,
                held.renew(&run.store, &run.worker, run.lease),
            );
            membership_due = match renewed.await {
                Ok(()) => Instant::now() + run.lease / 4,
                Err(e) => {
                    tracing::warn!(error = %e, "scheduler membership failed");
                    Instant::now() + Duration::from_millis(500)
                }
            };
        }
        if held.is_empty() {
            // Another scheduler holds everything; it claims what was named.
            s.named.clear();
            continue;
        }
        let converged = store.within("loading the capacity view", STEP_DEADLINE, async {
            Ok(s.converge_view(&run).await)
        });
        match converged.await {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "loading the capacity view failed; reloading it");
                s.loaded_at = None;
                s.scan = true;
                continue;
            }
        }
        let round = store.within("a placement round", STEP_DEADLINE, s.round(&run, &mut held));
        if let Err(e) = round.await {
            tracing::warn!(error = %e, "placement round failed; reloading capacity and scanning the queue");
            s.loaded_at = None;
            s.named.clear();
            s.scan = true;
            membership_due = Instant::now();
        }
    }
}

impl Loop {
    /// Files one notification: capacity changes mark nodes dirty, admissions name reservations to claim. A
    /// resync (notifications may have been lost): reload and scan.
    fn heard(&mut self, n: Notice) {
        match n {
            Notice::Message { channel, payload } => {
                let ids = payload
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string);
                if channel == CAPACITY_CHANNEL {
                    self.dirty.extend(ids);
                } else {
                    self.named.extend(ids);
                }
            }
            Notice::Resync => {
                self.loaded_at = None;
                self.scan = true;
            }
        }
    }

    /// Brings the capacity view up to date (first load, landed refresh, dirty nodes); false when it could not.
    async fn converge_view(&mut self, run: &Run) -> bool {
        let store = &run.store;
        if self.loaded_at.is_none() {
            // No usable view (start, lost race, lost notifications): load it before placing anything.
            if let Some(r) = self.refresh.take() {
                r.task.abort();
            }
            match store.free_devices(None).await {
                Ok(devices) => {
                    self.capacity.clear();
                    self.capacity.fill(devices);
                    self.dirty.clear();
                    self.loaded_at = Some(Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "capacity load failed");
                    return false;
                }
            }
        } else if self.refresh.is_none()
            && self
                .loaded_at
                .is_some_and(|t| t.elapsed() > run.full_reload)
        {
            self.refresh = Some(Refresh::start(store));
        }
        if let Some(r) = self.refresh.take_if(|r| r.task.is_finished()) {
            match r.task.await {
                Ok(Ok(fresh)) => {
                    self.capacity = fresh;
                    // What changed while the snapshot was read is read again, node by node.
                    self.dirty.extend(r.touched);
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "capacity refresh failed; keeping the current view")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "capacity refresh task failed; keeping the current view")
                }
            }
            self.loaded_at = Some(Instant::now());
        }
        if !self.dirty.is_empty() {
            let nodes: Vec<String> = self.dirty.drain().collect();
            if let Some(r) = self.refresh.as_mut() {
                r.touched.extend(nodes.iter().cloned());
            }
            match store.free_devices(Some(&nodes)).await {
                Ok(devices) => {
                    for n in &nodes {
                        self.capacity.remove_node(n);
                    }
                    self.capacity.fill(devices);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "capacity reload failed");
                    self.loaded_at = None;
                    return false;
                }
            }
        }
        true
    }

    /// Claims what was named, then (on a tick or after a loss) scans the queue, batch by batch.
    async fn round(&mut self, run: &Run, held: &mut Held) -> Result<(), bc_store::StoreError> {
        let named = std::mem::take(&mut self.named);
        for ids in named.chunks(BATCH as usize) {
            let (tx, pending) = held.claim(&run.store, &run.worker, Some(ids)).await?;
            self.place_batch(run, tx, pending).await?;
        }
        if self.scan {
            loop {
                let (tx, pending) = held.claim(&run.store, &run.worker, None).await?;
                let n = pending.len();
                self.place_batch(run, tx, pending).await?;
                // A short batch drained the queue; anything admitted since then has notified us already.
                if (n as i64) < BATCH {
                    break;
                }
            }
            self.scan = false;
        }
        Ok(())
    }

    /// Decides a claimed batch with the placer and commits it. A lost race (a device booked meanwhile) leaves the
    /// reservation pending and returns an error so the caller reloads capacity and scans again. The nodes it books
    /// on go into the in-flight refresh's `touched`.
    async fn place_batch(
        &mut self,
        run: &Run,
        tx: bc_store::sqlx::Transaction<'static, bc_store::sqlx::Postgres>,
        pending: Vec<bc_store::reservations::Pending>,
    ) -> Result<(), bc_store::StoreError> {
        let claimed = Instant::now();
        if pending.is_empty() {
            tx.rollback().await?;
            return Ok(());
        }
        let decisions: Vec<Decision> = pending.iter().map(|p| self.decide(p)).collect();
        if let Some(r) = self.refresh.as_mut() {
            for d in &decisions {
                if let Decision::Place { devices, .. } = d {
                    r.touched
                        .extend(devices.iter().map(|(_, node, _)| node.clone()));
                }
            }
        }
        let retry = run.store.commit_placements(tx, &decisions).await?;
        let since_claim = claimed.elapsed();
        for (p, d) in pending.iter().zip(&decisions) {
            if matches!(d, Decision::Place { id, .. } if !retry.contains(id)) {
                run.observer.observe(p.age + since_claim);
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

    /// The placer's decision for one claimed reservation; a placed one's GPUs leave the view at once.
    fn decide(&mut self, p: &bc_store::reservations::Pending) -> Decision {
        let req: ReservationRequest = match serde_json::from_value(p.request.clone()) {
            Ok(r) => r,
            Err(e) => {
                return Decision::Fail {
                    id: p.id.clone(),
                    error: format!("stored request is unreadable: {e}"),
                };
            }
        };
        match self.capacity.place(&req) {
            Ok(placement) => {
                self.capacity.take(&placement);
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
                Decision::Place {
                    id: p.id.clone(),
                    devices,
                    duration_s: i64::from(req.duration_s),
                }
            }
            Err(e) => Decision::Fail {
                id: p.id.clone(),
                error: e.0,
            },
        }
    }
}

/// The periodic full reload of capacity, read beside placement (at 80,000 devices it takes 100–250 ms, which
/// would otherwise stall every admission behind it each [`FULL_RELOAD`]). Nodes booked on or notified while it
/// reads are re-read one by one once it lands, so the swap loses no change.
struct Refresh {
    task: tokio::task::JoinHandle<Result<View, bc_store::StoreError>>,
    touched: HashSet<String>,
}

impl Refresh {
    fn start(store: &Store) -> Refresh {
        let store = store.clone();
        Refresh {
            task: tokio::spawn(async move {
                let devices = store.free_devices(None).await?;
                let mut capacity = View::default();
                capacity.fill(devices);
                Ok(capacity)
            }),
            touched: HashSet::new(),
        }
    }
}
