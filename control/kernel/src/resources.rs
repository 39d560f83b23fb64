//! What modules share without knowing each other's crates: one value per type (the store, a module's state, the
//! gateway's session registry), put in by the backend and by modules as they start, read by handlers and
//! reconcilers.

use crate::error::ApiError;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

/// One value per type. Filled while the control plane initializes, then shared read-only.
#[derive(Default, Clone)]
pub struct Resources {
    map: HashMap<TypeId, Entry>,
}

#[derive(Clone)]
struct Entry {
    value: Arc<dyn Any + Send + Sync>,
    type_name: &'static str,
}

impl Resources {
    pub fn new() -> Resources {
        Resources::default()
    }

    /// Puts `value` in; replaces (and returns true for) one of the same type.
    pub fn insert<T: Send + Sync + 'static>(&mut self, value: T) -> bool {
        self.insert_arc(Arc::new(value))
    }

    /// Puts a shared value in; replaces (and returns true for) one of the same type.
    pub fn insert_arc<T: Send + Sync + 'static>(&mut self, value: Arc<T>) -> bool {
        self.map
            .insert(
                TypeId::of::<T>(),
                Entry {
                    value,
                    type_name: std::any::type_name::<T>(),
                },
            )
            .is_some()
    }

    pub fn get<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.map.get(&TypeId::of::<T>())?.value.downcast_ref()
    }

    /// The shared handle of a value (for a task that outlives the borrow).
    pub fn get_arc<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        self.map
            .get(&TypeId::of::<T>())?
            .value
            .clone()
            .downcast()
            .ok()
    }

    /// The value of type `T`, or UNAVAILABLE naming the type (a module that was not started, or a backend that does
    /// not provide it).
    pub fn require<T: Send + Sync + 'static>(&self) -> Result<&T, ApiError> {
        self.get().ok_or_else(|| missing::<T>())
    }

    /// Like [`Resources::require`], the shared handle.
    pub fn require_arc<T: Send + Sync + 'static>(&self) -> Result<Arc<T>, ApiError> {
        self.get_arc().ok_or_else(|| missing::<T>())
    }

    /// Moves every value of `other` in (a later value of a type replaces an earlier one); returns the type names
    /// that were replaced.
    pub fn merge(&mut self, other: Resources) -> Vec<&'static str> {
        let mut replaced = Vec::new();
        for (k, v) in other.map {
            let name = v.type_name;
            if self.map.insert(k, v).is_some() {
                replaced.push(name);
            }
        }
        replaced
    }

    /// The type names held (for diagnostics).
    pub fn type_names(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self.map.values().map(|e| e.type_name).collect();
        names.sort_unstable();
        names
    }
}

fn missing<T>() -> ApiError {
    ApiError::unavailable(format!(
        "this control plane has no {} (the module that provides it is not configured or did not start)",
        std::any::type_name::<T>()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_per_type() {
        let mut r = Resources::new();
        assert!(!r.insert(3u32));
        assert!(r.insert(4u32));
        assert_eq!(r.get::<u32>(), Some(&4));
        assert!(r.get::<u64>().is_none());
        let e = r.require::<String>().err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with("UNAVAILABLE") && e.contains("String")),
            "{e:?}"
        );
        let mut other = Resources::new();
        other.insert(5u32);
        other.insert("x".to_string());
        assert_eq!(r.merge(other), vec!["u32"]);
        assert_eq!(
            r.get_arc::<String>().as_deref().map(String::as_str),
            Some("x")
        );
    }
}

/// The database's moves to another primary, counted (the server provides it when its pool follows the primary
/// among several hosts, `bc_store::Store::primary_moves`). What still waits on the old primary when it moves may
/// never be answered (a primary gone silent answers nothing, and nothing resets its connections), so at a move a
/// reconciler's step in flight is dropped and stepped again, and a method in flight is answered UNAVAILABLE, at
/// once instead of at their deadlines.
#[derive(Clone, Debug)]
pub struct DatabaseMoves(pub tokio::sync::watch::Receiver<u64>);

impl DatabaseMoves {
    /// Resolves at the first move after the call; never when the pool's watcher is gone.
    pub async fn next(&self) {
        let mut moves = self.0.clone();
        moves.borrow_and_update();
        if moves.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Resolves at the next move of the database in `resources` ([`DatabaseMoves`]); never when it provides none.
pub(crate) fn next_move(
    resources: &Resources,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let moves = resources.get::<DatabaseMoves>().cloned();
    async move {
        match moves {
            Some(m) => m.next().await,
            None => std::future::pending().await,
        }
    }
}
