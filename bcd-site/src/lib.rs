//! bcd-site owns the boot services a rack management host runs for `bcd site`: proxy DHCP ([`dhcp`]), a
//! read-only TFTP server ([`tftp`]), boot HTTP (iPXE scripts and artifacts with Range, [`http`]) and the Redfish
//! client ([`redfish`]); [`serve`] runs the three boot services as one process from a netboot table (what
//! `bcd site serve` calls); the boot lease will join them with the site's session.
//!
//! It knows nothing of the session or the control plane and must not import `bcd`, `bc-proto` or any control
//! crate: `bcd site` wires its session to these services, handing them a [`dhcp::NetbootTable`] through a
//! `tokio::sync::watch` channel and the served directory as a path.
//!
//! Each service is split the same way: a sans-I/O part that decides (`dhcp::decide`, `tftp::codec`,
//! `tftp::negotiate`) and a thin async server that takes already-bound sockets and a shutdown future
//! (`dhcp::server::run`, `tftp::server::run`). Start reading at [`dhcp::decide()`] and [`tftp::codec`].

pub mod dhcp;
pub mod http;
pub mod redfish;
pub mod serve;
pub mod tftp;
