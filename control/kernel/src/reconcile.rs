//! Reconcilers and the role runner. A reconciler runs in a role (`controllers`, `scheduler`, ...), optionally on
//! the shards that role's processes spread among themselves (rendezvous hashing over live workers, made real by
//! fenced leases through [`Membership`]), on its own tick and, sooner, when a notification it listens to arrives.
//! Every loop has a shutdown path; a lost notification costs latency, never correctness.

use crate::backend::{Membership, Notice};
use crate::error::ApiError;
use crate::method::BoxFuture;
use crate::resources::Resources;
use bc_core::shards::ShardLease;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// The roles a process can run. Several processes of each share its work through the database.
pub const ROLES: &[&str] = &["api", "gateway", "controllers", "scheduler", "sinks", "iam"];

/// How often a reconciler runs without being poked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tick {
    Every(Duration),
    /// A quarter of the shard lease (at least 100 ms): as often as membership is renewed.
    QuarterLease,
}

impl Tick {
    pub(crate) fn resolve(self, lease: Duration) -> Duration {
        match self {
            Tick::Every(d) => d,
            Tick::QuarterLease => (lease / 4).max(Duration::from_millis(100)),
        }
    }
}

/// Says when the process is stopping.
#[derive(Clone, Debug)]
pub struct Stop(watch::Receiver<bool>);

impl Stop {
    pub(crate) fn new(rx: watch::Receiver<bool>) -> Stop {
        Stop(rx)
    }

    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the process stops.
    pub async fn stopped(&mut self) {
        let _ = self.0.wait_for(|s| *s).await;
    }

    /// Sleeps for `d`; true when the process stopped first.
    pub async fn sleep(&mut self, d: Duration) -> bool {
        if self.is_stopped() {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep(d) => false,
            _ = self.stopped() => true,
        }
    }
}

/// A process in a role: `<role>/<id>` (the worker row and the owner of its leases).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub role: &'static str,
    pub id: String,
}

/// What a reconciler that runs its own loop gets.
pub struct ReconcileCx {
    pub resources: Arc<Resources>,
    pub worker: Worker,
    /// The shards this process leases in the reconciler's role (always empty when it is not shard-scoped).
    pub shards: watch::Receiver<Arc<[ShardLease]>>,
    /// The notifications it listens to (closed when it listens to none).
    pub pokes: mpsc::Receiver<Notice>,
    pub tick: Duration,
    /// The role membership and shard lease lifetime.
    pub lease: Duration,
    pub membership: Arc<dyn Membership>,
    pub stop: Stop,
}

/// What one step of a step reconciler gets.
pub struct StepCx {
    pub resources: Arc<Resources>,
    pub worker: Worker,
    /// The shards this process leases now (never empty for a shard-scoped reconciler: it is not stepped without).
    pub leases: Arc<[ShardLease]>,
    /// The notifications that woke this step (empty on a tick).
    pub pokes: Vec<Notice>,
}

type LoopFn = Arc<dyn Fn(ReconcileCx) -> BoxFuture<'static, ()> + Send + Sync>;
type StepFn = Arc<
    dyn Fn(StepCx) -> BoxFuture<'static, Result<(), Box<dyn std::error::Error + Send + Sync>>>
        + Send
        + Sync,
>;

#[derive(Clone)]
pub(crate) enum Body {
    Loop(LoopFn),
    Step(StepFn),
}

/// A reconciler: `Reconciler::new("lifecycle").role("controllers").shard_scoped().tick(..).poked_by(..).step(..)`.
#[derive(Clone)]
pub struct Reconciler {
    pub(crate) name: &'static str,
    pub(crate) roles: Vec<String>,
    pub(crate) shard_scoped: bool,
    pub(crate) tick: Tick,
    pub(crate) pokes: Vec<&'static str>,
    pub(crate) body: Option<Body>,
    pub(crate) step_deadline: Duration,
}

/// How long one step may run ([`Reconciler::step_deadline`] changes it). A step waiting on a database that does not
/// answer (a primary gone silent, no reset) would otherwise hold its reconciler for good: past this it is dropped
/// (its open transaction rolls back, as a failed step's does) and runs again on the next tick.
pub const STEP_DEADLINE: Duration = Duration::from_secs(120);

impl Reconciler {
    pub fn new(name: &'static str) -> Reconciler {
        Reconciler {
            name,
            roles: Vec::new(),
            shard_scoped: false,
            tick: Tick::Every(Duration::from_secs(5)),
            pokes: Vec::new(),
            body: None,
            step_deadline: STEP_DEADLINE,
        }
    }

