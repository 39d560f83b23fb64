//! The ramdisk's session commands against a real control plane (PostgreSQL, API, gateway over real mTLS on
//! loopback), in process: an agent joins, then
//! - refuses `"disks": "all"` and `ramdisk.kexec` (this test is not PID 1), and malformed arguments, each with a
//!   signed error that says why;
//! - (with a loop device) wipes it on a command an operator queued through the HTTP API, with signed evidence, and
//!   the device reads back as zeros; then streams a zstd image from a slow local HTTP server onto it, with progress
//!   stored while it runs, and answers a `ramdisk.diagnose` queued meanwhile before the stream ends (commands run
//!   concurrently); then streams over https: refused from a server the node does not trust (the join's bundle holds
//!   only the control plane's CA), written from one whose CA the command carries in `ca_pem`; then a stream past
//!   its command's deadline is cut and zeroed while the step asked again waits for the disk and then writes;
//! - the API refuses a caller without the grant.

#[path = "../../bcd/tests/common/mod.rs"]
mod common;
mod loopback;

use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;
use std::time::Duration;

use bc_control::client::{ApiClient, ClientError};
use bcd_ramdisk::agent::{
    self, DIAGNOSE_KIND, KEXEC_KIND, RamdiskCommands, STREAM_KIND, WIPE_KIND,
};
use common::{Options, TestResult, plane_with};
use loopback::Loop;
use serde_json::{Value, json};

/// (state, result, error, envelope, progress).
type Row = (
    String,
    Option<Value>,
    Option<String>,
    Option<Vec<u8>>,
    Option<Value>,
);

async fn command_row(p: &common::Plane, id: &str) -> Row {
    bc_store::sqlx::query_as(
        "SELECT state, result, error, envelope, progress FROM commands WHERE id = $1",
    )
    .bind(id)
    .fetch_one(p.store.pool())
    .await
    .expect("command row")
}

async fn wait_finished(p: &common::Plane, id: &str) -> Row {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let row = command_row(p, id).await;
        if !matches!(row.0.as_str(), "pending" | "sent") {
            return row;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "command {id} still {} after 120 s",
            row.0
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn deadline_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp() + 300) * 1000
}

/// Checks the stored envelope's signature against the node's recorded key and returns its payload type.
async fn verify(
    p: &common::Plane,
    node_id: &str,
    spiffe_id: &str,
    envelope: Option<Vec<u8>>,
) -> String {
    let env: bc_proto::v1::SignedEnvelope =
        prost::Message::decode(envelope.expect("stored envelope").as_slice()).expect("envelope");
    let key = p
        .store
        .node_public_key(node_id)
        .await
        .expect("store")
        .expect("recorded key");
    bc_proto::envelope::verify(&env, &key, spiffe_id).expect("signed by the node key");
    env.payload_type
}

/// Queues `kind` through the store and returns its finished row.
async fn run_command(p: &common::Plane, node_id: &str, id: &str, kind: &str, args: Value) -> Row {
    p.store
        .queue_command(id, node_id, kind, &args, deadline_ms())
        .await
        .expect("queue");
    wait_finished(p, id).await
}

fn error_of(row: &Row) -> String {
    row.1
        .as_ref()
        .and_then(|r| r["error"].as_str())
        .unwrap_or_default()
        .to_string()
}

// === loop device and HTTP server ===

/// Pseudo-random bytes, none of them zero (incompressible: the compressed image is about as large).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = vec![0u8; len.div_ceil(8) * 8];
    for word in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&(x | 0x0101_0101_0101_0101).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Serves `body` over HTTP/1.1 on 127.0.0.1 at about `bytes_per_s`, so a stream lasts long enough to watch.
fn slow_server(body: Vec<u8>, bytes_per_s: usize) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/image.zst", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut tcp) = stream else { return };
            let mut reader = BufReader::new(&mut tcp);
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nETag: \"v1\"\r\nAccept-Ranges: bytes\r\nConnection: close\r\n\r\n",
                body.len()
            );
            if tcp.write_all(head.as_bytes()).is_err() {
                continue;
            }
            let chunk = (bytes_per_s / 20).max(1);
            for part in body.chunks(chunk) {
                if tcp.write_all(part).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = tcp.flush();
        }
    });
    url
}

