#![no_main]
//! A ramdisk command's stored answer as the metal planner reads it (`bc_core::metal::ramdisk::ramdisk_outcome`):
//! the first byte picks the step and the command's state, the rest is the signed result (JSON) and, as text, the
//! error a failed or expired command carries. Whatever a machine's ramdisk sends: nothing panics, what reaches the
//! machine's record is bounded, an expiry is retryable and a reported failure is not, a diagnose is healthy only
//! with an empty problems list, a stream names a digest only as `<algo>:<hex>`, and MACs are canonical.
use bc_core::metal::ramdisk::{MAX_MACS, MAX_PROBLEMS, MAX_REASON, ramdisk_outcome};
use bc_core::metal::site_report::canonical_mac;
use bc_core::metal::{Outcome, Step};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const STEPS: [Step; 4] = [Step::Diagnose, Step::Wipe, Step::Stream, Step::Kexec];
const STATES: [&str; 4] = ["done", "failed", "expired", "sent"];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let step = STEPS[usize::from(pick & 3)];
    let state = STATES[usize::from((pick >> 2) & 3)];
    let result: Option<Value> = serde_json::from_slice(rest).ok();
    let error = (pick & 0x10 != 0).then(|| String::from_utf8_lossy(rest).into_owned());
    let o = ramdisk_outcome(step, state, result.clone(), error);

    let size = serde_json::to_vec(&o).expect("encodes").len();
    assert!(size <= 16 * 1024, "{size} bytes reach the record");
    match state {
        "expired" => assert!(
            matches!(
                o,
                Outcome::Failed {
                    retryable: true,
                    ..
                }
            ),
            "{o:?}"
        ),
        "done" => {}
        _ => assert!(
            matches!(
                o,
                Outcome::Failed {
                    retryable: false,
                    ..
                }
            ),
            "{o:?}"
        ),
    }
    match &o {
        Outcome::Failed { reason, .. } => assert!(reason.len() <= MAX_REASON, "{}", reason.len()),
        Outcome::Diagnosed {
            hardware,
            healthy,
            reasons,
        } => {
            assert!(reasons.len() <= MAX_PROBLEMS + 1);
            let problems = result.as_ref().and_then(|r| r.get("problems"));
            if *healthy {
                assert!(
                    problems
                        .and_then(Value::as_array)
                        .is_some_and(Vec::is_empty),
                    "healthy with problems {problems:?}"
                );
                assert!(reasons.is_empty());
            }
            assert!(hardware.macs.len() <= MAX_MACS);
            for (i, m) in hardware.macs.iter().enumerate() {
                assert_eq!(
                    canonical_mac(m).as_deref(),
                    Some(m.as_str()),
                    "not canonical"
                );
                assert!(!hardware.macs[..i].contains(m), "{m} twice");
            }
        }
        Outcome::Streamed { digest } => {
            let (algo, hex) = digest.split_once(':').expect("algo:hex");
            assert!(!algo.is_empty() && !hex.is_empty());
            assert!(
                hex.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            );
            let r = result.as_ref().expect("a stream outcome from a result");
            assert_eq!(r.get("digest").and_then(Value::as_str), Some(hex));
        }
        Outcome::Done => assert!(state == "done"),
        other => panic!("a ramdisk step read as {other:?}"),
    }
});
