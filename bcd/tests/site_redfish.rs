//! `bcd site redfish --secret` end to end: a real control plane (fresh PostgreSQL, mTLS on loopback) holds the BMC
//! credentials of site rack-1 as a secret; the real `bcd` binary, with the identity of an enrolled agent of that
//! site, gets them from the broker as a JWE to a per-request key and drives a real Redfish emulator (sushy-tools'
//! `sushy-emulator --fake`, HTTP Basic auth through `SUSHY_EMULATOR_AUTH_FILE` with a bcrypt htpasswd file) on
//! loopback: inspect, and a boot-once to Pxe read back. A wrong password is the emulator's 401, reported as such; a
//! secret of another site is refused by the broker; a secret that is not `{"username", "password"}` is refused
//! without being quoted; `--secret` and `--password-env` exclude each other. No output of any run holds the
//! password (nor its Basic encoding), with debug logging on.
//!
//! The emulator is `BC_SUSHY_EMULATOR` (scripts/setup installs it into .venv-sushy) or `sushy-emulator` on the PATH;
//! the htpasswd line is made with the `bcrypt` module of the python next to it. Without them the test prints
//! `SKIP: <test>: <reason>` (bc_testkit::skip!).

mod common;

use base64::Engine as _;
use bc_proto::v1;
use common::sushy::{PASSWORD, USER, start_emulator};
use common::{Plane, TestResult, plane};
use serde_json::json;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_bcd");
const WRONG: &str = "Wrong-pw-0b52d6aa";
const GARBLED: &str = "plain-text-pw-5e81c0";

async fn site_token(p: &Plane, site: &str) -> anyhow::Result<String> {
    let v = p
        .admin
        .call("site-tokens", "create", json!({"site": site, "uses": 1}))
        .await?;
    Ok(v["token"].as_str().unwrap_or_default().to_string())
}

async fn enroll(p: &Plane, state: &str, token: &str) -> anyhow::Result<()> {
    bcd::join::enroll_site(
        &p.node_config(state),
        token,
        bcd::join::JoinOptions {
            attempts: 1,
            claims: v1::HardwareClaims {
                hostname: state.into(),
                ..Default::default()
            },
        },
    )
    .await?;
    Ok(())
}

async fn put_secret(p: &Plane, site: &str, name: &str, value: &str) -> anyhow::Result<()> {
    p.admin
        .call(
            "secrets",
            "put",
            json!({"site": site, "name": name, "value": value}),
        )
        .await?;
    Ok(())
}

/// `bcd site redfish <url> <args>` with debug logging, no password in the environment.
fn bcd(url: &str, args: &[&str]) -> Output {
    let out = Command::new(BIN)
        .args(["site", "redfish", url])
        .args(args)
        .env("BCD_LOG", "debug")
        .env_remove("BMC_PASSWORD")
        .output()
        .expect("run bcd");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!("$ bcd site redfish {url} {}", args.join(" "));
    println!("exit {:?}\n{stdout}", out.status.code());
    // The last lines of the log: the error, if any (the debug log above it is long).
    let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
    println!("stderr (last lines): {tail:?}");
    let basic = |user: &str, pw: &str| {
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pw}"))
    };
    for secret in [
        PASSWORD.to_string(),
        WRONG.to_string(),
        GARBLED.to_string(),
        basic(USER, PASSWORD),
        basic(USER, WRONG),
    ] {
        assert!(
            !stdout.contains(&secret) && !stderr.contains(&secret),
            "the output of `bcd site redfish {}` holds a secret",
            args.join(" ")
        );
    }
    out
}

