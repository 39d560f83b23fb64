//! bcd: the Better Compute node daemon, as a library with a thin binary.
//!
//! It owns the node side of identity: the node key and state directory ([`state`]), configuration pinned by the
//! install script ([`config`]), hardware claims from DMI, sysfs and the GPU backend ([`hardware`], [`gpu`]) and
//! `bcd join` ([`join`]). GPU access goes through the [`gpu::GpuBackend`] trait: NVML (feature `nvml`) or a JSON
//! fixture. [`telemetry`] (feature `telemetry`) samples GPUs and the host for bc-telemetry's exporters, beside the
//! session and never through it. With default features off (as the ramdisk builds it) it has no NVML, no site code
//! and no telemetry.
//! [`vmm`] runs the node's VPS instances (QEMU over QMP; feature `vmm`, which needs `site`): without the feature
//! only its pure parts are built (the desired-spec parser, the planner, the seed renderer, VFIO logic), and a
//! desired state listing instances is refused.
//! Start with [`join::join`].

#[cfg(feature = "site")]
pub mod artifact_cache;
pub mod cdi;
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
pub mod vmm;
