//! API methods: [`ApiMethod`] names a method and its typed request and response once, for the handler and for the
//! CLI's client alike; [`Method`] registers a handler with its permission and scope; [`Cx`] is what a handler gets:
//! the caller, the shared [`Resources`], and the permission check of its method.

use crate::error::ApiError;
use crate::resources::Resources;
use bc_core::iam::Grant;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One API method, `POST /api/compute/{GROUP}/{METHOD}`, with its typed request and response. Declared once (by the
/// module that serves it, see [`api_method!`](crate::api_method)) and used by the handler and by clients.
pub trait ApiMethod: Send + Sync + 'static {
    const GROUP: &'static str;
    const METHOD: &'static str;
    /// Its JSON Schema (from the type and its serde attributes) is the API document's request body.
    type Request: Serialize + DeserializeOwned + JsonSchema + Send + 'static;
    /// Its JSON Schema is the API document's answer.
    type Response: Serialize + DeserializeOwned + JsonSchema + Send + 'static;
}

/// Declares a method type: `api_method!(pub ListNodes = "nodes" / "list": ListNodesRequest => ListNodesResponse);`
#[macro_export]
macro_rules! api_method {
    ($(#[$meta:meta])* $vis:vis $name:ident = $group:literal / $method:literal : $req:ty => $resp:ty) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy)]
        $vis struct $name;
        impl $crate::ApiMethod for $name {
            const GROUP: &'static str = $group;
            const METHOD: &'static str = $method;
            type Request = $req;
            type Response = $resp;
        }
    };
}

/// Who calls: an authenticated principal with its grants (from the IAM behind [`crate::Authenticator`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub id: String,
    pub tenant_id: String,
    pub tenant_is_root: bool,
    pub grants: Vec<Grant>,
}

impl Caller {
    /// How the audit log names this caller.
    pub fn actor(&self) -> String {
        format!("principal/{}", self.id)
    }

    /// Whether any grant allows `permission` on `scope`.
    pub fn allows(&self, permission: &str, scope: &str) -> bool {
        bc_core::iam::allows(&self.grants, permission, scope)
    }
}

/// What a method requires of its caller. Every method declares one; a method without is refused at build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permission {
    /// A grant of this permission on the method's scope (`compute:nodes:drain`).
    Grant(&'static str),
    /// Any authenticated caller (public facts such as the CA pin): declared, never a default.
    AnyCaller,
}

impl Permission {
    pub fn name(&self) -> &'static str {
        match self {
            Permission::Grant(p) => p,
            Permission::AnyCaller => "(any authenticated caller)",
        }
    }
}

/// Where a method's permission is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeKind {
    /// One scope for every call; the router checks it before the handler runs.
    Fixed,
    /// Computed from the request; the router checks it before the handler runs.
    Request,
    /// Known once the handler read what it depends on (a node's pool); the handler checks it with
    /// [`Cx::authorize`], and the router refuses an answer given without that check.
    Resource,
    /// A list: each item is shown where [`Cx::allows`] says so.
    Filtered,
    /// The handler checks the permission itself, outside [`Cx`]: only for the server's groups registered from its
    /// former dispatch until each moves into its module crate (the router cannot tell whether it did).
    Handler,
}

/// A method's scope: how it is found and, for the API document, its pattern (`pool/<pool>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope {
    pub kind: ScopeKind,
    pub pattern: &'static str,
}

impl Scope {
    pub fn fixed(scope: &'static str) -> Scope {
        Scope {
            kind: ScopeKind::Fixed,
            pattern: scope,
        }
    }

    pub fn resource(pattern: &'static str) -> Scope {
        Scope {
            kind: ScopeKind::Resource,
            pattern,
        }
    }

    /// See [`ScopeKind::Handler`].
    pub fn checked_by_handler(pattern: &'static str) -> Scope {
        Scope {
            kind: ScopeKind::Handler,
            pattern,
        }
    }

    pub fn filtered(pattern: &'static str) -> Scope {
        Scope {
            kind: ScopeKind::Filtered,
            pattern,
        }
    }
}

