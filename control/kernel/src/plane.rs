//! The control plane in a process: [`ControlPlane::builder`] (pure: validates options, registers modules and
//! checks the registry), [`ControlPlane::initialize`] (first I/O: the database, migrations, module start),
//! [`Initialized::router`] (the HTTP handler) and [`Initialized::start`] (the roles' reconcilers).

use crate::backend::{Authenticator, Backend, Membership, Notice};
use crate::error::{ApiError, InvalidConfig};
use crate::method::MethodDef;
use crate::module::{IntoModule, Migration, Module, Route, StartCx};
use crate::reconcile::{ROLES, ReconcileCx, Reconciler, Stop, Worker, membership_loop, run_body};
use crate::registry;
use crate::resources::Resources;
use bc_core::shards::ShardLease;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// The kernel's own options. Modules take theirs in their constructors.
#[derive(Debug, Clone)]
pub struct Options {
    /// This process's worker id in every role (`<role>/<id>`): unique per process, a restart is a new worker.
    pub worker_id: String,
    /// How long a process's role membership and shard leases last without renewal (500 ms to 10 min).
    pub shard_lease: Duration,
    /// Apply pending migrations in `initialize` (false: only verify that none is pending).
    pub migrate: bool,
}

pub const DEFAULT_SHARD_LEASE: Duration = Duration::from_secs(10);

impl Options {
    pub fn new(worker_id: impl Into<String>) -> Options {
        Options {
            worker_id: worker_id.into(),
            shard_lease: DEFAULT_SHARD_LEASE,
            migrate: true,
        }
    }

    fn validate(&self) -> Result<(), InvalidConfig> {
        let id = &self.worker_id;
        if id.is_empty() || id.len() > 200 || !id.bytes().all(|b| b.is_ascii_graphic() && b != b'/')
        {
            return Err(InvalidConfig::new(
                "worker_id",
                "must be 1 to 200 visible ASCII characters without '/'",
            ));
        }
        if !(Duration::from_millis(500)..=Duration::from_secs(600)).contains(&self.shard_lease) {
            return Err(InvalidConfig::new(
                "shard_lease",
                format!(
                    "must be between 500 ms and 600 s (got {} ms)",
                    self.shard_lease.as_millis()
                ),
            ));
        }
        Ok(())
    }
}

/// Which roles a process runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoleSet(BTreeSet<&'static str>);

impl RoleSet {
    /// A comma-separated list (`api,gateway`, or `all`).
    pub fn parse(list: &str) -> Result<RoleSet, InvalidConfig> {
        let mut set = BTreeSet::new();
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if name == "all" {
                set.extend(ROLES.iter().copied());
                continue;
            }
            let known = ROLES.iter().find(|r| **r == name).ok_or_else(|| {
                InvalidConfig::new(
                    "roles",
                    format!("unknown role {name:?}; roles are {}", ROLES.join(", ")),
                )
            })?;
            set.insert(*known);
        }
        if set.is_empty() {
            return Err(InvalidConfig::new("roles", "no roles given"));
        }
        Ok(RoleSet(set))
    }

    pub fn all() -> RoleSet {
        RoleSet(ROLES.iter().copied().collect())
    }

    pub fn contains(&self, role: &str) -> bool {
        self.0.contains(role)
    }

    pub fn iter(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.0.iter().copied()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Module,
    Plugin,
}

impl Kind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Module => "module",
            Kind::Plugin => "plugin",
        }
    }
}

/// Collects options, modules and plugins; [`ControlPlaneBuilder::build`] checks them without any I/O.
pub struct ControlPlaneBuilder {
    options: Options,
    modules: Vec<(Kind, Result<Module, InvalidConfig>)>,
    resources: Resources,
    api_paths: Vec<(&'static str, serde_json::Value)>,
}

impl ControlPlaneBuilder {
    /// A module of this workspace (registered after the kernel's own `system` module, in order).
    pub fn module(mut self, module: impl IntoModule) -> ControlPlaneBuilder {
        self.modules.push((Kind::Module, module.into_module()));
        self
    }

    /// A module from outside (registered after every module, in order); the same checks apply.
    pub fn plugin(mut self, plugin: impl IntoModule) -> ControlPlaneBuilder {
        self.modules.push((Kind::Plugin, plugin.into_module()));
        self
    }

    /// A value every module may read (configuration the binary resolved, a handle it owns).
    pub fn resource<T: Send + Sync + 'static>(mut self, value: T) -> ControlPlaneBuilder {
        self.resources.insert(value);
        self
    }

