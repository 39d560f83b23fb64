//! What a ramdisk command's stored result means to the planner: the node's answer (signed by the ramdisk's key and
//! verified by its session before it was stored) read into an [`Outcome`]. Outside input: a machine's ramdisk
//! runs on hardware the control plane does not own, so the answer is read leniently by field (a payload of another
//! version that lacks a field reports it as unknown, never as a pass) and what it carries into the machine's record
//! is bounded: a reason at most [`MAX_REASON`] bytes, at most [`MAX_PROBLEMS`] problems, only well-formed MACs.

use super::site_report::canonical_mac;
use super::{HardwareSummary, Outcome, Step};
use serde_json::Value;

/// The longest reason an outcome carries (longer ones are cut at a character boundary, saying how much).
pub const MAX_REASON: usize = 1024;
/// The most problems of a diagnose report an outcome carries (the rest are counted).
pub const MAX_PROBLEMS: usize = 32;
/// The most MACs a diagnose summary keeps (a machine has a few; more is not a report of hardware).
pub const MAX_MACS: usize = 64;
/// The longest problem kept, each.
const MAX_PROBLEM: usize = 256;
/// The longest digest a stream result may name (hex of SHA-512 is 128).
const MAX_DIGEST: usize = 128;

/// `s` cut to at most `max` bytes at a character boundary, saying how many bytes were cut.
fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max.saturating_sub(32);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &s[..end], s.len() - end)
}

fn count(v: &Value, key: &str) -> Option<u32> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| u32::try_from(a.len()).unwrap_or(u32::MAX))
}

/// The hardware a `ramdisk.diagnose` report describes.
pub fn diagnosed_hardware(report: &Value) -> HardwareSummary {
    let mut macs: Vec<String> = Vec::new();
    for mac in report
        .get("nics")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|n| n.get("mac").and_then(Value::as_str))
        .filter_map(canonical_mac)
        .filter(|m| m != "00:00:00:00:00:00")
    {
        if macs.len() == MAX_MACS {
            break;
        }
        if !macs.contains(&mac) {
            macs.push(mac);
        }
    }
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

/// The entries of the list at `key` as text (a non-string shown as JSON), at most `most` of them, each at most
/// [`MAX_PROBLEM`] bytes, and one line counting the rest.
fn strings(v: &Value, key: &str, most: usize) -> Vec<String> {
    let Some(a) = v.get(key).and_then(Value::as_array) else {
        return Vec::new();
    };
    let mut out: Vec<String> = a
        .iter()
        .take(most)
        .map(|s| {
            let text = s.as_str().map_or_else(|| s.to_string(), str::to_owned);
            bounded(&text, MAX_PROBLEM)
        })
        .collect();
    if a.len() > most {
        out.push(format!("and {} more", a.len() - most));
    }
    out
}

/// The outcome of a ramdisk command of `step` in `state` (done, failed, expired) with its result or error.
pub fn ramdisk_outcome(
    step: Step,
    state: &str,
    result: Option<Value>,
    error: Option<String>,
) -> Outcome {
    let failed = |reason: String, retryable: bool| Outcome::Failed {
        reason: bounded(&reason, MAX_REASON),
        retryable,
    };
    match state {
        "done" => {}
        "expired" => {
            return failed(
                match error {
                    // The ramdisk saw the deadline first and said what it stopped doing.
                    Some(e) => format!("the command's deadline passed on the ramdisk: {e}"),
                    None => "the ramdisk did not answer before the command's deadline".into(),
                },
                true,
            );
        }
        _ => {
            return failed(
                error.unwrap_or_else(|| "the ramdisk reported a failure without a reason".into()),
                false,
            );
        }
    }
    let r = result.unwrap_or(Value::Null);
    // A signed error (an unknown kind, arguments refused, a disk that failed): its own reason, not a complaint
    // that the report lacks the step's fields.
    if let Some(e) = r.get("error").and_then(Value::as_str) {
        return failed(e.to_owned(), false);
    }
    match step {
        Step::Diagnose => {
            let reasons = strings(&r, "problems", MAX_PROBLEMS);
            let listed = r.get("problems").is_some_and(Value::is_array);
            Outcome::Diagnosed {
                hardware: diagnosed_hardware(&r),
                healthy: reasons.is_empty() && listed,
                reasons: if listed {
                    reasons
                } else {
                    vec![
                        "the diagnose report has no problems list (not a ramdisk.diagnose report)"
                            .into(),
                    ]
                },
            }
        }
        Step::Wipe => match r.get("wiped").and_then(Value::as_bool) {
            Some(true) => Outcome::Done,
            Some(false) => failed(
                format!(
                    "wipe failed on {}",
                    strings(&r, "failed", MAX_PROBLEMS).join(", ")
                ),
                false,
            ),
            None => failed(
                "the wipe result does not say whether the disks were wiped".into(),
                false,
            ),
        },
        Step::Stream => match (
            r.get("digest").and_then(Value::as_str),
            r.get("algo").and_then(Value::as_str),
        ) {
            (Some(d), Some(a)) if is_digest(a, d) => Outcome::Streamed {
                digest: format!("{a}:{d}"),
            },
            (Some(_), Some(_)) => failed(
                "the stream result's digest is not an algorithm and a hex digest".into(),
                false,
            ),
            _ => failed("the stream result names no verified digest".into(), false),
        },
        _ => Outcome::Done,
    }
}

