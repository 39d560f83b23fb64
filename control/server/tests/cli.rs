//! The `better-compute` binary: configuration errors name the field; `dev` comes up on a private PostgreSQL and a
//! second `dev` on the same directory reuses the database, the CA, the JoinService key and the admin key.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

#[test]
fn serve_refuses_bad_configuration_naming_the_field() {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--roles",
            "api,wizard",
            "--database-url",
            "postgres://x@127.0.0.1:1/x",
        ])
        .output()
        .expect("run better-compute");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("INVALID_CONFIG") && err.contains("roles") && err.contains("wizard"),
        "{err}"
    );
}

/// Starts `dev`, waits for its ready block, returns (lines, ready time) and stops it.
fn dev_once(dir: &std::path::Path) -> (Vec<String>, Duration) {
    let t0 = Instant::now();
    let mut child = Command::new(BIN)
        .args([
            "dev",
            "--api-listen",
            "127.0.0.1:0",
            "--gateway-listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn dev");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read");
        let done = line.contains("environment:");
        lines.push(line);
        if done {
            break;
        }
    }
    let ready = t0.elapsed();
    // SIGTERM: dev shuts the roles and PostgreSQL down cleanly.
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let status = child.wait().expect("wait dev");
    assert!(status.success(), "dev exited with {status}");
    (lines, ready)
}

fn field<'a>(lines: &'a [String], name: &str) -> &'a str {
    lines
        .iter()
        .find_map(|l| l.trim().strip_prefix(name))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {name} in {lines:?}"))
}

#[test]
fn second_dev_reuses_the_same_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (first, _) = dev_once(dir.path());
    let (second, ready) = dev_once(dir.path());
    for name in ["admin key:", "CA pin:", "join key:"] {
        assert_eq!(
            field(&first, name),
            field(&second, name),
            "{name} changed between runs"
        );
    }
    assert_ne!(
        field(&first, "join token:"),
        field(&second, "join token:"),
        "each dev mints a fresh token"
    );
    // Not a performance assertion (that is scripts/bench): a sanity bound far above the 3 s goal.
    assert!(ready < Duration::from_secs(30), "dev took {ready:?}");
}
