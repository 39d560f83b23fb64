//! The command arguments the ramdisk parses (bcd-ramdisk's `commands::parse`: `ramdisk.diagnose`, `ramdisk.wipe {disks}`, `ramdisk.stream {url, sha256,
//! device}`, `ramdisk.kexec {target, seed}`). What a command's stored result means to the planner is
//! [`bc_core::metal::ramdisk`]'s (outside input, fuzzed there).

use bc_core::metal::RamdiskCommand;
use serde_json::Value;

pub const DIAGNOSE: &str = "ramdisk.diagnose";
pub const WIPE: &str = "ramdisk.wipe";
pub const STREAM: &str = "ramdisk.stream";
pub const KEXEC: &str = "ramdisk.kexec";

/// Where the deploy's image and disk are (the module's configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeployTarget {
    /// Base URL the image artifact is fetched from (`<base>/<sha256 hex>`) when the machine's site has not reported
    /// its boot HTTP URL; normally `None`: the site's own boot HTTP serves the image from its cache
    /// (`<boot_url>/artifacts/sha256/<hex>`), the address the ramdisk booted from.
    pub image_base_url: Option<String>,
    /// The disk to write (`vda`, `nvme0n1`).
    pub device: String,
}

/// Where a ramdisk streams image `hex` from: the site's boot HTTP (`site_boot_url`, as its agent reported it),
/// else the configured base; `None` when neither is known.
pub fn image_url(target: &DeployTarget, site_boot_url: Option<&str>, hex: &str) -> Option<String> {
    match (site_boot_url, &target.image_base_url) {
        (Some(site), _) => Some(format!(
            "{}/artifacts/sha256/{hex}",
            site.trim_end_matches('/')
        )),
        (None, Some(base)) => Some(format!("{}/{hex}", base.trim_end_matches('/'))),
        (None, None) => None,
    }
}

/// The command kind and arguments of a planned ramdisk command; `image_url` is where a stream fetches the image
/// ([`image_url`]), `join_token` the installed system's token minted in the same plan (for the kexec's seed).
pub fn command(
    c: &RamdiskCommand,
    target: &DeployTarget,
    image_url: Option<&str>,
    join_token: Option<&str>,
) -> (&'static str, Value) {
    match c {
        RamdiskCommand::Diagnose => (DIAGNOSE, serde_json::json!({})),
        RamdiskCommand::Wipe => (WIPE, serde_json::json!({"disks": "all"})),
        RamdiskCommand::Stream { image } => {
            let hex = image.strip_prefix("sha256:").unwrap_or(image);
            (
                STREAM,
                serde_json::json!({
                    "url": image_url,
                    "sha256": hex,
                    "device": target.device,
                }),
            )
        }
        RamdiskCommand::Kexec {
            user_data,
            meta_data,
        } => (
            KEXEC,
            serde_json::json!({
                "target": target.device,
                "seed": join_token.map(|t| serde_json::json!({
                    "join_token": t,
                    "user_data": user_data,
                    "meta_data": meta_data,
                })),
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_command_names_the_image_by_digest_on_the_sites_boot_http() {
        let mut t = DeployTarget {
            image_base_url: None,
            device: "vda".into(),
        };
        assert_eq!(image_url(&t, None, "ab"), None, "no URL is made up");
        let url = image_url(&t, Some("http://10.78.0.2:8080/"), "ab");
        assert_eq!(
            url.as_deref(),
            Some("http://10.78.0.2:8080/artifacts/sha256/ab")
        );
        let (kind, args) = command(
            &RamdiskCommand::Stream {
                image: "sha256:ab".into(),
            },
            &t,
            url.as_deref(),
            None,
        );
        assert_eq!(kind, STREAM);
        assert_eq!(args["url"], "http://10.78.0.2:8080/artifacts/sha256/ab");
        assert_eq!(args["sha256"], "ab");
        t.image_base_url = Some("http://mirror/images/".into());
        assert_eq!(
            image_url(&t, None, "ab").as_deref(),
            Some("http://mirror/images/ab")
        );
    }

    #[test]
    fn the_kexec_carries_the_seed_with_the_join_token() {
        let t = DeployTarget {
            image_base_url: None,
            device: "vda".into(),
        };
        let (kind, args) = command(
            &RamdiskCommand::Kexec {
                user_data: "#cloud-config\n".into(),
                meta_data: String::new(),
            },
            &t,
            None,
            Some("bcjt_a.b"),
        );
        assert_eq!(kind, KEXEC);
        assert_eq!(args["target"], "vda");
        assert_eq!(args["seed"]["join_token"], "bcjt_a.b");
        assert_eq!(args["seed"]["user_data"], "#cloud-config\n");
    }
}
