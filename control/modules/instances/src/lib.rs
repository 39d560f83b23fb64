//! The control plane's instances module, `instances`: VPS instances on hosted and provider pools.
//! `instances.create` runs the admission sequence as reservations do ([`methods`]: validation and the tenant check
//! before any database access, tx 1 records the request under its idempotency key, tx 2 places it). On a hosted
//! (`vps-host`) pool the placement books a node's atoms — vCPUs, memory and disk counted against what its inventory
//! advertises, kept per node in `instance_node_free` ([`queries`]), GPUs as its devices rows — and puts the instance
//! in the node's desired state (docs/instances.md) with an outbox row in the same transaction. On a provider pool
//! the placement hands the instance to the provider workflow ([`provider`]: a shard-owned reconciler that calls
//! EC2's API, idempotent by itself). `show|list` add what the node or the provider reports; `stop|start|reboot`
//! change only the desired state; `delete` takes the instance off its node or provider and it stays `deleting`
//! until that is confirmed ([`hosted`] for nodes). `instances.set-pool` makes a pool a `vps-host` or `provider`
//! pool. Its tables are its own (migrations 1300–1302). It imports no other module and not the binary: provider
//! credentials arrive through the [`provider::ProviderSecrets`] trait the composition provides.

pub mod hosted;
pub mod methods;
pub mod provider;
pub mod queries;

use bc_core::provider::workflow::Policy;
use bc_kernel::{ApiError, Migration, Module, Reconciler, StartCx, Tick};
use std::time::Duration;

/// The module's schema (its tables; versions 1300–1399 are this module's).
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1300,
        name: "instances",
        sql: include_str!("../migrations/1300_instances.sql"),
    },
    Migration {
        version: 1301,
        name: "instances_provider",
        sql: include_str!("../migrations/1301_provider.sql"),
    },
    Migration {
        version: 1302,
        name: "instances_node_free",
        sql: include_str!("../migrations/1302_node_free.sql"),
    },
    Migration {
        version: 1303,
        name: "instances_written_shard",
        sql: include_str!("../migrations/1303_written_shard.sql"),
    },
];

/// The module's tables that start empty and fill fast, declared hot ([`Module::hot_tables`]): the kernel's statistics
/// loop refreshes their planner statistics as they fill (bc-store's `statistics` says why: a statement prepared while its table was nearly empty keeps a plan that scans
/// it until the first ANALYZE). Measured before this (`BC_INSTANCES_ADMISSIONS_ONLY=1 target/release/instances`,
/// `pg_stat_statements`): placement's `UPDATE instances … WHERE id = $1` read 78 buffers a call, its table was
/// scanned 1,934 times (9.8 million rows read) in 40 s, and no autovacuum ANALYZE came within the run.
pub const HOT_TABLES: &[&str] = &["instances", "instance_idempotency", "instance_node_free"];

/// What the composition configures.
#[derive(Debug, Clone)]
pub struct Config {
    /// The provider workflow's timing.
    pub policy: Policy,
    /// How long a hosted instance's delete may wait for its node's confirmation before it is reported overdue.
    pub delete_deadline: Duration,
    /// The reconciler's tick (it is also poked).
    pub tick: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            policy: Policy::default(),
            delete_deadline: Duration::from_secs(600),
            tick: Duration::from_secs(1),
        }
    }
}

/// The module's shared state (a kernel resource, provided at start).
#[derive(Clone)]
pub struct Instances {
    pub store: bc_store::Store,
    pub config: Config,
    /// Wakes the outbox sink after a placement or a change committed ([`queries::publish`]).
    pub outbox: bc_store::pokes::Poker,
}

impl Instances {
    pub fn new(store: bc_store::Store, config: Config) -> Instances {
        let outbox = bc_store::pokes::Poker::spawn(store.clone(), queries::OUTBOX_WRITTEN_CHANNEL);
        Instances {
            store,
            config,
            outbox,
        }
    }
}

/// The `instances` module.
pub fn module(config: Config) -> Module {
    let tick = config.tick;
    let mut m = methods::register(Module::new("instances")).hot_tables(HOT_TABLES);
    for migration in MIGRATIONS {
        m = m.migration(*migration);
    }
    m.on_start(move |cx: StartCx| {
        let config = config.clone();
        async move {
            let store = cx.get::<bc_store::Store>()?.clone();
            let secrets = cx.get::<provider::ProviderCredentials>().ok().cloned();
            let client = provider::ec2::Ec2Client::new().map_err(ApiError::unavailable)?;
            cx.provide(provider::Provider {
                client,
                secrets,
                policy: config.policy,
            });
            cx.provide(Instances::new(store, config));
            Ok::<(), ApiError>(())
        }
    })
    .reconciler(
        Reconciler::new("instances")
            .role(provider::ROLE)
            .shard_scoped()
            .tick(Tick::Every(tick))
            .poked_by(provider::store::POKE)
            .step(provider::reconcile),
    )
}

/// The wall clock in ms since the epoch: read here, at the edge, and passed into the decisions.
pub fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .unwrap_or(i64::MAX)
}
