#![no_main]
//! The typed JSON payloads of bc-proto and the site API's boot spec, as their readers parse outside input: a node's
//! `gpus` inventory section (read by the control plane's inventory module), a `diag.nvml` report (read by the
//! lifecycle controller), secret claims (opened by the site agent) and a machine's boot spec (an operator's request
//! and a stored row). Each either parses or is an error; nothing panics, and what parses writes back and parses to
//! the same value.
use bc_core::api::sites::BootSpec;
use bc_proto::payloads::diag::DiagReport;
use bc_proto::payloads::{GpusSection, SecretClaims};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = serde_json::from_slice::<GpusSection>(data) {
        let again: GpusSection =
            serde_json::from_slice(&serde_json::to_vec(&s).expect("encodes")).expect("round trip");
        assert_eq!(again, s);
    }
    if let Ok(r) = DiagReport::from_json(data) {
        let _ = r.passed();
        let _ = r.failure_reasons();
        let again = DiagReport::from_json(&r.to_json().expect("encodes")).expect("round trip");
        assert_eq!(again, r);
    }
    let _ = serde_json::from_slice::<SecretClaims>(data);
    if let Ok(b) = serde_json::from_slice::<BootSpec>(data) {
        let again: BootSpec =
            serde_json::from_slice(&serde_json::to_vec(&b).expect("encodes")).expect("round trip");
        assert_eq!(again, b);
    }
});