    /// How long one step may run before it is dropped and retried on the next tick ([`STEP_DEADLINE`]).
    pub fn step_deadline(mut self, deadline: Duration) -> Reconciler {
        self.step_deadline = deadline;
        self
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// A role it runs in; several roles: it runs once in a process that runs any of them.
    pub fn role(mut self, role: &str) -> Reconciler {
        self.roles.push(role.to_string());
        self
    }

    /// Acts only on the shards this process leases in its role.
    pub fn shard_scoped(mut self) -> Reconciler {
        self.shard_scoped = true;
        self
    }

    pub fn tick(mut self, tick: Tick) -> Reconciler {
        self.tick = tick;
        self
    }

    /// Woken sooner by notifications on `channel` (LISTEN/NOTIFY).
    pub fn poked_by(mut self, channel: &'static str) -> Reconciler {
        self.pokes.push(channel);
        self
    }

    /// Runs `run` as the reconciler's own loop (it must return when `cx.stop` fires).
    pub fn run<F, Fut>(mut self, run: F) -> Reconciler
    where
        F: Fn(ReconcileCx) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.body = Some(Body::Loop(Arc::new(move |cx| Box::pin(run(cx)))));
        self
    }

    /// Runs `step` on every tick, notification and change of shards (a shard-scoped one only while it holds
    /// shards); a failed step is logged and retried on the next tick.
    pub fn step<F, Fut, E>(mut self, step: F) -> Reconciler
    where
        F: Fn(StepCx) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        let step = Arc::new(step);
        self.body = Some(Body::Step(Arc::new(move |cx| {
            let step = step.clone();
            Box::pin(async move {
                step(cx)
                    .await
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            })
        })));
        self
    }
}

// === the role runner ===

/// Keeps this process's membership of `role` and its shard leases, and publishes the leases held. A renewal that
/// has not answered, or has failed, by the time the leases it last renewed expire gives them up here too (an empty
/// set is published): the database has let other workers take them by then, and a reconciler must not go on acting
/// for shards it no longer holds (fencing keeps its database writes out, not its calls to BMCs or nodes). Every
/// renewal is bounded by that expiry, or by one lease while nothing is held, so a database that stops answering
/// (a primary gone silent, no reset) cannot hold this loop.
pub(crate) async fn membership_loop(
    membership: Arc<dyn Membership>,
    worker: Worker,
    lease: Duration,
    shards: watch::Sender<Arc<[ShardLease]>>,
    mut stop: Stop,
) {
    let every = Tick::QuarterLease.resolve(lease);
    // When the leases published now expire at the latest (counted from before the renewal that took them).
    let mut held_until: Option<tokio::time::Instant> = None;
    loop {
        let started = tokio::time::Instant::now();
        let answered = tokio::time::timeout_at(
            held_until.unwrap_or(started + lease),
            renew(membership.as_ref(), &worker, lease),
        )
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::unavailable(format!(
                "the database did not answer the {} membership renewal in time",
                worker.role
            )))
        });
        let next = match answered {
            Ok(held) => {
                held_until = (!held.is_empty()).then_some(started + lease);
                if held.len() != shards.borrow().len() {
                    tracing::info!(
                        role = worker.role,
                        worker = worker.id,
                        shards = held.len(),
                        "{} shards",
                        worker.role
                    );
                }
                // Reconcilers wake on a change of the leases, not on every renewal.
                shards.send_if_modified(|current| {
                    let changed = current.as_ref() != held.as_slice();
                    if changed {
                        *current = held.into();
                    }
                    changed
                });
                every
            }
            Err(e) => {
                tracing::warn!(role = worker.role, error = %e, "{} membership failed", worker.role);
                if held_until.is_some_and(|t| tokio::time::Instant::now() >= t) {
                    held_until = None;
                    shards.send_replace(Arc::from(Vec::new()));
                    tracing::warn!(
                        role = worker.role,
                        worker = worker.id,
                        "{} shards given up: not renewed within their lease of {} s",
                        worker.role,
                        lease.as_secs_f64()
                    );
                }
                Duration::from_millis(500)
            }
        };
        if stop.sleep(next).await {
            shards.send_replace(Arc::from(Vec::new()));
            let why = match tokio::time::timeout(lease, membership.leave(worker.role, &worker.id))
                .await
            {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {} s", lease.as_secs_f64())),
            };
            if let Some(e) = why {
                tracing::warn!(role = worker.role, error = %e, "leaving the role failed; its leases will expire");
            }
            return;
        }
    }
}

async fn renew(
    membership: &dyn Membership,
    worker: &Worker,
    lease: Duration,
) -> Result<Vec<ShardLease>, ApiError> {
    let workers = membership.heartbeat(worker.role, &worker.id, lease).await?;
    let want = bc_core::shards::shards_owned_by(&worker.id, &workers);
    membership
        .sync_leases(worker.role, &worker.id, &want, lease)
        .await
}

