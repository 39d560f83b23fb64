//! bcd: the Better Compute node daemon, as a library with a thin binary.
//!
//! It owns the node side of identity: the node key and state directory ([`state`]), configuration pinned by the
//! install script ([`config`]), hardware claims from DMI, sysfs and the GPU backend ([`hardware`], [`gpu`]) and
//! `bcd join` ([`join`]). GPU access goes through the [`gpu::GpuBackend`] trait: NVML (feature `nvml`) or a JSON
//! fixture. [`telemetry`] (feature `telemetry`) samples GPUs and the host for bc-telemetry's exporters, beside the
//! session and never through it. [`site`] (feature `site`) is the site agent, `bcd site`: boot lease, artifact
//! cache, secrets. [`cli`] is the command line (`main.rs` only calls [`cli::main`]). With default features off (as the
//! ramdisk builds it) it has no NVML, no site code and no telemetry. It never links the control plane (bc-control,
//! bc-store, bc-gateway, sqlx: `scripts/check-deps`).
//! [`vmm`] runs the node's VPS instances (QEMU over QMP; feature `vmm`, which needs `site`): without the feature
//! only its pure parts are built (the desired-spec parser, the planner, the seed renderer, VFIO logic), and a
//! desired state listing instances is refused.
//! Start with [`join::join`], and [`site::lease`] for the site agent.

pub mod cdi;
pub mod cli;
pub mod commands;
pub mod config;
pub mod diag;
pub mod gpu;
pub mod hardware;
pub mod inventory;
pub mod join;
pub mod session;
#[cfg(feature = "site")]
pub mod site;
pub mod state;
#[cfg(feature = "telemetry")]
pub mod telemetry;
pub mod tunnel;
pub mod vmm;
