//! The DHCPv4 wire rules live in `bc-dhcp-wire`, shared with the ramdisk's client; re-exported here so the server's
//! paths (`bcd_site::dhcp::wire::decode`) stay.

pub use bc_dhcp_wire::*;