/// The loop of a step reconciler.
pub(crate) async fn step_loop(
    name: &'static str,
    shard_scoped: bool,
    step: StepFn,
    deadline: Duration,
    mut cx: ReconcileCx,
) {
    let mut tick = tokio::time::interval(cx.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut listening = true;
    let mut watching = shard_scoped;
    loop {
        let mut pokes = Vec::new();
        tokio::select! {
            _ = tick.tick() => {}
            n = cx.pokes.recv(), if listening => match n {
                Some(n) => {
                    pokes.push(n);
                    while let Ok(n) = cx.pokes.try_recv() {
                        pokes.push(n);
                    }
                    tick.reset();
                }
                None => listening = false,
            },
            changed = cx.shards.changed(), if watching => {
                if changed.is_err() {
                    watching = false;
                }
            }
            _ = cx.stop.stopped() => return,
        }
        let leases = cx.shards.borrow().clone();
        if shard_scoped && leases.is_empty() {
            continue;
        }
        let step_cx = StepCx {
            resources: cx.resources.clone(),
            worker: cx.worker.clone(),
            leases,
            pokes,
        };
        let moved = crate::resources::next_move(&cx.resources);
        tokio::select! {
            r = tokio::time::timeout(deadline, step(step_cx)) => match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let e: &(dyn std::error::Error + 'static) = e.as_ref();
                    tracing::warn!(reconciler = name, error = %bc_error_chain::InlineErrorChain::new(e), "step failed; retrying next tick");
                }
                Err(_) => tracing::warn!(
                    reconciler = name,
                    deadline_s = deadline.as_secs_f64(),
                    "step ran past its deadline and was dropped (what it had not committed rolled back); retrying next tick"
                ),
            },
            () = moved => {
                tracing::warn!(
                    reconciler = name,
                    "the database primary moved during the step: dropped (what it had not committed rolled back) and stepped again on the new primary"
                );
                tick.reset_immediately();
            }
        }
    }
}

