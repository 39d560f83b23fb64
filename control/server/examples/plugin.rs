//! A control plane with a module of its own, built through the in-process API (docs/control-plane.md):
//!
//! ```text
//! better-compute dev &                     # prints its database URL and admin key (also in <data>/dev.env)
//! BC_DATABASE_URL=postgres://… cargo run -p bc-control --example plugin
//! curl -s -H "Authorization: Bearer $BC_API_KEY" -H 'Content-Type: application/json' \
//!      -d '{"name":"world"}' http://127.0.0.1:<port>/api/compute/hello/greet
//! ```
//!
//! It serves only its own `hello.greet` and the kernel's `system.methods`, and runs a reconciler in the `scheduler`
//! role that logs how many shards it leases.

use bc_control::backend::StoreBackend;
use bc_kernel::{
    ApiError, ControlPlane, Cx, Method, Module, Options, Reconciler, RoleSet, Scope, StepCx, Tick,
};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Serialize, Deserialize, bc_kernel::schemars::JsonSchema)]
#[schemars(crate = "bc_kernel::schemars")]
#[serde(deny_unknown_fields)]
struct Greet {
    name: String,
}

#[derive(Debug, Serialize, Deserialize, bc_kernel::schemars::JsonSchema)]
#[schemars(crate = "bc_kernel::schemars")]
struct Greeting {
    text: String,
}

bc_kernel::api_method!(GreetMethod = "hello" / "greet": Greet => Greeting);

fn hello_module() -> Module {
    Module::new("hello")
        .method(
            Method::<GreetMethod>::new()
                .permission("compute:hello:greet")
                .scope(Scope::fixed("hello"))
                .handler(|cx: Cx, req: Greet| async move {
                    Ok::<_, ApiError>(Greeting {
                        text: format!("hello {}, from {}", req.name, cx.caller().id),
                    })
                }),
        )
        .reconciler(
            Reconciler::new("shards")
                .role("scheduler")
                .shard_scoped()
                .tick(Tick::Every(Duration::from_secs(5)))
                .step(|cx: StepCx| async move {
                    println!("{} leases {} shards", cx.worker.id, cx.leases.len());
                    Ok::<(), ApiError>(())
                }),
        )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("BC_DATABASE_URL")
        .map_err(|_| anyhow::anyhow!("set BC_DATABASE_URL (better-compute dev prints one)"))?;
    // Lazy: nothing connects before initialize.
    let pool = bc_store::sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&url)?;
    let mut options = Options::new(format!("example-{}", std::process::id()));
    options.migrate = false; // verify the schema `better-compute migrate` applied; never change it from here
    let plane = ControlPlane::builder(options)
        .plugin(hello_module())
        .build()?;
    let initialized = plane
        .initialize(StoreBackend::new(bc_store::Store::new(pool)))
        .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!(
        "serving http://{}/api/compute/hello/greet",
        listener.local_addr()?
    );
    let mut running = initialized.start(&RoleSet::parse("api,scheduler")?);
    bc_kernel::serve::serve(listener, initialized.router(), async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await;
    running.stop().await;
    Ok(())
}
