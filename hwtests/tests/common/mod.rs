//! Helpers shared by the hwtests that run the real `bcd` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
#[allow(unused_imports)]
pub use bc_hwtests::{Proc, run};

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
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

/// `BC_CONTROL_BIN`, else `cargo build -p bc-control --bin better-compute` next to this test's own profile directory.
pub fn control_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("BC_CONTROL_BIN") {
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
        "bc-control",
        "--bin",
        "better-compute",
    ]);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    cmd.arg("--locked");
    run(&mut cmd).context("building better-compute (or set BC_CONTROL_BIN)")?;
    Ok(profile_dir.join("better-compute"))
}
