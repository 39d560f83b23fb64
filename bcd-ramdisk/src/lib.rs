//! bcd-ramdisk owns what a PXE-booted machine does before it runs its installed system: read its parameters from
//! the kernel command line ([`cmdline`]), load the kernel modules the initramfs carries in dependency order
//! ([`modules`]), wipe disks by probed capability with per-device evidence ([`wipe`]) and stream an OS image to a
//! block device with inline hashing, Range resume and read-back verification ([`stream`]), report the hardware
//! ([`diagnose`]), get an address with its own DHCP client ([`dhcp`]), leave a NoCloud seed on the installed root
//! ([`seed`]) and kexec into it ([`kexec`]), and in agent mode join as the machine's node and keep a session with
//! bcd's own join and session code ([`agent`]). [`init`] is the PID 1 flow and [`cli`] the binary's entry; both call
//! [`actions`]. Hardware and OS access go
//! through narrow traits ([`stream::BlockSink`], [`wipe::BlockDevice`]) whose real implementations live in [`os`],
//! the only module allowed to use `unsafe` (ioctls). It must not import NVML, OpenSSL or anything that loads
//! libraries at run time: the binary is a static musl PID 1. Start reading at [`init::run`] (PID 1), then
//! [`stream::write_image`] (the pipeline) and [`wipe::plan`] (the wipe decision) and their executors.

pub mod actions;
pub mod agent;
pub mod cli;
pub mod cmdline;
pub mod commands;
pub mod dhcp;
pub mod diagnose;
pub mod disk_gate;
pub mod init;
pub mod kexec;
pub mod modules;
pub mod os;
pub mod seed;
pub mod stream;
pub mod wipe;
