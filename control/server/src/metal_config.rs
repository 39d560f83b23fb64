//! `[metal]` of the control plane's configuration: the metal module's deadlines and retry plans, where its ramdisk
//! and deploy images come from. Every field is optional; what is left out keeps bc-mod-metal's default. Times are
//! in seconds, so a lab can bound its failure cases (`netboot_timeout_s = 60, netboot_attempts = 2`).

use crate::config::ConfigError;
use bc_core::metal::{Millis, Retry};
use serde::Deserialize;

/// `[metal]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetalWire {
    /// The ramdisk's kernel and initrd: a path in the site's artifact folder or `sha256:<hex>` of an artifact.
    pub ramdisk_kernel: Option<String>,
    pub ramdisk_initrd: Option<String>,
    /// The ramdisk's kernel command line before `bc.url`, `bc.ca_pin`, `bc.join_key` (default `console=ttyS0`).
    pub ramdisk_cmdline: Option<String>,
    /// Where ramdisks stream deploy images from when the site has not reported its boot HTTP URL.
    pub image_base_url: Option<String>,
    /// The disk images are written to (default `vda`).
    pub device: Option<String>,
    pub bmc_timeout_s: Option<u64>,
    pub inspect_timeout_s: Option<u64>,
    pub inspect_attempts: Option<u32>,
    /// From the power kick to the ramdisk's join, and how many PXE attempts (k) before the machine fails.
    pub netboot_timeout_s: Option<u64>,
    pub netboot_attempts: Option<u32>,
    pub diagnose_timeout_s: Option<u64>,
    pub diagnose_attempts: Option<u32>,
    pub wipe_timeout_s: Option<u64>,
    pub wipe_attempts: Option<u32>,
    pub deploy_timeout_s: Option<u64>,
    pub deploy_attempts: Option<u32>,
    pub stream_timeout_s: Option<u64>,
    pub kexec_join_timeout_s: Option<u64>,
    pub reboot_join_timeout_s: Option<u64>,
    /// In `ready` with the ramdisk up: power off after this long; 0 never.
    pub ready_idle_timeout_s: Option<u64>,
    /// The executor's tick (milliseconds; default 2000).
    pub tick_ms: Option<u64>,
}

