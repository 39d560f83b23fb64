//! Issue 17 (item 5): the docs cannot drift from the binaries.
//!
//! - Every `better-compute …` and `bcd …` command that README.md and docs/*.md name (in code blocks and inline code)
//!   is a command of the parser: its words are walked down the clap tree (`a|b` alternatives each), so a page that
//!   lists a command that does not exist fails here.
//! - Every code block marked ` ```sh runnable` is run, in page order, by bash (`-e -o pipefail`) against a real
//!   `better-compute dev` on a private PostgreSQL, with its `dev.env` in the environment (BC_API_URL, BC_API_KEY,
//!   BC_JOIN_TOKEN, ...), the built `better-compute` first on the PATH and a scratch directory as the working
//!   directory shared by the page's blocks. A block that fails names its page and line.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");
/// The fence info string of a block the test runs.
const RUNNABLE: &str = "sh runnable";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// README.md and docs/*.md.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// A code block: its page, first line (1-based, the fence's), info string and text.
struct Block {
    page: PathBuf,
    line: usize,
    info: String,
    text: String,
}

fn blocks(page: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(page).expect("read page");
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut open, line.trim_start().strip_prefix("```")) {
            (None, Some(info)) => {
                open = Some(Block {
                    page: page.to_path_buf(),
                    line: i + 1,
                    info: info.trim().to_string(),
                    text: String::new(),
                })
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(b), None) => {
                b.text.push_str(line);
                b.text.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// The commands named on a line: each `better-compute` or `bcd` word (at a command position: the line's start,
/// after a backtick, `$ `, `|`, `&&`, `;` or an environment assignment) and the words after it.
fn commands(line: &str) -> Vec<(String, Vec<String>)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut found = Vec::new();
    for (i, w) in words.iter().enumerate() {
        let w = w.trim_start_matches(['`', '(']);
        if w.trim_end_matches(['`', ',', '.']) != "better-compute"
            && w.trim_end_matches(['`', ',', '.']) != "bcd"
        {
            continue;
        }
        let starts = i == 0
            || words[i].starts_with('`')
            || matches!(words[i - 1], "$" | "|" | "&&" | ";" | "#" | "sudo")
            || (words[i - 1].contains('=') && !words[i - 1].starts_with('-'));
        if !starts {
            continue;
        }
        // Inline code ends at its closing backtick; a code line at a comment.
        let inline = words[i].starts_with('`');
        let mut rest = Vec::new();
        for w in &words[i + 1..] {
            if *w == "#" {
                break;
            }
            rest.push(
                w.trim_end_matches(['`', ',', ')', ':', '.', ';'])
                    .to_string(),
            );
            if inline && w.contains('`') {
                break;
            }
        }
        if inline && w.contains('`') {
            // `bcd` alone: no command words.
            rest.clear();
        }
        found.push((w.trim_end_matches(['`', ',', '.']).to_string(), rest));
    }
    found
}

/// Why the words after the binary do not name a command of `cmd`, if they do not.
fn check(cmd: &clap::Command, words: &[String]) -> Option<String> {
    let first = words.first()?;
    // A command without subcommands takes arguments, not command words.
    cmd.get_subcommands().next()?;
    // Stop at what is not a command word: a flag, a placeholder, an ellipsis, a redirection.
    let word = first.as_str();
    if !word
        .chars()
        .all(|c| c.is_ascii_lowercase() || c == '-' || c == '|')
        || word.is_empty()
        || word.starts_with('-')
    {
        return None;
    }
    for alt in word.split('|').filter(|a| !a.is_empty()) {
        let Some(sub) = cmd.find_subcommand(alt) else {
            let known: Vec<&str> = cmd.get_subcommands().map(|s| s.get_name()).collect();
            return Some(format!(
                "{} has no command {alt:?} (it has: {})",
                cmd.get_name(),
                known.join(", ")
            ));
        };
        if let Some(why) = check(sub, &words[1..]) {
            return Some(why);
        }
    }
    None
}

#[test]
fn every_command_the_docs_name_exists() {
    let bc = bc_control::cli::command("docs");
    let bcd = bcd::cli::command("docs");
    let mut wrong = Vec::new();
    let mut seen = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read");
        for (n, line) in text.lines().enumerate() {
            for (bin, words) in commands(line) {
                seen += 1;
                let cmd = if bin == "bcd" { &bcd } else { &bc };
                if let Some(why) = check(cmd, &words) {
                    wrong.push(format!(
                        "{}:{}: `{bin} {}`: {why}",
                        page.strip_prefix(root()).unwrap_or(&page).display(),
                        n + 1,
                        words.join(" ")
                    ));
                }
            }
        }
    }
    assert!(seen > 50, "only {seen} commands found: is the scan broken?");
    assert!(
        wrong.is_empty(),
        "commands the docs name that do not exist:\n{}",
        wrong.join("\n")
    );
}

/// A `better-compute dev` on a private PostgreSQL, stopped on drop.
struct Dev {
    child: std::process::Child,
    env: Vec<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Dev {
    fn start() -> Dev {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("dev");
        let mut child = Command::new(BIN)
            .args([
                "dev",
                "--api-listen",
                "127.0.0.1:0",
                "--gateway-listen",
                "127.0.0.1:0",
                "--data-dir",
            ])
            .arg(&data)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn dev");
        let stdout = child.stdout.take().expect("stdout");
        // Bounded by dev itself: it prints its ready block or exits (its database has its own start deadline).
        for line in BufReader::new(stdout).lines() {
            if line.expect("read dev").contains("environment:") {
                break;
            }
        }
        let env = std::fs::read_to_string(data.join("dev.env"))
            .expect("dev.env")
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Dev {
            child,
            env,
            _dir: dir,
        }
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

#[test]
fn runnable_blocks_run_against_a_dev_control_plane() {
    let runnable: Vec<Block> = pages()
        .iter()
        .flat_map(|p| blocks(p))
        .filter(|b| b.info == RUNNABLE)
        .collect();
    assert!(
        runnable.len() >= 3,
        "only {} runnable blocks",
        runnable.len()
    );
    let dev = Dev::start();
    let bin_dir = Path::new(BIN).parent().expect("bin dir").to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut page: Option<(PathBuf, tempfile::TempDir)> = None;
    for b in &runnable {
        if page.as_ref().is_none_or(|(p, _)| *p != b.page) {
            page = Some((b.page.clone(), tempfile::tempdir().expect("scratch")));
        }
        let scratch = page
            .as_ref()
            .map(|(_, d)| d.path().to_path_buf())
            .expect("scratch");
        let out = Command::new("bash")
            .args(["-e", "-o", "pipefail", "-c", &b.text])
            .current_dir(&scratch)
            .envs(dev.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("PATH", &path)
            .env("BC_CONFIG", scratch.join("no-profile.toml"))
            .env_remove("BC_CONTEXT")
            .stdin(Stdio::null())
            .output()
            .expect("run bash");
        let at = format!(
            "{}:{}",
            b.page.strip_prefix(root()).unwrap_or(&b.page).display(),
            b.line
        );
        assert!(
            out.status.success(),
            "the runnable block at {at} failed ({}):\n{}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            b.text,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("ran {at} ({} lines)", b.text.lines().count());
    }
}