    /// Documents a path the binary serves itself (outside the kernel's router, or on another listener) in the API
    /// document: `item` is an OpenAPI path item object.
    pub fn api_path(mut self, path: &'static str, item: serde_json::Value) -> ControlPlaneBuilder {
        self.api_paths.push((path, item));
        self
    }

    /// Validates the options and the registry: a duplicate module or method, a method without a permission, scope
    /// or handler, a reconciler on an unknown role, a missing or circular dependency, a migration version used twice
    /// are INVALID_CONFIG naming the module and the item. No I/O.
    pub fn build(self) -> Result<ControlPlane, InvalidConfig> {
        self.options.validate()?;
        let mut modules = vec![(Kind::Module, registry::system_module())];
        let (mine, plugins): (Vec<_>, Vec<_>) = self
            .modules
            .into_iter()
            .partition(|(k, _)| *k == Kind::Module);
        for (kind, m) in mine.into_iter().chain(plugins) {
            modules.push((kind, m?));
        }
        let order = registry::check(&modules)?;
        let mut ordered: Vec<Option<(Kind, Module)>> = modules.into_iter().map(Some).collect();
        let modules = order
            .into_iter()
            .filter_map(|i| ordered[i].take())
            .collect();
        Ok(ControlPlane {
            options: self.options,
            modules,
            resources: self.resources,
            api_paths: self.api_paths,
        })
    }
}

/// A control plane built and checked, not yet touching anything outside the process.
pub struct ControlPlane {
    options: Options,
    /// In start order (dependencies first).
    modules: Vec<(Kind, Module)>,
    resources: Resources,
    api_paths: Vec<(&'static str, serde_json::Value)>,
}

/// The control plane's OpenAPI document, as `GET /api/openapi.json` serves it (a kernel resource).
#[derive(Debug, Clone)]
pub struct OpenApiDocument(pub Arc<serde_json::Value>);

impl ControlPlane {
    pub fn builder(options: Options) -> ControlPlaneBuilder {
        ControlPlaneBuilder {
            options,
            modules: Vec::new(),
            resources: Resources::new(),
            api_paths: Vec::new(),
        }
    }

    /// The OpenAPI 3.1 document of this control plane (pure: from the registry, no I/O).
    pub fn openapi(&self) -> serde_json::Value {
        crate::openapi::document(&self.modules, &self.api_paths)
    }

    /// Every registered method (the API document), in start order of the modules.
    pub fn methods(&self) -> Vec<&MethodDef> {
        self.modules
            .iter()
            .flat_map(|(_, m)| m.methods.iter())
            .collect()
    }

    /// The modules in start order.
    pub fn module_names(&self) -> Vec<&'static str> {
        self.modules.iter().map(|(_, m)| m.name).collect()
    }

    /// The gateway services the modules serve (`join`, `session`, `site`).
    pub fn gateway_services(&self) -> Vec<&'static str> {
        let mut all: Vec<_> = self
            .modules
            .iter()
            .flat_map(|(_, m)| m.gateway_services.iter().copied())
            .collect();
        all.dedup();
        all
    }

    /// Reaches the database (UNAVAILABLE when it cannot), applies or verifies the migrations, then starts each
    /// module in order; a module that fails to start fails this with its code, naming the module.
    pub async fn initialize(self, backend: impl Backend) -> Result<Initialized, ApiError> {
        let backend: Arc<dyn Backend> = Arc::new(backend);
        backend.check().await?;
        let migrations: Vec<Migration> = self
            .modules
            .iter()
            .flat_map(|(_, m)| m.migrations.iter().copied())
            .collect();
        let applied = backend.migrate(&migrations, self.options.migrate).await?;
        if applied > 0 {
            tracing::info!(applied, "migrations applied");
        }
        let openapi = OpenApiDocument(Arc::new(self.openapi()));
        let mut resources = self.resources;
        backend.provide(&mut resources);
        resources.insert(registry::ApiDocument::of(&self.modules));
        resources.insert(openapi);
        let mut hot = Vec::new();
        for table in self.modules.iter().flat_map(|(_, m)| m.hot_tables.iter()) {
            if !hot.contains(table) {
                hot.push(*table);
            }
        }
        resources.insert(crate::module::HotTables(hot));
        let mut notes = Vec::new();
        for (kind, module) in &self.modules {
            let Some(start) = &module.start else { continue };
            let cx = StartCx::new(Arc::new(resources.clone()), module.name);
            start(cx.clone()).await.map_err(|e| {
                ApiError::new(
                    e.code(),
                    format!(
                        "{} {} did not start: {}",
                        kind.label(),
                        module.name,
                        e.message()
                    ),
                )
                .with_source(e)
            })?;
            let (provided, said) = cx.finish();
            resources.merge(provided);
            notes.extend(said);
        }
        let mut methods = Vec::new();
        let mut routes = Vec::new();
        let mut reconcilers = Vec::new();
        for (_, module) in self.modules {
            methods.extend(module.methods);
            routes.extend(module.routes);
            reconcilers.extend(module.reconcilers.into_iter().map(|r| (module.name, r)));
        }
        Ok(Initialized {
            options: self.options,
            resources: Arc::new(resources),
            auth: backend.authenticator(),
            membership: backend.membership(),
            backend,
            methods,
            routes: std::sync::Mutex::new(routes),
            reconcilers,
            notes,
        })
    }
}