impl MetalWire {
    /// The module's configuration: its defaults with the fields set here.
    pub fn validate(self, origin: &str) -> Result<bc_mod_metal::Config, ConfigError> {
        let field = |field: &'static str, message: &str| ConfigError::Field {
            origin: origin.to_string(),
            field,
            message: message.to_string(),
        };
        let secs = |name: &'static str, v: Option<u64>, default: Millis| match v {
            None => Ok(default),
            Some(s) if (1..=86_400).contains(&s) => {
                Ok(Millis::try_from(s * 1000).unwrap_or(default))
            }
            Some(_) => Err(field(name, "must be between 1 and 86400 seconds")),
        };
        let count = |name: &'static str, v: Option<u32>, default: u32| match v {
            None => Ok(default),
            Some(n) if (1..=20).contains(&n) => Ok(n),
            Some(_) => Err(field(name, "must be between 1 and 20")),
        };
        let retry = |t: &'static str, a: &'static str, v: (Option<u64>, Option<u32>), d: Retry| {
            Ok::<_, ConfigError>(Retry {
                timeout_ms: secs(t, v.0, d.timeout_ms)?,
                attempts: count(a, v.1, d.attempts)?,
            })
        };
        let mut c = bc_mod_metal::Config::default();
        let p = c.policy.clone();
        c.policy.bmc_timeout_ms =
            secs("metal.bmc_timeout_s", self.bmc_timeout_s, p.bmc_timeout_ms)?;
        c.policy.inspect = retry(
            "metal.inspect_timeout_s",
            "metal.inspect_attempts",
            (self.inspect_timeout_s, self.inspect_attempts),
            p.inspect,
        )?;
        c.policy.netboot = retry(
            "metal.netboot_timeout_s",
            "metal.netboot_attempts",
            (self.netboot_timeout_s, self.netboot_attempts),
            p.netboot,
        )?;
        c.policy.diagnose = retry(
            "metal.diagnose_timeout_s",
            "metal.diagnose_attempts",
            (self.diagnose_timeout_s, self.diagnose_attempts),
            p.diagnose,
        )?;
        c.policy.wipe = retry(
            "metal.wipe_timeout_s",
            "metal.wipe_attempts",
            (self.wipe_timeout_s, self.wipe_attempts),
            p.wipe,
        )?;
        c.policy.deploy = retry(
            "metal.deploy_timeout_s",
            "metal.deploy_attempts",
            (self.deploy_timeout_s, self.deploy_attempts),
            p.deploy,
        )?;
        c.policy.stream_timeout_ms = secs(
            "metal.stream_timeout_s",
            self.stream_timeout_s,
            p.stream_timeout_ms,
        )?;
        c.policy.kexec_join_timeout_ms = secs(
            "metal.kexec_join_timeout_s",
            self.kexec_join_timeout_s,
            p.kexec_join_timeout_ms,
        )?;
        c.policy.reboot_join_timeout_ms = secs(
            "metal.reboot_join_timeout_s",
            self.reboot_join_timeout_s,
            p.reboot_join_timeout_ms,
        )?;
        c.policy.ready_idle_timeout_ms = match self.ready_idle_timeout_s {
            None => p.ready_idle_timeout_ms,
            Some(0) => None,
            Some(s) => Some(secs("metal.ready_idle_timeout_s", Some(s), 0)?),
        };
        if let Some(k) = self.ramdisk_kernel {
            c.ramdisk.kernel = k;
        }
        if let Some(i) = self.ramdisk_initrd {
            c.ramdisk.initrd = Some(i).filter(|i| !i.is_empty());
        }
        if let Some(cmdline) = self.ramdisk_cmdline {
            if cmdline.len() > 1024 || cmdline.contains(['\n', '\0']) {
                return Err(field(
                    "metal.ramdisk_cmdline",
                    "at most 1024 bytes on one line",
                ));
            }
            c.ramdisk.cmdline = cmdline;
        }
        if let Some(url) = self.image_base_url {
            bc_core::metal::site_report::check_boot_url(&url)
                .map_err(|e| field("metal.image_base_url", &e))?;
            c.deploy.image_base_url = Some(url);
        }
        if let Some(d) = self.device {
            let ok = !d.is_empty()
                && d.len() <= 32
                && d.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !ok {
                return Err(field(
                    "metal.device",
                    "a device name such as vda or nvme0n1",
                ));
            }
            c.deploy.device = d;
        }
        if let Some(ms) = self.tick_ms {
            if !(100..=60_000).contains(&ms) {
                return Err(field("metal.tick_ms", "must be between 100 and 60000"));
            }
            c.tick = std::time::Duration::from_millis(ms);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_override_the_defaults_and_bad_values_name_their_field() {
        let w: MetalWire = toml::from_str(
            "netboot_timeout_s = 60\nnetboot_attempts = 2\nready_idle_timeout_s = 0\ndevice = \"vdb\"\n",
        )
        .expect("toml");
        let c = w.validate("x.toml").expect("valid");
        assert_eq!(c.policy.netboot.timeout_ms, 60_000);
        assert_eq!(c.policy.netboot.attempts, 2);
        assert_eq!(c.policy.ready_idle_timeout_ms, None);
        assert_eq!(c.deploy.device, "vdb");
        assert_eq!(
            c.policy.wipe,
            bc_core::metal::Policy::default().wipe,
            "unset fields keep the default"
        );
        for (text, name) in [
            ("netboot_attempts = 0", "metal.netboot_attempts"),
            ("bmc_timeout_s = 0", "metal.bmc_timeout_s"),
            ("device = \"../sda\"", "metal.device"),
            ("image_base_url = \"ftp://x\"", "metal.image_base_url"),
        ] {
            let w: MetalWire = toml::from_str(text).expect("toml");
            let e = w
                .validate("x.toml")
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(name), "{text}: {e}");
        }
        assert!(toml::from_str::<MetalWire>("wizard = 1").is_err());
    }
}
