//! Issue 17: the `--help` of every `bcd` command, walked from the parser itself, against a reviewed golden file
//! (`BC_UPDATE_GOLDEN=1` rewrites it), and `--version` naming the commit.

const BIN: &str = env!("CARGO_BIN_EXE_bcd");

#[test]
fn every_commands_help_matches_its_golden_file() {
    let cmd = bcd::cli::command("golden");
    let pages = bc_testkit::help::help_pages(BIN.as_ref(), "bcd", &cmd);
    let n = bc_testkit::help::command_paths(&cmd).len();
    assert!(n > 15, "only {n} commands walked");
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
    let expected = format!("bcd {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(text.starts_with(&expected), "{text}");
}
