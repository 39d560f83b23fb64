//! Issue 18 item 1: the control plane through a PostgreSQL failover. A primary and a synchronous streaming standby
//! (Debian's PostgreSQL, private data directories and ports, run as `postgres`), six `better-compute serve`
//! processes (api ×2, gateway, controllers ×2, scheduler) given the multi-host URL with
//! `target_session_attrs=read-write`, two real `bcd run` daemons in session, and admissions, joins and commands
//! throughout. The primary is killed (SIGKILL) and the standby promoted: every process's pool finds the new primary,
//! every role works again, nothing acknowledged is lost, nothing is booked twice and no command runs twice
//! ([`bc_bench::failover`], which `scripts/bench failover` runs in release).

use bc_bench::failover::{Failure, Options, Report, run};
use bc_store::embedded::Durability;
use std::path::{Path, PathBuf};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

/// The directory of this profile's binaries, with `bcd` in it: the one `BCD_BIN` names when it is this profile's
/// (scripts/test sets it to the `bcd` its `cargo test` built), else built here (a no-op when it is up to date). A
/// `cargo build -p bcd` after the workspace's `cargo test` is no no-op: cargo unifies features over the packages it
/// is asked for, so it compiled bcd and eight of its dependencies again (135 s of CI's 204 s in this test).
fn binaries() -> PathBuf {
    let dir = Path::new(BIN).parent().expect("bin dir").to_path_buf();
    if let Some(bcd) = std::env::var_os("BCD_BIN").map(PathBuf::from)
        && bcd.parent() == Some(dir.as_path())
    {
        assert!(bcd.is_file(), "BCD_BIN={} is not a file", bcd.display());
        return dir;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .args(["build", "-q", "--locked", "-p", "bcd", "--bin", "bcd"]);
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("cargo build -p bcd");
    assert!(status.success(), "building bcd failed");
    dir
}

/// The scenario with the primary failing as `failure`; its report, or a panic naming the kept logs.
async fn scenario(failure: Failure) -> Report {
    bc_proto::install_crypto_provider();
    let bin = binaries();
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = Options {
        // fsync off (a throwaway cluster); synchronous commit stays on, which is what the standby's copy needs.
        durability: Durability::Throwaway,
        failure,
        daemons: 2,
        shard_lease_ms: 2000,
        before: Duration::from_secs(5),
        after: Duration::from_secs(3),
        deadline: Duration::from_secs(90),
    };
    let r = match run(&bin, dir.path(), &opts).await {
        Ok(r) => r,
        Err(e) => {
            // Keep the processes' logs for the failure.
            let kept = dir.keep();
            panic!("{e:#} (logs under {})", kept.display());
        }
    };
    println!("{r:#?}");
    assert!(r.admissions > 0 && r.joins > 0 && r.commands > 0, "{r:?}");
    for (name, at) in &r.switches {
        assert!(
            at.is_some(),
            "{name} never logged its pool moving to the new primary"
        );
    }
    println!("failover: {:.1} s to recover", r.recovered.as_secs_f64());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_replaced_by_its_standby_and_every_role_resumes_losing_nothing() {
    scenario(Failure::Kill).await;
}

/// The primary hangs (SIGSTOP of its postmaster and processes): no connection is reset, so every process learns
/// only by its deadlines, and calls in flight hold their connections until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_primary_is_replaced_by_its_standby_and_every_role_resumes_losing_nothing() {
    scenario(Failure::Hang).await;
}
