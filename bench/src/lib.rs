//! bc-bench: benchmark programs run by `scripts/bench <name>`; each prints figures beside a peer measured in the same
//! run and ends with one summary line. This library holds what the programs share: a `better-compute dev` child,
//! PostgreSQL's client tools, hostile connections against the gateway ([`flood`], also used by the gateway's
//! flood regression tests), and the tunnel bench's peers and emulated network ([`peers`]: sshd, `ssh -L`, a shaped
//! link to a namespace; [`delay`]: the user-space delay line for kernels without netem).

pub mod delay;
pub mod failover;
pub mod flood;
pub mod peers;

use anyhow::{Context as _, bail};
use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `better-compute dev` and the environment it wrote (`dev.env`).
pub struct Dev {
    pub child: Child,
    pub env: HashMap<String, String>,
    /// From spawn to the ready block on stdout.
    pub ready_wall: Duration,
}

impl Dev {
    /// Starts `bin/better-compute dev` on `dir` with the gateway on `gateway` (`127.0.0.1:0` for any port) and waits
    /// until it is ready.
    pub fn start(bin: &Path, dir: &Path, gateway: &str) -> anyhow::Result<Dev> {
        Dev::spawn(Command::new(bin.join("better-compute")), dir, gateway)
    }

    /// As [`Dev::start`], under a descriptor limit (RLIMIT_NOFILE): soft `soft`, and hard `hard` when given (else
    /// the one this process has). Set by the shell that execs the binary, so the process id stays dev's.
    pub fn start_limited(
        bin: &Path,
        dir: &Path,
        gateway: &str,
        soft: u64,
        hard: Option<u64>,
    ) -> anyhow::Result<Dev> {
        let hard = hard
            .map(|h| format!(" && ulimit -Hn {h}"))
            .unwrap_or_default();
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg(format!("ulimit -Sn {soft}{hard} && exec \"$0\" \"$@\""))
            .arg(bin.join("better-compute"));
        Dev::spawn(sh, dir, gateway)
    }

    /// As [`Dev::start`], with `command` as the program (better-compute itself, or a tool that runs it: valgrind).
    pub fn spawn(command: Command, dir: &Path, gateway: &str) -> anyhow::Result<Dev> {
        Dev::spawn_with(command, dir, gateway, &[])
    }

    /// As [`Dev::spawn`], with more of dev's flags (`--config <file>`).
    pub fn spawn_with(
        mut command: Command,
        dir: &Path,
        gateway: &str,
        extra: &[&std::ffi::OsStr],
    ) -> anyhow::Result<Dev> {
        let t0 = Instant::now();
        let mut child = command
            .args([
                "dev",
                "--api-listen",
                "127.0.0.1:0",
                "--gateway-listen",
                gateway,
                "--data-dir",
            ])
            .arg(dir)
            .args(extra)
            .env("BC_LOG", "warn,sqlx=error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting better-compute dev")?;
        let stdout = child.stdout.take().context("dev stdout")?;
        let mut ready = false;
        for line in BufReader::new(stdout).lines() {
            if line?.contains("environment:") {
                ready = true;
                break;
            }
        }
        if !ready {
            bail!("dev exited before it was ready");
        }
        let ready_wall = t0.elapsed();
        let env = std::fs::read_to_string(dir.join("dev.env"))?
            .lines()
            .filter_map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        Ok(Dev {
            child,
            env,
            ready_wall,
        })
    }

    /// SIGTERM and wait: dev stops its roles and PostgreSQL. An error when it had to be killed.
    pub fn stop(mut self) -> anyhow::Result<()> {
        match self.terminate()? {
            true => Ok(()),
            false => bail!(
                "better-compute dev did not stop within {} s of SIGTERM; killed",
                DEV_STOP.as_secs()
            ),
        }
    }

    /// SIGTERM, then SIGKILL if dev has not exited within [`DEV_STOP`]; whether it exited by itself (or had already).
    fn terminate(&mut self) -> std::io::Result<bool> {
        Ok(matches!(
            bc_testkit::terminate(&mut self.child, DEV_STOP)?,
            bc_testkit::Stopped::Exited(..)
        ))
    }
}

/// How long dev has to stop on SIGTERM: its roles' grace period (10 s) and the rest of its stop (PostgreSQL's
/// shutdown after a 50,000-session run among it), with room.
const DEV_STOP: Duration = Duration::from_secs(60);

impl Drop for Dev {
    /// A bench that fails on its way does not leave `dev` running, holding its ports (/metrics on 9404 among them)
    /// and its PostgreSQL for the next run.
    fn drop(&mut self) {
        let _ = self.terminate();
    }
}

/// A PostgreSQL client tool (psql, pgbench) from Debian's server packages.
/// A fresh database `bench` on an embedded PostgreSQL under `dir`: migrated (modules included), with the root
/// tenant, the `default` pool and an administrator. Keep `pg` alive as long as the database is used.
pub struct BenchDb {
    pub pg: bc_store::embedded::EmbeddedPostgres,
    pub store: bc_store::Store,
    pub url: String,
    pub admin_key: String,
}

