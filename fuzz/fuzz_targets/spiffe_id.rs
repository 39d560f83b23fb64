#![no_main]
use bc_proto::spiffe::SpiffeId;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = SpiffeId::from_cert_der(data);
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(id) = s.parse::<SpiffeId>() {
            assert_eq!(id.to_string().parse::<SpiffeId>().ok(), Some(id));
        }
    }
});
