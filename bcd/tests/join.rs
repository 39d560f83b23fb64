//! `bcd join` end to end: a real control plane (API + gateway roles) on a real PostgreSQL, real TLS on loopback,
//! the bcd library and the real `bcd` binary.

mod common;

use bc_proto::v1;
use common::*;
use serde_json::{Value, json};
use std::path::Path;
use tokio::process::Command;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_join_is_adopting_with_claims_and_a_verifiable_spiffe_cert() -> TestResult {
    let p = plane().await;
    let token = p.token(json!({"pool": "default", "uses": 2})).await;
    let out = join(&p, "n1", &token, claims("n1", 8)).await?;
    assert!(!out.replayed && !out.reclaimed);

    let v = p
        .admin
        .call("nodes", "get", json!({"id": out.identity.node_id}))
        .await?;
    assert_eq!(v["node"]["state"], "adopting");
    assert_eq!(
        v["node"]["claims"]["gpus"].as_array().map(Vec::len),
        Some(8)
    );
    assert_eq!(v["node"]["claims"]["dmi"]["system_uuid"], "uuid-n1");

    // The certificate chains to the CA for client auth and carries exactly one SPIFFE URI SAN.
    let state = bcd::state::StateDir::open(&p.dir.path().join("n1"))?;
    let cert = state.certificate()?;
    let bundle = state.trust_bundle()?;
    let mut roots = rustls::RootCertStore::empty();
    for c in &bundle {
        roots.add(c.clone())?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder(roots.into()).build()?;
    verifier.verify_client_cert(&cert, &[], rustls_pki_types::UnixTime::now())?;
    use x509_parser::prelude::*;
    let (_, x) = X509Certificate::from_der(&cert)?;
    let uris: Vec<String> = x
        .subject_alternative_name()?
        .map(|s| {
            s.value
                .general_names
                .iter()
                .filter_map(|g| match g {
                    GeneralName::URI(u) => Some(u.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        uris,
        vec![format!("spiffe://test.bc/node/{}", out.identity.node_id)]
    );
    let life = x.validity().not_after.timestamp() - x.validity().not_before.timestamp();
    assert_eq!(life, 24 * 3600 + 5 * 60, "24 h plus the 5 min backdate");
    // The key file is private.
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(state.path("node.key"))?
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    Ok(())
}

/// Sends a hand-built request and returns the refusal.
async fn refused(p: &Plane, req: v1::JoinRequest) -> tonic::Status {
    match bcd::join::send(&p.node_config("probe"), req).await {
        Ok(r) => panic!("join unexpectedly accepted: node {}", r.node_id),
        Err(s) => s,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_distinct_clear_and_changes_nothing() -> TestResult {
    let p = plane().await;
    let good = p.token(json!({"pool": "default", "uses": 1})).await;
    join(&p, "first", &good, claims("first", 2)).await?; // spends the only use
    let fresh = p.token(json!({"pool": "default", "uses": 5})).await;
    let revoked = p.token(json!({"pool": "default", "uses": 5})).await;
    let revoked_id = revoked[5..21].to_string();
    p.admin
        .call("join-tokens", "revoke", json!({"id": revoked_id}))
        .await?;
    let expired = p.token(json!({"pool": "default", "uses": 5})).await;
    bc_store::sqlx::query(
        "UPDATE join_tokens SET expires_at = now() - interval '1 minute' WHERE id = $1",
    )
    .bind(&expired[5..21])
    .execute(p.store.pool())
    .await?;
    let expecting = p
        .token(json!({"pool": "default", "uses": 5, "expect": {"gpu.count": "4"}}))
        .await;
    let before = p.snapshot().await;

    let cfg = p.node_config("probe");
    let state = bcd::state::StateDir::open(&cfg.state_dir)?;
    let other_state = bcd::state::StateDir::open(&p.dir.path().join("other-key"))?;
    let req = |token: &str| bcd::join::build_request(&cfg, &state, token, claims("probe", 8));

    let mut cases: Vec<(&str, Code, &str, v1::JoinRequest)> = Vec::new();
    let wrong_secret = format!(
        "{}{}",
        &fresh[..22],
        if &fresh[22..23] == "A" { "B" } else { "A" }
    ) + &fresh[23..];
    cases.push((
        "wrong secret",
        Code::PermissionDenied,
        "secret does not match",
        req(&wrong_secret)?,
    ));
    cases.push(("expired", Code::PermissionDenied, "expired", req(&expired)?));
    cases.push(("revoked", Code::PermissionDenied, "revoked", req(&revoked)?));
    cases.push((
        "exhausted",
        Code::ResourceExhausted,
        "no uses left",
        req(&good)?,
    ));
    cases.push((
        "expect mismatch",
        Code::PermissionDenied,
        "gpu.count is \"8\"",
        req(&expecting)?,
    ));
    // A captured blob replayed with another CSR key.
    let mut replayed = req(&fresh)?;
    replayed.csr_der =
        bcd::join::build_request(&cfg, &other_state, &fresh, claims("probe", 8))?.csr_der;
    cases.push((
        "replayed blob",
        Code::PermissionDenied,
        "sealed for another key",
        replayed,
    ));
    let mut tampered = req(&fresh)?;
    tampered.sealed_token[40] ^= 0x01;
    cases.push(("tampered blob", Code::InvalidArgument, "corrupt", tampered));
    let mut bad_sig = req(&fresh)?;
    let n = bad_sig.csr_der.len();
    bad_sig.csr_der[n - 3] ^= 0x01;
    cases.push((
        "bad CSR signature",
        Code::PermissionDenied,
        "signature does not verify",
        bad_sig,
    ));
    let mut garbage_sealed = req(&fresh)?;
    garbage_sealed.sealed_token = vec![0x5a; 97];
    cases.push((
        "garbage sealed_token",
        Code::InvalidArgument,
        "sealed token",
        garbage_sealed,
    ));
    let mut garbage_csr = req(&fresh)?;
    garbage_csr.csr_der = b"\x30\x03garbage".to_vec();
    cases.push((
        "garbage csr_der",
        Code::InvalidArgument,
        "not a DER PKCS#10",
        garbage_csr,
    ));
    let mut garbage_claims = req(&fresh)?;
    if let Some(c) = garbage_claims.claims.as_mut() {
        c.gpus[1].serial = "\u{0}\u{1b}[31m".into();
    }
    cases.push((
        "garbage claims",
        Code::InvalidArgument,
        "claims.gpus[1].serial",
        garbage_claims,
    ));
    let mut huge_claims = req(&fresh)?;
    if let Some(c) = huge_claims.claims.as_mut() {
        c.hostname = "h".repeat(10_000);
    }
    cases.push((
        "oversized claims",
        Code::InvalidArgument,
        "claims.hostname",
        huge_claims,
    ));
    let mut garbage_version = req(&fresh)?;
    garbage_version.agent_version = "\u{7f}\u{0}".into();
    cases.push((
        "garbage agent_version",
        Code::InvalidArgument,
        "agent_version",
        garbage_version,
    ));
    let mut empty = req(&fresh)?;
    empty.sealed_token.clear();
    empty.csr_der.clear();
    cases.push((
        "empty fields",
        Code::InvalidArgument,
        "csr_der is empty",
        empty,
    ));

    let mut messages = std::collections::HashSet::new();
    for (name, code, phrase, request) in cases {
        let s = refused(&p, request).await;
        assert_eq!(s.code(), code, "{name}: {}", s.message());
        assert!(
            s.message().contains(phrase),
            "{name}: {:?} lacks {phrase:?}",
            s.message()
        );
        assert!(
            messages.insert(s.message().to_string()),
            "{name}: message not distinct: {}",
            s.message()
        );
        assert_eq!(p.snapshot().await, before, "{name} changed state");
    }
    // The honest request still works afterwards.
    join(&p, "probe", &fresh, claims("probe", 8)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_commit_then_retried_gives_one_node_and_one_use() -> TestResult {
    let p = plane().await;
    // One use: the retry must be recognised as a retry although the token is now exhausted.
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let hw = p.dir.path().join("hw");
    fake_hardware(&hw, "crashy")?;
    let run = |fault: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_bcd"));
        cmd.args(["--config", "/nonexistent", "--state-dir"])
            .arg(p.dir.path().join("crashy"))
            .args([
                "join",
                "--attempts",
                "1",
                "--gpu-backend",
                "none",
                "--gateway-url",
            ])
            .arg(&p.running.gateway_url)
            .args([
                "--ca-pin",
                &p.running.ca_pin,
                "--join-public-key",
                &p.running.join_public_key,
            ])
            .arg("--hardware-root")
            .arg(&hw)
            .env("BCD_JOIN_TOKEN", &token);
        if fault {
            cmd.env("BCD_FAULT", "exit-after-join-reply");
        }
        cmd.output()
    };
    let first = run(true).await?;
    assert_eq!(
        first.status.code(),
        Some(137),
        "the client died after the server committed"
    );
    assert!(!p.dir.path().join("crashy/node.json").exists());
    assert!(
        p.dir.path().join("crashy/node.key").exists(),
        "the key was persisted before the call"
    );
    let second = run(false).await?;
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert!(
        second.status.success(),
        "retry failed: {}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert!(stdout.contains("a retry of an earlier join"), "{stdout}");
    let (nodes, uses_left, _) = p.snapshot().await;
    assert_eq!((nodes, uses_left), (1, 0), "one node, one use spent");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_keeps_the_node_id_and_plain_rejoin_is_refused() -> TestResult {
    let p = plane().await;
    let first = p.token(json!({"pool": "default", "uses": 1})).await;
    let a = join(&p, "before-reinstall", &first, claims("box", 8)).await?;
    // Reinstalled: new state directory, new key, same hardware.
    let plain = p.token(json!({"pool": "default", "uses": 1})).await;
    match join(&p, "reinstalled-plain", &plain, claims("box", 8)).await {
        Err(bcd::join::JoinError::Refused {
            code: Code::AlreadyExists,
            message,
        }) => {
            assert!(message.contains(&a.identity.node_id), "{message}")
        }
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
    let reclaim = p
        .token(json!({"pool": "default", "uses": 1, "reclaim": true}))
        .await;
    let b = join(&p, "reinstalled", &reclaim, claims("box", 8)).await?;
    assert!(b.reclaimed);
    assert_eq!(b.identity.node_id, a.identity.node_id);
    assert_eq!(p.snapshot().await.0, 1);
    // A pool that does not allow reclaim refuses reclaim tokens at creation.
    let err = p
        .admin
        .call(
            "join-tokens",
            "create",
            json!({"pool": "strict", "uses": 1, "reclaim": true}),
        )
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("does not allow reclaim"), "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_concurrent_joins_on_n_minus_one_uses() -> TestResult {
    const N: usize = 24;
    let p = std::sync::Arc::new(plane().await);
    let token = p.token(json!({"pool": "default", "uses": N - 1})).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..N {
        let p = p.clone();
        let token = token.clone();
        tasks.spawn(async move {
            join(&p, &format!("c{i}"), &token, claims(&format!("c{i}"), 1)).await
        });
    }
    let (mut ok, mut exhausted) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r? {
            Ok(_) => ok += 1,
            Err(bcd::join::JoinError::Refused {
                code: Code::ResourceExhausted,
                ..
            }) => exhausted += 1,
            Err(e) => panic!("unexpected: {e:?}"),
        }
    }
    assert_eq!((ok, exhausted), (N - 1, 1));
    let (nodes, uses_left, _) = p.snapshot().await;
    assert_eq!((nodes, uses_left), ((N - 1) as i64, 0));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_never_holds_a_token_or_api_key_secret() -> TestResult {
    let p = plane().await;
    let token = p.token(json!({"pool": "default", "uses": 2})).await;
    join(&p, "s1", &token, claims("s1", 1)).await?;
    let dump = p.db.dump()?;
    assert!(
        dump.contains(&token[5..21]),
        "the dump must contain the token id (sanity check of the dump)"
    );
    let secret = &token[22..];
    assert!(
        !dump.contains(secret),
        "token secret found in the database dump"
    );
    let api_secret = p.admin_key_secret();
    assert!(
        !dump.contains(&api_secret),
        "API key secret found in the database dump"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_script_into_a_staging_root_installs_and_joins() -> TestResult {
    let p = plane().await;
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let root = p.dir.path().join("stage");
    let hw = p.dir.path().join("hw");
    fake_hardware(&hw, "installed")?;
    let fixture = p.dir.path().join("gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(8, "inst"))?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install.sh");
    let out = Command::new("sh")
        .arg(&script)
        .args([
            "--gateway-url",
            &p.running.gateway_url,
            "--ca-pin",
            &p.running.ca_pin,
        ])
        .args([
            "--join-public-key",
            &p.running.join_public_key,
            "--binary",
            env!("CARGO_BIN_EXE_bcd"),
        ])
        .arg("--gpu-backend")
        .arg(format!("fixture:{}", fixture.display()))
        .arg("--hardware-root")
        .arg(&hw)
        .env("DESTDIR", &root)
        .env("BCD_JOIN_TOKEN", &token)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "install.sh failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("with 8 GPU(s)"), "{stdout}");
    assert!(root.join("usr/local/bin/bcd").exists());
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/bcd.service"))?;
    assert!(
        unit.contains("ExecStart=/usr/local/bin/bcd --config /etc/bcd/bcd.toml run"),
        "{unit}"
    );
    let conf = std::fs::read_to_string(root.join("etc/bcd/bcd.toml"))?;
    assert!(
        conf.contains(&p.running.ca_pin) && conf.contains(&p.running.join_public_key),
        "{conf}"
    );
    let id: Value = serde_json::from_slice(&std::fs::read(root.join("var/lib/bcd/node.json"))?)?;
    let v = p.admin.call("nodes", "list", json!({})).await?;
    let nodes = v["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0]["id"], id["node_id"]);
    assert_eq!(nodes[0]["claims"]["dmi"]["system_uuid"], "uuid-installed");
    assert!(
        !conf.contains(&token[22..]),
        "the token must not be written to the config"
    );
    Ok(())
}

/// Runs the real `bcd` binary with `args` against the plane, the token in the environment.
async fn bcd_cli(p: &Plane, state: &str, args: &[&str], env: (&str, &str)) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bcd"))
        .args(["--config", "/nonexistent", "--state-dir"])
        .arg(p.dir.path().join(state))
        .args(args)
        .args([
            "--gateway-url",
            &p.running.gateway_url,
            "--ca-pin",
            &p.running.ca_pin,
        ])
        .args(["--join-public-key", &p.running.join_public_key])
        .env(env.0, env.1)
        .output()
        .await
        .expect("run bcd")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_kind_is_refused_on_the_wrong_path_by_the_client_and_by_join_service()
-> TestResult {
    let p = plane().await;
    let join_token = p.token(json!({"pool": "default", "uses": 3})).await;
    let site_token = p
        .admin
        .call(
            "site-tokens",
            "create",
            json!({"site": "rack-9", "uses": 3}),
        )
        .await?["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let site_uses = || async {
        bc_store::sqlx::query_scalar::<_, i32>("SELECT uses_left FROM site_tokens")
            .fetch_one(p.store.pool())
            .await
            .expect("site token")
    };
    let before = (p.snapshot().await, site_uses().await);

    // The client: `bcd join` with a site token, `bcd site enroll` with a join token. Each names the right command
    // and leaves nothing behind (no key, no identity).
    let out = bcd_cli(
        &p,
        "wrong-join",
        &["join", "--gpu-backend", "none"],
        ("BCD_JOIN_TOKEN", &site_token),
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "bcd join took a site token: {stderr}"
    );
    assert!(stderr.contains("`bcd site enroll`"), "{stderr}");
    assert!(!p.dir.path().join("wrong-join/node.json").exists());
    assert!(!p.dir.path().join("wrong-join/node.key").exists());
    let out = bcd_cli(
        &p,
        "wrong-enroll",
        &["site", "enroll", "--agent-config", "/nonexistent"],
        ("BCD_SITE_TOKEN", &join_token),
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "bcd site enroll took a join token: {stderr}"
    );
    assert!(stderr.contains("run `bcd join`"), "{stderr}");
    assert!(!p.dir.path().join("wrong-enroll/node.key").exists());
    // The library refuses the same before any call.
    match join(&p, "lib", &site_token, claims("lib", 1)).await {
        Err(bcd::join::JoinError::WrongTokenKind(m)) => {
            assert!(m.contains("bcd site enroll"), "{m}")
        }
        other => panic!("expected WrongTokenKind, got {other:?}"),
    }

    // JoinService: a modified client that sends a token on the wrong path, or states no purpose.
    let cfg = p.node_config("probe");
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    use bc_proto::token::TokenKind;
    let mut site_as_node =
        bcd::join::request_as(&cfg, &key, TokenKind::Site, &site_token, claims("m", 1))?;
    site_as_node.purpose = v1::JoinPurpose::Node.into();
    let mut join_as_site =
        bcd::join::request_as(&cfg, &key, TokenKind::Join, &join_token, claims("m", 1))?;
    join_as_site.purpose = v1::JoinPurpose::Site.into();
    let mut unset =
        bcd::join::request_as(&cfg, &key, TokenKind::Join, &join_token, claims("m", 1))?;
    unset.purpose = v1::JoinPurpose::Unspecified.into();
    for (name, req, phrase) in [
        (
            "site token on the node path",
            site_as_node,
            "run `bcd site enroll`",
        ),
        (
            "join token on the site path",
            join_as_site,
            "run `bcd join`",
        ),
        ("no purpose", unset, "purpose is unset"),
    ] {
        let s = refused(&p, req).await;
        assert_eq!(s.code(), Code::InvalidArgument, "{name}: {s:?}");
        assert!(s.message().contains(phrase), "{name}: {:?}", s.message());
        assert_eq!(
            (p.snapshot().await, site_uses().await),
            before,
            "{name} spent or wrote something"
        );
    }
    let sites: i64 = bc_store::sqlx::query_scalar("SELECT count(*) FROM site_agents")
        .fetch_one(p.store.pool())
        .await?;
    assert_eq!(sites, 0, "no site agent was enrolled");

    // Each on its own path works (positive control).
    let node = join(&p, "right-join", &join_token, claims("right", 1)).await?;
    assert!(node.identity.spiffe_id.contains("/node/"));
    let site = bcd::join::enroll_site(
        &p.node_config("right-site"),
        &site_token,
        bcd::join::JoinOptions {
            attempts: 1,
            claims: v1::HardwareClaims::default(),
        },
    )
    .await?;
    assert_eq!(site.identity.spiffe_id, "spiffe://test.bc/site/rack-9");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_a_day_later_is_refused_naming_the_node_with_or_without_a_hardware_key()
-> TestResult {
    let p = plane().await;
    let token = p.token(json!({"pool": "default", "uses": 5})).await;
    let keyless = v1::HardwareClaims {
        hostname: "keyless".into(),
        ..Default::default()
    };
    for (name, c) in [("keyed", claims("keyed", 1)), ("keyless", keyless)] {
        let first = join(&p, name, &token, c.clone()).await?;
        // The reply was lost (the identity never stored): the same key and token again, within the window.
        std::fs::remove_file(p.dir.path().join(name).join("node.json"))?;
        let again = join(&p, name, &token, c.clone()).await?;
        assert!(again.replayed, "{name}: {again:?}");
        assert_eq!(again.identity.node_id, first.identity.node_id);
        // A day later: refused, naming the node, spending nothing.
        std::fs::remove_file(p.dir.path().join(name).join("node.json"))?;
        bc_store::sqlx::query(
            "UPDATE nodes SET joined_at = now() - interval '1 day' WHERE id = $1",
        )
        .bind(&first.identity.node_id)
        .execute(p.store.pool())
        .await?;
        let before = p.snapshot().await;
        match join(&p, name, &token, c).await {
            Err(bcd::join::JoinError::Refused {
                code: Code::AlreadyExists,
                message,
            }) => {
                assert!(
                    message.contains(&first.identity.node_id),
                    "{name}: {message}"
                );
                assert!(message.contains("within 10 min"), "{name}: {message}");
                assert!(message.contains("--reclaim"), "{name}: {message}");
            }
            other => panic!("{name}: a retry a day later was {other:?}"),
        }
        assert_eq!(
            p.snapshot().await,
            before,
            "{name}: the refusal changed state"
        );
    }
    Ok(())
}

/// Issue 17: a CA pin that does not match the gateway's CA is named at once (the pin, the CA the gateway presents,
/// what to check) and never retried: before, `bcd join` retried it as a transport failure, 8 attempts with backoff,
/// then reported the gateway "unreachable".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_pin_is_named_at_once_and_not_retried() -> TestResult {
    let p = plane().await;
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let wrong = format!("sha256:{}", "ab".repeat(32));
    let t0 = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_bcd"))
        .args(["--config", "/nonexistent", "--state-dir"])
        .arg(p.dir.path().join("pinned"))
        .args(["join", "--gpu-backend", "none", "--gateway-url"])
        .arg(&p.running.gateway_url)
        .args([
            "--ca-pin",
            &wrong,
            "--join-public-key",
            &p.running.join_public_key,
        ])
        .env("BCD_JOIN_TOKEN", &token)
        .output()
        .await?;
    let took = t0.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is not the control plane this node pins")
            && stderr.contains(&wrong)
            && stderr.contains(&format!("it presents {}", p.running.ca_pin))
            && stderr.contains("better-compute info")
            && !stderr.contains("attempt"),
        "{stderr}"
    );
    assert!(
        took < std::time::Duration::from_secs(5),
        "took {took:?}: retried?"
    );
    let (nodes, uses_left, _) = p.snapshot().await;
    assert_eq!((nodes, uses_left), (0, 1), "nothing joined, no use spent");
    Ok(())
}

/// A gateway that completes TLS and HTTP/2 (and answers pings) but whose Join handler never answers, as one stuck on
/// its database: the join gives up at its deadline with DEADLINE_EXCEEDED, saying so. Before, it waited for ever
/// (HTTP/2 keep-alive ends only a connection whose peer is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_never_answers_a_join_is_given_up_at_the_deadline() -> TestResult {
    struct Stuck;
    #[tonic::async_trait]
    impl v1::join_service_server::JoinService for Stuck {
        async fn join(
            &self,
            _: tonic::Request<v1::JoinRequest>,
        ) -> Result<tonic::Response<v1::JoinResponse>, tonic::Status> {
            std::future::pending().await
        }
    }
    bc_proto::install_crypto_provider();
    // A CA and a gateway certificate for 127.0.0.1, the chain presented as the real gateway presents it.
    let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key)?;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?
        .signed_by(&key, &rcgen::Issuer::from_ca_cert_der(ca.der(), &ca_key)?)?;
    let mut tls = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone(), ca.der().clone()],
            rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(tls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let incoming = async_stream_of(listener, acceptor);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::join_service_server::JoinServiceServer::new(Stuck))
            .serve_with_incoming(incoming),
    );
    let (_, join_key) = bc_proto::seal::generate_join_keypair();
    let dir = tempfile::tempdir()?;
    let config = bcd::config::ConfigWire {
        gateway_url: Some(format!("https://127.0.0.1:{port}")),
        ca_pin: bc_proto::channel::ca_pin_of(ca.der()),
        join_public_key: Some(join_key.encode()),
        state_dir: Some(dir.path().to_owned()),
        gpu_backend: Some("none".into()),
        hardware_root: None,
        cdi_dir: None,
        tunnels: None,
    }
    .validate("test")?;
    let t0 = std::time::Instant::now();
    let answer = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        bcd::join::send_within(
            &config,
            v1::JoinRequest::default(),
            std::time::Duration::from_secs(2),
        ),
    )
    .await
    .map_err(|_| "the join still waited after 20 s")?;
    let status = answer.err().ok_or("a stuck gateway cannot have answered")?;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status
            .message()
            .contains("join: the gateway did not answer within 2 s"),
        "{}",
        status.message()
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t0.elapsed()
    );
    Ok(())
}

/// TLS connections accepted on `listener`, as tonic's `serve_with_incoming` takes them.
fn async_stream_of(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) -> impl tokio_stream::Stream<
    Item = std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let _ = tx.send(Ok(tls)).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
