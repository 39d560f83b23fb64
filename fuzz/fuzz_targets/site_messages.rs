#![no_main]
use bc_proto::v1;
use jwt_simple::prelude::{EcdhEsA256KWDecryptionKey, EcdhEsA256KWEncryptionKey};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use std::sync::OnceLock;

// The site agent's parsers of what reaches it through the gateway (the netboot table, a secret JWE), and the
// control plane's parser of a SecretRequest's recipient key (a JWK from the site). First byte picks the parser.
fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            if let Ok(r) = v1::NetbootResponse::decode(rest) {
                let table = bcd::site::netboot_table(&r);
                assert!(table.len() <= r.machines.len());
            }
        }
        1 => {
            static KEY: OnceLock<EcdhEsA256KWDecryptionKey> = OnceLock::new();
            let key = KEY.get_or_init(EcdhEsA256KWDecryptionKey::generate);
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = bcd::site::open_secret(key, s, "bmc/x", "rack-1");
            }
        }
        _ => {
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = EcdhEsA256KWEncryptionKey::from_jwk(s);
            }
        }
    }
});
