//! DHCPv4 bytes → `Message` without ever panicking on what the network sends: the same checked decoder as bcd-site's
//! server, from the shared `bc-dhcp-wire` crate (the ramdisk may not link bcd-site). Fuzzed by
//! `fuzz/fuzz_targets/ramdisk_dhcp.rs`.

pub use bc_dhcp_wire::{DecodeError, HEADER_LEN, decode};