/// A control plane whose database is reachable and whose modules started.
pub struct Initialized {
    options: Options,
    resources: Arc<Resources>,
    auth: Arc<dyn Authenticator>,
    membership: Arc<dyn Membership>,
    backend: Arc<dyn Backend>,
    methods: Vec<MethodDef>,
    routes: std::sync::Mutex<Vec<Route>>,
    reconcilers: Vec<(&'static str, Reconciler)>,
    notes: Vec<String>,
}

impl Initialized {
    /// What the modules said while starting (a configuration that cannot work as it stands).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    pub fn resources(&self) -> &Arc<Resources> {
        &self.resources
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The HTTP handler: `POST /api/compute/{group}/{method}`, the modules' own routes, `GET /healthz`. The
    /// modules' routes go to the first router made.
    pub fn router(&self) -> axum::Router {
        let routes = self
            .routes
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default();
        let mut allowed: Vec<(&'static str, &'static str)> =
            routes.iter().map(|r| (r.path, r.http_method)).collect();
        allowed.sort_unstable();
        let state = crate::router::RouterState::new(
            self.resources.clone(),
            self.auth.clone(),
            self.backend.clone(),
            &self.methods,
            allowed,
        );
        crate::router::router(
            state,
            routes.into_iter().map(|r| (r.path, r.router)).collect(),
        )
    }

    /// Starts the reconcilers of `roles`: one membership loop per role that has shard-scoped ones, one listening
    /// connection for every notification they wait for, then each reconciler. Returns at once.
    pub fn start(&self, roles: &RoleSet) -> Running {
        let (stop_tx, stop_rx) = watch::channel(false);
        let stop = Stop::new(stop_rx);
        let mut tasks = JoinSet::new();
        let chosen: Vec<(&'static str, &Reconciler, &'static str)> = self
            .reconcilers
            .iter()
            .filter_map(|(module, r)| {
                let role = r.roles.iter().find(|role| roles.contains(role))?;
                let role = ROLES.iter().copied().find(|known| known == role)?;
                Some((*module, r, role))
            })
            .collect();
        let mut shards: HashMap<&'static str, watch::Receiver<Arc<[ShardLease]>>> = HashMap::new();
        for (_, r, role) in &chosen {
            if !r.shard_scoped || shards.contains_key(role) {
                continue;
            }
            let (tx, rx) = watch::channel::<Arc<[ShardLease]>>(Arc::from(Vec::new()));
            shards.insert(role, rx);
            tasks.spawn(membership_loop(
                self.membership.clone(),
                self.worker(role),
                self.options.shard_lease,
                tx,
                stop.clone(),
            ));
        }
        let mut subscribers = Vec::new();
        let none: watch::Receiver<Arc<[ShardLease]>> = watch::channel(Arc::from(Vec::new())).1;
        for (module, r, role) in &chosen {
            let (pokes_tx, pokes) = mpsc::channel(4096);
            if !r.pokes.is_empty() {
                subscribers.push(Subscriber {
                    channels: r.pokes.clone(),
                    tx: pokes_tx,
                    overflowed: false,
                });
            }
            let cx = ReconcileCx {
                resources: self.resources.clone(),
                worker: self.worker(role),
                shards: if r.shard_scoped {
                    shards.get(role).cloned().unwrap_or_else(|| none.clone())
                } else {
                    none.clone()
                },
                pokes,
                tick: r.tick.resolve(self.options.shard_lease),
                lease: self.options.shard_lease,
                membership: self.membership.clone(),
                stop: stop.clone(),
            };
            let Some(body) = &r.body else { continue };
            tracing::info!(module, reconciler = r.name, role, "reconciler running");
            tasks.spawn(run_body(r, body, cx));
        }
        if !subscribers.is_empty() {
            let mut channels: Vec<&'static str> = subscribers
                .iter()
                .flat_map(|s| s.channels.iter().copied())
                .collect();
            channels.sort_unstable();
            channels.dedup();
            let notices = self.backend.listen(channels, stop.clone());
            tasks.spawn(fan_out(notices, subscribers));
        }
        Running {
            tasks,
            stop: stop_tx,
            stop_rx: stop,
        }
    }

