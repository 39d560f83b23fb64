//! The fleet page (`GET /fleet`) in Debian's headless chromium against a demo-like fleet: a real control plane
//! (all roles, fresh PostgreSQL), a real `bcd run` with four fixture GPUs (adopted, online), two more joined nodes
//! that never connect and one revoked, reservations placed, released and pending, and metal machines enrolled, in
//! flight and failed. The page is signed in with a key that holds only `compute:fleet:read`; the test reads the
//! counts and tables off the page and checks them against the API (`nodes.list`, `reservations.list`,
//! `metal.list`), sees the page refresh itself after a change, the key stay out of the URL and cookies, nothing
//! load from elsewhere, a wrong key refused, and the headers (a strict Content-Security-Policy). Screenshots of each
//! view go to docs/fleet/ with `BC_UPDATE_GOLDEN=1` (else to a temporary directory). Without chromium the test
//! prints `SKIP: …`.

mod common;

use bc_testkit::browser::Browser;
use common::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The page's count cards as `card → (label → value)`, with `total` for each card's big number.
const COUNTS: &str = "const out = {};
    for (const c of document.querySelectorAll('[data-card]')) {
      const m = { total: Number(c.querySelector('.big').textContent) };
      for (const dd of c.querySelectorAll('dd[data-count]')) m[dd.dataset.count] = Number(dd.textContent);
      out[c.dataset.card] = m;
    }
    return out;";

fn by<'a>(items: &'a [Value], key: impl Fn(&'a Value) -> String) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for i in items {
        *m.entry(key(i)).or_default() += 1;
    }
    m
}

fn rows(page: &Value, id: &str) -> usize {
    page[id].as_u64().unwrap_or(u64::MAX) as usize
}

