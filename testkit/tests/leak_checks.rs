//! scripts/test's check of what the tests leave in their private TMPDIR (`scripts/test-leaks tmp DIR`): nothing, or
//! only the test harness's PostgreSQL clusters, passes; anything else fails the run and is named. (Found on
//! 2026-12-05: a fuzz target's static `TempDir`, never dropped, left an empty `/tmp/.tmpXXXXXX/sha256/` behind
//! every run.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A scratch directory of this test's own, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("bc-leak-check-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn check_tmp(dir: &Path) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/test-leaks");
    Command::new(script)
        .arg("tmp")
        .arg(dir)
        .output()
        .expect("run scripts/test-leaks")
}

#[test]
fn an_empty_tmpdir_or_one_with_only_the_harness_clusters_passes() {
    let s = Scratch::new("clean");
    let out = check_tmp(&s.0);
    assert!(out.status.success(), "{out:?}");
    std::fs::create_dir_all(s.0.join("bc-test-pg-4242/data")).expect("cluster dir");
    let out = check_tmp(&s.0);
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn a_directory_left_in_the_tmpdir_fails_the_run_and_is_named() {
    let s = Scratch::new("left");
    std::fs::create_dir_all(s.0.join(".tmpAbC123/sha256")).expect("leftover");
    std::fs::create_dir_all(s.0.join("bc-test-pg-4242")).expect("cluster dir");
    let out = check_tmp(&s.0);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        stderr.contains(".tmpAbC123: sha256"),
        "the leftover and what it holds are named:\n{stderr}"
    );
    assert!(!stderr.contains("bc-test-pg"), "{stderr}");
    // A file counts as much as a directory.
    std::fs::remove_dir_all(s.0.join(".tmpAbC123")).expect("remove");
    std::fs::write(s.0.join("stray.sock"), b"").expect("stray file");
    let out = check_tmp(&s.0);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("stray.sock"));
}
