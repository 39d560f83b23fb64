//! The inventory module's interface: what the nodes module's session backend hands it (a node's inventory section
//! as the node sent it) and what it answers. The session backend holds an `Arc<dyn InventorySink>` given by the
//! composition, so neither module imports the other.

use crate::ids::NodeId;
use std::future::Future;
use std::pin::Pin;

/// The inventory sections a node reports, in the order they are requested.
pub const SECTIONS: &[&str] = &[
    "system",
    "cpu",
    "memory",
    "gpus",
    "nics",
    "disks",
    "instances",
];
/// The largest section payload accepted.
pub const MAX_SECTION_BYTES: usize = 1 << 20;

/// A section as the node sent it: its name, the SHA-256 it declares, and its JSON payload.
#[derive(Debug, Clone, Copy)]
pub struct SectionReport<'a> {
    pub node: &'a NodeId,
    /// The session epoch it arrived in (a section of an older session is stale).
    pub epoch: i64,
    pub name: &'a str,
    pub hash: &'a [u8],
    pub payload: &'a [u8],
}

/// What recording a section did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Stored,
    /// The session it arrived in is no longer the node's current one: nothing was stored.
    Stale,
}

/// Why a section was not recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryRefusal {
    /// The node sent something wrong (unknown section, too large, hash mismatch, not the section's JSON).
    #[error("{0}")]
    Invalid(String),
    /// The control plane could not store it now (logged there); the node retries.
    #[error("{0}")]
    Unavailable(String),
}

pub type RecordFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Recorded, InventoryRefusal>> + Send + 'a>>;

/// Records a node's inventory sections and derives what follows from them (bookable GPUs from `gpus`).
pub trait InventorySink: Send + Sync + 'static {
    fn record<'a>(&'a self, section: SectionReport<'a>) -> RecordFuture<'a>;
}
