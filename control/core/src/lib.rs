//! bc-core: Better Compute's domain types and pure decisions.
//!
//! It owns what the control plane decides: join-token rules ([`join`]) and the join commit ([`join_commit`]), the
//! hardware key ([`hardware`]), which gateways went silent ([`gateways`]), which node a GPU belongs to ([`devices`]), the lean IAM check ([`iam`]), node
//! lifecycle states ([`node`]), the bare-metal machine state machine ([`metal`]), reservation admission
//! ([`reservation`]), GPU placement ([`placer`]), the provider pools' workflow and EC2 codec ([`provider`]) and shard ownership
//! ([`shards`]). It must not import tokio, sqlx,
//! tonic, axum or reqwest, and never reads the clock, the RNG or the environment: time arrives as an argument (Unix
//! milliseconds). Start with [`join_commit::plan`].
// Decisions take `now`, random numbers and settings as arguments: no clock, global RNG or environment reads here
// (the list is in the root clippy.toml; scripts/check-pure keeps this line).
#![deny(clippy::disallowed_methods)]

pub mod api;
pub mod devices;
pub mod gateways;
pub mod hardware;
pub mod iam;
pub mod ids;
pub mod join;
pub mod join_commit;
pub mod lifecycle;
pub mod metal;
pub mod node;
pub mod placer;
pub mod provider;
pub mod reservation;
pub mod shards;
