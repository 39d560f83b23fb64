//! The kernel's outside, over bc-store: [`StoreBackend`] is the [`Backend`] (reachability, migrations,
//! LISTEN/NOTIFY, the [`Store`] every module reads), [`StoreMembership`] the role membership and fenced shard leases,
//! [`StoreAuthenticator`] the IAM (API keys, cached [`crate::api::PRINCIPAL_TTL`]). The kernel never sees the store;
//! this file is the only place the two meet.

use crate::api::{PrincipalCache, authenticate_key};
use crate::notify;
use bc_core::shards::{Shard, ShardLease};
use bc_kernel::{
    ApiCode, ApiError, Authenticator, Backend, BoxFuture, Caller, Membership, Migration, Notice,
    Resources, Stop,
};
use bc_store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How long `initialize` waits to reach the database before answering UNAVAILABLE.
pub const CHECK_DEADLINE: Duration = Duration::from_secs(10);

/// The control plane's database, as the kernel uses it.
#[derive(Clone)]
pub struct StoreBackend {
    store: Store,
    principals: Arc<PrincipalCache>,
}

impl StoreBackend {
    pub fn new(store: Store) -> StoreBackend {
        StoreBackend {
            store,
            principals: Arc::new(PrincipalCache::default()),
        }
    }

    /// The principal cache its authenticator shares with the server's own API state.
    pub fn principals(&self) -> Arc<PrincipalCache> {
        self.principals.clone()
    }
}

fn unreachable(e: impl std::error::Error + Send + Sync + 'static) -> ApiError {
    ApiError::unavailable(
        "the database cannot be reached; check database_url and that PostgreSQL is running, then start again",
    )
    .with_source(e)
}

impl Backend for StoreBackend {
    fn check(&self) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(async move {
            let ping =
                bc_store::sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(self.store.pool());
            match tokio::time::timeout(CHECK_DEADLINE, ping).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(unreachable(e)),
                Err(elapsed) => Err(unreachable(elapsed)),
            }
        })
    }

    fn migrate<'a>(
        &'a self,
        modules: &'a [Migration],
        apply: bool,
    ) -> BoxFuture<'a, Result<usize, ApiError>> {
        Box::pin(async move {
            let extra: Vec<bc_store::migrate::Migration> = modules
                .iter()
                .map(|m| bc_store::migrate::Migration {
                    version: m.version,
                    name: m.name,
                    sql: m.sql,
                })
                .collect();
            let failed = |e: bc_store::migrate::MigrateError| {
                let code = match e {
                    bc_store::migrate::MigrateError::Db(_) => ApiCode::Unavailable,
                    _ => ApiCode::FailedPrecondition,
                };
                ApiError::new(code, format!("migrations: {e}")).with_source(e)
            };
            if apply {
                return bc_store::migrate::migrate_with(self.store.pool(), &extra)
                    .await
                    .map_err(failed);
            }
            let pending = bc_store::migrate::pending(self.store.pool(), &extra)
                .await
                .map_err(failed)?;
            match pending.first() {
                None => Ok(0),
                Some((version, name)) => Err(ApiError::new(
                    ApiCode::FailedPrecondition,
                    format!(
                        "{} migration(s) pending, the first {version} ({name}): run `better-compute migrate` \
                         (or start without --no-migrate)",
                        pending.len()
                    ),
                )),
            }
        })
    }

    fn provide(&self, resources: &mut Resources) {
        resources.insert(self.store.clone());
        if let Some(moves) = self.store.primary_moves() {
            resources.insert(bc_kernel::DatabaseMoves(moves));
        }
    }

    fn authenticator(&self) -> Arc<dyn Authenticator> {
        Arc::new(StoreAuthenticator {
            store: self.store.clone(),
            principals: self.principals.clone(),
        })
    }

    fn membership(&self) -> Arc<dyn Membership> {
        Arc::new(StoreMembership {
            store: self.store.clone(),
        })
    }

    fn listen(&self, channels: Vec<&'static str>, mut stop: Stop) -> mpsc::Receiver<Notice> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut notices = notify::listen(&self.store, &channels, stop_rx);
        let (tx, rx) = mpsc::channel(4096);
        tokio::spawn(async move {
            loop {
                let n = tokio::select! {
                    n = notices.recv() => n,
                    _ = stop.stopped() => None,
                };
                let n = match n {
                    Some(notify::Notice::Message { channel, payload }) => {
                        Notice::Message { channel, payload }
                    }
                    Some(notify::Notice::Resync) => Notice::Resync,
                    None => break,
                };
                // Full: the fan-out is behind; the listener's own Resync follows any loss it sees.
                if let Err(mpsc::error::TrySendError::Closed(_)) = tx.try_send(n) {
                    break;
                }
            }
            let _ = stop_tx.send(true);
        });
        rx
    }
}

/// Role membership and shard leases in the `workers` and `shard_leases` tables.
pub struct StoreMembership {
    store: Store,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Membership for StoreMembership {
    fn heartbeat<'a>(
        &'a self,
        role: &'a str,
        worker: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, ApiError>> {
        Box::pin(async move { Ok(self.store.heartbeat_worker(role, worker, ms(ttl)).await?) })
    }

    fn sync_leases<'a>(
        &'a self,
        role: &'a str,
        worker: &'a str,
        want: &'a [Shard],
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<ShardLease>, ApiError>> {
        Box::pin(async move {
            let want: Vec<i16> = want.iter().map(|s| s.get()).collect();
            let held = self.store.sync_leases(role, worker, &want, ms(ttl)).await?;
            Ok(held
                .into_iter()
                .filter_map(|l| {
                    Some(ShardLease {
                        shard: Shard::new(l.shard)?,
                        fence: l.fence,
                    })
                })
                .collect())
        })
    }

    fn leave<'a>(&'a self, role: &'a str, worker: &'a str) -> BoxFuture<'a, Result<(), ApiError>> {
        Box::pin(async move { Ok(self.store.leave_role(role, worker).await?) })
    }
}

/// API keys checked against the principals table (through the shared cache).
pub struct StoreAuthenticator {
    store: Store,
    principals: Arc<PrincipalCache>,
}

impl Authenticator for StoreAuthenticator {
    fn authenticate<'a>(
        &'a self,
        api_key: &'a str,
    ) -> BoxFuture<'a, Result<Arc<Caller>, ApiError>> {
        Box::pin(async move {
            let p = authenticate_key(&self.store, &self.principals, api_key).await?;
            Ok(Arc::new(Caller {
                id: p.id,
                tenant_id: p.tenant_id,
                tenant_is_root: p.tenant_is_root,
                grants: p.grants,
            }))
        })
    }
}
