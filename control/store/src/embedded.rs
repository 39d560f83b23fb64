//! A private PostgreSQL started from Debian's server binaries, for `better-compute dev` and for tests.
//!
//! `initdb` once into a directory, then `postgres` as a child process bound to 127.0.0.1 on a free port, with no
//! Unix socket. PostgreSQL refuses to run as root, so when we are root the cluster belongs to the `postgres` user
//! and the server runs as it. The child gets PR_SET_PDEATHSIG(SIGINT): if our process dies, PostgreSQL does a fast
//! shutdown instead of lingering as an orphan.

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::io;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SUPERUSER: &str = "bc";

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (install Debian's postgresql package, or run \
         scripts/setup)"
    )]
    NoBinaries,
    #[error("{what} in {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "running as root but there is no `postgres` user to own the cluster (install Debian's postgresql)"
    )]
    NoPostgresUser,
    #[error("{program} failed ({status}); its output:\n{output}")]
    Command {
        program: String,
        status: String,
        output: String,
    },
    #[error("PostgreSQL did not become ready within {secs} s; see {log}")]
    NotReady { secs: u64, log: PathBuf },
    #[error("connecting to the embedded PostgreSQL")]
    Connect(#[source] sqlx::Error),
}

/// How the cluster authenticates and how durable it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync and synchronous_commit on: an acknowledged commit survives a crash (dev mode, benchmarks).
    Durable,
    /// fsync off: for throwaway test clusters only.
    Throwaway,
}

/// A running PostgreSQL child process.
pub struct EmbeddedPostgres {
    pid: i32,
    /// The thread that forked PostgreSQL and waits for it. PR_SET_PDEATHSIG fires when the *thread* that forked the
    /// child exits, so the fork happens on this thread, which lives exactly as long as the server.
    keeper: Option<std::thread::JoinHandle<()>>,
    port: u16,
    password: String,
    data: PathBuf,
}

pub(crate) fn find_bin_dir() -> Result<PathBuf, EmbeddedError> {
    let mut best: Option<(u32, PathBuf)> = None;
    let entries =
        std::fs::read_dir("/usr/lib/postgresql").map_err(|_| EmbeddedError::NoBinaries)?;
    for e in entries.flatten() {
        let Ok(v) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let bin = e.path().join("bin");
        if bin.join("postgres").exists()
            && bin.join("initdb").exists()
            && best.as_ref().is_none_or(|(b, _)| v > *b)
        {
            best = Some((v, bin));
        }
    }
    best.map(|(_, p)| p).ok_or(EmbeddedError::NoBinaries)
}

/// (uid, gid) to run PostgreSQL as: ourselves, or `postgres` when we are root.
pub(crate) fn run_as() -> Result<Option<(u32, u32)>, EmbeddedError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Ok(None);
    }
    let passwd =
        std::fs::read_to_string("/etc/passwd").map_err(|_| EmbeddedError::NoPostgresUser)?;
    for line in passwd.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() > 3 && f[0] == "postgres" {
            let uid = f[2].parse().map_err(|_| EmbeddedError::NoPostgresUser)?;
            let gid = f[3].parse().map_err(|_| EmbeddedError::NoPostgresUser)?;
            return Ok(Some((uid, gid)));
        }
    }
    Err(EmbeddedError::NoPostgresUser)
}

pub(crate) fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> EmbeddedError + 'a {
    move |source| EmbeddedError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn command(bin: &Path, owner: Option<(u32, u32)>) -> Command {
    let mut cmd = Command::new(bin);
    if let Some((uid, gid)) = owner {
        cmd.uid(uid).gid(gid);
    }
    cmd.env_remove("PGDATA").env("LC_ALL", "C.UTF-8");
    cmd
}

