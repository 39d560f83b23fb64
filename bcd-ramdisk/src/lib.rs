//! bcd-ramdisk owns what a PXE-booted machine does before it runs its installed system: read its parameters from
//! the kernel command line ([`cmdline`]), load the kernel modules the initramfs carries in dependency order
//! ([`modules`]), wipe disks by probed capability with per-device evidence ([`wipe`]) and stream an OS image to a
//! block device with inline hashing, Range resume and read-back verification ([`stream`]). Hardware and OS access go
//! through narrow traits ([`stream::BlockSink`], [`wipe::BlockDevice`]) whose real implementations live in [`os`],
//! the only module allowed to use `unsafe` (ioctls). It must not import NVML, OpenSSL or anything that loads
//! libraries at run time: the binary is a static musl PID 1. Start reading at [`stream::write_image`] (the
//! pipeline) and [`wipe::plan`] (the wipe decision), then their executors.

pub mod cmdline;
pub mod modules;
pub mod os;
pub mod stream;
pub mod wipe;
