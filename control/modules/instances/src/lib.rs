//! The control plane's instances module, `instances`: VPS instances on hosted pools. `instances.create` runs the
//! admission sequence as reservations do ([`methods`]: validation and the tenant check before any database access,
//! tx 1 records the request under its idempotency key, tx 2 places it); the placement books a `vps-host` pool
//! node's atoms — vCPUs, memory and disk counted against what its inventory advertises, GPUs as its devices rows
//! — and puts the instance in the node's desired state (docs/instances.md) with an outbox row in the same
//! transaction. `show|list` add what the node reports (its `instances` inventory section); `stop|start|reboot`
//! change only the desired state; `delete` takes the instance off its node and gives its atoms back.
//! `instances.set-pool` makes a pool a `vps-host` (or `provider`) pool. Its tables are its own (migration 1300,
//! [`queries`]). It imports no other module and not the binary.

pub mod methods;
pub mod queries;

use bc_kernel::{ApiError, Migration, Module, StartCx};

/// The module's schema (its tables; versions 1300–1399 are this module's).
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1300,
    name: "instances",
    sql: include_str!("../migrations/1300_instances.sql"),
}];

/// The module's shared state (a kernel resource, provided at start).
pub struct Instances {
    pub store: bc_store::Store,
}

/// The `instances` module.
pub fn module() -> Module {
    let mut m = methods::register(Module::new("instances"));
    for migration in MIGRATIONS {
        m = m.migration(*migration);
    }
    m.on_start(|cx: StartCx| async move {
        let store = cx.get::<bc_store::Store>()?.clone();
        cx.provide(Instances { store });
        Ok::<(), ApiError>(())
    })
}
