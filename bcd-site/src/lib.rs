//! bcd-site: proxy DHCP, TFTP, boot HTTP, Redfish client and the boot lease for `bcd site` (filled by the site issue).
