//! The in-process API against a real PostgreSQL: `build()` does no I/O (a control plane builds against a database
//! that cannot be reached, and `initialize` then answers UNAVAILABLE), and a plugin defined only in this test adds a
//! group, a method and a reconciler through the public API, answers over HTTP and runs in its role only.

use bc_control::backend::StoreBackend;
use bc_kernel::{
    ApiCode, ApiError, ControlPlane, Cx, Method, Module, Options, Reconciler, RoleSet, StepCx, Tick,
};
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::sqlx;
use bc_store::testing::test_db;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Debug, Serialize, Deserialize, bc_kernel::schemars::JsonSchema)]
#[schemars(crate = "bc_kernel::schemars")]
#[serde(deny_unknown_fields)]
struct Hello {
    name: String,
}

#[derive(Debug, Serialize, Deserialize, bc_kernel::schemars::JsonSchema)]
#[schemars(crate = "bc_kernel::schemars")]
struct Greeting {
    text: String,
    caller: String,
    principals: i64,
}

bc_kernel::api_method!(SayHello = "greeter" / "hello": Hello => Greeting);

/// What the plugin's reconciler saw: how many steps ran, and how many shards it held on the last one.
#[derive(Default)]
struct Seen {
    steps: AtomicUsize,
    shards: AtomicUsize,
}

async fn hello(cx: Cx, req: Hello) -> Result<Greeting, ApiError> {
    let store = cx.get::<Store>()?;
    let principals: i64 = sqlx::query_scalar("SELECT count(*) FROM principals")
        .fetch_one(store.pool())
        .await
        .map_err(|e| ApiError::unavailable("counting principals failed").with_source(e))?;
    Ok(Greeting {
        text: format!("hello {}", req.name),
        caller: cx.caller().id.clone(),
        principals,
    })
}

fn greeter() -> Module {
    Module::new("greeter")
        .method(
            Method::<SayHello>::new()
                .permission("compute:greeter:hello")
                .scope_from_request("greeter/<name>", |r: &Hello| format!("greeter/{}", r.name))
                .handler(hello),
        )
        .reconciler(
            Reconciler::new("count")
                .role("scheduler")
                .shard_scoped()
                .tick(Tick::Every(Duration::from_millis(100)))
                .step(|cx: StepCx| async move {
                    let seen = cx.resources.require::<Seen>()?;
                    seen.shards.store(cx.leases.len(), Ordering::SeqCst);
                    seen.steps.fetch_add(1, Ordering::SeqCst);
                    Ok::<(), ApiError>(())
                }),
        )
}

fn options() -> Options {
    let mut o = Options::new("kernel-test");
    o.shard_lease = Duration::from_secs(2);
    o
}

#[tokio::test]
async fn build_does_no_io_and_initialize_says_the_database_is_unavailable() {
    // Port 1 on loopback: nothing listens, so every connection is refused.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy("postgres://bc@127.0.0.1:1/absent")
        .expect("a lazy pool connects to nothing");
    let plane = ControlPlane::builder(options())
        .plugin(greeter())
        .build()
        .expect("build() succeeds without a database");
    let started = std::time::Instant::now();
    let e = match plane.initialize(StoreBackend::new(Store::new(pool))).await {
        Ok(_) => panic!("initialize succeeded without a database"),
        Err(e) => e,
    };
    assert_eq!(e.code(), ApiCode::Unavailable, "{e}");
    assert!(e.message().contains("database cannot be reached"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "initialize waited {:?}",
        started.elapsed()
    );
}

async fn post(http: &reqwest::Client, url: &str, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut req = http.post(url).json(&body);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("JSON answer"))
}

/// A principal holding `compute:greeter:hello` on `greeter/alice` only; returns its API key.
async fn alice_only(store: &Store) -> String {
    let key = Token::generate(TokenKind::ApiKey).expect("key");
    let grant = bc_core::iam::Grant {
        permission: "compute:greeter:hello".into(),
        scope: "greeter/alice".into(),
    };
    store
        .upsert_principal(
            "alice-greeter",
            bc_store::iam::ROOT_TENANT,
            "alice's greeter",
            key.id(),
            &key.secret().hash(),
            &[grant],
        )
        .await
        .expect("principal");
    key.reveal()
}

async fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_test_plugin_answers_over_http_and_runs_in_its_role() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    let admin = bc_control::bootstrap_admin(&store).await.expect("admin");
    let alice = alice_only(&store).await;
    let plane = ControlPlane::builder(options())
        .resource(Seen::default())
        .plugin(greeter())
        .build()
        .expect("build");
    let init = plane
        .initialize(StoreBackend::new(store.clone()))
        .await
        .expect("initialize");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!(
        "http://{}/api/compute",
        listener.local_addr().expect("addr")
    );
    let router = init.router();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let http = reqwest::Client::new();
    let url = format!("{base}/greeter/hello");

    let (status, v) = post(&http, &url, Some(&admin), json!({"name": "alice"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["text"], "hello alice");
    assert_eq!(v["caller"], "admin");
    assert_eq!(
        v["principals"], 2,
        "the handler read the real database: {v}"
    );

    // The method's permission is checked on the scope computed from the request, before the handler runs.
    let (status, v) = post(&http, &url, Some(&alice), json!({"name": "alice"})).await;
    assert_eq!(
        (status, v["text"].as_str()),
        (200, Some("hello alice")),
        "{v}"
    );
    let (status, v) = post(&http, &url, Some(&alice), json!({"name": "bob"})).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (403, Some("ACCESS_DENIED")),
        "{v}"
    );
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("compute:greeter:hello on greeter/bob")),
        "{v}"
    );
    let (status, v) = post(&http, &url, None, json!({"name": "alice"})).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (401, Some("UNAUTHENTICATED")),
        "{v}"
    );
    let (status, v) = post(
        &http,
        &url,
        Some(&admin),
        json!({"name": "alice", "extra": 1}),
    )
    .await;
    assert_eq!(
        (status, v["code"].as_str()),
        (400, Some("INVALID_ARGUMENT")),
        "{v}"
    );

    // The API document lists the plugin's method with its permission and scope.
    let (status, v) = post(
        &http,
        &format!("{base}/system/methods"),
        Some(&alice),
        json!({}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let listed = v["methods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["group"] == "greeter");
    assert_eq!(
        listed,
        Some(
            &json!({"module": "greeter", "group": "greeter", "method": "hello",
            "permission": "compute:greeter:hello", "scope": "greeter/<name>",
            "request": "Hello", "response": "Greeting"})
        ),
        "{v}"
    );

    // In a process without the scheduler role the reconciler never runs.
    let seen = init.resources().get_arc::<Seen>().expect("seen");
    let mut running = init.start(&RoleSet::parse("api,gateway").expect("roles"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    running.stop().await;
    assert_eq!(seen.steps.load(Ordering::SeqCst), 0, "ran outside its role");
    assert!(
        store
            .shard_leases("scheduler")
            .await
            .expect("leases")
            .is_empty()
    );

    // In the scheduler role it runs on the shards it leases: all 256, this process being the only scheduler.
    let mut running = init.start(&RoleSet::parse("scheduler").expect("roles"));
    wait_for("the reconciler's steps on every shard", || {
        seen.steps.load(Ordering::SeqCst) >= 3 && seen.shards.load(Ordering::SeqCst) == 256
    })
    .await;
    let leases = store.shard_leases("scheduler").await.expect("leases");
    assert_eq!(
        leases
            .iter()
            .filter(|(_, owner, _, valid)| owner == "kernel-test" && *valid)
            .count(),
        256
    );
    running.stop().await;
    // Stopping leaves the role: its leases expire at once for the next scheduler.
    let leases = store.shard_leases("scheduler").await.expect("leases");
    assert!(leases.iter().all(|(_, _, _, valid)| !valid), "{leases:?}");
    server.abort();
}

/// The database primary goes silent (no reset) while a caller's API key is looked up, and the pool moves to
/// another primary: the request is answered UNAVAILABLE at the move, saying to retry, not at the methods' 60 s
/// deadline. Before, the lookup was bounded by the deadline only, so it held its pooled connection, and with enough
/// of them every later call waited out the pool's acquire timeout (`BC_FAILOVER_FAILURE=hang scripts/bench
/// failover`: a command queued after the hang was done 10.4 s after it, 5.0 s with the cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_looked_up_when_the_primary_moves_is_answered_unavailable_at_the_move() {
    bc_proto::install_crypto_provider();
    let primary = bc_store::testing::SilentPrimary::start(4).await;
    let admin = bc_control::bootstrap_admin(&Store::new(primary.db.pool.clone()))
        .await
        .expect("admin");
    let plane = ControlPlane::builder(options())
        .plugin(greeter())
        .build()
        .expect("build");
    let init = plane
        .initialize(StoreBackend::new(primary.store.clone()))
        .await
        .expect("initialize");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/api/compute/greeter/hello",
        listener.local_addr().expect("addr")
    );
    let router = init.router();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    // Every connection open now goes silent; the admin's key was never looked up, so its lookup reads the database.
    primary.silence();
    let http = reqwest::Client::new();
    let request = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let answer = post(&http, &url, Some(&admin), json!({"name": "alice"})).await;
        (answer, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !request.is_finished(),
        "the lookup answered through a silent database"
    );
    primary.move_primary();
    let ((status, v), waited) = tokio::time::timeout(Duration::from_secs(5), request)
        .await
        .expect("answered at the move, not at the methods' deadline")
        .expect("request task");
    assert_eq!(
        (status, v["code"].as_str()),
        (503, Some("UNAVAILABLE")),
        "{v}"
    );
    assert!(
        v["message"].as_str().is_some_and(|m| m
            .starts_with("authenticating the caller was cut short: the database primary moved")
            && m.ends_with("retry")),
        "{v}"
    );
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    server.abort();
}
