//! `ControlPlane::builder(..).build()` is pure and refuses a bad registry with INVALID_CONFIG naming the module (or
//! option) and the item: a bad option, a duplicate method, a method without a permission, a reconciler on an
//! unknown role, a missing dependency. No database is involved: `build()` does no I/O.

use bc_kernel::{
    ApiCode, ApiError, ControlPlane, Cx, InvalidConfig, Method, Module, Options, Reconciler,
    RoleSet, Scope, StepCx,
};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Serialize, Deserialize, bc_kernel::schemars::JsonSchema)]
#[schemars(crate = "bc_kernel::schemars")]
struct Ping {
    n: u32,
}

#[derive(Debug, Serialize, Deserialize, bc_kernel::schemars::JsonSchema)]
#[schemars(crate = "bc_kernel::schemars")]
struct Pong {
    n: u32,
}

bc_kernel::api_method!(PingMethod = "demo" / "ping": Ping => Pong);

async fn ping(_cx: Cx, req: Ping) -> Result<Pong, ApiError> {
    Ok(Pong { n: req.n + 1 })
}

fn ping_method() -> Method<PingMethod> {
    Method::<PingMethod>::new()
        .permission("compute:demo:ping")
        .scope(Scope::fixed("demo/*"))
        .handler(ping)
}

#[derive(Debug, thiserror::Error)]
#[error("never")]
struct Never;

fn reconciler(role: &str) -> Reconciler {
    Reconciler::new("tidy")
        .role(role)
        .tick(bc_kernel::Tick::Every(Duration::from_secs(1)))
        .step(|_cx: StepCx| async { Ok::<(), Never>(()) })
}

fn options() -> Options {
    Options::new("test-worker")
}

fn refused(result: Result<ControlPlane, InvalidConfig>) -> InvalidConfig {
    match result {
        Ok(plane) => panic!("build() accepted it: modules {:?}", plane.module_names()),
        Err(e) => {
            assert_eq!(e.code(), ApiCode::InvalidConfig);
            assert!(e.to_string().starts_with("INVALID_CONFIG: "), "{e}");
            e
        }
    }
}

#[test]
fn a_well_formed_registry_builds_and_lists_its_methods() {
    let plane = ControlPlane::builder(options())
        .module(
            Module::new("demo")
                .method(ping_method())
                .reconciler(reconciler("controllers")),
        )
        .build()
        .expect("build");
    assert_eq!(plane.module_names(), vec!["system", "demo"]);
    let methods: Vec<String> = plane
        .methods()
        .iter()
        .map(|m| format!("{}.{}", m.group, m.method))
        .collect();
    assert_eq!(methods, vec!["system.methods", "demo.ping"]);
}

#[test]
fn a_bad_option_is_invalid_config_naming_it() {
    let mut o = options();
    o.shard_lease = Duration::from_millis(10);
    let e = refused(ControlPlane::builder(o).build());
    assert_eq!(e.field, "shard_lease");
    assert!(e.reason.contains("500 ms"), "{e}");

    let e = refused(ControlPlane::builder(Options::new("a/b")).build());
    assert_eq!(e.field, "worker_id");

    // A module's own option, refused by its constructor, reaches build() unchanged.
    let bad: Result<Module, InvalidConfig> = Err(InvalidConfig::new(
        "plugin demo: interval",
        "must be at least 1 s (got 0 s)",
    ));
    let e = refused(ControlPlane::builder(options()).plugin(bad).build());
    assert_eq!(e.field, "plugin demo: interval");
}

#[test]
fn a_duplicate_method_is_refused_naming_the_module_and_the_method() {
    let e = refused(
        ControlPlane::builder(options())
            .module(Module::new("demo").method(ping_method()))
            .plugin(Module::new("copycat").method(ping_method()))
            .build(),
    );
    assert_eq!(e.field, "plugin copycat");
    assert!(
        e.reason.contains("demo.ping") && e.reason.contains("first by demo"),
        "{e}"
    );

    // The kernel's own methods are taken too.
    bc_kernel::api_method!(Shadow = "system" / "methods": Ping => Pong);
    let e =
        refused(
            ControlPlane::builder(options())
                .module(
                    Module::new("shadow").method(Method::<Shadow>::new().any_caller().handler(
                        |_cx: Cx, r: Ping| async move { Ok::<_, ApiError>(Pong { n: r.n }) },
                    )),
                )
                .build(),
        );
    assert_eq!(e.field, "module shadow");
    assert!(
        e.reason.contains("system.methods") && e.reason.contains("first by system"),
        "{e}"
    );
}

