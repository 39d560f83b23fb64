//! Proxy DHCP for PXE and UEFI HTTP boot.
//!
//! The proxy never assigns addresses: the rack's own DHCP server does that. It answers only PXE (`PXEClient`) and
//! HTTP-boot (`HTTPClient`) clients whose MAC is in the [`NetbootTable`], on port 67 (an OFFER with option 43 so
//! clients need not ask port 4011, or, with [`OfferStyle::BootServer`], a boot-server menu that sends PXE firmware
//! to port 4011) and on port 4011 (an ACK with the boot file).
//!
//! - [`wire`]: decoding that never panics, encoding.
//! - [`decide()`]: the pure decision, request + table → reply or ignore-with-reason.
//! - [`rogue`]: noticing another server handing out PXE boot information on the segment.
//! - [`render`]: the human-readable form of a reply used by golden tests and debug logs.
//! - [`server`]: the UDP server around all of the above.

mod decide;
pub mod render;
pub mod rogue;
pub mod server;
mod table;
pub mod wire;

/// The DHCP codec this module speaks, re-exported so callers build and read messages with the same version.
pub use dhcproto;

pub use decide::{
    Arch, BOOT_SERVER_TYPE, BootFiles, Decision, Destination, IgnoreReason, ListenPort, Loader,
    OfferStyle, Reply, ServerInfo, decide,
};
pub use table::{MacAddr, MacParseError, NetbootRule, NetbootTable};
