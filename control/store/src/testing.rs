//! The test harness: one private PostgreSQL per test process (fsync off), a template database migrated once, and a
//! fresh database per test created from the template (`CREATE DATABASE … TEMPLATE`, milliseconds).

use crate::embedded::{Durability, EmbeddedPostgres};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TEMPLATE: &str = "bc_template";
const PREFIX: &str = "bc-test-pg-";

struct Cluster {
    pg: EmbeddedPostgres,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();
static TEMPLATE_READY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
static NEXT: AtomicU32 = AtomicU32::new(0);

/// Removes clusters left by earlier test processes that died (their pid is in the directory name).
fn remove_stale_clusters(tmp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn cluster() -> &'static Cluster {
    let result = CLUSTER.get_or_init(|| {
        let tmp = std::env::temp_dir();
        remove_stale_clusters(&tmp);
        let dir = tmp.join(format!("{PREFIX}{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The postgres user must be able to reach the directory when we run as root.
        EmbeddedPostgres::start(&dir, Durability::Throwaway)
            .map(|pg| Cluster { pg })
            .map_err(|e| format!("{e}: {}", error_chain(&e)))
    });
    match result {
        Ok(c) => c,
        Err(e) => panic!("test PostgreSQL did not start: {e}"),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = String::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(&format!(" / {s}"));
        cur = s.source();
    }
    out
}

/// A fresh, migrated database for one test.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
}

impl TestDb {
    pub fn connect_options(&self) -> PgConnectOptions {
        cluster().pg.connect_options(&self.name)
    }

    /// A pool of exactly one connection to this database: for tests that read a session's own view
    /// (`pg_prepared_statements`) or need every write counted by the one backend whose statistics they flush.
    pub async fn one_connection(&self) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(self.connect_options())
            .await
            .expect("one connection to the test database")
    }

    /// A `postgres://` URL to this database (for spawning `better-compute serve --database-url`).
    pub fn url(&self) -> String {
        cluster().pg.url(&self.name)
    }

    /// A plain-text `pg_dump` of the whole database (schema and data).
    pub fn dump(&self) -> std::io::Result<String> {
        let c = cluster();
        let bin = std::fs::read_dir("/usr/lib/postgresql")?
            .flatten()
            .map(|e| e.path().join("bin/pg_dump"))
            .find(|p| p.exists())
            .ok_or_else(|| std::io::Error::other("pg_dump not found"))?;
        let out = std::process::Command::new(bin)
            .arg("--no-owner")
            .arg(c.pg.url(&self.name))
            .output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(
                String::from_utf8_lossy(&out.stderr).to_string(),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    }
}

/// Creates a fresh database from the migrated template.
pub async fn test_db() -> TestDb {
    let c = cluster();
    TEMPLATE_READY
        .get_or_init(|| async {
            let admin =
                c.pg.pool("postgres", 2)
                    .await
                    .expect("connect to test cluster");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {TEMPLATE}")))
                .execute(&admin)
                .await
                .expect("create template database");
            let tpl = c.pg.pool(TEMPLATE, 2).await.expect("connect to template");
            crate::migrate::migrate(&tpl)
                .await
                .expect("migrate template");
            tpl.close().await;
            admin.close().await;
        })
        .await;
    let name = format!(
        "t{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let admin =
        c.pg.pool("postgres", 1)
            .await
            .expect("connect to test cluster");
    let mut attempt = 0;
    loop {
        match sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {name} TEMPLATE {TEMPLATE}"
        )))
        .execute(&admin)
        .await
        {
            Ok(_) => break,
            // Another test copying the template at the same moment holds it briefly.
            Err(e) if attempt < 50 => {
                attempt += 1;
                tracing::debug!(error = %e, "retrying CREATE DATABASE");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("create test database: {e}"),
        }
    }
    admin.close().await;
    let pool =
        c.pg.pool(&name, 20)
            .await
            .expect("connect to test database");
    TestDb { pool, name }
}

/// Seeds `nodes` adopted nodes in pool `pool` (created if absent, in the root tenant) with `gpus` GPUs each of
/// `model`, as if they had joined, passed acceptance and reported inventory: for tests and benchmarks of
/// placement that need a fleet without running its daemons. Node ids are `<prefix>-<n>`; GPU UUIDs
/// `GPU-<prefix>-<n>-<i>`. Returns how many devices exist afterwards.
pub async fn seed_gpu_nodes(
    pool: &PgPool,
    pool_id: &str,
    prefix: &str,
    nodes: i32,
    gpus: i32,
    model: &str,
) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO tenants (id, name, is_root) VALUES ('root', 'root', true) ON CONFLICT DO NOTHING")
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO pools (id, tenant_id, name) VALUES ($1, 'root', $1) ON CONFLICT DO NOTHING",
    )
    .bind(pool_id)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO nodes (id, shard, pool_id, state, claims, join_key_hash, joined_at, cert_serial, cert_not_after, \
           desired_generation, desired_spec) \
         SELECT $2 || '-' || n, bc_shard($2 || '-' || n), $1, 'adopted', '{}', md5($2 || n), now(), n::text, \
           now() + interval '1 day', 1, '{\"version\": 1, \"bookings\": []}' FROM generate_series(1, $3) AS n",
    )
    .bind(pool_id)
    .bind(prefix)
    .bind(nodes)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO devices (id, node_id, idx, uuid, model) \
         SELECT $1 || '-' || n || '/gpu/GPU-' || $1 || '-' || n || '-' || i, $1 || '-' || n, i, \
           'GPU-' || $1 || '-' || n || '-' || i, $4 \
         FROM generate_series(1, $2) AS n, generate_series(0, $3 - 1) AS i",
    )
    .bind(prefix)
    .bind(nodes)
    .bind(gpus)
    .bind(model)
    .execute(pool)
    .await?;
    sqlx::query_scalar("SELECT count(*) FROM devices")
        .fetch_one(pool)
        .await
}

