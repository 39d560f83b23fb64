//! bc-hwtests: tests that need real or emulated hardware (QEMU lab, Redfish emulator, NVML). Each skips with a
//! printed reason when its hardware is absent.
//!
//! The library holds what the tests share: [`proc`] (child processes killed by PID, the one `skip` helper),
//! [`netns`] (namespaces deleted by name; code run inside one), [`watch`] (timing patterns in a growing file) and
//! [`lab`], the metal lab: a boot segment, dnsmasq, libvirtd and sushy-tools' libvirt driver as a real BMC (start
//! at [`lab::MetalLab::up`]). `metal-lab` (scripts/lab) brings the same lab up by hand. It imports no crate of the
//! product: the tests drive the product's binaries and libraries from outside.

pub mod lab;
pub mod metal_flow;
pub mod netns;
pub mod proc;
pub mod watch;

pub use proc::{Proc, have, run, skip};
