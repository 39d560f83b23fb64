//! A primary and a synchronous streaming standby of it, from Debian's PostgreSQL server binaries: what a failover
//! test and `scripts/bench failover` run the control plane on. Both are [`EmbeddedPostgres`] children (private data
//! directories, loopback ports, run as `postgres` when we are root). The standby is a `pg_basebackup -R` copy of the
//! primary streaming through a replication slot; once it streams, the primary names it synchronous
//! (`synchronous_standby_names = '*'`, `synchronous_commit = on`), so a commit is acknowledged only once the
//! standby has flushed it: killing the primary loses nothing that was acknowledged.

use crate::embedded::{
    Durability, EmbeddedError, EmbeddedPostgres, command, find_bin_dir, io_err, run, run_as,
};
use sqlx::{ConnectOptions as _, Connection as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The standby's replication slot on the primary.
const SLOT: &str = "bc_standby";

/// A primary (until [`Replicated::kill_primary`]) and its synchronous standby.
pub struct Replicated {
    primary: Option<EmbeddedPostgres>,
    pub standby: EmbeddedPostgres,
    primary_port: u16,
    /// The primary's processes stopped by [`Replicated::freeze_primary`], its postmaster first.
    frozen: Vec<i32>,
}

fn step_err<'a>(
    what: &'static str,
    dir: &'a Path,
) -> impl FnOnce(sqlx::Error) -> EmbeddedError + 'a {
    move |e| EmbeddedError::Io {
        what,
        path: dir.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    }
}

