//! Embedded migrations: the SQL files under `migrations/` are compiled into the binary and applied in order, once,
//! under an advisory lock, each in its own transaction. A checksum guards against a file edited after it ran; a
//! database newer than the binary is refused rather than guessed at.

use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "identity_and_join",
        sql: include_str!("../migrations/0001_identity_and_join.sql"),
    },
    Migration {
        version: 2,
        name: "join_key_unique",
        sql: include_str!("../migrations/0002_join_key_unique.sql"),
    },
    Migration {
        version: 3,
        name: "sessions",
        sql: include_str!("../migrations/0003_sessions.sql"),
    },
    Migration {
        version: 4,
        name: "reservations",
        sql: include_str!("../migrations/0004_reservations.sql"),
    },
    Migration {
        version: 5,
        name: "sites",
        sql: include_str!("../migrations/0005_sites.sql"),
    },
    Migration {
        version: 6,
        name: "revocations",
        sql: include_str!("../migrations/0006_revocations.sql"),
    },
    Migration {
        version: 7,
        name: "artifacts",
        sql: include_str!("../migrations/0007_artifacts.sql"),
    },
    Migration {
        version: 8,
        name: "command_progress",
        sql: include_str!("../migrations/0008_command_progress.sql"),
    },
    Migration {
        version: 9,
        name: "command_redelivery",
        sql: include_str!("../migrations/0009_command_redelivery.sql"),
    },
    Migration {
        version: 10,
        name: "site_revocation",
        sql: include_str!("../migrations/0010_site_revocation.sql"),
    },
    Migration {
        version: 11,
        name: "identity_bindings",
        sql: include_str!("../migrations/0011_identity_bindings.sql"),
    },
    Migration {
        version: 12,
        name: "desired_state_failures",
        sql: include_str!("../migrations/0012_desired_state_failures.sql"),
    },
    Migration {
        version: 13,
        name: "pool_leases",
        sql: include_str!("../migrations/0013_pool_leases.sql"),
    },
    Migration {
        version: 14,
        name: "session_gateways",
        sql: include_str!("../migrations/0014_session_gateways.sql"),
    },
    Migration {
        version: 15,
        name: "nodes_hot_updates",
        sql: include_str!("../migrations/0015_nodes_hot_updates.sql"),
    },
    Migration {
        version: 16,
        name: "devices_hot_bookings",
        sql: include_str!("../migrations/0016_devices_hot_bookings.sql"),
    },
    Migration {
        version: 17,
        name: "pending_pool_index",
        sql: include_str!("../migrations/0017_pending_pool_index.sql"),
    },
    Migration {
        version: 18,
        name: "written_shards",
        sql: include_str!("../migrations/0018_written_shards.sql"),
    },
    Migration {
        version: 19,
        name: "gateway_lease",
        sql: include_str!("../migrations/0019_gateway_lease.sql"),
    },
];

/// Arbitrary constant naming our advisory lock.
const LOCK_KEY: i64 = 0x6263_6d69_6772; // "bcmigr"

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("database error while migrating")]
    Db(#[from] sqlx::Error),
    #[error("migration {version} ({name}) was changed after it was applied (checksum differs)")]
    Changed { version: i64, name: String },
    #[error(
        "database has migration {version} which this binary does not know: it is newer than this binary"
    )]
    DatabaseNewer { version: i64 },
    #[error("migration version {version} ({name}) is used twice")]
    Duplicate { version: i64, name: String },
}

fn checksum(sql: &str) -> String {
    hex::encode(Sha256::digest(sql.as_bytes()))
}

/// Versions from here on are the control plane's modules' (`Module::migration`); the kernel applies and verifies
/// them at start with its list ([`migrate_with`]).
pub const MODULE_VERSIONS: i64 = 1000;

/// Applies the base schema's pending migrations; returns how many ran. Modules' migrations already applied
/// (versions from [`MODULE_VERSIONS`]) are left to the kernel's check: this list does not know them.
pub async fn migrate(pool: &PgPool) -> Result<usize, MigrateError> {
    locked(pool, &all_migrations(&[])?, false).await
}

/// The base schema's migrations and `extra` (the control plane's modules', numbered from 1000), in version order;
/// a version used twice is refused.
fn all_migrations(extra: &[Migration]) -> Result<Vec<Migration>, MigrateError> {
    let mut all: Vec<Migration> = MIGRATIONS.iter().chain(extra).copied().collect();
    all.sort_by_key(|m| m.version);
    if let Some(w) = all.windows(2).find(|w| w[0].version == w[1].version) {
        return Err(MigrateError::Duplicate {
            version: w[0].version,
            name: w[1].name.to_string(),
        });
    }
    Ok(all)
}

/// The migrations of [`all_migrations`] not applied yet, as `(version, name)` (none when the table is missing:
/// then every one is pending).
pub async fn pending(
    pool: &PgPool,
    extra: &[Migration],
) -> Result<Vec<(i64, &'static str)>, MigrateError> {
    let all = all_migrations(extra)?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('bc_migrations') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    let applied: Vec<i64> = if exists {
        sqlx::query_scalar("SELECT version FROM bc_migrations")
            .fetch_all(pool)
            .await?
    } else {
        Vec::new()
    };
    Ok(all
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(|m| (m.version, m.name))
        .collect())
}

/// Applies the pending migrations of the base schema and `extra`; returns how many ran.
pub async fn migrate_with(pool: &PgPool, extra: &[Migration]) -> Result<usize, MigrateError> {
    locked(pool, &all_migrations(extra)?, true).await
}

/// Applies `all` under the migration lock; `modules_listed`: `all` holds every module's migrations too.
async fn locked(
    pool: &PgPool,
    all: &[Migration],
    modules_listed: bool,
) -> Result<usize, MigrateError> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    let result = apply(&mut conn, all, modules_listed).await;
    let unlock = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(LOCK_KEY)
        .execute(&mut *conn)
        .await;
    let n = result?;
    unlock?;
    Ok(n)
}

async fn apply(
    conn: &mut sqlx::PgConnection,
    all: &[Migration],
    modules_listed: bool,
) -> Result<usize, MigrateError> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bc_migrations (version bigint PRIMARY KEY, name text NOT NULL, \
         checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut *conn)
    .await?;
    let applied = sqlx::query("SELECT version, name, checksum FROM bc_migrations ORDER BY version")
        .fetch_all(&mut *conn)
        .await?;
    for row in &applied {
        let version: i64 = row.get(0);
        let Some(m) = all.iter().find(|m| m.version == version) else {
            if version >= MODULE_VERSIONS && !modules_listed {
                continue;
            }
            return Err(MigrateError::DatabaseNewer { version });
        };
        if row.get::<String, _>(2) != checksum(m.sql) {
            return Err(MigrateError::Changed {
                version,
                name: row.get(1),
            });
        }
    }
    let mut ran = 0;
    for m in all {
        if applied.iter().any(|r| r.get::<i64, _>(0) == m.version) {
            continue;
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::raw_sql(m.sql).execute(&mut *tx).await?;
        sqlx::query("INSERT INTO bc_migrations (version, name, checksum) VALUES ($1, $2, $3)")
            .bind(m.version)
            .bind(m.name)
            .bind(checksum(m.sql))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        tracing::info!(version = m.version, name = m.name, "applied migration");
        ran += 1;
    }
    Ok(ran)
}