    fn worker(&self, role: &'static str) -> Worker {
        Worker {
            role,
            id: self.options.worker_id.clone(),
        }
    }
}

struct Subscriber {
    channels: Vec<&'static str>,
    tx: mpsc::Sender<Notice>,
    overflowed: bool,
}

/// Hands each notification to the reconcilers that listen to its channel, never blocking on a slow one: a full
/// queue is remembered and answered with a [`Notice::Resync`] as soon as there is room.
async fn fan_out(mut notices: mpsc::Receiver<Notice>, mut subscribers: Vec<Subscriber>) {
    while let Some(n) = notices.recv().await {
        for s in &mut subscribers {
            let wants = match &n {
                Notice::Message { channel, .. } => s.channels.iter().any(|c| c == channel),
                Notice::Resync => true,
            };
            if s.overflowed && s.tx.try_send(Notice::Resync).is_ok() {
                s.overflowed = false;
            }
            if wants && !s.overflowed && s.tx.try_send(n.clone()).is_err() {
                s.overflowed = true;
            }
        }
    }
}

/// How long [`Running::stop`] lets the tasks finish what they are doing, side by side: the gateway's sessions up to
/// 5 s to record that they went offline, then its in-flight calls up to 5 s (milliseconds each with a database
/// that answers); a role's farewell (leaving its shards). Then the rest are aborted: a transaction in flight rolls
/// back, and shards not left expire with their leases, as after a crash. Without it, a control plane whose database
/// was down took 57 s to stop on SIGTERM (`better-compute dev`: two pool timeouts of 30 s, one after the other).
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// The tasks of a started control plane.
pub struct Running {
    tasks: JoinSet<()>,
    stop: watch::Sender<bool>,
    stop_rx: Stop,
}

impl Running {
    /// Says when the process stops (for the binary's own tasks: listeners).
    pub fn stop_signal(&self) -> Stop {
        self.stop_rx.clone()
    }

    /// Adds a task of the binary's (a listener) that must end when [`Running::stop_signal`] fires.
    pub fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Stops every task and waits for them, [`STOP_GRACE`] at most: a task still running then is aborted, as a
    /// crash would end it.
    pub async fn stop(&mut self) {
        let _ = self.stop.send(true);
        let tasks = &mut self.tasks;
        let drained = tokio::time::timeout(STOP_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                tasks = self.tasks.len(),
                grace_s = STOP_GRACE.as_secs(),
                "tasks still running after the stop's grace period; aborting them"
            );
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
        }
    }

    /// Waits until a task ends on its own (an error in a server).
    pub async fn wait_any(&mut self) {
        let _ = self.tasks.join_next().await;
    }
}

#[cfg(test)]
mod stop_tests {
    use super::*;

    /// A task that never looks at the stop signal (one stuck waiting on a database that is gone) is aborted after
    /// the grace period; one that stops is not.
    #[tokio::test(start_paused = true)]
    async fn stop_aborts_a_task_still_running_after_the_grace_period() {
        let (stop_tx, stop_rx) = watch::channel(false);
        let stop = Stop::new(stop_rx);
        let mut running = Running {
            tasks: JoinSet::new(),
            stop: stop_tx,
            stop_rx: stop.clone(),
        };
        let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
        let mut polite = stop.clone();
        running.spawn(async move {
            polite.stopped().await;
            let _ = stopped_tx.send(());
        });
        let (dropped_tx, dropped_rx) = tokio::sync::oneshot::channel::<()>();
        running.spawn(async move {
            let _dropped = dropped_tx;
            std::future::pending::<()>().await;
        });
        let t0 = tokio::time::Instant::now();
        tokio::time::timeout(STOP_GRACE * 3, running.stop())
            .await
            .expect("stop returns although a task never stops");
        assert_eq!(
            t0.elapsed(),
            STOP_GRACE,
            "stop waits the grace period, no more"
        );
        assert!(
            stopped_rx.await.is_ok(),
            "the task that stops ran to its end"
        );
        assert!(
            dropped_rx.await.is_err(),
            "the stuck task was aborted (its sender dropped without sending)"
        );
        assert!(running.tasks.is_empty());
    }
}