pub(crate) fn run(mut cmd: Command) -> Result<(), EmbeddedError> {
    let program = format!("{:?}", cmd.get_program());
    let out = cmd.output().map_err(|source| EmbeddedError::Io {
        what: "running",
        path: PathBuf::from(&program),
        source,
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(EmbeddedError::Command {
        program,
        status: out.status.to_string(),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

pub(crate) fn free_port() -> Result<u16, EmbeddedError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(io_err("binding a probe port", Path::new("127.0.0.1")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(io_err("reading a probe port", Path::new("127.0.0.1")))
}

/// A new cluster in `data`: a random superuser password in `pw_path` (0600, owned by the server's user), initdb.
fn init_cluster(
    bin: &Path,
    dir: &Path,
    data: &Path,
    pw_path: &Path,
    owner: Option<(u32, u32)>,
    durability: Durability,
) -> Result<(), EmbeddedError> {
    let _ = std::fs::remove_dir_all(data);
    let mut pw = [0u8; 24];
    getrandom::fill(&mut pw).map_err(|e| EmbeddedError::Io {
        what: "generating a password",
        path: pw_path.to_path_buf(),
        source: io::Error::other(e.to_string()),
    })?;
    write_private(pw_path, hex::encode(pw).as_bytes(), owner)?;
    std::fs::create_dir_all(data).map_err(io_err("creating", data))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(io_err("chown", dir))?;
        std::os::unix::fs::chown(data, Some(uid), Some(gid)).map_err(io_err("chown", data))?;
    }
    let mut cmd = command(&bin.join("initdb"), owner);
    cmd.arg("-D")
        .arg(data)
        .args([
            "-U",
            SUPERUSER,
            "-E",
            "UTF8",
            "--no-locale",
            "--auth=scram-sha-256",
        ])
        .arg(format!("--pwfile={}", pw_path.display()));
    if durability == Durability::Throwaway {
        cmd.arg("--no-sync");
    }
    run(cmd)?;
    Ok(())
}

/// The server's command line: loopback only, no unix socket, the durability asked for, statement statistics
/// where the server ships them (and per statement when `BC_PG_STAT_STATEMENTS=1`).
fn postgres_command(
    bin: &Path,
    data: &Path,
    port: u16,
    owner: Option<(u32, u32)>,
    durability: Durability,
) -> Command {
    let mut cmd = command(&bin.join("postgres"), owner);
    cmd.arg("-D").arg(data).args([
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        &format!("port={port}"),
        "-c",
        "unix_socket_directories=",
        "-c",
        "max_connections=300",
        "-c",
        "shared_buffers=128MB",
        "-c",
        "logging_collector=off",
        // Our statements are short; JIT compiling them costs more than it saves.
        "-c",
        "jit=off",
    ]);
    // Statement statistics for operators and benchmarks (statements per admission), where the server ships it.
    if bin
        .parent()
        .is_some_and(|p| p.join("lib/pg_stat_statements.so").exists())
    {
        cmd.args(["-c", "shared_preload_libraries=pg_stat_statements"]);
    }
    match durability {
        Durability::Durable => cmd.args(["-c", "fsync=on", "-c", "synchronous_commit=on"]),
        Durability::Throwaway => cmd.args([
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
        ]),
    };
    // Per-statement counts (pg_stat_statements), to break the database's load down by origin
    // (`scripts/bench sessions`); off unless asked for.
    if std::env::var("BC_PG_STAT_STATEMENTS").as_deref() == Ok("1") {
        cmd.args([
            "-c",
            "shared_preload_libraries=pg_stat_statements",
            "-c",
            "pg_stat_statements.track=all",
            // Autovacuum's transactions count as commits but are no statements: log each run to count them.
            "-c",
            "log_autovacuum_min_duration=0",
            // And each extended-protocol step (parse, bind, execute): a parse with its own Sync commits too.
            "-c",
            "log_min_duration_statement=0",
        ]);
    }
    cmd
}

/// Spawns `cmd` on a keeper thread that reaps it; the server dies with this process (PR_SET_PDEATHSIG).
pub(crate) fn spawn_kept(
    mut cmd: Command,
    bin: &Path,
) -> Result<(u32, std::thread::JoinHandle<()>), EmbeddedError> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent; it runs in the
    // forked child before exec.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let keeper = std::thread::Builder::new()
        .name("postgres-keeper".into())
        .spawn(move || match cmd.spawn() {
            Ok(mut child) => {
                let _ = tx.send(Ok(child.id()));
                let _ = child.wait();
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        })
        .map_err(io_err("starting a thread for postgres", bin))?;
    let pid = rx
        .recv()
        .map_err(|_| io::Error::other("postgres keeper thread died"))
        .and_then(|r| r)
        .map_err(io_err("starting postgres", bin))?;
    Ok((pid, keeper))
}

impl EmbeddedPostgres {
    /// Creates the cluster under `dir` if it does not exist yet, then starts it. `dir` holds `data/` (the cluster),
    /// `password` (0600) and `postgres.log`.
    pub fn start(dir: &Path, durability: Durability) -> Result<EmbeddedPostgres, EmbeddedError> {
        EmbeddedPostgres::start_with(dir, durability, &[])
    }

    /// As [`EmbeddedPostgres::start`], with more server settings (`name=value`, after the durability's: they win).
    pub fn start_with(
        dir: &Path,
        durability: Durability,
        settings: &[&str],
    ) -> Result<EmbeddedPostgres, EmbeddedError> {
        let bin = find_bin_dir()?;
        let owner = run_as()?;
        std::fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
        let data = dir.join("data");
        let pw_path = dir.join("password");
        if !data.join("PG_VERSION").exists() {
            init_cluster(&bin, dir, &data, &pw_path, owner, durability)?;
        }
        let password = std::fs::read_to_string(&pw_path)
            .map_err(io_err("reading", &pw_path))?
            .trim()
            .to_string();
        // A previous run killed without a shutdown may have left its pid file; postgres itself refuses to start
        // only if that pid is alive, so a stale file is harmless.
        let port = free_port()?;
        let log_path = dir.join("postgres.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err("opening", &log_path))?;
        if let Some((uid, gid)) = owner {
            let _ = std::os::unix::fs::chown(&log_path, Some(uid), Some(gid));
        }
        let log2 = log.try_clone().map_err(io_err("opening", &log_path))?;
        let mut cmd = postgres_command(&bin, &data, port, owner, durability);
        for setting in settings {
            cmd.args(["-c", setting]);
        }
        cmd.stdin(Stdio::null()).stdout(log).stderr(log2);
        let (pid, keeper) = spawn_kept(cmd, &bin)?;
        let mut pg = EmbeddedPostgres {
            pid: i32::try_from(pid).unwrap_or(i32::MAX),
            keeper: Some(keeper),
            port,
            password,
            data,
        };
        pg.wait_ready(&log_path)?;
        Ok(pg)
    }

    fn wait_ready(&mut self, log: &Path) -> Result<(), EmbeddedError> {
        let start = Instant::now();
        let limit = Duration::from_secs(60);
        loop {
            if self.keeper.as_ref().is_none_or(|k| k.is_finished()) {
                let output = std::fs::read_to_string(log).unwrap_or_default();
                let tail: String = output
                    .lines()
                    .rev()
                    .take(20)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(EmbeddedError::Command {
                    program: "postgres".into(),
                    status: "exited during start-up".into(),
                    output: tail,
                });
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(EmbeddedError::NotReady {
                    secs: limit.as_secs(),
                    log: log.to_path_buf(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// Connection options for `database` as the cluster's superuser.
    pub fn connect_options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(SUPERUSER)
            .password(&self.password)
            .database(database)
    }

    /// A `postgres://` URL for tools such as psql and pgbench.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}",
            self.password, self.port
        )
    }

    /// A pool to `database`, retrying while the server finishes starting up.
    pub async fn pool(
        &self,
        database: &str,
        max_connections: u32,
    ) -> Result<PgPool, EmbeddedError> {
        let start = Instant::now();
        loop {
            match PgPoolOptions::new()
                .max_connections(max_connections)
                .connect_with(self.connect_options(database))
                .await
            {
                Ok(pool) => return Ok(pool),
                Err(e) if start.elapsed() < Duration::from_secs(30) => {
                    tracing::debug!(error = %e, "waiting for the embedded PostgreSQL");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(EmbeddedError::Connect(e)),
            }
        }
    }

    pub(crate) fn password(&self) -> &str {
        &self.password
    }

    /// The server's process id (the postmaster).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// SIGKILL, as a crash would end it, and wait: nothing is flushed or shut down cleanly.
    pub fn kill(mut self) {
        if let Some(keeper) = self.keeper.take() {
            if !keeper.is_finished() {
                // SAFETY: kill(2) on our own child's pid (not yet reaped: the keeper thread is still waiting on it).
                #[allow(unsafe_code)]
                unsafe {
                    libc::kill(self.pid, libc::SIGKILL);
                }
            }
            let _ = keeper.join();
        }
    }

    /// Fast shutdown (SIGINT) and wait.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(keeper) = self.keeper.take() else {
            return;
        };
        if !keeper.is_finished() {
            // SAFETY: kill(2) on our own child's pid (not yet reaped: the keeper thread is still waiting on it).
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(self.pid, libc::SIGINT);
            }
        }
        let _ = keeper.join();
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn write_private(
    path: &Path,
    bytes: &[u8],
    owner: Option<(u32, u32)>,
) -> Result<(), EmbeddedError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err("writing", path))?;
    f.write_all(bytes).map_err(io_err("writing", path))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_err("chown", path))?;
    }
    Ok(())
}