/// `algo` a short name (`sha256`), `digest` lowercase hex of at most [`MAX_DIGEST`] characters.
fn is_digest(algo: &str, digest: &str) -> bool {
    (1..=16).contains(&algo.len())
        && algo.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && (1..=MAX_DIGEST).contains(&digest.len())
        && digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_diagnose_report_reads_into_counts_and_problems() {
        let r = json!({
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
        let o = ramdisk_outcome(Step::Diagnose, "done", Some(json!({})), None);
        assert!(
            matches!(o, Outcome::Diagnosed { healthy: false, .. }),
            "{o:?}"
        );
        // A problems "list" that is not a list is no list.
        let o = ramdisk_outcome(Step::Diagnose, "done", Some(json!({"problems": {}})), None);
        assert!(
            matches!(o, Outcome::Diagnosed { healthy: false, .. }),
            "{o:?}"
        );
        let o = ramdisk_outcome(Step::Wipe, "done", Some(json!({})), None);
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
    fn what_a_report_carries_into_the_record_is_bounded() {
        // 1,000 problems of 10 KB, 1,000 NICs with MACs and garbage, a 60 KB error: what reaches the machine's
        // record is a few kilobytes.
        let long = "x".repeat(10_000);
        let nics: Vec<Value> = (0..1000)
            .map(|i| json!({"mac": if i % 2 == 0 { format!("52-54-00-00-{:02X}-{:02X}", i / 256, i % 256) } else { long.clone() }}))
            .collect();
        let r = json!({"problems": vec![long.clone(); 1000], "nics": nics});
        let o = ramdisk_outcome(Step::Diagnose, "done", Some(r), None);
        let Outcome::Diagnosed {
            hardware, reasons, ..
        } = &o
        else {
            panic!("{o:?}");
        };
        assert_eq!(reasons.len(), MAX_PROBLEMS + 1);
        assert_eq!(reasons[MAX_PROBLEMS], "and 968 more");
        assert!(reasons[0].ends_with("… (9776 bytes cut)"), "{}", reasons[0]);
        assert_eq!(hardware.macs.len(), MAX_MACS);
        assert_eq!(hardware.macs[1], "52:54:00:00:00:02");
        let size = serde_json::to_vec(&o).expect("encodes").len();
        assert!(size < 16 * 1024, "{size} bytes");

        let o = ramdisk_outcome(Step::Stream, "failed", None, Some("é".repeat(30_000)));
        let Outcome::Failed { reason, .. } = &o else {
            panic!("{o:?}");
        };
        assert!(reason.len() <= MAX_REASON, "{}", reason.len());
        assert!(reason.ends_with("bytes cut)"), "{reason}");

        // A stream result whose digest is not one is not a stream of that image.
        let o = ramdisk_outcome(
            Step::Stream,
            "done",
            Some(json!({"algo": "sha256", "digest": long})),
            None,
        );
        assert!(matches!(o, Outcome::Failed { .. }), "{o:?}");
        let o = ramdisk_outcome(
            Step::Stream,
            "done",
            Some(json!({"algo": "sha256", "digest": "ab01"})),
            None,
        );
        assert_eq!(
            o,
            Outcome::Streamed {
                digest: "sha256:ab01".into()
            }
        );
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
            Some(json!({"error": "ramdisk.stream: /dev/vda is read-only"})),
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
}