/// What a handler gets: the caller, the shared resources and its method's permission check.
pub struct Cx {
    resources: Arc<Resources>,
    caller: Arc<Caller>,
    permission: Permission,
    checked: Arc<AtomicBool>,
}

impl Cx {
    /// A context for `caller` calling a method that requires `permission` (tests and the router).
    pub fn new(resources: Arc<Resources>, caller: Arc<Caller>, permission: Permission) -> Cx {
        Cx {
            resources,
            caller,
            permission,
            checked: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    /// The value of type `T` in the resources, or UNAVAILABLE naming it.
    pub fn get<T: Send + Sync + 'static>(&self) -> Result<&T, ApiError> {
        self.resources.require()
    }

    /// The method's permission on `scope`, or ACCESS_DENIED saying which grant is missing.
    pub fn authorize(&self, scope: &str) -> Result<(), ApiError> {
        self.checked.store(true, Ordering::Relaxed);
        match self.permission {
            Permission::AnyCaller => Ok(()),
            Permission::Grant(p) if self.caller.allows(p, scope) => Ok(()),
            Permission::Grant(p) => Err(ApiError::denied(format!(
                "principal {} lacks {p} on {scope}; ask an administrator for that grant",
                self.caller.id
            ))),
        }
    }

    /// Whether the caller holds the method's permission on `scope` (filtering a list).
    pub fn allows(&self, scope: &str) -> bool {
        self.checked.store(true, Ordering::Relaxed);
        match self.permission {
            Permission::AnyCaller => true,
            Permission::Grant(p) => self.caller.allows(p, scope),
        }
    }

    pub(crate) fn was_checked(&self) -> bool {
        self.checked.load(Ordering::Relaxed)
    }

    fn share(&self) -> Cx {
        Cx {
            resources: self.resources.clone(),
            caller: self.caller.clone(),
            permission: self.permission,
            checked: self.checked.clone(),
        }
    }
}

/// A registered method with its types erased: what the router calls.
pub(crate) type CallFn = Arc<
    dyn Fn(Cx, serde_json::Value) -> BoxFuture<'static, Result<Vec<u8>, ApiError>> + Send + Sync,
>;

/// A method as the registry holds it.
#[derive(Clone)]
pub struct MethodDef {
    pub group: &'static str,
    pub method: &'static str,
    pub permission: Option<Permission>,
    pub scope: Option<Scope>,
    pub request: &'static str,
    pub response: &'static str,
    /// The request's and the response's schemas, added to a generator (the API document's).
    pub(crate) schemas: fn(&mut SchemaGenerator) -> (Schema, Schema),
    pub(crate) call: Option<CallFn>,
}

fn schemas_of<M: ApiMethod>(generator: &mut SchemaGenerator) -> (Schema, Schema) {
    (
        generator.subschema_for::<M::Request>(),
        generator.subschema_for::<M::Response>(),
    )
}

impl std::fmt::Debug for MethodDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MethodDef")
            .field("group", &self.group)
            .field("method", &self.method)
            .field("permission", &self.permission)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// Registers a handler for `M` with its permission and scope:
/// `Method::<ListNodes>::new().permission("compute:nodes:list").scope(Scope::filtered("pool/<pool>")).handler(list)`.
pub struct Method<M: ApiMethod> {
    permission: Option<Permission>,
    scope: Option<Scope>,
    scope_of: Option<fn(&M::Request) -> String>,
    call: Option<CallFn>,
    deadline: std::time::Duration,
    _m: PhantomData<M>,
}

/// How long a method's handler may run ([`Method::deadline`] changes it for one method). The database pool's
/// connections have no deadline of their own, and a primary that vanishes without a reset leaves a query waiting
/// for ever; past this the caller gets UNAVAILABLE and the handler is dropped (its open transaction rolls back),
/// as when the caller hangs up.
pub const METHOD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

impl<M: ApiMethod> Default for Method<M> {
    fn default() -> Self {
        Method {
            permission: None,
            scope: None,
            scope_of: None,
            call: None,
            deadline: METHOD_DEADLINE,
            _m: PhantomData,
        }
    }
}

impl<M: ApiMethod> Method<M> {
    pub fn new() -> Method<M> {
        Method::default()
    }