fn state_arg(p: &Plane, name: &str) -> String {
    p.dir.path().join(name).display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokered_credentials_drive_the_redfish_emulator() -> TestResult {
    bc_proto::install_crypto_provider();
    let emu = match start_emulator()? {
        Ok(emu) => emu,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    let p = plane().await;
    enroll(&p, "site-1", &site_token(&p, "rack-1").await?).await?;
    enroll(&p, "site-2", &site_token(&p, "rack-2").await?).await?;
    let creds = |pw: &str| json!({"username": USER, "password": pw}).to_string();
    put_secret(&p, "rack-1", "bmc/node-1", &creds(PASSWORD)).await?;
    put_secret(&p, "rack-1", "bmc/wrong", &creds(WRONG)).await?;
    put_secret(&p, "rack-1", "bmc/garbled", GARBLED).await?;
    put_secret(&p, "rack-2", "bmc/rack-2-only", &creds(PASSWORD)).await?;
    let site1 = state_arg(&p, "site-1");
    let site2 = state_arg(&p, "site-2");

    // Inspect with the brokered credentials.
    let out = bcd(
        &emu.url(),
        &["--state-dir", &site1, "--secret", "bmc/node-1", "inspect"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.to_lowercase().contains("system"), "{text}");
    let delivered: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'secret.delivered' \
         AND subject = 'site/rack-1/secret/bmc/node-1'",
    )
    .fetch_one(p.store.pool())
    .await?;
    assert_eq!(delivered, 1, "one delivery per operation");

    // Boot-once to Pxe: the PATCH is authenticated and read back. sushy's fake driver sets the target but keeps
    // Enabled=Continuous (hard-coded in its template), so the read-back reports the override as not applied.
    let out = bcd(
        &emu.url(),
        &[
            "--state-dir",
            &site1,
            "--secret",
            "bmc/node-1",
            "boot-once",
            "pxe",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a Continuous override reported as success"
    );
    assert!(err.contains("Target=Pxe"), "{err}");
    assert!(err.contains("not applied"), "{err}");
    assert!(!err.contains("rejected the credentials"), "{err}");
    // Read back by hand, with the credentials the test knows.
    let http = reqwest::Client::new();
    let systems: serde_json::Value = http
        .get(format!("{}/redfish/v1/Systems", emu.url()))
        .basic_auth(USER, Some(PASSWORD))
        .send()
        .await?
        .json()
        .await?;
    let system = systems["Members"][0]["@odata.id"]
        .as_str()
        .ok_or("no system")?
        .to_string();
    let sys: serde_json::Value = http
        .get(format!("{}{system}", emu.url()))
        .basic_auth(USER, Some(PASSWORD))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(sys["Boot"]["BootSourceOverrideTarget"], "Pxe", "{sys}");

    // A wrong password in the secret: the emulator's 401, said as such, with the secret to fix.
    let out = bcd(
        &emu.url(),
        &["--state-dir", &site1, "--secret", "bmc/wrong", "inspect"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("HTTP 401"), "{err}");
    assert!(err.contains("rejected the credentials"), "{err}");
    assert!(
        err.contains("better-compute secrets put bmc/wrong --site rack-1"),
        "{err}"
    );

    // Another site's secret: the broker refuses it (NOT_FOUND for this site), the BMC is never asked.
    let out = bcd(
        &emu.url(),
        &[
            "--state-dir",
            &site1,
            "--secret",
            "bmc/rack-2-only",
            "inspect",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("refused secret"), "{err}");
    assert!(err.contains("NotFound"), "{err}");
    assert!(err.contains("rack-1"), "{err}");
    // ... while its own site's agent gets it.
    let out = bcd(
        &emu.url(),
        &[
            "--state-dir",
            &site2,
            "--secret",
            "bmc/rack-2-only",
            "inspect",
        ],
    );
    assert!(
        out.status.success(),
        "rack-2 inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Not BMC credentials: refused with the format to use, without quoting it.
    let out = bcd(
        &emu.url(),
        &["--state-dir", &site1, "--secret", "bmc/garbled", "inspect"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("is not JSON (syntax error at line 1, column 1)"),
        "{err}"
    );
    assert!(err.contains(r#"{"username": "<BMC user>""#), "{err}");

    // Without an enrolled agent: said so.
    let out = bcd(
        &emu.url(),
        &[
            "--state-dir",
            &state_arg(&p, "nobody"),
            "--secret",
            "bmc/node-1",
            "inspect",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("has not enrolled yet"), "{err}");
    Ok(())
}

#[test]
fn secret_and_password_env_exclude_each_other() {
    for extra in [["--password-env", "BMC_PASSWORD"], ["--user", "root"]] {
        let out = bcd(
            "http://127.0.0.1:9",
            &["--secret", "bmc/x", extra[0], extra[1], "inspect"],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("cannot be used with"), "{err}");
    }
    // Without --secret, an unset password variable is an error that says what to do, not an empty password.
    let out = bcd(
        "http://127.0.0.1:9",
        &["--password-env", "BC_TEST_NO_SUCH_VAR", "inspect"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("BC_TEST_NO_SUCH_VAR, which is not set"),
        "{err}"
    );
    assert!(err.contains("--secret"), "{err}");
}

/// A BMC with sessions whose Systems collection never answers in time: enough to interrupt `bcd site redfish`
/// mid-inspect. Records every request line; a session is open from its POST until its DELETE.
async fn slow_session_bmc()
-> anyhow::Result<(String, std::sync::Arc<std::sync::Mutex<Vec<String>>>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log2 = log.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let log = log2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let mut chunk = [0u8; 4096];
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    while buf.len() < end + 4 + len {
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..end + 4 + len);
                    let line = head.lines().next().unwrap_or_default().to_owned();
                    log.lock().map(|mut l| l.push(line.clone())).ok();
                    let mut parts = line.split(' ');
                    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                    let (status, extra, body) = match (method, path.trim_end_matches('/')) {
                        ("GET", "/redfish/v1") => ("200 OK", String::new(), r#"{"@odata.id":"/redfish/v1","RedfishVersion":"1.15.0","Systems":{"@odata.id":"/redfish/v1/Systems"},"SessionService":{"@odata.id":"/redfish/v1/SessionService"},"Links":{"Sessions":{"@odata.id":"/redfish/v1/SessionService/Sessions"}}}"#.to_owned()),
                        ("POST", "/redfish/v1/SessionService/Sessions") => ("201 Created", "X-Auth-Token: t1\r\nLocation: /redfish/v1/SessionService/Sessions/1\r\n".to_owned(), r#"{"@odata.id":"/redfish/v1/SessionService/Sessions/1"}"#.to_owned()),
                        ("DELETE", _) => ("204 No Content", String::new(), String::new()),
                        ("GET", "/redfish/v1/Systems") => {
                            tokio::time::sleep(Duration::from_secs(60)).await;
                            ("200 OK", String::new(), r#"{"Members":[]}"#.to_owned())
                        }
                        _ => ("404 Not Found", String::new(), r#"{"error":{"code":"Base.1.8.ResourceMissingAtURI","message":"no such resource"}}"#.to_owned()),
                    };
                    let resp = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}\r\n{body}",
                        body.len()
                    );
                    if conn.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok((url, log))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_and_sigterm_log_the_session_out() -> anyhow::Result<()> {
    for signal in ["INT", "TERM"] {
        let (url, log) = slow_session_bmc().await?;
        let child = Command::new(BIN)
            .args(["site", "redfish", &url, "--user", "admin", "inspect"])
            .env("BMC_PASSWORD", "pw")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        // Wait until the session is open and the inventory is under way.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !log
            .lock()
            .map(|l| l.iter().any(|x| x.starts_with("GET /redfish/v1/Systems")))
            .unwrap_or(false)
        {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "bcd never reached the systems: {:?}",
                log.lock().map(|l| l.clone())
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -{signal}");
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!(
            "SIG{signal}: exit {:?}, stderr tail: {:?}",
            out.status.code(),
            stderr.lines().last()
        );
        assert_eq!(out.status.code(), Some(130), "{stderr}");
        assert!(stderr.contains("interrupted"), "{stderr}");
        let lines = log.lock().map(|l| l.clone()).unwrap_or_default();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("DELETE /redfish/v1/SessionService/Sessions/1")),
            "SIG{signal}: the session was not logged out: {lines:?}"
        );
    }
    Ok(())
}