/// The demo-like fleet: a control plane with all roles, a real `bcd run` (4 fixture GPUs, adopted), two nodes that
/// joined and never connected, one revoked; reservations placed (1 + 2 GPUs), released and failed; three metal
/// machines of site `rack-7`: one enrolled, one inspecting (waiting for its BMC), one aborted.
async fn demo_fleet() -> Result<(Plane, tokio::process::Child), Box<dyn std::error::Error>> {
    let p = plane_with_config(
        Options {
            controllers: true,
            fast: true,
            leaf_lifetime: None,
        },
        |_| {},
    )
    .await;

    // Nodes: one running bcd (adopted, 4 fixture GPUs), two that joined and never connected, one revoked.
    let token = p.token(json!({"pool": "default", "uses": 4})).await;
    let name = "gpu-a1";
    let node_id = join(&p, name, &token, claims(name, 4))
        .await?
        .identity
        .node_id;
    let fixture = p.dir.path().join(format!("{name}-gpus.json"));
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(4, name))?;
    let hw = p.dir.path().join(format!("{name}-hw"));
    fake_hardware(&hw, name)?;
    let daemon = bcd_run(
        Path::new(env!("CARGO_BIN_EXE_bcd")),
        &p,
        &p.dir.path().join(name),
        &fixture,
        &hw,
    )
    .arg("--cdi-dir")
    .arg(p.dir.path().join("cdi"))
    .kill_on_drop(true)
    .spawn()?;
    for other in ["gpu-b1", "gpu-b2", "gpu-old"] {
        join(&p, other, &token, claims(other, 8)).await?;
    }
    let old = p.admin.call("nodes", "list", json!({})).await?["nodes"]
        .as_array()
        .and_then(|n| {
            n.iter()
                .find(|n| n["claims"]["hostname"] == "gpu-old")
                .cloned()
        })
        .ok_or("gpu-old not listed")?;
    p.admin
        .call("nodes", "revoke", json!({"id": old["id"]}))
        .await?;
    wait_node(&p, &node_id, 60, "adoption", |n| n.state == "adopted").await;

    // Reservations: two placed (1 + 2 GPUs), one released, one that cannot be placed (failed).
    let reserve = |k: &str, gpus: u32| json!({"tenant": "root", "gpus": gpus, "duration_s": 3600, "idempotency_key": k});
    let mut placed = Vec::new();
    for (k, gpus) in [("r1", 1), ("r2", 2), ("r3", 1)] {
        let r = p
            .admin
            .call("reservations", "create", reserve(k, gpus))
            .await?;
        assert_eq!(r["reservation"]["state"], "placed", "{r}");
        placed.push(r["reservation"]["id"].clone());
    }
    p.admin
        .call("reservations", "release", json!({"id": placed[2]}))
        .await?;
    // More GPUs than any node has: refused, and the reservation stays as failed with its error.
    let big = p
        .admin
        .call("reservations", "create", reserve("r-big", 64))
        .await;
    assert!(big.is_err(), "{big:?}");

    // Metal: three machines of a site; two inspected (waiting for the BMC: in flight), one of those aborted.
    p.admin
        .call(
            "site-tokens",
            "create",
            json!({"site": "rack-7", "uses": 1}),
        )
        .await?;
    let bmc = json!({"address": "http://127.0.0.1:1", "credentials": "bmc/rack-7"});
    for mac in [
        "52:54:00:07:00:01",
        "52:54:00:07:00:02",
        "52:54:00:07:00:03",
    ] {
        p.admin
            .call(
                "metal",
                "enroll",
                json!({"site": "rack-7", "mac": mac, "bmc": bmc}),
            )
            .await?;
    }
    for mac in ["52:54:00:07:00:02", "52:54:00:07:00:03"] {
        p.admin
            .call("metal", "inspect", json!({"mac": mac}))
            .await?;
    }
    p.admin
        .call("metal", "abort", json!({"mac": "52:54:00:07:00:03"}))
        .await?;

    Ok((p, daemon))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_page_shows_what_the_api_says() -> TestResult {
    if let Some(why) = bc_testkit::browser::missing() {
        bc_testkit::skip!("{why}");
    }
    let (p, _daemon) = demo_fleet().await?;
    let api = format!("http://{}", p.running.api_addr.ok_or("api")?);
    let reserve = |k: &str, gpus: u32| json!({"tenant": "root", "gpus": gpus, "duration_s": 3600, "idempotency_key": k});

    // A principal that may read the fleet page and nothing else.
    let key = bc_proto::token::Token::generate(bc_proto::token::TokenKind::ApiKey)?;
    p.store
        .upsert_principal(
            "viewer",
            "root",
            "fleet page viewer",
            key.id(),
            &key.secret().hash(),
            &[bc_core::iam::Grant {
                permission: "compute:fleet:read".into(),
                scope: "fleet".into(),
            }],
        )
        .await?;
    let viewer = bc_control::client::ApiClient::new(&api, &key.reveal());
    assert!(
        viewer
            .call("nodes", "list", json!({}))
            .await
            .is_ok_and(|v| v["nodes"] == json!([])),
        "the viewer's key lists no node: it holds no compute:nodes:list"
    );

    // The page's own headers.
    let page = reqwest::get(format!("{api}/fleet")).await?;
    let csp = page
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert_eq!(csp, bc_control::fleet::CSP);
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    assert_eq!(
        page.headers()
            .get("x-content-type-options")
            .map(|v| v.as_bytes()),
        Some(&b"nosniff"[..])
    );

    let shots: PathBuf =
        if std::env::var_os("BC_UPDATE_GOLDEN").is_some_and(|v| !v.is_empty() && v != "0") {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/fleet")
        } else {
            p.dir.path().join("shots")
        };
    std::fs::create_dir_all(&shots)?;
    let browser = Browser::start(1400, 900).await?;
    let shoot = |file: &'static str| {
        let (browser, shots) = (&browser, shots.clone());
        async move {
            let png = browser.screenshot().await?;
            assert!(png.starts_with(b"\x89PNG"), "{file} is not a PNG");
            std::fs::write(shots.join(file), png)?;
            Ok::<_, Box<dyn std::error::Error>>(())
        }
    };

    // A wrong key is refused on the page, saying why.
    browser.open(&format!("{api}/fleet")).await?;
    browser
        .wait_for("return !document.getElementById('sign-in').hidden", 30)
        .await?;
    browser.type_into("#key", "bcak_nope.nope").await?;
    browser.click("#key-form button[type=submit]").await?;
    let said = browser
        .wait_for(
            "const t = document.getElementById('sign-in-error').textContent; return t || null;",
            30,
        )
        .await?;
    assert!(
        said.as_str()
            .unwrap_or_default()
            .starts_with("UNAUTHENTICATED"),
        "{said}"
    );
    shoot("sign-in.png").await?;

    // Signed in with the viewer's key.
    browser.type_into("#key", &key.reveal()).await?;
    browser.click("#key-form button[type=submit]").await?;
    browser
        .wait_for("return document.body.dataset.loaded || null", 30)
        .await?;
    let href = browser.eval("return location.href").await?;
    assert_eq!(
        href,
        json!(format!("{api}/fleet")),
        "the key stays out of the URL"
    );
    assert_eq!(browser.eval("return document.cookie").await?, json!(""));
    let loaded = browser
        .eval("return performance.getEntriesByType('resource').map(e => e.name)")
        .await?;
    for r in loaded.as_array().ok_or("resources")? {
        assert!(
            r.as_str().unwrap_or_default().starts_with(&api),
            "the page loaded {r} from elsewhere"
        );
    }

    // The counts against the API.
    let nodes = p.admin.call("nodes", "list", json!({})).await?["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let reservations = p.admin.call("reservations", "list", json!({})).await?["reservations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let machines = p.admin.call("metal", "list", json!({})).await?["machines"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let counts = browser.eval(COUNTS).await?;
    let node_states = by(&nodes, |n| n["state"].as_str().unwrap_or("?").to_string());
    assert_eq!(counts["nodes"]["total"], json!(nodes.len()), "{counts}");
    for (state, n) in &node_states {
        assert_eq!(counts["nodes"][state], json!(n), "nodes {state}: {counts}");
    }
    let online = nodes
        .iter()
        .filter(|n| n["online"] == true && n["state"] != "revoked")
        .count();
    assert_eq!(counts["nodes"]["online"], json!(online), "{counts}");
    let res_states = by(&reservations, |r| {
        r["state"].as_str().unwrap_or("?").to_string()
    });
    assert_eq!(counts["reservations"]["total"], json!(reservations.len()));
    for (state, n) in &res_states {
        assert_eq!(
            counts["reservations"][state],
            json!(n),
            "reservations {state}: {counts}"
        );
    }
    let booked: u64 = reservations
        .iter()
        .filter(|r| r["state"] == "placed")
        .map(|r| r["request"]["gpus"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(booked, 3);
    assert_eq!(counts["gpus"]["booked"], json!(booked), "{counts}");
    assert_eq!(
        counts["gpus"]["total"],
        json!(4),
        "the running node's 4 GPUs: {counts}"
    );
    assert_eq!(counts["gpus"]["free"], json!(4 - booked), "{counts}");
    let phase = |m: &Value| match m["state"]["state"].as_str() {
        Some("failed") => "failed".to_string(),
        _ => m["state"]["phase"].as_str().unwrap_or("?").to_string(),
    };
    let machine_phases = by(&machines, phase);
    assert_eq!(counts["machines"]["total"], json!(machines.len()));
    for (ph, n) in &machine_phases {
        assert_eq!(counts["machines"][ph], json!(n), "machines {ph}: {counts}");
    }
    assert_eq!(machine_phases.get("failed"), Some(&1), "{machine_phases:?}");

    // The tables: listed nodes (revoked ones are counted only), machines in flight, failures.
    let table = "return { nodes: document.querySelectorAll('#nodes tr:not(:has(.empty))').length,
        flying: document.querySelectorAll('#in-flight tr:not(:has(.empty))').length,
        failures: document.querySelectorAll('#failures tr:not(:has(.empty))').length,
        failure_text: document.getElementById('failures').textContent,
        flying_text: document.getElementById('in-flight').textContent,
        nodes_text: document.getElementById('nodes').textContent }";
    let t = browser.eval(table).await?;
    assert_eq!(
        rows(&t, "nodes"),
        nodes.iter().filter(|n| n["state"] != "revoked").count(),
        "{t}"
    );
    let waiting = machines
        .iter()
        .filter(|m| m["state"]["state"] == "active" && m["state"]["phase"] == "inspecting")
        .count();
    assert_eq!((rows(&t, "flying"), waiting), (1, 1), "{t}");
    assert!(
        t["flying_text"]
            .as_str()
            .unwrap_or_default()
            .contains("52:54:00:07:00:02"),
        "{t}"
    );
    assert!(
        t["nodes_text"]
            .as_str()
            .unwrap_or_default()
            .contains("gpu-a1"),
        "{t}"
    );
    let failures = t["failure_text"].as_str().unwrap_or_default();
    assert!(
        failures.contains("aborted by the operator during inspecting"),
        "{t}"
    );
    assert!(
        failures.contains("no capacity"),
        "the failed reservation's error: {t}"
    );
    assert!(rows(&t, "failures") >= 1, "{t}");
    shoot("nodes.png").await?;
    browser.click("[data-view=in-flight]").await?;
    browser
        .wait_for(
            "return !document.getElementById('view-in-flight').hidden",
            10,
        )
        .await?;
    shoot("in-flight.png").await?;
    browser.click("[data-view=failures]").await?;
    browser
        .wait_for(
            "return !document.getElementById('view-failures').hidden",
            10,
        )
        .await?;
    shoot("failures.png").await?;

    // It refreshes by itself: a new booking shows within two refreshes.
    p.admin
        .call("reservations", "create", reserve("r4", 1))
        .await?;
    browser
        .wait_for(
            "return document.querySelector('[data-card=gpus] dd[data-count=booked]').textContent === '4' || null",
            15,
        )
        .await?;

    // Signing out forgets the key.
    browser.click("#sign-out").await?;
    assert_eq!(
        browser.eval("return sessionStorage.length").await?,
        json!(0)
    );
    assert_eq!(
        browser
            .eval("return document.getElementById('sign-in').hidden")
            .await?,
        json!(false)
    );
    browser.close().await?;
    Ok(())
}

/// Checks each `(schema, answer)` against docs/openapi.json with the OpenAPI 3.1 schema validator (PyPI's
/// openapi-schema-validator, `.venv-openapi`); returns what it refused.
const VALIDATE: &str = r##"
import json, sys
from openapi_schema_validator import OAS31Validator
doc = json.load(open(sys.argv[1]))
bad = []
for name, answer in json.load(open(sys.argv[2])):
    schema = dict(doc, **{"$ref": "#/components/schemas/" + name})
    for e in OAS31Validator(schema).iter_errors(answer):
        bad.append(f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
print("\n".join(bad) if bad else "OK")
"##;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answers_of_a_demo_fleet_match_the_api_documents_schemas() -> TestResult {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = repo.join(".venv-openapi/bin/python");
    if !python.exists() {
        bc_testkit::skip!(
            "no .venv-openapi (scripts/setup installs openapi-spec-validator into it)"
        );
    }
    let (p, _daemon) = demo_fleet().await?;
    let a = &p.admin;
    let nodes = a.call("nodes", "list", json!({})).await?;
    let node = nodes["nodes"][0]["id"].clone();
    let reservations = a.call("reservations", "list", json!({})).await?;
    let answers = json!([
        ["Nodes", nodes],
        [
            "NodeDetail",
            a.call("nodes", "get", json!({"id": node})).await?
        ],
        ["ReservationList", reservations],
        [
            "ReservationAnswer",
            a.call(
                "reservations",
                "get",
                json!({"id": reservations["reservations"][0]["id"]})
            )
            .await?
        ],
        ["ListResponse", a.call("metal", "list", json!({})).await?],
        [
            "MachineView",
            a.call("metal", "show", json!({"mac": "52:54:00:07:00:03"}))
                .await?
        ],
        [
            "FleetOverview",
            a.call("fleet", "overview", json!({})).await?
        ],
        [
            "JoinTokens",
            a.call("join-tokens", "list", json!({})).await?
        ],
        [
            "ListSiteTokensResponse",
            a.call("site-tokens", "list", json!({"site": "rack-7"}))
                .await?
        ],
        ["Info", a.call("system", "info", json!({})).await?],
        ["ApiDocument", a.call("system", "methods", json!({})).await?],
    ]);
    let file = p.dir.path().join("answers.json");
    std::fs::write(&file, answers.to_string())?;
    let out = std::process::Command::new(&python)
        .args(["-c", VALIDATE])
        .arg(repo.join("docs/openapi.json"))
        .arg(&file)
        .output()?;
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim() == "OK",
        "answers outside their schemas:\n{said}"
    );
    // The validator refuses what breaks a schema (a check that can fail): a node whose state is not one.
    let mut broken = answers.clone();
    broken[0][1]["nodes"][0]["state"] = json!("melting");
    broken[0][1]["nodes"][0]["joined_at_ms"] = json!("yesterday");
    std::fs::write(&file, broken.to_string())?;
    let out = std::process::Command::new(&python)
        .args(["-c", VALIDATE])
        .arg(repo.join("docs/openapi.json"))
        .arg(&file)
        .output()?;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("nodes/0/state") && said.contains("nodes/0/joined_at_ms"),
        "{said}"
    );
    Ok(())
}