impl Replicated {
    /// Starts a primary under `dir/primary`, creates `database` on it, copies it to `dir/standby` with
    /// `pg_basebackup`, starts the standby and waits (60 s at most) until the primary reports it synchronous.
    /// `durability` applies to both (synchronous commit stays on either way: it is what makes the standby hold every
    /// acknowledged commit).
    pub async fn start(
        dir: &Path,
        durability: Durability,
        database: &str,
    ) -> Result<Replicated, EmbeddedError> {
        // `wal_retrieve_retry_interval`: a standby whose primary vanished waits this long between tries to get WAL,
        // and a promotion requested during that wait ends recovery only after it (PostgreSQL 15: "received promote
        // request", then 5 s to "redo done" at the default 5 s, in 2 of 12 runs of `scripts/bench failover`; the
        // control plane waited for it). 200 ms, as a failover's operator would set it (docs/failover.md).
        let settings = [
            "synchronous_commit=on",
            "wal_level=replica",
            "max_wal_senders=4",
            "wal_retrieve_retry_interval=200ms",
        ];
        let primary = EmbeddedPostgres::start_with(&dir.join("primary"), durability, &settings)?;
        let mut conn = connect_ready(&primary).await?;
        if database.is_empty()
            || !database
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(EmbeddedError::Connect(sqlx::Error::Configuration(
                format!("database name {database:?}: use [a-z0-9_]").into(),
            )));
        }
        // The name is checked above: lower-case letters, digits and underscores only.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{database}\""
        )))
        .execute(&mut conn)
        .await
        .map_err(step_err("creating the database", dir))?;
        let standby_dir = dir.join("standby");
        base_backup(&primary, &standby_dir)?;
        let standby = EmbeddedPostgres::start_with(&standby_dir, durability, &settings)?;
        for q in [
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
            "SELECT pg_reload_conf()",
        ] {
            sqlx::query(q)
                .execute(&mut conn)
                .await
                .map_err(step_err("naming the standby synchronous", dir))?;
        }
        let start = Instant::now();
        loop {
            let sync: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE sync_state = 'sync' LIMIT 1",
            )
            .fetch_optional(&mut conn)
            .await
            .map_err(step_err("reading pg_stat_replication", dir))?;
            if sync.is_some() {
                break;
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(EmbeddedError::NotReady {
                    secs: 60,
                    log: standby_dir.join("postgres.log"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = conn.close().await;
        Ok(Replicated {
            primary_port: primary.port(),
            primary: Some(primary),
            standby,
            frozen: Vec::new(),
        })
    }

    /// The primary, until it is killed.
    pub fn primary(&self) -> Option<&EmbeddedPostgres> {
        self.primary.as_ref()
    }

    /// A libpq multi-host URL for `database` listing the primary's port, then the standby's, with
    /// `target_session_attrs=read-write`.
    pub fn url(&self, database: &str) -> String {
        let single = self.standby.url(database);
        let host = format!("127.0.0.1:{}", self.standby.port());
        single.replacen(&host, &format!("127.0.0.1:{},{host}", self.primary_port), 1)
            + "?target_session_attrs=read-write"
    }

    /// SIGKILL the primary's postmaster (as a crash would) and wait for it. Its backends notice and exit; frozen
    /// ones ([`Replicated::freeze_primary`]) are killed too.
    pub fn kill_primary(&mut self) {
        for pid in self.frozen.drain(..).skip(1) {
            signal(pid, libc::SIGKILL);
        }
        if let Some(p) = self.primary.take() {
            p.kill();
        }
    }

    /// The primary hangs (a stalled disk, a VM paused): SIGSTOP its postmaster, then every process it started. Their
    /// sockets stay open and the kernel still acknowledges what clients send, so no client sees an error, ever:
    /// only its own deadlines tell it. [`Replicated::kill_primary`], or dropping this, ends them. Returns how many
    /// processes were stopped.
    pub fn freeze_primary(&mut self) -> usize {
        let Some(root) = self.primary.as_ref().map(EmbeddedPostgres::pid) else {
            return 0;
        };
        // The postmaster first, so it starts no process after the list is read.
        signal(root, libc::SIGSTOP);
        self.frozen = vec![root];
        for pid in children_of(root) {
            signal(pid, libc::SIGSTOP);
            self.frozen.push(pid);
        }
        self.frozen.len()
    }

    /// Promotes the standby (`pg_promote`, waiting for it) and returns how long that took.
    pub async fn promote_standby(&self) -> Result<Duration, EmbeddedError> {
        let t0 = Instant::now();
        let mut conn = connect_ready(&self.standby).await?;
        let done: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
            .fetch_one(&mut conn)
            .await
            .map_err(step_err("promoting the standby", self.standby.data_dir()))?;
        let _ = conn.close().await;
        if !done {
            return Err(EmbeddedError::NotReady {
                secs: 60,
                log: self.standby.data_dir().join("../postgres.log"),
            });
        }
        Ok(t0.elapsed())
    }
}

/// A connection to `pg`'s `postgres` database, retried for 30 s while the server is still starting up (it accepts
/// TCP before it accepts sessions).
async fn connect_ready(pg: &EmbeddedPostgres) -> Result<sqlx::PgConnection, EmbeddedError> {
    let start = Instant::now();
    loop {
        match pg.connect_options("postgres").connect().await {
            Ok(c) => return Ok(c),
            Err(e) if start.elapsed() < Duration::from_secs(30) => {
                tracing::debug!(error = %e, "waiting for PostgreSQL to accept sessions");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(EmbeddedError::Connect(e)),
        }
    }
}

/// `pg_basebackup -R` of `primary` into `dir/data` through a new replication slot, as the server's user, and the
/// primary's password file beside it (the copy has the same superuser).
fn base_backup(primary: &EmbeddedPostgres, dir: &Path) -> Result<(), EmbeddedError> {
    let bin = find_bin_dir()?;
    let owner = run_as()?;
    std::fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(io_err("chown", dir))?;
    }
    let data: PathBuf = dir.join("data");
    let _ = std::fs::remove_dir_all(&data);
    let mut cmd = command(&bin.join("pg_basebackup"), owner);
    cmd.arg("-D")
        .arg(&data)
        // --checkpoint=fast: the default spread checkpoint paces its writes over most of checkpoint_timeout, and
        // the copy waited for it (93 s of the failover test's 108 s here, for a database of a few MiB).
        .args([
            "-R",
            "-X",
            "stream",
            "-C",
            "-S",
            SLOT,
            "--no-sync",
            "--checkpoint=fast",
            "-d",
        ])
        .arg(format!(
            "host=127.0.0.1 port={} user=bc application_name=bc_standby",
            primary.port()
        ))
        .env("PGPASSWORD", primary.password());
    run(cmd)?;
    let pw = dir.join("password");
    std::fs::write(&pw, primary.password()).map_err(io_err("writing", &pw))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600))
        .map_err(io_err("chmod", &pw))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&pw, Some(uid), Some(gid)).map_err(io_err("chown", &pw))?;
    }
    Ok(())
}

impl Drop for Replicated {
    fn drop(&mut self) {
        // A frozen primary would not answer the fast shutdown its drop asks for.
        if !self.frozen.is_empty() {
            self.kill_primary();
        }
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) with a pid read from /proc as PostgreSQL's (the primary's postmaster, our child, or one of
    // its children); no memory is touched.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(pid, sig);
    }
}

/// The pids whose parent is `parent` (`/proc/<pid>/stat`'s fourth field, after the command's parentheses).
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = stat.rsplit_once(')')?.1;
                    after.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect()
}
