//! The registry checks `build()` runs, the start order they imply, and the kernel's own `system` module
//! (`system.methods`: the API document of this control plane).

use crate::error::{ApiError, InvalidConfig};
use crate::method::{Cx, Method, Permission};
use crate::module::Module;
use crate::plane::Kind;
use crate::reconcile::ROLES;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

fn valid_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// Checks every registration; returns the start order (indexes into `modules`, dependencies first).
pub(crate) fn check(modules: &[(Kind, Module)]) -> Result<Vec<usize>, InvalidConfig> {
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut methods: HashMap<(&str, &str), &str> = HashMap::new();
    let mut migrations: HashMap<i64, &str> = HashMap::new();
    let mut routes: HashMap<&str, &str> = HashMap::new();
    for (i, (kind, m)) in modules.iter().enumerate() {
        let at =
            |reason: String| InvalidConfig::new(format!("{} {}", kind.label(), m.name), reason);
        if !valid_name(m.name) {
            return Err(at(
                "a module name is 1 to 64 of [a-z0-9-], starting with a letter".into(),
            ));
        }
        if names.insert(m.name, i).is_some() {
            return Err(at("registered twice: module names are unique".into()));
        }
        for d in &m.methods {
            let id = format!("{}.{}", d.group, d.method);
            if !valid_name(d.group) || !valid_name(d.method) {
                return Err(at(format!(
                    "method {id}: group and method are 1 to 64 of [a-z0-9-], starting with a letter"
                )));
            }
            if let Some(first) = methods.insert((d.group, d.method), m.name) {
                return Err(at(format!(
                    "method {id} is registered twice (first by {first}); every method has one handler"
                )));
            }
            if d.permission.is_none() {
                return Err(at(format!(
                    "method {id} has no permission: declare .permission(\"compute:...\") or .any_caller()"
                )));
            }
            if d.scope.is_none() && d.permission != Some(Permission::AnyCaller) {
                return Err(at(format!("method {id} has no scope: declare .scope(..)")));
            }
            if d.call.is_none() {
                return Err(at(format!("method {id} has no handler")));
            }
        }
        let mut reconcilers = HashSet::new();
        for r in &m.reconcilers {
            if !reconcilers.insert(r.name) {
                return Err(at(format!("reconciler {} is registered twice", r.name)));
            }
            if r.roles.is_empty() {
                return Err(at(format!(
                    "reconciler {} runs in no role: declare .role(..) (roles are {})",
                    r.name,
                    ROLES.join(", ")
                )));
            }
            if let Some(role) = r.roles.iter().find(|role| !ROLES.contains(&role.as_str())) {
                return Err(at(format!(
                    "reconciler {} runs on unknown role {role:?}; roles are {}",
                    r.name,
                    ROLES.join(", ")
                )));
            }
            if r.shard_scoped && r.roles.len() != 1 {
                return Err(at(format!(
                    "reconciler {} is shard-scoped on several roles: shards belong to one role",
                    r.name
                )));
            }
            if r.body.is_none() {
                return Err(at(format!(
                    "reconciler {} has nothing to run: declare .step(..) or .run(..)",
                    r.name
                )));
            }
            if matches!(r.tick, crate::reconcile::Tick::Every(d) if d.is_zero()) {
                return Err(at(format!("reconciler {}: a tick of 0 spins", r.name)));
            }
        }
        for g in &m.migrations {
            if g.version < 1000 {
                return Err(at(format!(
                    "migration {} ({}): module migrations are numbered from 1000 (below is the base schema)",
                    g.version, g.name
                )));
            }
            if let Some(first) = migrations.insert(g.version, m.name) {
                return Err(at(format!(
                    "migration {} ({}) uses a version {first} already uses",
                    g.version, g.name
                )));
            }
        }
        for r in &m.routes {
            if r.permission.is_none() {
                return Err(at(format!(
                    "route {} {} has no permission",
                    r.http_method, r.path
                )));
            }
            if r.path.starts_with("/api/compute/") || crate::router::KERNEL_PATHS.contains(&r.path)
            {
                return Err(at(format!("route {} is the kernel's", r.path)));
            }
            if let Some(first) = routes.insert(r.path, m.name) {
                return Err(at(format!(
                    "route {} is registered twice (first by {first})",
                    r.path
                )));
            }
        }
    }
    start_order(modules, &names)
}

