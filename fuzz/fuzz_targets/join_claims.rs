#![no_main]
//! The hardware a node claims in its join (`HardwareClaims`, outside input: any process with a join token sends
//! it), as the control plane checks it (`HardwareClaims::check`) and keys it (`hardware_key`, which recognises a
//! re-joining machine and stops two nodes claiming one machine). The input is the claims as JSON. Claims that pass
//! have bounded lists and values without control characters; the key's lines are one identifier each (no line
//! break inside one, so no two claims' lines run together) and the key does not depend on the order of the NICs
//! and GPUs; claims that fail name a field (`claims.…`).
use bc_core::hardware::{
    HardwareClaims, MAX_CLAIM, MAX_GPUS, MAX_NICS, MAX_NOTES, hardware_key, stable_identifiers,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(claims) = serde_json::from_slice::<HardwareClaims>(data) else {
        return;
    };
    match claims.check() {
        Err(e) => assert!(e.0.starts_with("claims"), "{e}"),
        Ok(()) => {
            assert!(claims.nics.len() <= MAX_NICS && claims.gpus.len() <= MAX_GPUS);
            assert!(claims.collection_notes.len() <= MAX_NOTES);
            let ok = |v: &str| v.len() <= MAX_CLAIM && !v.chars().any(char::is_control);
            let d = &claims.dmi;
            for v in [
                &d.system_uuid,
                &d.system_serial,
                &d.board_serial,
                &d.chassis_serial,
            ] {
                assert!(ok(v));
            }
            assert!(claims.nics.iter().all(|n| ok(&n.mac)));
            assert!(claims.gpus.iter().all(|g| ok(&g.serial)));
            let lines = stable_identifiers(&claims);
            for l in &lines {
                assert!(!l.contains('\n'), "a key line with a line break: {l:?}");
            }
            let mut reordered = claims.clone();
            reordered.nics.reverse();
            reordered.gpus.reverse();
            assert_eq!(hardware_key(&claims), hardware_key(&reordered));
            assert_eq!(hardware_key(&claims).is_none(), lines.is_empty());
        }
    }
});