#[test]
fn a_method_without_a_permission_is_refused_naming_it() {
    let e = refused(
        ControlPlane::builder(options())
            .module(
                Module::new("demo").method(
                    Method::<PingMethod>::new()
                        .scope(Scope::fixed("demo/*"))
                        .handler(ping),
                ),
            )
            .build(),
    );
    assert_eq!(e.field, "module demo");
    assert!(e.reason.contains("demo.ping has no permission"), "{e}");

    // A permission without a scope is refused too (only any_caller needs none).
    let e = refused(
        ControlPlane::builder(options())
            .module(
                Module::new("demo").method(
                    Method::<PingMethod>::new()
                        .permission("compute:demo:ping")
                        .handler(ping),
                ),
            )
            .build(),
    );
    assert!(e.reason.contains("demo.ping has no scope"), "{e}");
}

#[test]
fn a_reconciler_on_an_unknown_role_is_refused_naming_it() {
    let e = refused(
        ControlPlane::builder(options())
            .plugin(Module::new("demo").reconciler(reconciler("janitors")))
            .build(),
    );
    assert_eq!(e.field, "plugin demo");
    assert!(
        e.reason.contains("reconciler tidy") && e.reason.contains("\"janitors\""),
        "{e}"
    );
    assert!(
        e.reason.contains("controllers"),
        "the known roles are listed: {e}"
    );

    let e = refused(
        ControlPlane::builder(options())
            .module(Module::new("demo").reconciler(Reconciler::new("idle").role("controllers")))
            .build(),
    );
    assert!(
        e.reason.contains("reconciler idle has nothing to run"),
        "{e}"
    );
}

#[test]
fn a_missing_or_circular_dependency_is_refused_naming_it() {
    let e = refused(
        ControlPlane::builder(options())
            .module(Module::new("nodes").depends_on("inventory"))
            .build(),
    );
    assert_eq!(e.field, "module nodes");
    assert!(e.reason.contains("depends on module inventory"), "{e}");

    let e = refused(
        ControlPlane::builder(options())
            .module(Module::new("a").depends_on("b"))
            .module(Module::new("b").depends_on("a"))
            .build(),
    );
    assert!(e.reason.contains("cycle"), "{e}");
}

#[test]
fn dependencies_start_first_and_plugins_after_modules() {
    let plane = ControlPlane::builder(options())
        .plugin(Module::new("extra"))
        .module(Module::new("nodes").depends_on("inventory"))
        .module(Module::new("inventory"))
        .build()
        .expect("build");
    assert_eq!(
        plane.module_names(),
        vec!["system", "inventory", "nodes", "extra"]
    );
}

#[test]
fn duplicate_modules_and_bad_names_are_refused() {
    let e = refused(
        ControlPlane::builder(options())
            .module(Module::new("demo"))
            .plugin(Module::new("demo"))
            .build(),
    );
    assert_eq!(e.field, "plugin demo");
    assert!(e.reason.contains("registered twice"), "{e}");
    let e = refused(
        ControlPlane::builder(options())
            .module(Module::new("Demo"))
            .build(),
    );
    assert_eq!(e.field, "module Demo");
}

#[test]
fn roles_parse_and_refuse_an_unknown_one() {
    let r = RoleSet::parse("api, gateway").expect("roles");
    assert!(r.contains("api") && r.contains("gateway") && !r.contains("scheduler"));
    assert!(RoleSet::parse("all").expect("all").contains("sinks"));
    let e = RoleSet::parse("api,janitors").expect_err("unknown role");
    assert_eq!(e.field, "roles");
    assert!(e.reason.contains("janitors"), "{e}");
}

#[test]
fn a_module_route_on_a_kernel_path_is_refused_and_the_document_lists_what_is_registered() {
    for path in bc_kernel::KERNEL_PATHS {
        let route = bc_kernel::Route::new(path, "GET", axum::routing::get(|| async { "mine" }))
            .permission("compute:demo:read");
        let e = refused(
            ControlPlane::builder(options())
                .module(Module::new("demo").route(route))
                .build(),
        );
        assert!(e.reason.contains("is the kernel's"), "{path}: {e}");
    }
    // The document is built from the registry, with no I/O: the method with its schemas, permission and scope.
    let plane = ControlPlane::builder(options())
        .module(Module::new("demo").method(ping_method()))
        .build()
        .expect("build");
    let doc = plane.openapi();
    assert_eq!(doc["openapi"], "3.1.0");
    let op = &doc["paths"]["/api/compute/demo/ping"]["post"];
    assert_eq!(op["x-permission"], "compute:demo:ping");
    assert_eq!(op["x-scope"], "demo/*");
    assert_eq!(op["x-scope-check"], "fixed");
    assert_eq!(
        op["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/Ping"
    );
    assert_eq!(
        doc["components"]["schemas"]["Pong"]["properties"]["n"]["type"],
        "integer"
    );
    for path in bc_kernel::KERNEL_PATHS {
        assert!(doc["paths"][path]["get"].is_object(), "{path}");
    }
    assert!(
        doc["paths"]["/api/compute/system/methods"]["post"]["responses"]
            .get("403")
            .is_none(),
        "a method any caller may call cannot answer ACCESS_DENIED"
    );
}
