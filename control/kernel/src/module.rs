//! What a module declares: its name and dependencies, its API methods, its reconcilers, its migrations, the
//! gateway services it serves, extra HTTP routes, and what it does when the control plane initializes.

use crate::error::{ApiError, InvalidConfig};
use crate::method::{ApiMethod, BoxFuture, Method, MethodDef, Permission};
use crate::reconcile::Reconciler;
use crate::resources::Resources;
use crate::router::RouterState;
use std::future::Future;
use std::sync::{Arc, Mutex};

/// A schema change a module owns. Versions are global (the base schema's are bc-store's); the store's runner
/// applies them in version order, once, and refuses a changed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// An HTTP route outside `POST /api/compute/{group}/{method}` (a streamed upload), with the permission it checks.
pub struct Route {
    pub path: &'static str,
    /// The HTTP method it answers (for the "use PUT" answer to any other).
    pub http_method: &'static str,
    pub permission: Option<Permission>,
    /// Its OpenAPI operation object (summary, description, parameters, request body, responses), as
    /// [`Route::doc`] set it; the API document adds the permission and the error answers.
    pub(crate) doc: Option<serde_json::Value>,
    /// The schema of its JSON answer (200), as [`Route::answers`] set it.
    pub(crate) answer: Option<fn(&mut schemars::SchemaGenerator) -> schemars::Schema>,
    pub(crate) router: axum::routing::MethodRouter<RouterState>,
}

impl Route {
    pub fn new(
        path: &'static str,
        http_method: &'static str,
        router: axum::routing::MethodRouter<RouterState>,
    ) -> Route {
        Route {
            path,
            http_method,
            permission: None,
            doc: None,
            answer: None,
            router,
        }
    }

    /// Documents the route in the API document: an OpenAPI operation object (`summary`, `description`,
    /// `parameters`, `requestBody`, `responses`).
    pub fn doc(mut self, operation: serde_json::Value) -> Route {
        self.doc = Some(operation);
        self
    }

    /// Its 200 answer is `T` as JSON (the API document takes `T`'s schema).
    pub fn answers<T: schemars::JsonSchema>(mut self) -> Route {
        fn schema<T: schemars::JsonSchema>(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
            g.subschema_for::<T>()
        }
        self.answer = Some(schema::<T>);
        self
    }

    pub fn permission(mut self, permission: &'static str) -> Route {
        self.permission = Some(Permission::Grant(permission));
        self
    }
}

/// What a module's start hook gets: the resources provided so far (the backend's, the modules started before it)
/// and where it puts its own.
#[derive(Clone)]
pub struct StartCx {
    resources: Arc<Resources>,
    provided: Arc<Mutex<Resources>>,
    notes: Arc<Mutex<Vec<String>>>,
    module: &'static str,
}

impl StartCx {
    pub(crate) fn new(resources: Arc<Resources>, module: &'static str) -> StartCx {
        StartCx {
            resources,
            provided: Arc::default(),
            notes: Arc::default(),
            module,
        }
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    /// A value provided by the backend or a module started earlier, or UNAVAILABLE naming it.
    pub fn get<T: Send + Sync + 'static>(&self) -> Result<&T, ApiError> {
        self.resources.require()
    }

    pub fn get_arc<T: Send + Sync + 'static>(&self) -> Result<Arc<T>, ApiError> {
        self.resources.require_arc()
    }

    /// Shares `value` with handlers, reconcilers and later modules.
    pub fn provide<T: Send + Sync + 'static>(&self, value: T) {
        self.provide_arc(Arc::new(value));
    }

    pub fn provide_arc<T: Send + Sync + 'static>(&self, value: Arc<T>) {
        if let Ok(mut p) = self.provided.lock() {
            p.insert_arc(value);
        }
    }

    /// Something the operator should know (`initialize` logs it and returns it): a configuration that cannot
    /// work as it stands, a role no process runs.
    pub fn note(&self, note: impl Into<String>) {
        let note = format!("{}: {}", self.module, note.into());
        tracing::warn!(module = self.module, "{note}");
        if let Ok(mut n) = self.notes.lock() {
            n.push(note);
        }
    }

    pub(crate) fn finish(self) -> (Resources, Vec<String>) {
        let provided = self
            .provided
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default();
        let notes = self
            .notes
            .lock()
            .map(|mut n| std::mem::take(&mut *n))
            .unwrap_or_default();
        (provided, notes)
    }
}

