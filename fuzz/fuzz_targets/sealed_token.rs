#![no_main]
use bc_proto::seal;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static KEY: OnceLock<seal::JoinPrivateKey> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let key = KEY.get_or_init(|| seal::generate_join_keypair().0);
    let _ = seal::open(key, data, b"spki");
});
