//! NVMe facts for the report: identity from Identify Controller, health from the SMART / Health Information log
//! page (NVMe Base Specification 2.0, Figure 207).

use std::io;

use serde::Serialize;

use crate::wipe::NvmeCapabilities;

/// What Identify Controller says, as reported.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct NvmeIdentity {
    pub model: String,
    pub serial: String,
    pub firmware: String,
    pub namespaces: u32,
    pub sanitize_crypto: bool,
    pub sanitize_block: bool,
    pub format_supported: bool,
    pub format_crypto: bool,
}

impl From<NvmeCapabilities> for NvmeIdentity {
    fn from(c: NvmeCapabilities) -> Self {
        Self {
            model: c.model,
            serial: c.serial,
            firmware: c.firmware,
            namespaces: c.namespaces,
            sanitize_crypto: c.sanitize_crypto,
            sanitize_block: c.sanitize_block,
            format_supported: c.format_supported,
            format_crypto: c.format_crypto,
        }
    }
}

/// The SMART / Health Information log page (LID 02h).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SmartHealth {
    /// Critical Warning bits: 0 spare below threshold, 1 temperature, 2 reliability degraded, 3 read-only,
    /// 4 volatile backup failed, 5 persistent memory read-only.
    pub critical_warning: u8,
    pub healthy: bool,
    pub temperature_celsius: i32,
    pub available_spare_pct: u8,
    pub available_spare_threshold_pct: u8,
    pub percentage_used: u8,
    /// In units of 512,000 bytes, as the drive counts them.
    pub data_units_read: u128,
    pub data_units_written: u128,
    pub power_on_hours: u128,
    pub power_cycles: u128,
    pub unsafe_shutdowns: u128,
    pub media_errors: u128,
    pub error_log_entries: u128,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("SMART log is {0} bytes, 512 expected")]
pub struct SmartLengthError(pub usize);

impl SmartHealth {
    pub fn parse(log: &[u8]) -> Result<Self, SmartLengthError> {
        if log.len() < 512 {
            return Err(SmartLengthError(log.len()));
        }
        let u128_at = |o: usize| {
            let mut b = [0u8; 16];
            b.copy_from_slice(&log[o..o + 16]);
            u128::from_le_bytes(b)
        };
        let kelvin = u16::from_le_bytes([log[1], log[2]]);
        let critical_warning = log[0];
        Ok(Self {
            critical_warning,
            healthy: critical_warning == 0,
            temperature_celsius: i32::from(kelvin) - 273,
            available_spare_pct: log[3],
            available_spare_threshold_pct: log[4],
            percentage_used: log[5],
            data_units_read: u128_at(32),
            data_units_written: u128_at(48),
            power_cycles: u128_at(112),
            power_on_hours: u128_at(128),
            unsafe_shutdowns: u128_at(144),
            media_errors: u128_at(160),
            error_log_entries: u128_at(176),
        })
    }
}

/// NVMe admin commands the report needs, by block-device name (`nvme0n1`).
pub trait NvmeAdmin {
    fn identify(&self, name: &str) -> io::Result<NvmeIdentity>;
    fn smart(&self, name: &str) -> io::Result<SmartHealth>;
}

/// Issues the commands on `/dev/<name>` (needs CAP_SYS_ADMIN).
pub struct RealNvme;

fn open(name: &str) -> io::Result<std::fs::File> {
    if name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "device name with a slash",
        ));
    }
    std::fs::File::open(std::path::Path::new("/dev").join(name))
}

impl NvmeAdmin for RealNvme {
    fn identify(&self, name: &str) -> io::Result<NvmeIdentity> {
        use std::os::fd::AsFd;
        let f = open(name)?;
        let page = crate::os::nvme::identify_controller(f.as_fd())?;
        NvmeCapabilities::from_identify_controller(&page)
            .map(NvmeIdentity::from)
            .map_err(io::Error::other)
    }

    fn smart(&self, name: &str) -> io::Result<SmartHealth> {
        use std::os::fd::AsFd;
        let f = open(name)?;
        let log = crate::os::nvme::get_log_page(
            f.as_fd(),
            crate::os::nvme::LOG_SMART,
            crate::os::nvme::NSID_ALL,
            512,
        )?;
        SmartHealth::parse(&log).map_err(io::Error::other)
    }
}