impl BenchDb {
    /// Starts it with `durability` and extra server `settings`; the store's pool holds `connections`.
    pub async fn start(
        dir: &Path,
        durability: bc_store::embedded::Durability,
        settings: &'static [&'static str],
        connections: u32,
    ) -> anyhow::Result<BenchDb> {
        let pg_dir = dir.join("pg");
        let pg = tokio::task::spawn_blocking(move || {
            bc_store::embedded::EmbeddedPostgres::start_with(&pg_dir, durability, settings)
        })
        .await??;
        let admin_pool = pg.pool("postgres", 2).await?;
        bc_store::sqlx::raw_sql("CREATE DATABASE bench")
            .execute(&admin_pool)
            .await?;
        let store = bc_store::Store::new(pg.pool("bench", connections).await?);
        bc_control::migrate(&store).await?;
        store.ensure_root_tenant().await?;
        store
            .ensure_pool("default", "root", "default", true)
            .await?;
        let admin_key = bc_control::bootstrap_admin(&store).await?;
        Ok(BenchDb {
            url: pg.url("bench"),
            pg,
            store,
            admin_key,
        })
    }
}

/// A number from the environment: `default` when `name` is unset; an error naming the setting when it is set to
/// something that does not parse or is below `min` (a typo must not run the default and look like a result).
pub fn knob<T>(name: &str, default: T, min: T) -> anyhow::Result<T>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    parse_knob(name, std::env::var(name).ok().as_deref(), default, min)
}

/// [`knob`] on a given value (None: unset).
fn parse_knob<T>(name: &str, value: Option<&str>, default: T, min: T) -> anyhow::Result<T>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    let Some(v) = value else {
        return Ok(default);
    };
    v.trim()
        .parse::<T>()
        .ok()
        .filter(|n| *n >= min)
        .with_context(|| format!("{name}={v:?}: give a number, at least {min} (unset: {default})"))
}

/// The load generator's runtime: `BC_BENCH_THREADS` worker threads, 2 by default (this machine's cores). On a
/// machine with more cores, more threads keep the generator from being what saturates first; the programs print
/// the generator's CPU beside the control plane's either way.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(knob("BC_BENCH_THREADS", 2, 1)?)
        .enable_all()
        .build()?)
}

pub fn pg_tool(name: &str) -> anyhow::Result<PathBuf> {
    std::fs::read_dir("/usr/lib/postgresql")?
        .flatten()
        .map(|e| e.path().join("bin").join(name))
        .find(|p| p.exists())
        .with_context(|| format!("{name} not found under /usr/lib/postgresql"))
}

/// One integer from a query, through psql.
pub fn query_i64(url: &str, q: &str) -> anyhow::Result<i64> {
    let out = Command::new(pg_tool("psql")?)
        .args([url, "-At", "-c", q])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// The `p` quantile of sorted durations, in milliseconds.
/// A process's resident set (VmRSS) in KiB; 0 once it is gone.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system) a process has used; 0 once it is gone.
pub fn cpu_s(pid: u32) -> f64 {
    // SC_CLK_TCK is 100 on Linux/x86_64.
    cpu_ticks(pid) as f64 / 100.0
}

/// PostgreSQL's processes: the postmaster (first line of `<data>/postmaster.pid`) and its children.
pub fn pg_pids(data: &Path) -> Vec<u32> {
    let Some(main) = std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()
        .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
    else {
        return Vec::new();
    };
    let mut pids = vec![main];
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')').and_then(|(_, a)| {
                        a.split_whitespace()
                            .nth(1)
                            .and_then(|p| p.parse::<u32>().ok())
                    })
                });
            if ppid == Some(main) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// The machine's CPU seconds so far, all cores together: (busy, idle), idle counting iowait, from /proc/stat.
pub fn machine_cpu_s() -> (f64, f64) {
    let line = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_default();
    let f: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let at = |i: usize| f.get(i).copied().unwrap_or(0.0) / 100.0;
    let idle = at(3) + at(4);
    let busy = at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
    (busy, idle)
}

/// A process's utime + stime in clock ticks (100 per second); 0 once it is gone.
pub fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            Some(rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

pub fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx].as_secs_f64() * 1000.0
}

#[cfg(test)]
mod knob_tests {
    use super::parse_knob;

    #[test]
    fn unset_is_the_default_and_a_bad_value_is_refused_by_name() {
        assert_eq!(parse_knob("BC_X", None, 64usize, 1).expect("unset"), 64);
        assert_eq!(
            parse_knob("BC_X", Some(" 128 "), 64usize, 1).expect("128"),
            128
        );
        assert_eq!(
            parse_knob("BC_R", Some("1500"), 1000.0, 1.0).expect("1500"),
            1500.0
        );
        for bad in ["abc", "0", "-3", ""] {
            let e = parse_knob("BC_X", Some(bad), 64usize, 1)
                .expect_err("refused")
                .to_string();
            assert_eq!(
                e,
                format!("BC_X={bad:?}: give a number, at least 1 (unset: 64)")
            );
        }
    }
}
