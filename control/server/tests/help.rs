//! Issue 17: the `--help` of every `better-compute` command, walked from the parser itself, against a reviewed
//! golden file (`BC_UPDATE_GOLDEN=1` rewrites it): a new command cannot land without its help being read, and a
//! changed flag shows up in review. And `--version` names the commit the binary was built from.

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

#[test]
fn every_commands_help_matches_its_golden_file() {
    let cmd = bc_control::cli::command("golden");
    let pages = bc_testkit::help::help_pages(BIN.as_ref(), "better-compute", &cmd);
    // Not a count to keep in step: a floor that catches a walk that stopped at the top.
    let n = bc_testkit::help::command_paths(&cmd).len();
    assert!(n > 60, "only {n} commands walked");
    bc_testkit::assert_golden(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/help.txt"),
        &pages,
    );
}

#[test]
fn version_names_the_commit() {
    let out = std::process::Command::new(BIN)
        .arg("--version")
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let expected = format!("better-compute {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(text.starts_with(&expected), "{text}");
}
