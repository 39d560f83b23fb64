//! scripts/test's skip accounting (scripts/test-skips) on real libtest output: this binary runs its own fixture
//! test, which skips in the way the environment asks, and the counter must see one skip for a skip! (printed twice,
//! counted once), none for a passing test, and flag the old stderr form (`SKIP <module>: why`, item 20 of issue
//! 10), which the former `grep -c '^SKIP:'` let pass as a pass.

use std::path::Path;
use std::process::Command;

const MODE: &str = "BC_TESTKIT_FIXTURE_MODE";

/// The fixture: ignored in a normal run (so it is neither a pass nor a skip there); the tests below run it.
#[test]
#[ignore = "fixture for the tests below, run by them with BC_TESTKIT_FIXTURE_MODE"]
fn fixture() {
    match std::env::var(MODE).as_deref() {
        Ok("skip") => {
            println!("some output before");
            bc_testkit::print_skip(module_path!(), "first line");
            bc_testkit::skip!("no such hardware here");
        }
        Ok("stderr") => {
            eprintln!("SKIP {}: not root", module_path!());
        }
        _ => {}
    }
}

/// Runs the fixture as scripts/test runs tests, then scripts/test-skips on that output.
fn account(mode: &str) -> (String, String) {
    let exe = std::env::current_exe().expect("current exe");
    let out = Command::new(&exe)
        .args(["--exact", "fixture", "--include-ignored", "--show-output"])
        .args(["--test-threads", "1"])
        .env(MODE, mode)
        .output()
        .expect("run the fixture");
    assert!(out.status.success(), "{out:?}");
    let log = format!(
        "     Running tests/skip_accounting.rs ({})\n{}{}",
        exe.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/test-skips");
    let mut child = Command::new(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run scripts/test-skips");
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(log.as_bytes())
        .expect("write the log");
    let done = child.wait_with_output().expect("scripts/test-skips");
    assert!(done.status.success(), "{done:?}");
    (log, String::from_utf8_lossy(&done.stdout).into_owned())
}

#[test]
fn a_skipping_test_is_counted_once_as_skipped() {
    let (log, found) = account("skip");
    assert!(
        log.contains("test result: ok. 1 passed"),
        "libtest counts it as passed:\n{log}"
    );
    let lines: Vec<&str> = found.lines().collect();
    assert_eq!(lines.len(), 1, "{found}");
    let fields: Vec<&str> = lines[0].split('\t').collect();
    assert_eq!(fields[0], "SKIPPED");
    assert_eq!(fields[2], "fixture");
    assert_eq!(fields[3], "SKIP: fixture: first line");
}

#[test]
fn a_passing_test_is_not_a_skip() {
    let (_, found) = account("pass");
    assert_eq!(found, "");
}

#[test]
fn a_skip_on_stderr_in_another_shape_is_flagged() {
    let (log, found) = account("stderr");
    assert!(log.contains("SKIP skip_accounting: not root"), "{log}");
    assert_eq!(found, "MALFORMED\tSKIP skip_accounting: not root\n");
    // The former accounting: grep -cE '^SKIP(PED)?:' found nothing, so this test counted as a pass.
    assert_eq!(
        log.lines()
            .filter(|l| l.starts_with("SKIP:") || l.starts_with("SKIPPED:"))
            .count(),
        0
    );
}