/// Inserts reservations `<prefix><g>` for `g` in `from..=to` of the root tenant (which must exist), in `state`, each
/// with the request that the SQL expression `request` gives (it may use `g`, e.g. `jsonb_build_object('pool', 'a')`):
/// history or a backlog for tests of plans and statistics. The shard and the pool are written as the store's own
/// admission writes them (migration 18).
pub async fn insert_reservations(
    pool: &PgPool,
    prefix: &str,
    (from, to): (i64, i64),
    state: &str,
    request: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO reservations (id, shard, pool, tenant_id, principal_id, request, state, duration_s) \
         SELECT $1 || g, bc_shard($1 || g), q.request ->> 'pool', 'root', 'admin', q.request, $4, 60 \
         FROM generate_series($2::bigint, $3::bigint) AS g, LATERAL (SELECT ({request})::jsonb AS request) AS q"
    )))
    .bind(prefix)
    .bind(from)
    .bind(to)
    .bind(state)
    .execute(pool)
    .await
    .map(drop)
}

/// The stored generated columns (`table.column`) whose expression calls a SQL-language function: PostgreSQL 15 inlines
/// such a function, parsing its body, on every statement that inserts into or updates the table (migration 18).
pub async fn generated_columns_calling_sql_functions(
    pool: &PgPool,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT DISTINCT c.relname || '.' || a.attname FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid \
         JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
         JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid \
           AND dep.refclassid = 'pg_proc'::regclass \
         JOIN pg_proc p ON p.oid = dep.refobjid JOIN pg_language l ON l.oid = p.prolang \
         WHERE a.attgenerated = 's' AND l.lanname = 'sql' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
}

/// Rows whose `shard` is not `bc_shard` of their key, as `table key`, in the given `(table, key column)` pairs: a
/// writer that computed a shard of its own would put the row on the wrong owner's shard.
pub async fn misplaced_shards(
    pool: &PgPool,
    tables: &[(&str, &str)],
) -> Result<Vec<String>, sqlx::Error> {
    let mut out = Vec::new();
    for (table, key) in tables {
        let bad: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT '{table} ' || {key} FROM {table} WHERE shard IS DISTINCT FROM bc_shard({key}) LIMIT 5"
        )))
        .fetch_all(pool)
        .await?;
        out.extend(bad);
    }
    Ok(out)
}

