//! `scripts/bench failover`: the control plane through a PostgreSQL failover ([`bc_bench::failover`]): a primary and
//! a synchronous streaming standby (fsync and synchronous_commit on), six `better-compute serve` processes on the
//! multi-host URL, three real `bcd run` daemons, admissions, joins and commands throughout; the primary is killed
//! (SIGKILL) and the standby promoted at once. It prints when each role worked again, when each process's pool
//! moved, the checks (nothing acknowledged lost, nothing booked twice, no command run twice), and ends with
//! `failover: <s> s to recover` (the latest role's first success after the kill). The peer in the same run is
//! PostgreSQL's own promotion time (`pg_promote`, which the recovery includes).

use bc_bench::failover::{Failure, Options, run};
use bc_store::embedded::Durability;
use std::path::PathBuf;
use std::time::Duration;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    let bin =
        PathBuf::from(std::env::var("BC_BIN_DIR").unwrap_or_else(|_| "target/release".into()));
    let data = tempfile::tempdir()?;
    // BC_FAILOVER_FAILURE=hang stops the primary (SIGSTOP) instead of killing it.
    let failure = match std::env::var("BC_FAILOVER_FAILURE").as_deref() {
        Ok("hang") => Failure::Hang,
        Ok("kill") | Err(_) => Failure::Kill,
        Ok(other) => anyhow::bail!("BC_FAILOVER_FAILURE={other}: use kill (the default) or hang"),
    };
    let opts = Options {
        durability: Durability::Durable,
        failure,
        daemons: 3,
        shard_lease_ms: 2000,
        before: Duration::from_secs(10),
        after: Duration::from_secs(10),
        deadline: Duration::from_secs(120),
    };
    // BC_FAILOVER_KEEP=1 keeps the processes' logs and both clusters' directories.
    let dir = if std::env::var("BC_FAILOVER_KEEP").as_deref() == Ok("1") {
        let kept = data.keep();
        println!("keeping {}", kept.display());
        kept
    } else {
        data.path().to_path_buf()
    };
    let r = run(&bin, &dir, &opts).await?;
    println!(
        "load: {} admissions, {} joins, {} commands acknowledged; {} calls failed during the outage (admissions retried under their key)",
        r.admissions, r.joins, r.commands, r.failed_calls
    );
    println!(
        "standby promoted (pg_promote, waited) in {:.2} s after the kill",
        r.promote.as_secs_f64()
    );
    for (name, at) in &r.switches {
        println!(
            "  {name}: pool moved to the new primary at {}",
            at.map(|d| format!("{:.2} s", d.as_secs_f64()))
                .unwrap_or_else(|| "(no switch logged)".into())
        );
    }
    for role in &r.roles {
        println!(
            "  {}: {} at {}",
            role.role,
            role.what,
            role.after
                .map(|d| format!("{:.2} s", d.as_secs_f64()))
                .unwrap_or_else(|| "never".into())
        );
    }
    for c in &r.checks {
        println!("  check: {c}");
    }
    println!("failover: {:.1} s to recover", r.recovered.as_secs_f64());
    Ok(())
}