    /// The grant the caller needs on the method's scope.
    pub fn permission(mut self, permission: &'static str) -> Method<M> {
        self.permission = Some(Permission::Grant(permission));
        self
    }

    /// Any authenticated caller may call it (declared explicitly, never a default).
    pub fn any_caller(mut self) -> Method<M> {
        self.permission = Some(Permission::AnyCaller);
        self
    }

    pub fn scope(mut self, scope: Scope) -> Method<M> {
        self.scope = Some(scope);
        self
    }

    /// A scope computed from the request (`pattern` for the API document); the router checks it first.
    pub fn scope_from_request(
        mut self,
        pattern: &'static str,
        scope_of: fn(&M::Request) -> String,
    ) -> Method<M> {
        self.scope = Some(Scope {
            kind: ScopeKind::Request,
            pattern,
        });
        self.scope_of = Some(scope_of);
        self
    }

    pub fn handler<F, Fut>(mut self, handler: F) -> Method<M>
    where
        F: Fn(Cx, M::Request) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<M::Response, ApiError>> + Send + 'static,
    {
        let scope = self.scope;
        let scope_of = self.scope_of;
        let handler = Arc::new(handler);
        self.call = Some(Arc::new(move |cx: Cx, body: serde_json::Value| {
            let handler = handler.clone();
            Box::pin(async move {
                let request: M::Request = serde_json::from_value(body)
                    .map_err(|e| ApiError::invalid(format!("request body: {e}")))?;
                match (scope.map(|s| s.kind), scope_of) {
                    (Some(ScopeKind::Fixed), _) => {
                        cx.authorize(scope.map(|s| s.pattern).unwrap_or_default())?
                    }
                    (Some(ScopeKind::Request), Some(of)) => cx.authorize(&of(&request))?,
                    _ => {}
                }
                let response = handler(cx.share(), request).await?;
                if scope.is_some_and(|s| s.kind == ScopeKind::Resource) && !cx.was_checked() {
                    tracing::error!(
                        group = M::GROUP,
                        method = M::METHOD,
                        "a handler answered without checking its permission; answer withheld"
                    );
                    return Err(ApiError::unavailable(format!(
                        "{}.{} answered without checking the caller's permission; the answer was withheld \
                         (a bug in the module that serves it; the control plane logged it)",
                        M::GROUP,
                        M::METHOD
                    )));
                }
                serde_json::to_vec(&response).map_err(|e| {
                    ApiError::unavailable(
                        "the answer could not be encoded; the control plane logged why",
                    )
                    .with_source(e)
                })
            })
        }));
        self
    }

    /// How long this method's handler may run before the caller gets UNAVAILABLE ([`METHOD_DEADLINE`]).
    pub fn deadline(mut self, deadline: std::time::Duration) -> Method<M> {
        self.deadline = deadline;
        self
    }

