//! What a ramdisk command's stored result means to the planner: the signed payload (already verified against the
//! node's key by the session) read into an [`Outcome`], and the command arguments the ramdisk parses
//! (bcd-ramdisk's `commands::parse`: `ramdisk.diagnose`, `ramdisk.wipe {disks}`, `ramdisk.stream {url, sha256,
//! device}`, `ramdisk.kexec {target, seed}`). Read leniently by field: a payload of another version that lacks a
//! field reports it as unknown, never as a pass.

use bc_core::metal::{HardwareSummary, Outcome, RamdiskCommand, Step};
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

fn count(v: &Value, key: &str) -> Option<u32> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| u32::try_from(a.len()).unwrap_or(u32::MAX))
}

/// The hardware a `ramdisk.diagnose` report describes.
pub fn diagnosed_hardware(report: &Value) -> HardwareSummary {
    let macs = report
        .get("nics")
        .and_then(Value::as_array)
        .map(|nics| {
            nics.iter()
                .filter_map(|n| n.get("mac").and_then(Value::as_str))
                .filter(|m| *m != "00:00:00:00:00:00")
                .map(str::to_ascii_lowercase)
                .collect()
        })
        .unwrap_or_default();
    HardwareSummary {
        cpus: report
            .pointer("/cpu/logical_cpus")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok()),
        memory_mib: report
            .pointer("/memory/total_bytes")
            .and_then(Value::as_u64)
            .map(|b| b / (1024 * 1024)),
        gpus: count(report, "gpus"),
        disks: count(report, "disks"),
        macs,
    }
}

fn strings(v: &Value, key: &str) -> Vec<String> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().map_or_else(|| s.to_string(), str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The outcome of a ramdisk command of `step` in `state` (done, failed, expired) with its result or error.
pub fn ramdisk_outcome(
    step: Step,
    state: &str,
    result: Option<Value>,
    error: Option<String>,
) -> Outcome {
    match state {
        "done" => {}
        "expired" => {
            return Outcome::Failed {
                reason: match error {
                    // The ramdisk saw the deadline first and said what it stopped doing.
                    Some(e) => format!("the command's deadline passed on the ramdisk: {e}"),
                    None => "the ramdisk did not answer before the command's deadline".into(),
                },
                retryable: true,
            };
        }
        _ => {
            return Outcome::Failed {
                reason: error
                    .unwrap_or_else(|| "the ramdisk reported a failure without a reason".into()),
                retryable: false,
            };
        }
    }
    let r = result.unwrap_or(Value::Null);
    // A signed error (an unknown kind, arguments refused, a disk that failed): its own reason, not a complaint
    // that the report lacks the step's fields.
    if let Some(e) = r.get("error").and_then(Value::as_str) {
        return Outcome::Failed {
            reason: e.to_owned(),
            retryable: false,
        };
    }
    match step {
        Step::Diagnose => {
            let reasons = strings(&r, "problems");
            Outcome::Diagnosed {
                hardware: diagnosed_hardware(&r),
                healthy: reasons.is_empty() && r.get("problems").is_some(),
                reasons: if r.get("problems").is_none() {
                    vec![
                        "the diagnose report has no problems list (not a ramdisk.diagnose report)"
                            .into(),
                    ]
                } else {
                    reasons
                },
            }
        }
        Step::Wipe => match r.get("wiped").and_then(Value::as_bool) {
            Some(true) => Outcome::Done,
            Some(false) => Outcome::Failed {
                reason: format!("wipe failed on {}", strings(&r, "failed").join(", ")),
                retryable: false,
            },
            None => Outcome::Failed {
                reason: "the wipe result does not say whether the disks were wiped".into(),
                retryable: false,
            },
        },
        Step::Stream => match (
            r.get("digest").and_then(Value::as_str),
            r.get("algo").and_then(Value::as_str),
        ) {
            (Some(d), Some(a)) => Outcome::Streamed {
                digest: format!("{a}:{d}"),
            },
            _ => Outcome::Failed {
                reason: "the stream result names no verified digest".into(),
                retryable: false,
            },
        },
        _ => Outcome::Done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diagnose_report_reads_into_counts_and_problems() {
        let r = serde_json::json!({
            "cpu": {"logical_cpus": 2, "sockets": 1},
            "memory": {"total_bytes": 2147483648u64, "available_bytes": 1},
            "gpus": [{"address": "0000:01:00.0"}],
            "disks": [{"name": "vda"}, {"name": "vdb"}],
            "nics": [{"name": "eth0", "mac": "52:54:00:AA:BB:01"}, {"name": "lo", "mac": "00:00:00:00:00:00"}],
            "problems": ["vdb: SMART says failing"],
        });
        let o = ramdisk_outcome(Step::Diagnose, "done", Some(r), None);
        let Outcome::Diagnosed {
            hardware,
            healthy,
            reasons,
        } = o
        else {
            panic!("{o:?}");
        };
        assert_eq!(hardware.cpus, Some(2));
        assert_eq!(hardware.memory_mib, Some(2048));
        assert_eq!((hardware.gpus, hardware.disks), (Some(1), Some(2)));
        assert_eq!(hardware.macs, vec!["52:54:00:aa:bb:01".to_string()]);
        assert!(!healthy);
        assert_eq!(reasons, vec!["vdb: SMART says failing".to_string()]);
    }

    #[test]
    fn a_report_without_its_fields_is_never_a_pass() {
        let o = ramdisk_outcome(Step::Diagnose, "done", Some(serde_json::json!({})), None);
        assert!(
            matches!(o, Outcome::Diagnosed { healthy: false, .. }),
            "{o:?}"
        );
        let o = ramdisk_outcome(Step::Wipe, "done", Some(serde_json::json!({})), None);
        assert!(
            matches!(
                o,
                Outcome::Failed {
                    retryable: false,
                    ..
                }
            ),
            "{o:?}"
        );
        let o = ramdisk_outcome(Step::Stream, "done", None, None);
        assert!(matches!(o, Outcome::Failed { .. }), "{o:?}");
    }

    #[test]
    fn expiry_is_retryable_and_a_reported_failure_is_not() {
        let o = ramdisk_outcome(Step::Wipe, "expired", None, None);
        assert!(
            matches!(
                o,
                Outcome::Failed {
                    retryable: true,
                    ..
                }
            ),
            "{o:?}"
        );
        let o = ramdisk_outcome(
            Step::Stream,
            "expired",
            None,
            Some("ramdisk.stream: the command's deadline passed after 5 bytes".into()),
        );
        assert_eq!(
            o,
            Outcome::Failed {
                reason:
                    "the command's deadline passed on the ramdisk: ramdisk.stream: the command's \
                         deadline passed after 5 bytes"
                        .into(),
                retryable: true
            }
        );
        // A signed error carries its reason through (before: "the stream result names no verified digest").
        let o = ramdisk_outcome(
            Step::Stream,
            "done",
            Some(serde_json::json!({"error": "ramdisk.stream: /dev/vda is read-only"})),
            None,
        );
        assert_eq!(
            o,
            Outcome::Failed {
                reason: "ramdisk.stream: /dev/vda is read-only".into(),
                retryable: false
            }
        );
        let o = ramdisk_outcome(Step::Wipe, "failed", None, Some("no disk".into()));
        assert_eq!(
            o,
            Outcome::Failed {
                reason: "no disk".into(),
                retryable: false
            }
        );
    }

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