/// Copies `from` to `to` until either ends, or until `freeze` moves past `generation`: then it forwards nothing more
/// and holds both sockets open (a peer gone silent without a reset).
async fn frozen_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut freeze: tokio::sync::watch::Receiver<u64>,
    generation: u64,
) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let frozen = async {
            let _ = freeze.wait_for(|g| *g > generation).await;
        };
        tokio::select! {
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => if to.write_all(&buf[..n]).await.is_err() { return },
            },
            () = frozen => break,
        }
    }
    // Silent from here on: both sockets stay open, nothing moves.
    let _held = (from, to);
    std::future::pending::<()>().await;
}

/// A TCP proxy to `to` (a database) that can go silent: bumping the returned counter freezes every connection
/// open at that moment (nothing forwarded, nothing closed: a primary cut off without a reset), while connections
/// opened later pass as before (the host a failover moved to).
pub async fn freezing_proxy(
    to: std::net::SocketAddr,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<u64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let at = listener.local_addr().expect("addr");
    let (freeze, watching) = tokio::sync::watch::channel(0u64);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                continue;
            };
            let generation = *watching.borrow();
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(frozen_pipe(cr, sw, watching.clone(), generation));
            tokio::spawn(frozen_pipe(sr, cw, watching.clone(), generation));
        }
    });
    (at, freeze)
}

/// A fresh database reached through a [`freezing_proxy`] by a [`Store`](crate::Store) that follows its primary:
/// [`SilentPrimary::silence`] makes every connection open at that moment go silent (a primary that hangs), and
/// [`SilentPrimary::move_primary`] counts a move as `multihost`'s watcher does when it finds another primary. As
/// there, connections opened before the move are not handed out again, and are closed (not pinged) when given back;
/// the proxy lets connections opened later through (the host the pool moved to).
pub struct SilentPrimary {
    /// The database itself, reached directly (not through the proxy).
    pub db: TestDb,
    /// The store through the proxy.
    pub store: crate::Store,
    freeze: tokio::sync::watch::Sender<u64>,
    moves: tokio::sync::watch::Sender<u64>,
    moved_at: std::sync::Arc<OnceLock<std::time::Instant>>,
}

impl SilentPrimary {
    /// A pool of `connections`, all open and idle, handed out without a ping (so a call after [`Self::silence`]
    /// waits on a silent connection, as calls in flight at a hang do).
    pub async fn start(connections: u32) -> SilentPrimary {
        let db = test_db().await;
        let direct = db.connect_options();
        let (at, freeze) = freezing_proxy(std::net::SocketAddr::from((
            [127, 0, 0, 1],
            direct.get_port(),
        )))
        .await;
        let moved_at = std::sync::Arc::new(OnceLock::<std::time::Instant>::new());
        let (before, after) = (moved_at.clone(), moved_at.clone());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(connections)
            .test_before_acquire(false)
            .before_acquire(move |_, meta| {
                let stale = before.get().is_some_and(|t| meta.age > t.elapsed());
                Box::pin(async move { Ok(!stale) })
            })
            .after_release(move |_, meta| {
                let stale = after.get().is_some_and(|t| meta.age > t.elapsed());
                Box::pin(async move { Ok(!stale) })
            })
            .connect_with(direct.port(at.port()))
            .await
            .expect("a pool through the freezing proxy");
        let mut open = Vec::new();
        for _ in 0..connections {
            open.push(
                pool.acquire()
                    .await
                    .expect("a connection through the proxy"),
            );
        }
        drop(open);
        while pool.num_idle() < connections as usize {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let (moves, moved) = tokio::sync::watch::channel(0u64);
        SilentPrimary {
            db,
            store: crate::Store::following(pool, moved),
            freeze,
            moves,
            moved_at,
        }
    }

    /// Every connection open now goes silent.
    pub fn silence(&self) {
        self.freeze.send_modify(|g| *g += 1);
    }

    /// The pool moves to another primary (the same database, through connections opened from now on).
    pub fn move_primary(&self) {
        let _ = self.moved_at.set(std::time::Instant::now());
        self.moves.send_modify(|n| *n += 1);
    }
}