    pub(crate) fn into_def(self) -> MethodDef {
        let deadline = self.deadline;
        let call = self.call.map(|call| -> CallFn {
            Arc::new(move |cx: Cx, body: serde_json::Value| {
                let moved = crate::resources::next_move(cx.resources());
                let running = call(cx, body);
                Box::pin(async move {
                    let bounded = tokio::time::timeout(deadline, running);
                    let answer = tokio::select! {
                        answer = bounded => answer,
                        () = moved => {
                            tracing::warn!(
                                group = M::GROUP,
                                method = M::METHOD,
                                "the database primary moved while a method ran; answered UNAVAILABLE"
                            );
                            return Err(ApiError::unavailable(format!(
                                "{}.{} was cut short: the database primary moved while it ran; a change it made in \
                                 a transaction was rolled back, one it had committed stands: read the state back \
                                 before you retry",
                                M::GROUP,
                                M::METHOD,
                            )));
                        }
                    };
                    match answer {
                        Ok(answer) => answer,
                        Err(_) => {
                            tracing::warn!(
                                group = M::GROUP,
                                method = M::METHOD,
                                deadline_ms = deadline.as_millis() as u64,
                                "a method ran past its deadline; answered UNAVAILABLE"
                            );
                            Err(ApiError::unavailable(format!(
                                "{}.{} did not finish within {} ms (the database or a service it needs did not \
                                 answer in time); a change it made in a transaction was rolled back, one it had \
                                 committed stands: read the state back before you retry",
                                M::GROUP,
                                M::METHOD,
                                deadline.as_millis()
                            )))
                        }
                    }
                })
            })
        });
        MethodDef {
            group: M::GROUP,
            method: M::METHOD,
            permission: self.permission,
            scope: self.scope,
            request: std::any::type_name::<M::Request>(),
            response: std::any::type_name::<M::Response>(),
            schemas: schemas_of::<M>,
            call,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::api_method!(Stuck = "demo" / "stuck": serde_json::Value => serde_json::Value);

    fn root_caller() -> Arc<Caller> {
        Arc::new(Caller {
            id: "p".into(),
            tenant_id: "root".into(),
            tenant_is_root: true,
            grants: Vec::new(),
        })
    }

    /// A handler that waits on something that never answers (a query to a primary gone silent) is given up at
    /// the method's deadline with UNAVAILABLE naming the method; before, the caller waited as long as the
    /// connection lived. A handler that answers in time is untouched.
    /// The database primary moves while a handler waits on the old one: the caller is answered UNAVAILABLE at the
    /// move, not at the method's deadline.
    #[tokio::test(start_paused = true)]
    async fn a_handler_in_flight_when_the_database_moves_is_answered_unavailable() {
        let def = Method::<Stuck>::new()
            .permission("compute:demo:stuck")
            .handler(|_cx, _req: serde_json::Value| async move {
                std::future::pending::<()>().await;
                Ok(serde_json::Value::Null)
            })
            .into_def();
        let call = def.call.expect("a handler");
        let caller = root_caller();
        let (moves_tx, moves) = tokio::sync::watch::channel(0u64);
        let mut resources = crate::resources::Resources::new();
        resources.insert(crate::DatabaseMoves(moves));
        let cx = Cx::new(Arc::new(resources), caller, Permission::AnyCaller);
        let began = tokio::time::Instant::now();
        let answer = tokio::spawn(call(cx, serde_json::json!({})));
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        moves_tx.send_modify(|n| *n += 1);
        let e = tokio::time::timeout(std::time::Duration::from_secs(1), answer)
            .await
            .expect("answered at the move")
            .expect("task")
            .expect_err("cut short");
        assert_eq!(began.elapsed(), std::time::Duration::from_secs(2));
        assert_eq!(e.code(), crate::ApiCode::Unavailable);
        assert!(
            e.message()
                .starts_with("demo.stuck was cut short: the database primary moved"),
            "{}",
            e.message()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_past_its_deadline_is_answered_unavailable() {
        let def = Method::<Stuck>::new()
            .permission("compute:demo:stuck")
            .handler(|_cx, req: serde_json::Value| async move {
                if req["hang"] == true {
                    std::future::pending::<()>().await;
                }
                Ok(req)
            })
            .deadline(std::time::Duration::from_secs(5))
            .into_def();
        let call = def.call.expect("a handler");
        let caller = root_caller();
        let cx = || {
            Cx::new(
                Arc::new(crate::resources::Resources::new()),
                caller.clone(),
                Permission::AnyCaller,
            )
        };
        let began = tokio::time::Instant::now();
        let e = tokio::time::timeout(
            std::time::Duration::from_secs(600),
            call(cx(), serde_json::json!({"hang": true})),
        )
        .await
        .expect("answered at the method's deadline, not left waiting")
        .expect_err("it never answers");
        assert_eq!(began.elapsed(), std::time::Duration::from_secs(5));
        assert_eq!(e.code(), crate::ApiCode::Unavailable);
        assert!(
            e.message()
                .starts_with("demo.stuck did not finish within 5000 ms"),
            "{}",
            e.message()
        );
        let ok = call(cx(), serde_json::json!({"hang": false}))
            .await
            .expect("answers");
        assert_eq!(ok, br#"{"hang":false}"#);
    }
}
