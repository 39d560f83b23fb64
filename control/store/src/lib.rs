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
    /// Counts the pool's moves to another primary ([`multihost`]); `None` for a pool on one host.
    moves: Option<tokio::sync::watch::Receiver<u64>>,
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
    /// A call given up ([`Store::within`]): past its deadline, or cut short when the pool moved to another
    /// primary. What it had not committed was rolled back.
    #[error("{0}")]
    Cut(String),
}

impl Store {
    pub fn new(pool: PgPool) -> Store {
        Store { pool, moves: None }
    }

    /// A store whose pool follows the primary among several hosts, `moves` counting each move
    /// ([`multihost::connect`]).
    pub fn following(pool: PgPool, moves: tokio::sync::watch::Receiver<u64>) -> Store {
        Store {
            pool,
            moves: Some(moves),
        }
    }

    /// `call` within `deadline`, and cut short when the pool moves to another primary ([`Store::primary_moves`]):
    /// a call waiting on a primary gone silent would otherwise wait as long as its connection lives (for ever on
    /// one that hangs). A loop that must go on (a batcher, a scheduler) runs each round through this. `what` names
    /// the call in the error ([`StoreError::Cut`]).
    pub async fn within<T>(
        &self,
        what: &str,
        deadline: std::time::Duration,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.cut(what, deadline, call).await?
    }

    /// Any `call` (one that reports its own errors, such as a gateway's handler made of several store calls)
    /// within `deadline`, and cut short when the pool moves to another primary: [`Store::within`]'s bounds for a
    /// call whose output is not the store's `Result`.
    pub async fn cut<F: std::future::Future>(
        &self,
        what: &str,
        deadline: std::time::Duration,
        call: F,
    ) -> Result<F::Output, StoreError> {
        let mut moves = self.moves.clone();
        if let Some(m) = moves.as_mut() {
            m.borrow_and_update();
        }
        let moved = next_move(&mut moves);
        tokio::select! {
            r = tokio::time::timeout(deadline, call) => r.map_err(|_| {
                StoreError::Cut(format!(
                    "{what}: the database did not answer within {deadline:?}"
                ))
            }),
            () = moved => Err(StoreError::Cut(format!(
                "{what}: cut short, the database primary moved while it ran"
            ))),
        }
    }

    /// The count of the pool's moves to another primary, watched: a change says that whatever still waits on the
    /// old primary (which may never answer: one gone silent) can be given up. `None` for a pool on one host.
    pub fn primary_moves(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.moves.clone()
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

/// Resolves at the pool's next move to another primary after the last one `moves` saw; never when it counts none
/// (a pool on one host) or its watcher is gone.
pub async fn next_move(moves: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    let followed = match moves.as_mut() {
        Some(m) => m.changed().await.is_ok(),
        None => false,
    };
    if !followed {
        std::future::pending::<()>().await;
    }
}

/// The API code of a store error (the control plane's kernel turns it into `{code, message}`): a missing row is
/// NOT_FOUND, a refused change CONFLICT, anything else UNAVAILABLE with the cause kept for the log.
impl bc_core::api::Coded for StoreError {
    fn api_code(&self) -> bc_core::api::ApiCode {
        use bc_core::api::ApiCode;
        match self {
            StoreError::NotFound { .. } => ApiCode::NotFound,
            StoreError::Conflict(_) => ApiCode::Conflict,
            StoreError::Db(_) | StoreError::Corrupt(_) | StoreError::Cut(_) => ApiCode::Unavailable,
        }
    }

    fn public_message(&self) -> String {
        match self {
            StoreError::NotFound { .. } | StoreError::Conflict(_) => self.to_string(),
            StoreError::Cut(why) => format!("{why}; retry"),
            StoreError::Db(_) | StoreError::Corrupt(_) => {
                "the database is unavailable; retry later".into()
            }
        }
    }
}
