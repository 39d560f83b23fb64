#![no_main]
//! The CSR parser JoinService runs on every Join (rcgen over x509-parser, signature verified).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = rcgen::CertificateSigningRequestParams::from_der(&data.into());
});
