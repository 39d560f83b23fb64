//! Every command's `--help` of a binary, walked from its clap tree, for a golden test: a command added to the
//! parser shows up in the walk, so its help lands in the golden file (or the test fails until it is reviewed).

use std::path::Path;
use std::process::Command;

/// The paths of every (sub)command under `cmd`, depth first, `cmd` itself first (an empty path); clap's generated
/// `help` subcommands are left out.
pub fn command_paths(cmd: &clap::Command) -> Vec<Vec<String>> {
    fn walk(cmd: &clap::Command, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        out.push(path.clone());
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            path.push(sub.get_name().to_string());
            walk(sub, path, out);
            path.pop();
        }
    }
    let mut out = Vec::new();
    walk(cmd, &mut Vec::new(), &mut out);
    out
}

/// `<bin> <path> --help` for every path of `cmd`, run as a process with an environment cleared of the variables
/// whose values clap shows (`[env: X=…]`), as one text: a `$ <bin> <path> --help` line, then the help. Panics
/// when one fails.
pub fn help_pages(bin: &Path, name: &str, cmd: &clap::Command) -> String {
    let mut text = String::new();
    for path in command_paths(cmd) {
        let mut c = Command::new(bin);
        c.args(&path).arg("--help").env_clear();
        if let Some(p) = std::env::var_os("PATH") {
            c.env("PATH", p);
        }
        let out = c
            .output()
            .unwrap_or_else(|e| panic!("running {} {path:?} --help: {e}", bin.display()));
        assert!(
            out.status.success(),
            "{name} {} --help: {out:?}",
            path.join(" ")
        );
        let shown = if path.is_empty() {
            format!("$ {name} --help\n")
        } else {
            format!("$ {name} {} --help\n", path.join(" "))
        };
        text.push_str(&shown);
        text.push_str(&String::from_utf8_lossy(&out.stdout));
        text.push('\n');
    }
    text
}
