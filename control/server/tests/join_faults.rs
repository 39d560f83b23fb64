//! `bcd join` while the control plane dies: 200 joins (bcd's join, real TLS on loopback, arriving over ~4 s) against
//! a real `better-compute serve` process that is killed (SIGKILL) in the middle of them and started again on the same
//! port and state directory. Every join completes (a reset mid-call is retried, and a retry of a committed join is the
//! same node), no machine gets two nodes, and the token's uses match the nodes.

use bc_core::join::Expectations;
use bc_proto::token::{Token, TokenKind};
use bc_proto::v1;
use bc_store::Store;
use bc_store::join_tokens::NewJoinToken;
use bc_store::sqlx;
use bc_store::testing::test_db;
use std::collections::HashSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");
const JOINS: usize = 200;
const WARM: usize = 5;

/// A `better-compute serve` process (api and gateway roles) and what it printed: (CA pin, JoinService key).
async fn serve(dir: &Path, url: &str, port: u16) -> (Child, String, String) {
    let cfg = dir.join("serve.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = {:?}\ndatabase_url = {url:?}\nroles = \"api,gateway\"\napi_listen = \"127.0.0.1:0\"\n\
             gateway_listen = \"127.0.0.1:{port}\"\ngateway_hosts = [\"localhost\", \"127.0.0.1\"]\n\
             trust_domain = \"test.bc\"\n",
            dir.join("control")
        ),
    )
    .expect("config");
    let mut child = Command::new(BIN)
        .args(["serve", "--no-migrate", "--config"])
        .arg(&cfg)
        .env("BC_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut keys = None;
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(deadline, lines.next_line()).await {
        if line.starts_with("serving: ") {
            let field = |name: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))
                    .unwrap_or_default()
                    .to_string()
            };
            keys = Some((field("ca_pin="), field("join_key=")));
            break;
        }
    }
    // Keep draining stdout so the process never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let (pin, key) = keys.expect("the control plane started within 60 s");
    (child, pin, key)
}

fn claims(i: usize) -> v1::HardwareClaims {
    v1::HardwareClaims {
        dmi: Some(v1::DmiClaims {
            system_uuid: format!("fault-{i:04}"),
            system_serial: format!("FSN{i:04}"),
            ..Default::default()
        }),
        hostname: format!("fault-{i}"),
        arch: "x86_64".into(),
        ..Default::default()
    }
}

async fn nodes(store: &Store) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM nodes")
        .fetch_one(store.pool())
        .await
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_join_completes_when_the_control_plane_is_killed_mid_join_and_restarted() {
    bc_proto::install_crypto_provider();
    let db = test_db().await;
    let store = Store::new(db.pool.clone());
    // The modules' migrations too: `serve --no-migrate` refuses a database with any pending.
    bc_control::migrate(&store)
        .await
        .expect("module migrations");
    store.ensure_root_tenant().await.expect("root tenant");
    store
        .ensure_pool("default", "root", "default", true)
        .await
        .expect("pool");
    let token = Token::generate(TokenKind::Join).expect("token");
    const USES: usize = JOINS + WARM + 20;
    store
        .create_join_token(NewJoinToken {
            id: token.id(),
            pool_id: "default",
            secret_hash: &token.secret().hash(),
            uses: USES as i32,
            expires_at_ms: i64::MAX / 2_000_000,
            expect: &Expectations::default(),
            reclaim: false,
            created_by: "test",
        })
        .await
        .expect("create token");
    let dir = tempfile::tempdir().expect("dir");
    // A port that stays the same across the restart.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let (mut plane, pin, join_key) = serve(dir.path(), &db.url(), port).await;

    let config = |i: usize| {
        bcd::config::ConfigWire {
            gateway_url: Some(format!("https://localhost:{port}")),
            ca_pin: Some(pin.clone()),
            join_public_key: Some(join_key.clone()),
            state_dir: Some(dir.path().join(format!("node-{i}"))),
            gpu_backend: Some("none".into()),
            hardware_root: None,
            cdi_dir: None,
            tunnels: None,
        }
        .validate("test")
        .expect("node config")
    };
    // A few machines first, so the flood meets a warm control plane (pool connections, token cache) and commits
    // in many batches rather than one.
    for i in JOINS..JOINS + WARM {
        let opts = bcd::join::JoinOptions {
            attempts: 40,
            claims: claims(i),
        };
        bcd::join::join(&config(i), &token.reveal(), opts)
            .await
            .expect("warm-up join");
    }

    let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut joins = tokio::task::JoinSet::new();
    for i in 0..JOINS {
        let config = config(i);
        let token = token.reveal();
        let (finished, started) = (finished.clone(), started.clone());
        joins.spawn(async move {
            // Machines arrive over ~4 s: the kill finds joins committed, in flight, and not yet sent.
            tokio::time::sleep(Duration::from_millis(20 * i as u64)).await;
            started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let opts = bcd::join::JoinOptions {
                attempts: 40,
                claims: claims(i),
            };
            let outcome = bcd::join::join(&config, &token, opts).await;
            finished.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (i, outcome)
        });
    }
    // Once a third of the machines have sent their join, hold the token's row (as a slow commit would): the joins
    // committing from then on wait for their answer inside the RPC, so the kill resets calls in flight, not just
    // connections.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while started.load(std::sync::atomic::Ordering::SeqCst) < JOINS / 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut held = db.pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM join_tokens WHERE id = $1 FOR UPDATE")
        .bind(token.id())
        .execute(&mut *held)
        .await
        .expect("lock the token row");
    let committed = nodes(&store).await;
    let waiting_commit = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%FROM join_tokens WHERE id = $1 FOR UPDATE%'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap_or(0)
    };
    while waiting_commit().await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no join commit waited for the token row within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    plane.start_kill().expect("kill");
    plane.wait().await.expect("wait");
    let in_flight = started.load(std::sync::atomic::Ordering::SeqCst)
        - finished.load(std::sync::atomic::Ordering::SeqCst);
    held.rollback().await.expect("release the token row");
    assert_eq!(
        nodes(&store).await,
        committed,
        "nothing committed while the row was held"
    );
    println!(
        "control plane killed with {} of {JOINS} nodes committed and {in_flight} joins sent and unanswered",
        committed as usize - WARM
    );
    assert!(
        in_flight >= 10,
        "only {in_flight} joins were in flight at the kill: the test did not test"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_plane, pin_again, _) = serve(dir.path(), &db.url(), port).await;
    assert_eq!(pin_again, pin, "the restart kept its CA");

    let mut ids = HashSet::new();
    let mut failures = Vec::new();
    let mut replayed = 0;
    while let Some(r) = joins.join_next().await {
        let (i, outcome) = r.expect("join task");
        match outcome {
            Ok(o) => {
                replayed += usize::from(o.replayed);
                assert!(
                    ids.insert(o.identity.node_id.clone()),
                    "two machines got node {}",
                    o.identity.node_id
                );
            }
            Err(e) => failures.push(format!("machine {i}: {e}")),
        }
    }
    println!(
        "{} joins completed ({replayed} answered as a retry of a join committed before the kill)",
        ids.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {JOINS} joins failed: {failures:#?}",
        failures.len()
    );
    assert_eq!(
        nodes(&store).await,
        (JOINS + WARM) as i64,
        "one node per machine"
    );
    let uses_left: i32 = sqlx::query_scalar("SELECT uses_left FROM join_tokens WHERE id = $1")
        .bind(token.id())
        .fetch_one(store.pool())
        .await
        .expect("uses");
    assert_eq!(
        uses_left as usize,
        USES - JOINS - WARM,
        "one use per node, none for retries"
    );
}
