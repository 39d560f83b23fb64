//! Child processes killed by PID, commands run to completion, and the one skip helper of the hwtests.

use std::fs;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Runs `cmd` to completion; its stdout, or an error with its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether `cmd` is on the PATH.
pub fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Prints `SKIP: <test>: <why>` on stdout through the workspace's one skip helper ([`bc_testkit::print_skip`]) and
/// returns Ok (a skip is not a pass: scripts/test counts the line), or fails when `BC_HWTESTS_REQUIRE_LAB=1` asks
/// for the lab to be there.
pub fn skip(test: &str, why: impl std::fmt::Display) -> Result<()> {
    if std::env::var_os("BC_HWTESTS_REQUIRE_LAB").is_some_and(|v| v == "1") {
        bail!("{test}: BC_HWTESTS_REQUIRE_LAB=1 but {why}");
    }
    bc_testkit::print_skip(test, &why.to_string());
    Ok(())
}

/// A child process killed (by its PID) and reaped when dropped.
pub struct Proc {
    pub name: &'static str,
    pub child: Child,
}

impl Proc {
    pub fn spawn(name: &'static str, cmd: &mut Command) -> Result<Proc> {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Proc { name, child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then SIGKILL after `grace`; returns whether it exited by itself within the grace.
    pub fn terminate(&mut self, grace: Duration) -> bool {
        if let Ok(Some(_)) = self.child.try_wait() {
            return true;
        }
        signal(self.child.id(), "TERM");
        let end = Instant::now() + grace;
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
            eprintln!("hwtests: killed {} (pid {})", self.name, self.child.id());
        }
    }
}

/// Sends `SIG<sig>` to one PID (never a group, never by name).
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// The start time of a process (field 22 of `/proc/<pid>/stat`, clock ticks since boot): with the PID it names one
/// process, so a PID reused by an unrelated process is never signalled. `None` when there is no such process.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}
