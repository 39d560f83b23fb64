//! Issue 17: the `bcd` binary's surface: the `--help` of every command, walked from the parser itself, against a
//! reviewed golden file (`BC_UPDATE_GOLDEN=1` rewrites it); `--version` naming the commit; log lines with their
//! journal priority under systemd.

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

/// Issue 17 (item 2): under systemd (`JOURNAL_STREAM` names the daemon's stderr) each log line starts with its
/// sd-daemon priority and carries no timestamp of its own, so journald files it at its level (`journalctl -p
/// warning` shows it); written elsewhere (a file, a terminal) the lines stay as they were. Before, every line went
/// to the journal at one priority with its own timestamp.
#[test]
fn logs_to_the_journal_carry_their_priority() {
    use std::os::unix::fs::MetadataExt as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let log = |journal: Option<&str>| -> String {
        let path = dir.path().join("stderr");
        let file = std::fs::File::create(&path).expect("create");
        let meta = file.metadata().expect("stat");
        let mut c = std::process::Command::new(BIN);
        // A GPU backend that cannot open: bcd warns and samples without GPUs.
        c.args([
            "telemetry",
            "--once",
            "--config",
            "/nonexistent",
            "--gpu-backend",
        ])
        .arg(format!(
            "fixture:{}",
            dir.path().join("none.json").display()
        ))
        .arg("--state-dir")
        .arg(dir.path())
        .arg("--hardware-root")
        .arg(dir.path())
        .env_remove("NO_COLOR")
        .env("BCD_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(file);
        match journal {
            Some("this") => c.env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino())),
            Some(other) => c.env("JOURNAL_STREAM", other),
            None => c.env_remove("JOURNAL_STREAM"),
        };
        let status = c.status().expect("run bcd");
        assert!(status.success(), "{status}");
        std::fs::read_to_string(&path).expect("read")
    };
    let journal = log(Some("this"));
    let warn = journal
        .lines()
        .find(|l| l.contains("no GPU backend"))
        .unwrap_or_else(|| panic!("no warning in {journal}"));
    assert!(warn.starts_with("<4> WARN"), "{warn}");
    assert!(!journal.contains('\x1b'), "{journal}");
    for (name, text) in [("a file", log(None)), ("another stream", log(Some("1:2")))] {
        let warn = text
            .lines()
            .find(|l| l.contains("no GPU backend"))
            .unwrap_or_else(|| panic!("{name}: no warning in {text}"));
        assert!(
            !warn.starts_with('<') && warn.contains("WARN") && warn.starts_with("20"),
            "{name}: a timestamped line without priority: {warn}"
        );
    }
}
