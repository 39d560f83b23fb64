//! `--watch`: repeats a read (a `list`, a `show`, `info`) every `--interval` by running this same command line
//! again with the watch turned off, and prints its output when it changed. On a terminal the screen is redrawn
//! under a header line (like watch(1)); elsewhere each changed output is printed after the last, so a pipe gets
//! the successive states (JSON documents one after another, as `jq` reads them). A failed read is shown and the
//! watch goes on; Ctrl-C ends it.

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;
use std::time::Duration;

/// The commands whose last word is one of these are reads.
const READS: [&str; 3] = ["list", "show", "info"];

/// The last subcommand's name (`nodes list` → `list`) and the whole path.
fn path(matches: &clap::ArgMatches) -> Vec<String> {
    let mut out = Vec::new();
    let mut m = matches;
    while let Some((name, sub)) = m.subcommand() {
        out.push(name.to_string());
        m = sub;
    }
    out
}

/// Runs the watch: never returns while reads go on, except for a command that is not a read (a usage error, 2).
pub fn run(matches: &clap::ArgMatches, interval: Duration, marker: &str) -> ExitCode {
    let path = path(matches);
    if !path.last().is_some_and(|l| READS.contains(&l.as_str())) {
        eprintln!(
            "better-compute: error: --watch repeats reads (list, show, info); `{}` is not one",
            path.join(" ")
        );
        return ExitCode::from(2);
    }
    let tty = std::io::stdout().is_terminal();
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("better-compute: error: --watch cannot find its own program: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut last: Option<Vec<u8>> = None;
    loop {
        let out = std::process::Command::new(&exe)
            .args(&args)
            .env(marker, "1")
            .stdin(std::process::Stdio::null())
            .output();
        let shown = match out {
            Ok(o) if o.status.success() => o.stdout,
            Ok(o) => [o.stdout, o.stderr].concat(),
            Err(e) => format!("better-compute: error: running the read: {e}\n").into_bytes(),
        };
        if last.as_ref() != Some(&shown) {
            let mut stdout = std::io::stdout().lock();
            let written = if tty {
                let header = format!(
                    "Every {}: better-compute {}    {}\n\n",
                    crate::output::age(Some(0), interval.as_millis() as i64),
                    path.join(" "),
                    crate::output::rfc3339(crate::output::now_ms())
                );
                stdout
                    .write_all(b"\x1b[H\x1b[2J")
                    .and_then(|()| stdout.write_all(header.as_bytes()))
                    .and_then(|()| stdout.write_all(&shown))
            } else {
                stdout.write_all(&shown)
            };
            if written.and_then(|()| stdout.flush()).is_err() {
                // The reader went away (`| head`): end quietly, as SIGPIPE would.
                return ExitCode::from(bc_proto::runtime::BROKEN_PIPE_EXIT as u8);
            }
            last = Some(shown);
        }
        std::thread::sleep(interval);
    }
}
