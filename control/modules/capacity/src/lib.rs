//! The control plane's capacity module, `capacity`: `reservations.create|get|list|release` ([`admission`]: the
//! pure checks, tx 1 group-committed, the wait for the placer's decision) and the placer, a `scheduler`-role
//! reconciler chosen by configuration ([`Placer`]): `shard` spreads the 256 reservation shards over the live
//! scheduler processes, `pool-lease` gives each pool one holder, its only booking writer ([`pool_lease`]). Both
//! run under the scheduler's own membership (workers `scheduler/<id>`, leases `scheduler/shard:<n>` or
//! `scheduler/pool:<pool>`), never the controllers'. Its queries are bc-store's (shared with the controllers'
//! expiry) and, for what only it uses, [`queries`]. It imports no other module and not the binary.

pub mod admission;
pub mod pool_lease;
pub mod queries;
pub mod scheduler;
mod view;

use bc_kernel::{ApiError, InvalidConfig, Module, Reconciler, StartCx};
use std::sync::Arc;
use std::time::Duration;

/// The role its placers run in.
pub const ROLE: &str = "scheduler";

/// How often the placer reads all free capacity again (beside placement).
pub const FULL_RELOAD: Duration = scheduler::FULL_RELOAD;

/// Which placer books reservations (`[capacity] placer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placer {
    /// Reservations are split by shard over the live scheduler processes (rendezvous hashing); any of them may
    /// book on any node.
    #[default]
    Shard,
    /// One scheduler process holds a lease per pool and is that pool's only booking writer; a reservation names
    /// its pool.
    PoolLease,
}

impl Placer {
    /// The placer a configuration value names, or INVALID_CONFIG naming `capacity.placer`.
    pub fn parse(value: &str) -> Result<Placer, InvalidConfig> {
        match value {
            "shard" => Ok(Placer::Shard),
            "pool-lease" => Ok(Placer::PoolLease),
            other => Err(InvalidConfig::new(
                "capacity.placer",
                format!("unknown placer {other:?}: use \"shard\" (the default) or \"pool-lease\""),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Placer::Shard => "shard",
            Placer::PoolLease => "pool-lease",
        }
    }
}

/// Records one committed placement's latency (the binary's metrics; none in tests).
#[derive(Clone)]
pub struct PlacementObserver(pub Arc<dyn Fn(Duration) + Send + Sync>);

impl PlacementObserver {
    fn observe(&self, latency: Duration) {
        (self.0)(latency)
    }
}

impl Default for PlacementObserver {
    fn default() -> Self {
        PlacementObserver(Arc::new(|_| {}))
    }
}

/// The module's options.
#[derive(Clone, Default)]
pub struct CapacityOptions {
    pub placer: Placer,
    /// How often the placer rereads all free capacity; None: [`FULL_RELOAD`].
    pub full_reload: Option<Duration>,
    /// Whether this process runs the scheduler role (so `initialize` does not warn about the one it will start).
    pub runs_scheduler: bool,
    pub observer: PlacementObserver,
}

/// The module's shared state (a kernel resource, provided at start).
pub struct Capacity {
    pub store: bc_store::Store,
    pub placer: Placer,
    pub decisions: Arc<admission::Decisions>,
    pub admitter: admission::Admitter,
}

/// The `capacity` module.
pub fn module(options: CapacityOptions) -> Module {
    let placer = options.placer;
    let runs_scheduler = options.runs_scheduler;
    admission::register(Module::new("capacity"))
        .reconciler(placer_reconciler(options))
        .reconciler(admission::decisions_reconciler())
        .on_start(move |cx: StartCx| async move {
            let store = cx.get::<bc_store::Store>()?.clone();
            if placer == Placer::PoolLease && !runs_scheduler {
                let live = queries::live_workers(&store, ROLE).await?;
                if live == 0 {
                    cx.note(
                        "capacity.placer is \"pool-lease\" and no scheduler process is running (no live \
                         scheduler/<id> worker): reservations stay pending until one runs; start a process with \
                         --roles scheduler",
                    );
                }
            }
            cx.provide(Capacity {
                admitter: admission::Admitter::start(store.clone()),
                decisions: Arc::default(),
                placer,
                store,
            });
            Ok::<(), ApiError>(())
        })
}

fn placer_reconciler(options: CapacityOptions) -> Reconciler {
    let name = match options.placer {
        Placer::Shard => "placer",
        Placer::PoolLease => "pool-lease-placer",
    };
    Reconciler::new(name)
        .role(ROLE)
        .poked_by(bc_store::reservations::PENDING_CHANNEL)
        .poked_by(bc_store::reservations::CAPACITY_CHANNEL)
        .run(move |cx| {
            let options = options.clone();
            async move {
                let store = match cx.resources.require::<bc_store::Store>() {
                    Ok(s) => s.clone(),
                    Err(e) => {
                        tracing::error!(error = %e, "placer: no store; not placing");
                        return;
                    }
                };
                tracing::info!(
                    worker = cx.worker.id,
                    placer = options.placer.as_str(),
                    "scheduler role: placer running"
                );
                let run = scheduler::Run {
                    store,
                    worker: cx.worker.id.clone(),
                    lease: cx.lease,
                    full_reload: options.full_reload.unwrap_or(FULL_RELOAD),
                    observer: options.observer.clone(),
                    placer: options.placer,
                };
                scheduler::run(run, cx).await
            }
        })
}