pub(crate) fn run_body(r: &Reconciler, body: &Body, cx: ReconcileCx) -> BoxFuture<'static, ()> {
    match body {
        Body::Loop(run) => run(cx),
        Body::Step(step) => Box::pin(step_loop(
            r.name,
            r.shard_scoped,
            step.clone(),
            r.step_deadline,
            cx,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_core::shards::Shard;
    use std::sync::Mutex;

    /// A database that renews `answers` times, then fails (`hang` false) or never answers (`hang` true).
    struct Fading {
        answers: Mutex<u32>,
        hang: bool,
    }

    impl Membership for Fading {
        fn heartbeat<'a>(
            &'a self,
            _role: &'a str,
            worker: &'a str,
            _ttl: Duration,
        ) -> BoxFuture<'a, Result<Vec<String>, ApiError>> {
            Box::pin(async move {
                let left = {
                    let mut n = self.answers.lock().unwrap_or_else(|p| p.into_inner());
                    *n = n.saturating_sub(1);
                    *n
                };
                if left == 0 && self.hang {
                    std::future::pending::<()>().await;
                }
                if left == 0 {
                    return Err(ApiError::unavailable("connection refused"));
                }
                Ok(vec![worker.to_owned()])
            })
        }

        fn sync_leases<'a>(
            &'a self,
            _role: &'a str,
            _worker: &'a str,
            want: &'a [Shard],
            _ttl: Duration,
        ) -> BoxFuture<'a, Result<Vec<ShardLease>, ApiError>> {
            Box::pin(async move {
                Ok(want
                    .iter()
                    .map(|&shard| ShardLease { shard, fence: 1 })
                    .collect())
            })
        }

        fn leave<'a>(
            &'a self,
            _role: &'a str,
            _worker: &'a str,
        ) -> BoxFuture<'a, Result<(), ApiError>> {
            Box::pin(std::future::pending())
        }
    }

    /// Runs the loop against `db` until its leases are given up; how long after the last renewal that came.
    async fn leases_given_up(hang: bool) -> Duration {
        let lease = Duration::from_secs(20);
        let db = Arc::new(Fading {
            // Three renewals: at 0, 5 and 10 s (a quarter lease apart); the fourth, at 15 s, never succeeds.
            answers: Mutex::new(4),
            hang,
        });
        let (shards, mut seen) = watch::channel(Arc::from(Vec::new()));
        let (stop_tx, stop_rx) = watch::channel(false);
        let worker = Worker {
            role: "controllers",
            id: "w1".into(),
        };
        let task = tokio::spawn(membership_loop(
            db,
            worker,
            lease,
            shards,
            Stop::new(stop_rx),
        ));
        seen.wait_for(|s| !s.is_empty())
            .await
            .expect("leases taken");
        let t0 = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(120), seen.wait_for(|s| s.is_empty()))
            .await
            .unwrap_or_else(|_| {
                panic!("hang {hang}: the leases were still published 120 s after they were taken")
            })
            .expect("leases given up");
        let took = t0.elapsed();
        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the loop ends after a stop, its leave bounded too")
            .expect("loop");
        took
    }

    #[derive(Debug, thiserror::Error)]
    #[error("never")]
    struct Never;

    /// A reconciler ticking every `tick` whose first step never returns (a query to a primary gone silent) and whose
    /// later ones return at once.
    fn hangs_first(
        name: &'static str,
        tick: Duration,
        began: Arc<Mutex<Vec<tokio::time::Instant>>>,
    ) -> Reconciler {
        Reconciler::new(name)
            .tick(Tick::Every(tick))
            .step(move |_cx: StepCx| {
                let seen = began.clone();
                async move {
                    let n = {
                        let mut b = seen.lock().expect("lock");
                        b.push(tokio::time::Instant::now());
                        b.len()
                    };
                    if n == 1 {
                        std::future::pending::<()>().await;
                    }
                    Ok::<(), Never>(())
                }
            })
    }

    /// Runs `r` (ticking every `tick`) with `resources` while `during` runs, then stops it; when each of its steps
    /// began, from the start.
    async fn steps_while(
        r: Reconciler,
        resources: Resources,
        tick: Duration,
        began: Arc<Mutex<Vec<tokio::time::Instant>>>,
        during: impl std::future::Future<Output = ()>,
    ) -> Vec<Duration> {
        let (_shards_tx, shards) = watch::channel(Arc::from(Vec::new()));
        let (_pokes_tx, pokes) = mpsc::channel(1);
        let (stop_tx, stop_rx) = watch::channel(false);
        let cx = ReconcileCx {
            resources: Arc::new(resources),
            worker: Worker {
                role: "controllers",
                id: "w1".into(),
            },
            shards,
            pokes,
            tick,
            lease: Duration::from_secs(20),
            membership: Arc::new(Fading {
                answers: Mutex::new(1),
                hang: false,
            }),
            stop: Stop::new(stop_rx),
        };
        let t0 = tokio::time::Instant::now();
        let body = r.body.clone().expect("a step");
        let task = tokio::spawn(run_body(&r, &body, cx));
        during.await;
        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the loop ends at a stop")
            .expect("loop");
        let began = began.lock().expect("lock").clone();
        began.iter().map(|b| *b - t0).collect()
    }

    /// A step that never returns (a query to a primary gone silent) is dropped at the step deadline and the
    /// reconciler steps again on its next tick; before, the first such step held the reconciler for good.
    #[tokio::test(start_paused = true)]
    async fn a_step_past_its_deadline_is_dropped_and_the_next_tick_steps_again() {
        let began = Arc::new(Mutex::new(Vec::new()));
        let tick = Duration::from_secs(1);
        let r = hangs_first("stuck", tick, began.clone()).step_deadline(Duration::from_secs(5));
        let during = tokio::time::sleep(Duration::from_secs(30));
        let began = steps_while(r, Resources::new(), tick, began, during).await;
        assert!(
            began.len() >= 2,
            "the stuck first step held the reconciler: {} steps in 30 s",
            began.len()
        );
        // The second step began when the first was dropped (5 s) and the next tick came (within 1 s more).
        assert!(
            (Duration::from_secs(5)..=Duration::from_secs(7)).contains(&began[1]),
            "{:?}",
            began[1]
        );
    }

    /// The database primary moves while a step waits on the old one (gone silent, it would never answer): the step
    /// is dropped at the move and the next one begins at once, not at the step's deadline.
    #[tokio::test(start_paused = true)]
    async fn a_step_in_flight_when_the_database_moves_is_dropped_and_stepped_again() {
        let began = Arc::new(Mutex::new(Vec::new()));
        let tick = Duration::from_secs(10);
        let r = hangs_first("stuck-on-the-old-primary", tick, began.clone());
        let (moves_tx, moves) = watch::channel(0u64);
        let mut resources = Resources::new();
        resources.insert(crate::DatabaseMoves(moves));
        let during = async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            moves_tx.send_modify(|n| *n += 1);
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        let began = steps_while(r, resources, tick, began, during).await;
        assert_eq!(
            began,
            [Duration::ZERO, Duration::from_secs(3)],
            "one step held on the old primary, one at the move"
        );
    }

    /// A database that stops answering (or keeps failing) after the leases were taken: they are given up when the
    /// last renewal's lease runs out (10 s + 20 s after they were taken), not kept for ever as before.
    #[tokio::test(start_paused = true)]
    async fn leases_not_renewed_within_their_lease_are_given_up() {
        for hang in [true, false] {
            let took = leases_given_up(hang).await;
            assert!(
                (Duration::from_secs(30)..=Duration::from_secs(31)).contains(&took),
                "hang {hang}: given up {took:?} after they were taken"
            );
        }
    }
}
