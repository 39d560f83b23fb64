//! What the kernel needs from the outside, as traits: the database behind [`Backend`] (reachability, migrations,
//! notifications, the values modules share), role membership and fenced shard leases behind [`Membership`], and
//! the IAM behind [`Authenticator`]. The binary implements them over bc-store; the kernel never sees the store.

use crate::error::ApiError;
use crate::method::{BoxFuture, Caller};
use crate::module::Migration;
use crate::reconcile::Stop;
use crate::resources::Resources;
use bc_core::shards::{Shard, ShardLease};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A notification (PostgreSQL NOTIFY), or word that some may have been lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Message {
        channel: String,
        payload: String,
    },
    /// The listening connection was lost (and is being re-established) or a queue overflowed: catch up.
    Resync,
}

/// The database, as the kernel uses it in `initialize` and `start`.
pub trait Backend: Send + Sync + 'static {
    /// Reaches the database once: UNAVAILABLE, with the cause, when it cannot.
    fn check(&self) -> BoxFuture<'_, Result<(), ApiError>>;

    /// Applies the base schema's and the modules' pending migrations (`apply`), or only verifies that none is
    /// pending (FAILED_PRECONDITION naming the first missing one). Returns how many ran.
    fn migrate<'a>(
        &'a self,
        modules: &'a [Migration],
        apply: bool,
    ) -> BoxFuture<'a, Result<usize, ApiError>>;

    /// Values every module may use (the store handle).
    fn provide(&self, resources: &mut Resources);

    fn authenticator(&self) -> Arc<dyn Authenticator>;

    fn membership(&self) -> Arc<dyn Membership>;

    /// Listens on `channels` until `stop`; notices arrive on the returned (bounded) receiver, starting with a
    /// [`Notice::Resync`] once listening.
    fn listen(&self, channels: Vec<&'static str>, stop: Stop) -> mpsc::Receiver<Notice>;
}

/// Role membership (a worker row per live process) and shard leases with expiry and a fencing token.
pub trait Membership: Send + Sync + 'static {
    /// Renews `worker`'s membership of `role` for `ttl`; returns the role's live workers, this one included.
    fn heartbeat<'a>(
        &'a self,
        role: &'a str,
        worker: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, ApiError>>;

    /// Makes `worker`'s leases of `role` match `want` (renew, take free or expired ones, let go of the rest);
    /// returns the leases held now.
    fn sync_leases<'a>(
        &'a self,
        role: &'a str,
        worker: &'a str,
        want: &'a [Shard],
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<ShardLease>, ApiError>>;

    /// Leaves `role` at once (a clean shutdown): the worker row and its leases expire now.
    fn leave<'a>(&'a self, role: &'a str, worker: &'a str) -> BoxFuture<'a, Result<(), ApiError>>;
}

/// The IAM: who holds a bearer API key.
pub trait Authenticator: Send + Sync + 'static {
    /// The caller that `api_key` (the bearer token, as sent) authenticates, or UNAUTHENTICATED saying why.
    fn authenticate<'a>(&'a self, api_key: &'a str)
    -> BoxFuture<'a, Result<Arc<Caller>, ApiError>>;
}