/// Dependencies first, otherwise in registration order; a missing or circular dependency is refused.
fn start_order(
    modules: &[(Kind, Module)],
    names: &HashMap<&str, usize>,
) -> Result<Vec<usize>, InvalidConfig> {
    for (kind, m) in modules {
        if let Some(d) = m.depends_on.iter().find(|d| !names.contains_key(*d)) {
            return Err(InvalidConfig::new(
                format!("{} {}", kind.label(), m.name),
                format!(
                    "depends on module {d}, which is not registered: register it (or drop {})",
                    m.name
                ),
            ));
        }
    }
    let mut order = Vec::with_capacity(modules.len());
    let mut state = vec![0u8; modules.len()]; // 0 new, 1 visiting, 2 done
    fn visit(
        i: usize,
        modules: &[(Kind, Module)],
        names: &HashMap<&str, usize>,
        state: &mut [u8],
        order: &mut Vec<usize>,
    ) -> Result<(), InvalidConfig> {
        match state[i] {
            2 => return Ok(()),
            1 => {
                let (kind, m) = &modules[i];
                return Err(InvalidConfig::new(
                    format!("{} {}", kind.label(), m.name),
                    "its dependencies lead back to it (a cycle): modules start in dependency order",
                ));
            }
            _ => {}
        }
        state[i] = 1;
        for d in &modules[i].1.depends_on {
            visit(names[d], modules, names, state, order)?;
        }
        state[i] = 2;
        order.push(i);
        Ok(())
    }
    for i in 0..modules.len() {
        visit(i, modules, names, &mut state, &mut order)?;
    }
    Ok(order)
}

// === the system module ===

/// One method as `system.methods` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct MethodEntry {
    pub module: String,
    pub group: String,
    pub method: String,
    pub permission: String,
    pub scope: String,
    pub request: String,
    pub response: String,
}

/// The API document: every method of this control plane.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ApiDocument {
    pub methods: Vec<MethodEntry>,
}

impl ApiDocument {
    pub(crate) fn of(modules: &[(Kind, Module)]) -> ApiDocument {
        let mut methods: Vec<MethodEntry> = modules
            .iter()
            .flat_map(|(_, m)| {
                m.methods.iter().map(|d| MethodEntry {
                    module: m.name.to_string(),
                    group: d.group.to_string(),
                    method: d.method.to_string(),
                    permission: d
                        .permission
                        .map(|p| p.name())
                        .unwrap_or_default()
                        .to_string(),
                    scope: d.scope.map(|s| s.pattern).unwrap_or("-").to_string(),
                    request: short(d.request),
                    response: short(d.response),
                })
            })
            .collect();
        methods.sort_by(|a, b| (&a.group, &a.method).cmp(&(&b.group, &b.method)));
        ApiDocument { methods }
    }
}

/// `bc_nodes::api::ListNodes` → `ListNodes` (generic arguments kept).
fn short(type_name: &str) -> String {
    let (head, generics) = type_name.split_once('<').unwrap_or((type_name, ""));
    let head = head.rsplit("::").next().unwrap_or(head);
    if generics.is_empty() {
        head.to_string()
    } else {
        format!("{head}<{generics}")
    }
}

/// A request that takes no fields (any object is accepted).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Empty {}

crate::api_method!(
    /// `system.methods`: every method of this control plane, with its permission and scope.
    pub ListMethods = "system" / "methods": Empty => ApiDocument
);

pub(crate) fn system_module() -> Module {
    Module::new("system").method(Method::<ListMethods>::new().any_caller().handler(
        |cx: Cx, _: Empty| async move { Ok::<_, ApiError>(cx.get::<ApiDocument>()?.clone()) },
    ))
}