pub(crate) type StartFn =
    Arc<dyn Fn(StartCx) -> BoxFuture<'static, Result<(), ApiError>> + Send + Sync>;

/// A module: `Module::new("nodes").depends_on("inventory").method(..).reconciler(..).on_start(..)`. Nothing it
/// declares runs before `initialize`.
pub struct Module {
    pub(crate) name: &'static str,
    pub(crate) depends_on: Vec<&'static str>,
    pub(crate) methods: Vec<MethodDef>,
    pub(crate) reconcilers: Vec<Reconciler>,
    pub(crate) migrations: Vec<Migration>,
    pub(crate) gateway_services: Vec<&'static str>,
    pub(crate) routes: Vec<Route>,
    pub(crate) hot_tables: Vec<&'static str>,
    pub(crate) start: Option<StartFn>,
}

/// The tables every module declared hot ([`Module::hot_tables`]), in registration order without repeats: a resource
/// of the initialized plane, read by the loop that keeps their planner statistics current.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HotTables(pub Vec<&'static str>);

impl Module {
    pub fn new(name: &'static str) -> Module {
        Module {
            name,
            depends_on: Vec::new(),
            methods: Vec::new(),
            reconcilers: Vec::new(),
            migrations: Vec::new(),
            gateway_services: Vec::new(),
            routes: Vec::new(),
            hot_tables: Vec::new(),
            start: None,
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// A module that must be registered too, and is started first.
    pub fn depends_on(mut self, module: &'static str) -> Module {
        self.depends_on.push(module);
        self
    }

    pub fn method<M: ApiMethod>(mut self, method: Method<M>) -> Module {
        self.methods.push(method.into_def());
        self
    }

    pub fn reconciler(mut self, reconciler: Reconciler) -> Module {
        self.reconcilers.push(reconciler);
        self
    }

    pub fn migration(mut self, migration: Migration) -> Module {
        self.migrations.push(migration);
        self
    }

    /// A daemon-facing service of the gateway role (`join`, `session`, `site`) this module serves; the binary
    /// that wires the gateway refuses to start one it cannot find.
    pub fn gateway_service(mut self, name: &'static str) -> Module {
        self.gateway_services.push(name);
        self
    }

    /// Tables whose query plans matter on a hot path (an admission, a placement): one process of the `controllers`
    /// or `scheduler` role ANALYZEs each of them as soon as it outgrows the planner's estimate, so a statement
    /// prepared while the table was empty does not keep scanning it until autovacuum comes.
    pub fn hot_tables(mut self, tables: &[&'static str]) -> Module {
        self.hot_tables.extend_from_slice(tables);
        self
    }

    pub fn route(mut self, route: Route) -> Module {
        self.routes.push(route);
        self
    }

    /// Runs once in `initialize`, after the modules it depends on: reads what they and the backend provide and
    /// provides its own state.
    pub fn on_start<F, Fut>(mut self, start: F) -> Module
    where
        F: Fn(StartCx) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), ApiError>> + Send + 'static,
    {
        self.start = Some(Arc::new(move |cx| Box::pin(start(cx))));
        self
    }
}

/// A module, or the configuration error its constructor found (`build()` reports it).
pub trait IntoModule {
    fn into_module(self) -> Result<Module, InvalidConfig>;
}

impl IntoModule for Module {
    fn into_module(self) -> Result<Module, InvalidConfig> {
        Ok(self)
    }
}

impl IntoModule for Result<Module, InvalidConfig> {
    fn into_module(self) -> Result<Module, InvalidConfig> {
        self
    }
}
