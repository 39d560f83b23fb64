//! Helpers shared by the hwtests that run the real `bcd` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

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

    /// SIGTERM, then SIGKILL after `grace`; returns whether it exited by itself within the grace.
    pub fn terminate(&mut self, grace: Duration) -> bool {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
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
            eprintln!("pxe_lab: killed {} (pid {})", self.name, self.child.id());
        }
    }
}

/// `BCD_BIN`, else `cargo build -p bcd` (a no-op when up to date) next to this test's own profile directory.
pub fn bcd_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("BCD_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary path")?
        .to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace()).args([
        "build",
        "-q",
        "-p",
        "bcd",
        "--bin",
        "bcd",
        "--features",
        "site",
    ]);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    cmd.arg("--locked");
    run(&mut cmd).context("building bcd (or set BCD_BIN)")?;
    Ok(profile_dir.join("bcd"))
}
