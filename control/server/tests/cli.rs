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

/// Starts `dev` on `dir` and reads its ready block: the child and the block's lines. Its log goes to `dir/dev.log`.
fn start_dev(dir: &std::path::Path) -> (std::process::Child, Vec<String>) {
    let log = std::fs::File::create(dir.join("dev.log")).expect("dev.log");
    let mut child = Command::new(BIN)
        .args([
            "dev",
            "--api-listen",
            "127.0.0.1:0",
            "--gateway-listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.join("data"))
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn dev");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = Vec::new();
    // Bounded by dev itself: it prints its ready block or exits.
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read");
        let done = line.contains("environment:");
        lines.push(line);
        if done {
            break;
        }
    }
    (child, lines)
}

/// Starts `dev`, waits for its ready block, returns (lines, ready time) and stops it.
fn dev_once(dir: &std::path::Path) -> (Vec<String>, Duration) {
    let t0 = Instant::now();
    let (mut child, lines) = start_dev(dir);
    let ready = t0.elapsed();
    // SIGTERM: dev shuts the roles and PostgreSQL down cleanly.
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let status = child.wait().expect("wait dev");
    assert!(status.success(), "dev exited with {status}");
    (lines, ready)
}

/// A control plane whose database is gone still stops on SIGTERM within its grace period (bc_kernel::STOP_GRACE,
/// 10 s), aborting the roles still waiting on the pool. Before the grace period, `dev` took 57 s: two pool timeouts
/// of 30 s in a row (a step waiting on the pool, then the role's farewell write).
#[test]
fn dev_stops_within_the_grace_period_when_its_database_is_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, _) = start_dev(dir.path());
    // The postmaster's pid is the first line of its pid file.
    let pid_file = dir.path().join("data/pg/data/postmaster.pid");
    let text = std::fs::read_to_string(&pid_file)
        .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()));
    let pg = text.lines().next().expect("a pid line").trim().to_string();
    let killed = Command::new("kill")
        .args(["-9", &pg])
        .status()
        .expect("kill");
    assert!(killed.success(), "kill -9 {pg}");
    // Long enough for the roles' next steps to wait on the pool.
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let deadline = t0 + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("dev did not stop within 60 s of SIGTERM with its database gone");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let took = t0.elapsed();
    // The grace period and the rest of the stop (the pool closed, PostgreSQL's keeper joined), with room for a
    // loaded machine; 57 s before.
    println!(
        "dev stopped in {took:?} ({status}); its log ends:\n{}",
        bc_testkit::log_tail(&dir.path().join("dev.log"), 15)
    );
    assert!(
        took < Duration::from_secs(25),
        "dev took {took:?} to stop ({status})"
    );
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

/// Issue 17: a reader that goes away (`better-compute … | head -1`) ends the CLI quietly with 141, as SIGPIPE
/// would, where `println!` used to panic ("failed printing to stdout: Broken pipe") and exit 101.
#[test]
fn a_closed_stdout_ends_the_cli_quietly() {
    let mut child = Command::new(BIN)
        .arg("unit")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // The read end closes before the child's first write.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(141), "{out:?}");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 17: exit codes and errors a script can act on. A usage error exits 2 (clap); an operational error exits 1
/// with one line naming the cause and no backtrace; an unreachable database is named at once, not after the pool's
/// 30 s of silence ending in "pool timed out".
#[test]
fn errors_exit_1_in_one_line_and_an_unreachable_database_is_named_at_once() {
    let out = Command::new(BIN)
        .args(["nodes", "list", "--no-such-flag"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // One duration syntax: a bare number is a usage error that says how to write it.
    let out = Command::new(BIN)
        .args(["join-tokens", "create", "--ttl", "600", "--api-key", "k"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("write 600s"), "{err}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let t0 = Instant::now();
    let out = Command::new(BIN)
        .args(["migrate", "--database-url"])
        .arg(format!("postgres://x:secret@127.0.0.1:{port}/db"))
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run");
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {err}");
    assert!(
        err.starts_with("better-compute: error: connecting to PostgreSQL")
            && err.contains("refused")
            && err.lines().count() == 1
            && !err.contains("secret"),
        "{err}"
    );
}

/// Issue 17: shell completions and the man page come from the parser itself, so they cannot drift from it: bash
/// loads the completion script and registers it for `better-compute`; the man page is roff naming the commands.
#[test]
fn completions_load_in_bash_and_the_man_page_is_roff() {
    let out = Command::new(BIN)
        .args(["completion", "bash"])
        .output()
        .expect("run");
    assert!(out.status.success());
    let script = std::env::temp_dir().join(format!("bc-completion-{}.bash", std::process::id()));
    std::fs::write(&script, &out.stdout).expect("write");
    let loaded = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source {} && complete -p better-compute",
            script.display()
        ))
        .output();
    let _ = std::fs::remove_file(&script);
    match loaded {
        Err(e) => println!("bash is not here to load the script ({e}); checked its text only"),
        Ok(o) => assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("better-compute"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        ),
    }
    let man = Command::new(BIN).arg("man").output().expect("run");
    let text = String::from_utf8_lossy(&man.stdout);
    assert!(
        man.status.success() && text.contains(".TH better-compute"),
        "{text}"
    );
    // roff spells a hyphen `\-`.
    for command in ["reservations", "nodes", "join\\-tokens", "info"] {
        assert!(text.contains(command), "the man page lacks {command}");
    }
}
