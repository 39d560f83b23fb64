//! The HTTP API against a real PostgreSQL: authentication, the lean IAM (a grant on one pool does not reach
//! another), stable error codes, and the CA / JoinService keys kept private on disk.

use bc_control::client::{ApiClient, ClientError};
use bc_control::config::{Roles, ServeConfig};
use bc_core::iam::Grant;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::testing::test_db;
use serde_json::json;
use std::os::unix::fs::PermissionsExt as _;

fn code(r: Result<serde_json::Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, .. }) => code,
        Err(e) => format!("transport: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_are_scoped_to_pools_and_errors_have_stable_codes() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("tenant");
    for pool in ["a", "b"] {
        store
            .ensure_pool(pool, "root", pool, true)
            .await
            .expect("pool");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServeConfig::loopback(
        dir.path().join("state"),
        "test.bc",
        Roles {
            api: true,
            ..Roles::default()
        },
    );
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start");
    let url = format!("http://{}", running.api_addr.expect("api"));

    let key = Token::generate(TokenKind::ApiKey).expect("key");
    store
        .upsert_principal(
            "ops-a",
            "root",
            "pool a operator",
            key.id(),
            &key.secret().hash(),
            &[Grant {
                permission: "compute:join-tokens:*".into(),
                scope: "pool/a".into(),
            }],
        )
        .await
        .expect("principal");
    let ops = ApiClient::new(&url, &key.reveal());
    let create = |pool: &str| json!({"pool": pool, "uses": 1});

    assert!(code(ops.call("join-tokens", "create", create("a")).await).starts_with("OK"));
    assert_eq!(
        code(ops.call("join-tokens", "create", create("b")).await),
        "ACCESS_DENIED"
    );
    assert_eq!(
        code(ops.call("join-tokens", "create", create("nope")).await),
        "ACCESS_DENIED"
    );
    assert!(code(ops.call("nodes", "list", json!({})).await).starts_with("OK"));
    assert_eq!(
        code(
            ops.call("join-tokens", "create", json!({"pool": "a", "uses": 0}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            ops.call(
                "join-tokens",
                "create",
                json!({"pool": "a", "expect": {"gpu.colour": "red"}})
            )
            .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            ops.call("join-tokens", "create", json!({"pool": "a", "bogus": 1}))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(ops.call("join-tokens", "frobnicate", json!({})).await),
        "NOT_FOUND"
    );
    let wrong = ApiClient::new(&url, &format!("{}.{}", &key.reveal()[..21], "A".repeat(43)));
    assert_eq!(
        code(wrong.call("nodes", "list", json!({})).await),
        "UNAUTHENTICATED"
    );
    let garbage = ApiClient::new(&url, "not-a-key");
    assert_eq!(
        code(garbage.call("nodes", "list", json!({})).await),
        "UNAUTHENTICATED"
    );
    // Listing shows only what the grant covers.
    let admin = ApiClient::new(
        &url,
        &bc_control::bootstrap_admin(&store).await.expect("admin"),
    );
    admin
        .call("join-tokens", "create", create("b"))
        .await
        .expect("admin creates in b");
    let listed = ops
        .call("join-tokens", "list", json!({}))
        .await
        .expect("list");
    let pools: Vec<_> = listed["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t["pool_id"].clone())
        .collect();
    assert_eq!(pools, vec![json!("a")]);

    for f in ["ca.key", "join.key"] {
        let mode = std::fs::metadata(config.state_dir.join(f))
            .expect(f)
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f} must be private");
    }
    running.shutdown().await;
}

/// An API-only control plane on a fresh database, with its administrator.
struct Api {
    store: Store,
    url: String,
    admin: ApiClient,
    running: bc_control::Running,
    _dir: tempfile::TempDir,
    _db: bc_store::testing::TestDb,
}

async fn api() -> Api {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("tenant");
    store
        .ensure_pool("a", "root", "a", true)
        .await
        .expect("pool");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServeConfig::loopback(
        dir.path().join("state"),
        "test.bc",
        Roles {
            api: true,
            ..Roles::default()
        },
    );
    let running = bc_control::start(&config, store.clone())
        .await
        .expect("start");
    let url = format!("http://{}", running.api_addr.expect("api"));
    let admin = ApiClient::new(
        &url,
        &bc_control::bootstrap_admin(&store).await.expect("admin"),
    );
    Api {
        store,
        url,
        admin,
        running,
        _dir: dir,
        _db: db,
    }
}

impl Api {
    /// A principal of `tenant` holding exactly `grants`, created directly in the store (not through the API).
    async fn principal(&self, id: &str, tenant: &str, grants: &[(&str, &str)]) -> ApiClient {
        let key = Token::generate(TokenKind::ApiKey).expect("key");
        let grants: Vec<Grant> = grants
            .iter()
            .map(|(p, s)| Grant {
                permission: p.to_string(),
                scope: s.to_string(),
            })
            .collect();
        self.store
            .upsert_principal(id, tenant, id, key.id(), &key.secret().hash(), &grants)
            .await
            .expect("principal");
        ApiClient::new(&self.url, &key.reveal())
    }
}

fn principal_body(id: &str, tenant: &str, grants: &[(&str, &str)]) -> serde_json::Value {
    let grants: Vec<_> = grants
        .iter()
        .map(|(p, s)| json!({"permission": p, "scope": s}))
        .collect();
    json!({"id": id, "tenant": tenant, "grants": grants})
}

/// Issue 10 item 7: `principals.create` hands out only what the caller's own grants cover, in the caller's tenant
/// and in the root tenant alike; a refused create leaves no principal behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_grants_only_what_its_own_grants_cover() {
    let a = api().await;
    for t in ["t", "u"] {
        a.admin
            .call("tenants", "create", json!({"id": t}))
            .await
            .expect("tenant");
    }
    // A tenant principal whose only grant is principals:create on its tenant.
    let creator = a
        .principal(
            "t-creator",
            "t",
            &[("compute:principals:create", "tenant/t")],
        )
        .await;
    // A root principal whose only grant is principals:create on the root tenant.
    let root_creator = a
        .principal(
            "root-creator",
            "root",
            &[("compute:principals:create", "tenant/root")],
        )
        .await;
    // A root principal administering tenant t (everything there) and allowed to create principals anywhere.
    let t_admin = a
        .principal(
            "t-admin",
            "root",
            &[("*", "tenant/t"), ("compute:principals:create", "*")],
        )
        .await;
    type Row<'a> = (
        &'a ApiClient,
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        &'a str,
    );
    let rows: &[Row] = &[
        (&creator, "x1", "t", &[("*", "tenant/t")], "ACCESS_DENIED"),
        (
            &creator,
            "x2",
            "t",
            &[("compute:*", "tenant/t")],
            "ACCESS_DENIED",
        ),
        (
            &creator,
            "x3",
            "t",
            &[("compute:principals:*", "tenant/t")],
            "ACCESS_DENIED",
        ),
        (
            &creator,
            "x4",
            "t",
            &[("compute:reservations:create", "tenant/t")],
            "ACCESS_DENIED",
        ),
        (
            &creator,
            "x5",
            "t",
            &[("compute:principals:create", "tenant/t"), ("*", "tenant/t")],
            "ACCESS_DENIED",
        ),
        (
            &creator,
            "x6",
            "t",
            &[("compute:principals:create", "tenant/t")],
            "OK",
        ),
        (&creator, "x7", "t", &[], "OK"),
        (&root_creator, "x8", "root", &[("*", "*")], "ACCESS_DENIED"),
        (
            &root_creator,
            "x9",
            "root",
            &[("*", "tenant/root")],
            "ACCESS_DENIED",
        ),
        (
            &root_creator,
            "x10",
            "t",
            &[("compute:principals:create", "tenant/t")],
            "ACCESS_DENIED",
        ),
        (
            &root_creator,
            "x11",
            "root",
            &[("compute:principals:create", "tenant/root")],
            "OK",
        ),
        (
            &t_admin,
            "x12",
            "t",
            &[("compute:reservations:create", "tenant/t")],
            "OK",
        ),
        (&t_admin, "x13", "t", &[("*", "tenant/t")], "OK"),
        (
            &t_admin,
            "x14",
            "u",
            &[("compute:reservations:create", "tenant/u")],
            "ACCESS_DENIED",
        ),
        (&t_admin, "x15", "root", &[("*", "*")], "ACCESS_DENIED"),
        (
            &t_admin,
            "x16",
            "root",
            &[("compute:principals:create", "*")],
            "OK",
        ),
        (
            &t_admin,
            "x17",
            "root",
            &[("compute:principals:*", "*")],
            "ACCESS_DENIED",
        ),
        (&a.admin, "x18", "root", &[("*", "*")], "OK"),
    ];
    for (caller, id, tenant, grants, want) in rows {
        let got = code(
            caller
                .call("principals", "create", principal_body(id, tenant, grants))
                .await,
        );
        assert!(
            got.starts_with(want),
            "{id}: creating in {tenant} with {grants:?}: {got}"
        );
        let exists: bool =
            bc_store::sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM principals WHERE id = $1)")
                .bind(id)
                .fetch_one(a.store.pool())
                .await
                .expect("query");
        assert_eq!(exists, *want == "OK", "{id}: principal row");
    }
    // A grant must name a permission and a scope.
    assert_eq!(
        code(
            a.admin
                .call(
                    "principals",
                    "create",
                    principal_body("bad", "t", &[("", "tenant/t")])
                )
                .await
        ),
        "INVALID_ARGUMENT"
    );
    a.running.shutdown().await;
}

/// A raw request to the API: (status, Content-Type, body as JSON or the text it was).
async fn raw(
    method: reqwest::Method,
    url: &str,
    key: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (u16, String, Result<serde_json::Value, String>) {
    let mut req = reqwest::Client::new()
        .request(method, url)
        .bearer_auth(key)
        .body(body);
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let text = resp.text().await.expect("body");
    (status, ct, serde_json::from_str(&text).map_err(|_| text))
}

/// Issue 10 item 16: what the HTTP layer refuses (malformed JSON, a wrong or missing content type, a body over
/// the limit, a wrong method, an empty body where fields are required, an unknown route) comes back as
/// `{code, message}` JSON with a stable code, like every other error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_layer_refuses_as_json_with_stable_codes() {
    let a = api().await;
    let key = a.admin.key().to_string();
    let method_url = |m: &str| format!("{}/api/compute/{m}", a.url);
    let json_ct = Some("application/json");
    let big = {
        let mut b = br#"{"pool": "a", "pad": ""#.to_vec();
        b.extend(std::iter::repeat_n(b'x', bc_control::api::MAX_BODY));
        b.extend(br#""}"#);
        b
    };
    use reqwest::Method;
    // (what, method, URL, content type, body, status, code)
    type Case<'a> = (
        &'a str,
        Method,
        String,
        Option<&'a str>,
        Vec<u8>,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "malformed JSON",
            Method::POST,
            method_url("join-tokens/create"),
            json_ct,
            b"{\"pool\": ".to_vec(),
            400,
            "INVALID_ARGUMENT",
        ),
        (
            "not an object",
            Method::POST,
            method_url("join-tokens/create"),
            json_ct,
            b"[1, 2]".to_vec(),
            400,
            "INVALID_ARGUMENT",
        ),
        (
            "wrong content type",
            Method::POST,
            method_url("join-tokens/create"),
            Some("text/plain"),
            br#"{"pool": "a"}"#.to_vec(),
            415,
            "INVALID_ARGUMENT",
        ),
        (
            "form content type (curl -d)",
            Method::POST,
            method_url("join-tokens/create"),
            Some("application/x-www-form-urlencoded"),
            br#"{"pool": "a"}"#.to_vec(),
            415,
            "INVALID_ARGUMENT",
        ),
        (
            "no content type",
            Method::POST,
            method_url("join-tokens/create"),
            None,
            br#"{"pool": "a"}"#.to_vec(),
            415,
            "INVALID_ARGUMENT",
        ),
        (
            "body over the limit",
            Method::POST,
            method_url("join-tokens/create"),
            json_ct,
            big,
            413,
            "INVALID_ARGUMENT",
        ),
        (
            "empty body where fields are required",
            Method::POST,
            method_url("join-tokens/create"),
            json_ct,
            Vec::new(),
            400,
            "INVALID_ARGUMENT",
        ),
        (
            "wrong method",
            Method::GET,
            method_url("nodes/list"),
            None,
            Vec::new(),
            405,
            "INVALID_ARGUMENT",
        ),
        (
            "wrong method on uploads",
            Method::POST,
            format!("{}/api/artifacts", a.url),
            None,
            Vec::new(),
            405,
            "INVALID_ARGUMENT",
        ),
        (
            "unknown route",
            Method::POST,
            format!("{}/api/nope", a.url),
            json_ct,
            b"{}".to_vec(),
            404,
            "NOT_FOUND",
        ),
        (
            "too many path segments",
            Method::POST,
            method_url("nodes/list/extra"),
            json_ct,
            b"{}".to_vec(),
            404,
            "NOT_FOUND",
        ),
        (
            "unknown method",
            Method::POST,
            method_url("nodes/frobnicate"),
            json_ct,
            b"{}".to_vec(),
            404,
            "NOT_FOUND",
        ),
    ];
    for (what, method, url, ct, body, status, want) in cases {
        let (got_status, got_ct, got) = raw(method, &url, &key, ct, body).await;
        let v = got.unwrap_or_else(|text| panic!("{what}: not JSON ({got_status}): {text:?}"));
        assert_eq!(got_status, status, "{what}: {v}");
        assert!(got_ct.starts_with("application/json"), "{what}: {got_ct}");
        assert_eq!(v["code"], want, "{what}: {v}");
        assert!(
            v["message"].as_str().is_some_and(|m| m.len() > 10),
            "{what}: {v}"
        );
    }
    // An empty body is the empty object, with or without a content type.
    for ct in [None, json_ct] {
        let (status, _, v) = raw(
            Method::POST,
            &method_url("nodes/list"),
            &key,
            ct,
            Vec::new(),
        )
        .await;
        assert_eq!(status, 200, "{v:?}");
        assert!(v.expect("json")["nodes"].is_array());
    }
    // A vendor +json type and a charset parameter are JSON too.
    for ct in ["application/json; charset=utf-8", "application/vnd.bc+json"] {
        let (status, _, v) = raw(
            Method::POST,
            &method_url("nodes/list"),
            &key,
            Some(ct),
            b"{}".to_vec(),
        )
        .await;
        assert_eq!(status, 200, "{ct}: {v:?}");
    }
    // Without a key nothing is read: the answer is UNAUTHENTICATED, in JSON, whatever the body.
    let (status, _, v) = raw(
        Method::POST,
        &method_url("nodes/list"),
        "",
        Some("text/plain"),
        b"x".to_vec(),
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(v.expect("json")["code"], "UNAUTHENTICATED");
    a.running.shutdown().await;
}

/// Issue 10 item 17: a NUL character in any string of any request (a value, a nested field, an object key) is
/// INVALID_ARGUMENT naming the field, before anything reaches PostgreSQL; nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_character_anywhere_is_refused_naming_the_field() {
    let a = api().await;
    a.admin
        .call("site-tokens", "create", json!({"site": "r1"}))
        .await
        .expect("site");
    let cases = [
        (
            "secrets",
            "put",
            json!({"site": "r1", "name": "bmc", "value": "pass\u{0}word"}),
            "field value ",
        ),
        (
            "join-tokens",
            "create",
            json!({"pool": "a\u{0}"}),
            "field pool ",
        ),
        (
            "principals",
            "create",
            json!({"id": "p1", "tenant": "root",
                   "grants": [{"permission": "*", "scope": "*"}, {"permission": "*", "scope": "pool/\u{0}"}]}),
            "field grants[1].scope ",
        ),
        (
            "machines",
            "create",
            json!({"mac": "52:54:00:00:00:01", "site": "r1", "boot": {"kernel": "k", "cmdline": "a\u{0}"}}),
            "field boot.cmdline ",
        ),
        (
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 60, "idempotency_key": "k\u{0}"}),
            "field idempotency_key ",
        ),
        (
            "nodes",
            "command",
            json!({"node_id": "n", "kind": "x", "args": {"k\u{0}ey": 1}}),
            "field name \"args.k",
        ),
    ];
    for (group, method, body, names) in cases {
        match a.admin.call(group, method, body.clone()).await {
            Err(ClientError::Api { code, message }) => {
                assert_eq!(code, "INVALID_ARGUMENT", "{group}.{method}: {message}");
                assert!(
                    message.contains(names) && message.contains("NUL"),
                    "{group}.{method}: {message}"
                );
            }
            other => panic!("{group}.{method} {body}: {other:?}"),
        }
    }
    let (secrets, principals, machines): (i64, i64, i64) = bc_store::sqlx::query_as(
        "SELECT (SELECT count(*) FROM secrets), (SELECT count(*) FROM principals WHERE id = 'p1'), \
         (SELECT count(*) FROM machines)",
    )
    .fetch_one(a.store.pool())
    .await
    .expect("counts");
    assert_eq!((secrets, principals, machines), (0, 0, 0));
    a.running.shutdown().await;
}