/// Serves `body` over HTTPS on 127.0.0.1 with a fresh self-signed certificate; returns the URL and the
/// certificate's PEM (the CA a client must trust).
fn tls_server(body: Vec<u8>) -> (String, String) {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])
        .expect("self-signed cert");
    let pem = certified.cert.pem();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![certified.cert.der().clone()], key)
        .expect("server config"),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("https://{}/image.zst", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(tcp) = stream else { return };
            let Ok(conn) = rustls::ServerConnection::new(config.clone()) else {
                continue;
            };
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            // A client that refuses the certificate ends the handshake here: read fails, next connection.
            while !head.ends_with(b"\r\n\r\n") {
                match std::io::Read::read(&mut tls, &mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            if !head.ends_with(b"\r\n\r\n") {
                continue;
            }
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nETag: \"v1\"\r\nAccept-Ranges: bytes\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = tls.write_all(response.as_bytes());
            let _ = tls.write_all(&body);
            let _ = tls.flush();
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
    });
    (url, pem)
}

fn code(r: Result<Value, ClientError>) -> String {
    match r {
        Ok(v) => format!("OK {v}"),
        Err(ClientError::Api { code, .. }) => code,
        Err(e) => format!("transport: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_agent_runs_wipe_stream_and_refusals_from_the_session_concurrently() -> TestResult {
    let p = plane_with(Options {
        fast: true,
        ..Options::default()
    })
    .await;
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let config = p.node_config("ramdisk");
    let hook = Arc::new(
        RamdiskCommands::new(
            "/".into(),
            Arc::new(bcd_ramdisk::diagnose::RealNvme),
            Box::new(|kind, id, out| println!("command {kind} {id}: ok={}", out.is_ok())),
        )
        .with_stream_progress_interval(Duration::from_millis(200))
        .with_state_dir(config.state_dir.clone()),
    );
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
    let (node, spiffe) = (joined.node_id.clone(), joined.spiffe_id.clone());

    // Refusals: not PID 1, so neither "all" disks nor kexec; every answer is signed and says why.
    let row = run_command(&p, &node, "c-all", WIPE_KIND, json!({"disks": "all"})).await;
    assert_eq!(row.0, "done", "{row:?}");
    let e = error_of(&row);
    assert!(e.contains("not PID 1") && e.contains("all"), "{e}");
    assert_eq!(
        verify(&p, &node, &spiffe, row.3).await,
        bcd::session::ERROR_PAYLOAD_TYPE
    );
    let row = run_command(&p, &node, "c-kexec", KEXEC_KIND, json!({"target": "vda"})).await;
    let e = error_of(&row);
    assert!(e.contains("not PID 1") && e.contains("kexec"), "{e}");
    let row = run_command(
        &p,
        &node,
        "c-bad-args",
        STREAM_KIND,
        json!({"url": "http://127.0.0.1:9/x", "sha256": "00".repeat(32), "device": "loop0", "bogus": 1}),
    )
    .await;
    let e = error_of(&row);
    assert!(e.contains("unknown field `bogus`"), "{e}");
    verify(&p, &node, &spiffe, row.3).await;
    let row = run_command(
        &p,
        &node,
        "c-bad-disk",
        WIPE_KIND,
        json!({"disks": ["../sda"]}),
    )
    .await;
    let e = error_of(&row);
    assert!(
        e.contains("disks") && e.contains("not a device name"),
        "{e}"
    );

    // The API: an operator queues a command and reads it back; a caller without the grant is refused.
    let reader_key = bc_proto::token::Token::generate(bc_proto::token::TokenKind::ApiKey)?;
    p.store
        .upsert_principal(
            "reader",
            "root",
            "can read nodes, not command them",
            reader_key.id(),
            &reader_key.secret().hash(),
            &[bc_core::iam::Grant {
                permission: "compute:nodes:get".into(),
                scope: "pool/default".into(),
            }],
        )
        .await?;
    let api = format!("http://{}", p.running.api_addr.expect("api"));
    let reader = ApiClient::new(&api, &reader_key.reveal());
    let ask = |kind: &str, args: Value| json!({"node_id": node, "kind": kind, "args": args, "timeout_s": 300});
    assert_eq!(
        code(
            reader
                .call(
                    "nodes",
                    "command",
                    ask(WIPE_KIND, json!({"disks": ["vda"]}))
                )
                .await
        ),
        "ACCESS_DENIED"
    );
    assert_eq!(
        code(
            p.admin
                .call("nodes", "command", ask("Not A Kind", json!({})))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(
            p.admin
                .call("nodes", "command", ask(DIAGNOSE_KIND, json!([1])))
                .await
        ),
        "INVALID_ARGUMENT"
    );
    let v = p
        .admin
        .call("nodes", "command", ask(DIAGNOSE_KIND, json!({})))
        .await?;
    let diag_id = v["id"].as_str().expect("id").to_string();
    wait_finished(&p, &diag_id).await;
    let got = reader
        .call("commands", "get", json!({"id": diag_id}))
        .await?;
    assert_eq!(got["command"]["state"], "done", "{got}");
    assert!(got["command"]["result"]["cpu"].is_object(), "{got}");
    assert_eq!(
        code(reader.call("commands", "get", json!({"id": "nope"})).await),
        "NOT_FOUND"
    );
    let nobody_key = bc_proto::token::Token::generate(bc_proto::token::TokenKind::ApiKey)?;
    p.store
        .upsert_principal(
            "nobody",
            "root",
            "no grants",
            nobody_key.id(),
            &nobody_key.secret().hash(),
            &[],
        )
        .await?;
    let nobody = ApiClient::new(&api, &nobody_key.reveal());
    assert_eq!(
        code(nobody.call("commands", "get", json!({"id": diag_id})).await),
        "ACCESS_DENIED"
    );

    // Real block devices from here on.
    let lo = match Loop::attach(Some(&noise(8 << 20, 7))) {
        Ok(l) => l,
        Err(why) => {
            let _ = stop_tx.send(());
            tokio::time::timeout(Duration::from_secs(10), agent).await???;
            bc_testkit::skip!("ramdisk.wipe and ramdisk.stream on a loop device: {why}");
        }
    };
    let dev = lo.name();

    // ramdisk.wipe through the API: signed evidence that says wiped, and the device reads back as zeros.
    let v = p
        .admin
        .call("nodes", "command", ask(WIPE_KIND, json!({"disks": [dev]})))
        .await?;
    let wipe_id = v["id"].as_str().expect("id").to_string();
    let row = wait_finished(&p, &wipe_id).await;
    assert_eq!(row.0, "done", "{row:?}");
    let result = row.1.clone().expect("result");
    assert_eq!(result["wiped"], true, "{result}");
    assert_eq!(result["failed"], json!([]), "{result}");
    assert_eq!(result["devices"][0]["device"], dev.as_str(), "{result}");
    assert_eq!(result["devices"][0]["wiped"], true, "{result}");
    assert_eq!(
        verify(&p, &node, &spiffe, row.3).await,
        bcd_ramdisk::commands::WIPE_PAYLOAD_TYPE
    );
    assert!(
        lo.read(loopback::SIZE).iter().all(|&b| b == 0),
        "the wiped loop device still holds data"
    );
    let got = p
        .admin
        .call("commands", "get", json!({"id": wipe_id}))
        .await?;
    assert_eq!(got["command"]["result"]["wiped"], true, "{got}");

    // ramdisk.stream of a zstd image served at ~1 MiB/s (about 10 s): progress is stored while it runs, and a
    // ramdisk.diagnose queued meanwhile finishes before the stream does.
    let image = noise(10 << 20, 11);
    let compressed = zstd::encode_all(image.as_slice(), 1)?;
    let sha = hex::encode(bc_proto::sha256(&compressed));
    let url = slow_server(compressed, 1 << 20);
    p.store
        .queue_command(
            "c-stream",
            &node,
            STREAM_KIND,
            &json!({"url": url, "sha256": sha, "device": dev}),
            deadline_ms(),
        )
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let progress = loop {
        let row = command_row(&p, "c-stream").await;
        assert!(
            matches!(row.0.as_str(), "pending" | "sent"),
            "the stream ended before any progress was stored: {row:?}"
        );
        if let Some(pr) = row.4 {
            break pr;
        }
        assert!(tokio::time::Instant::now() < deadline, "no progress stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("progress while streaming: {progress}");
    assert!(
        progress["written"].is_u64() && progress["rate_bps"].is_u64(),
        "{progress}"
    );
    assert!(progress.get("eta_s").is_some(), "{progress}");
    let row = run_command(&p, &node, "c-diag-during", DIAGNOSE_KIND, json!({})).await;
    assert_eq!(row.0, "done");
    let stream_state = command_row(&p, "c-stream").await.0;
    assert_eq!(
        stream_state, "sent",
        "ramdisk.diagnose should finish while the stream still runs (commands run concurrently)"
    );
    let got = p
        .admin
        .call("commands", "get", json!({"id": "c-stream"}))
        .await?;
    assert!(got["command"]["progress"]["written"].is_u64(), "{got}");
    let row = wait_finished(&p, "c-stream").await;
    assert_eq!(row.0, "done", "{row:?}");
    let result = row.1.clone().expect("result");
    assert!(result.get("error").is_none(), "{result}");
    assert_eq!(result["digest"], sha.as_str(), "{result}");
    assert_eq!(result["image_bytes"], image.len() as u64, "{result}");
    assert_eq!(result["compression"], "Zstd", "{result}");
    assert_eq!(
        verify(&p, &node, &spiffe, row.3).await,
        bcd_ramdisk::commands::STREAM_PAYLOAD_TYPE
    );
    assert!(
        lo.read(image.len() as u64) == image,
        "the device holds the image"
    );

    // https: a server chained to nothing the node trusts is refused (nothing is written), the same server is
    // trusted once the command carries its CA, and a `ca_pem` that is not PEM is refused naming the field.
    let image = noise(1 << 20, 13);
    let compressed = zstd::encode_all(image.as_slice(), 1)?;
    let sha = hex::encode(bc_proto::sha256(&compressed));
    let (url, ca_pem) = tls_server(compressed);
    let row = run_command(
        &p,
        &node,
        "c-https-untrusted",
        STREAM_KIND,
        json!({"url": url, "sha256": sha, "device": dev}),
    )
    .await;
    let e = error_of(&row);
    assert!(
        e.to_lowercase().contains("certificate") || e.contains("UnknownIssuer"),
        "an untrusted https server is refused for its certificate: {e}"
    );
    let row = run_command(
        &p,
        &node,
        "c-https-bad-ca",
        STREAM_KIND,
        json!({"url": url, "sha256": sha, "device": dev, "ca_pem": "not a certificate"}),
    )
    .await;
    let e = error_of(&row);
    assert!(e.contains("ca_pem"), "{e}");
    let row = run_command(
        &p,
        &node,
        "c-https",
        STREAM_KIND,
        json!({"url": url, "sha256": sha, "device": dev, "ca_pem": ca_pem}),
    )
    .await;
    assert_eq!(row.0, "done", "{row:?}");
    let result = row.1.clone().expect("result");
    assert!(result.get("error").is_none(), "{result}");
    assert_eq!(result["digest"], sha.as_str(), "{result}");
    assert!(
        lo.read(image.len() as u64) == image,
        "the device holds the https image"
    );

    // A stream past its command's deadline, and the step asked again while it stops: the first is cut at its
    // deadline and zeroes what it wrote; the second, queued meanwhile for the same disk, waits its turn and then
    // writes its image. Before, the first ran on after the control plane had given up on it, and the second
    // failed on the first's O_EXCL open ("device busy").
    let slow = noise(10 << 20, 17);
    let slow_zst = zstd::encode_all(slow.as_slice(), 1)?;
    let slow_url = slow_server(slow_zst.clone(), 1 << 20);
    let cut_at = deadline_ms() - 300_000 + 3_000;
    p.store
        .queue_command(
            "c-cut",
            &node,
            STREAM_KIND,
            &json!({"url": slow_url, "sha256": hex::encode(bc_proto::sha256(&slow_zst)), "device": dev}),
            cut_at,
        )
        .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let image = noise(1 << 20, 19);
    let compressed = zstd::encode_all(image.as_slice(), 1)?;
    let sha = hex::encode(bc_proto::sha256(&compressed));
    let fast_url = slow_server(compressed, 64 << 20);
    p.store
        .queue_command(
            "c-again",
            &node,
            STREAM_KIND,
            &json!({"url": fast_url, "sha256": sha, "device": dev}),
            deadline_ms(),
        )
        .await?;
    let cut = wait_finished(&p, "c-cut").await;
    println!("the stream past its deadline: {cut:?}");
    assert_eq!(cut.0, "expired", "{cut:?}");
    if let Some(e) = &cut.2 {
        // The node's own account, when it arrived before the control plane's sweep.
        assert!(e.contains("the command's deadline passed after"), "{e}");
    }
    let again = wait_finished(&p, "c-again").await;
    assert_eq!(again.0, "done", "{again:?}");
    let result = again.1.clone().expect("result");
    assert!(result.get("error").is_none(), "{result}");
    assert_eq!(result["digest"], sha.as_str(), "{result}");
    let on_disk = lo.read(slow.len() as u64);
    assert!(
        on_disk[..image.len()] == image[..],
        "the device holds the second image"
    );
    // (Past the second image the device holds zeros where the cut stream wrote, then the earlier 10 MiB image.)
    let left = (image.len()..slow.len())
        .step_by(4096)
        .filter(|&at| on_disk[at..at + 4096] == slow[at..at + 4096])
        .count();
    assert_eq!(
        left, 0,
        "blocks of the stream cut at its deadline left on the device"
    );

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), agent).await???;
    Ok(())
}
