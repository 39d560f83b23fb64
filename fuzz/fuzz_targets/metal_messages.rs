#![no_main]
//! The metal flow's messages between the control plane and the site agent: a BMC command's operation (`op_json`,
//! parsed by the site agent's BMC worker) and a BMC outcome (the signed payload of `BmcResult`, parsed by the
//! control plane's gateway before the planner reads it). Each either parses or is an error; nothing panics, and
//! what parses writes back and parses to the same value.
use bc_core::metal::{BmcOp, Outcome};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(op) = serde_json::from_slice::<BmcOp>(data) {
        let again: BmcOp =
            serde_json::from_slice(&serde_json::to_vec(&op).expect("encodes")).expect("round trip");
        assert_eq!(again, op);
    }
    if let Ok(o) = serde_json::from_slice::<Outcome>(data) {
        let again: Outcome =
            serde_json::from_slice(&serde_json::to_vec(&o).expect("encodes")).expect("round trip");
        assert_eq!(again, o);
    }
});
