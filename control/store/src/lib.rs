//! bc-store: Better Compute's PostgreSQL state.
//!
//! It owns the schema and its embedded migrations ([`migrate`]), every query the control plane runs ([`Store`]:
//! IAM, pools, join tokens, nodes, sessions, devices, reservations and how far desired state reached the nodes ([`desired`]), shard leases and the work queue, audit), the embedded PostgreSQL used by `dev` mode ([`embedded`]) and the test
//! harness ([`testing`]: one cluster per process, template migrated once, a fresh database per test). It must not
//! import tonic, axum or any workspace crate but bc-core. Start with [`Store::commit_joins`], the hot path of `bcd
//! join`.

pub mod artifacts;
pub mod audit;
pub mod desired;
pub mod devices;
pub mod embedded;
pub mod fleet;
pub mod gateways;
pub mod gauges;
pub mod iam;
pub mod join_tokens;
pub mod lifecycle;
pub mod migrate;
pub mod multihost;
pub mod nodes;
pub mod pokes;
pub mod replica;
pub mod reservations;
pub mod secrets;
pub mod sessions;
pub mod sites;
pub mod statistics;
pub mod testing;
pub mod work;

use sqlx::PgPool;

pub use sqlx;

/// Every query goes through a `Store`; it is cheap to clone (a pool handle).
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Db(#[from] sqlx::Error),
    #[error("{what} {id:?} not found")]
    NotFound { what: &'static str, id: String },
    #[error("{0}")]
    Conflict(String),
    #[error("stored value is invalid: {0}")]
    Corrupt(String),
}

impl Store {
    pub fn new(pool: PgPool) -> Store {
        Store { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Milliseconds since the Unix epoch of a stored timestamp.
pub(crate) fn to_ms(t: time::OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

pub(crate) fn from_ms(ms: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

/// The API code of a store error (the control plane's kernel turns it into `{code, message}`): a missing row is
/// NOT_FOUND, a refused change CONFLICT, anything else UNAVAILABLE with the cause kept for the log.
impl bc_core::api::Coded for StoreError {
    fn api_code(&self) -> bc_core::api::ApiCode {
        use bc_core::api::ApiCode;
        match self {
            StoreError::NotFound { .. } => ApiCode::NotFound,
            StoreError::Conflict(_) => ApiCode::Conflict,
            StoreError::Db(_) | StoreError::Corrupt(_) => ApiCode::Unavailable,
        }
    }

    fn public_message(&self) -> String {
        match self {
            StoreError::NotFound { .. } | StoreError::Conflict(_) => self.to_string(),
            StoreError::Db(_) | StoreError::Corrupt(_) => {
                "the database is unavailable; retry later".into()
            }
        }
    }
}
