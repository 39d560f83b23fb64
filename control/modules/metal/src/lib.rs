//! bc-mod-metal: the control plane's metal module, the executor of the bare-metal flow (DESIGN.md "Metal flow").
//! The decisions are all bc-core's pure planner ([`bc_core::metal::plan`]); this crate stores the machine's record
//! and timeline (`migrations/1100_metal.sql`), serves `metal.enroll|inspect|provide|deploy|release|abort|retry|
//! show|list` ([`api`], typed with [`bc_core::api::metal`]), and runs the executor ([`executor`], `controllers`
//! role, shard-owned) that turns each plan into BMC commands for the machine's site, single-use boot tokens and
//! netboot entries, ramdisk commands on the machine's node and audit events ([`apply`]), in one transaction.
//!
//! It imports no other module (check-deps): machines, commands and join tokens are reached through bc-store's
//! tables. The site agent's side of the BMC commands is served on the gateway's SiteService by [`gateway::WithBmc`]
//! (long-polled `BmcCommands`, signed `BmcResult`). Start with [`module`].

pub mod api;
pub mod apply;
pub mod executor;
pub mod gateway;
pub mod outcomes;
pub mod queries;

use bc_core::api::sites::BootSpec;
use bc_core::metal::Policy;
use bc_kernel::{Migration, Module, Reconciler, StartCx, Tick};
use bc_store::Store;
use std::time::Duration;

pub use outcomes::DeployTarget;

/// Notified when something a machine waits for happened (a BMC result, a verb, a transition).
pub const POKE: &str = "bc_metal";
/// Notified (payload: the site) when BMC commands were written for a site.
pub const BMC_WRITTEN: &str = "bc_metal_bmc";

/// The module's schema.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1100,
        name: "metal",
        sql: include_str!("../migrations/1100_metal.sql"),
    },
    Migration {
        version: 1101,
        name: "metal_deploy",
        sql: include_str!("../migrations/1101_metal_deploy.sql"),
    },
    Migration {
        version: 1102,
        name: "metal_written_shard",
        sql: include_str!("../migrations/1102_written_shard.sql"),
    },
];

/// What the composition configures.
#[derive(Debug, Clone)]
pub struct Config {
    pub policy: Policy,
    /// The ramdisk's netboot entry; each attempt appends `bc.boot_token=<its single-use token>` to the command
    /// line (which should carry `bc.url`, `bc.ca_pin` and `bc.join_key`).
    pub ramdisk: BootSpec,
    pub deploy: DeployTarget,
    /// The pool the ramdisk's node joins (created with no acceptance checks when missing).
    pub pool: String,
    pub tick: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            policy: Policy::default(),
            ramdisk: BootSpec {
                kernel: "ramdisk/vmlinuz".into(),
                initrd: Some("ramdisk/initrd.img".into()),
                cmdline: "console=ttyS0".into(),
            },
            deploy: DeployTarget {
                image_base_url: None,
                device: "vda".into(),
            },
            pool: "metal".into(),
            tick: Duration::from_secs(2),
        }
    }
}

/// The module's state, a kernel resource its handlers and executor read.
#[derive(Clone)]
pub struct Metal {
    pub store: Store,
    pub config: Config,
}

/// The `metal` module: its methods, its migration and the executor.
pub fn module(config: Config) -> Module {
    let tick = config.tick;
    let mut module = Module::new("metal")
        .depends_on("sites")
        .on_start(move |cx: StartCx| {
            let config = config.clone();
            async move {
                let store = cx.get::<Store>()?.clone();
                cx.provide(Metal { store, config });
                Ok(())
            }
        });
    for m in MIGRATIONS {
        module = module.migration(*m);
    }
    api::register(module).reconciler(
        Reconciler::new("metal")
            .role(executor::ROLE)
            .shard_scoped()
            .tick(Tick::Every(tick))
            .poked_by(POKE)
            .step(executor::reconcile),
    )
}

/// The wall clock in ms since the epoch: read here, at the edge, and passed into the planner.
pub fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
        .unwrap_or(i64::MAX)
}
