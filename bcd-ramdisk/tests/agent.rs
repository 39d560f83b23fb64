//! Agent mode against a real control plane (bcd's test harness: PostgreSQL, API, gateway, JoinService over real
//! mTLS on loopback), in process: the ramdisk's agent joins with a one-use join token through bcd's join code,
//! keeps bcd's session, and answers a queued `ramdisk.diagnose` with the report signed by the node key.

#[path = "../../bcd/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use bcd_ramdisk::agent::{self, DIAGNOSE_KIND, DIAGNOSE_PAYLOAD_TYPE, RamdiskCommands};
use common::{Options, TestResult, plane_with};
use serde_json::json;

/// The command row as the control plane stored it: (state, result, error, envelope bytes).
async fn command_row(
    p: &common::Plane,
    id: &str,
) -> (
    String,
    Option<serde_json::Value>,
    Option<String>,
    Option<Vec<u8>>,
) {
    bc_store::sqlx::query_as("SELECT state, result, error, envelope FROM commands WHERE id = $1")
        .bind(id)
        .fetch_one(p.store.pool())
        .await
        .expect("command row")
}

async fn wait_finished(
    p: &common::Plane,
    id: &str,
) -> (
    String,
    Option<serde_json::Value>,
    Option<String>,
    Option<Vec<u8>>,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let row = command_row(p, id).await;
        if !matches!(row.0.as_str(), "pending" | "sent") {
            return row;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "command {id} still {} after 60 s",
            row.0
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_joins_keeps_a_session_and_signs_the_diagnose_report() -> TestResult {
    let p = plane_with(Options {
        fast: true,
        ..Options::default()
    })
    .await;
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let config = p.node_config("ramdisk");
    let state_dir = config.state_dir.clone();
    let done = Arc::new(std::sync::Mutex::new(Vec::<(String, bool)>::new()));
    let seen = done.clone();
    let hook = Arc::new(RamdiskCommands::new(
        "/".into(),
        Arc::new(bcd_ramdisk::diagnose::RealNvme),
        Box::new(move |kind, _id, out| {
            if let Ok(mut v) = seen.lock() {
                v.push((kind.to_string(), out.is_ok()));
            }
        }),
    ));
    let (joined_tx, joined_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(async move {
        agent::run(
            config,
            &token,
            hook,
            move |j| {
                let _ = joined_tx.send(j.clone());
            },
            async move {
                let _ = stop_rx.await;
            },
        )
        .await
    });
    let joined = tokio::time::timeout(Duration::from_secs(30), joined_rx).await??;
    println!("joined: {joined:?}");
    assert!(!joined.replayed && !joined.reclaimed, "{joined:?}");
    assert_eq!(joined.pool, "default");

    // The node row exists with the key from the join; its session opens.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let row = p.store.node(&joined.node_id).await?.expect("node row");
        if row.online && row.session_epoch >= 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "session did not open: {} online={} epoch={}",
            row.state,
            row.online,
            row.session_epoch
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // bcd's session answers the gateway's inventory request from the ramdisk's own /sys and /proc.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let names: Vec<String> = p
            .store
            .inventory(&joined.node_id)
            .await?
            .into_iter()
            .map(|(name, _, _)| name)
            .collect();
        if ["system", "cpu", "memory", "nics", "disks"]
            .iter()
            .all(|s| names.iter().any(|n| n == s))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "inventory incomplete: {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (uses_left,): (i32,) = bc_store::sqlx::query_as("SELECT uses_left FROM join_tokens")
        .fetch_one(p.store.pool())
        .await?;
    assert_eq!(uses_left, 0, "the one-use boot token is spent by the join");

    // A queued ramdisk.diagnose finishes with the report, signed by the node key.
    let deadline_ms = (time::OffsetDateTime::now_utc().unix_timestamp() + 120) * 1000;
    p.store
        .queue_command(
            "c-diag-1",
            &joined.node_id,
            DIAGNOSE_KIND,
            &json!({}),
            deadline_ms,
        )
        .await?;
    let (state, result, error, envelope) = wait_finished(&p, "c-diag-1").await;
    assert_eq!(state, "done", "error: {error:?}");
    let result = result.expect("stored result");
    for section in ["system", "cpu", "memory", "pci", "disks", "nics"] {
        assert!(result.get(section).is_some(), "no {section} in {result}");
    }
    assert!(
        result["cpu"]["logical_cpus"]
            .as_u64()
            .is_some_and(|n| n >= 1),
        "{result}"
    );
    let env: bc_proto::v1::SignedEnvelope =
        prost::Message::decode(envelope.expect("stored envelope").as_slice())?;
    assert_eq!(env.payload_type, DIAGNOSE_PAYLOAD_TYPE);
    let key = p
        .store
        .node_public_key(&joined.node_id)
        .await?
        .expect("recorded key");
    bc_proto::envelope::verify(&env, &key, &joined.spiffe_id)?;
    // The recorded key is the ramdisk's node key (from its certificate), and a changed payload does not verify.
    let cert = bcd::state::StateDir::open(&state_dir)?.certificate()?;
    assert_eq!(bc_proto::envelope::cert_public_point(&cert)?, key);
    let mut forged = env.clone();
    forged.payload = br#"{"forged":true}"#.to_vec();
    assert!(bc_proto::envelope::verify(&forged, &key, &joined.spiffe_id).is_err());
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&env.payload)?,
        result
    );

    // A kind neither bcd nor the ramdisk knows gets a signed error result, not silence.
    p.store
        .queue_command(
            "c-bogus",
            &joined.node_id,
            "ramdisk.dance",
            &json!({}),
            deadline_ms,
        )
        .await?;
    let (state, result, error, _) = wait_finished(&p, "c-bogus").await;
    assert_eq!(state, "done", "error: {error:?}");
    assert!(
        result
            .as_ref()
            .and_then(|r| r["error"].as_str())
            .is_some_and(|e| e.contains("unknown command kind")),
        "{result:?}"
    );
    assert_eq!(
        done.lock().map(|v| v.clone()).unwrap_or_default(),
        [(DIAGNOSE_KIND.to_string(), true)],
        "the hook saw exactly the ramdisk's command"
    );

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), agent).await???;
    Ok(())
}
