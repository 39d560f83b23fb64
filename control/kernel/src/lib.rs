//! bc-kernel: the control plane in a process, as a registry of modules.
//!
//! It owns the builder and its checks ([`ControlPlane::builder`] → [`ControlPlane`], pure), the module registry
//! ([`Module`]: API methods with their permission, scope and typed request and response, reconcilers, migrations,
//! gateway services), the router for `POST /api/compute/{group}/{method}` ([`Initialized::router`]), the role
//! runner ([`Initialized::start`]: membership, fenced shard leases, ticks and pokes), the IAM check behind
//! [`Authenticator`] and the error codes ([`ApiCode`], [`ApiError`], [`InvalidConfig`]). It must not import the
//! store, the gateway or any module (`scripts/check-deps`): the database arrives as a [`Backend`], modules as
//! values. Start with [`ControlPlane::builder`]; `examples/plugin.rs` builds one with a module of its own.
//!
//! ```text
//! ControlPlane::builder(options).module(..).plugin(..).build()?   // pure: INVALID_CONFIG naming field or item
//!     .initialize(backend).await?                                 // database, migrations, module start
//!     .router()                                                   // the HTTP handler
//!     .start(&roles)                                              // the roles' reconcilers
//! ```

pub mod backend;
pub mod error;
pub mod method;
pub mod module;
pub mod openapi;
pub mod plane;
pub mod reconcile;
pub mod registry;
pub mod resources;
pub mod router;
pub mod serve;

pub use backend::{Authenticator, Backend, Membership, Notice};
pub use error::{ApiCode, ApiError, Coded, InvalidConfig, http_status};
pub use method::{
    ApiMethod, BoxFuture, Caller, Cx, METHOD_DEADLINE, Method, Permission, Scope, ScopeKind,
};
pub use module::{HotTables, IntoModule, Migration, Module, Route, StartCx};
pub use plane::{
    ControlPlane, ControlPlaneBuilder, DEFAULT_SHARD_LEASE, Initialized, OpenApiDocument, Options,
    RoleSet, Running, STOP_GRACE,
};
pub use reconcile::{ROLES, ReconcileCx, Reconciler, STEP_DEADLINE, StepCx, Stop, Tick, Worker};
pub use registry::{ApiDocument, Empty, ListMethods, MethodEntry};
pub use resources::{DatabaseMoves, Resources};
pub use router::{KERNEL_PATHS, MAX_BODY, READY_DEADLINE, RouterState, check_strings, read_body};
pub use schemars;
