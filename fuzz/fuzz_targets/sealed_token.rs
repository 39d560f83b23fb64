#![no_main]
//! The sealed join token JoinService opens on every Join (`bc_proto::seal`): no input may panic. The input is
//! opened as it is, and again with a valid 4-byte check appended, so that mutated bodies get past the checksum
//! (which random bytes almost never match) into HPKE's decapsulation and the AEAD. A UTF-8 input of a token's size
//! is also sealed and opened: it comes back unchanged, and not for another CSR key.
use bc_proto::seal;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static KEYS: OnceLock<(seal::JoinPrivateKey, seal::JoinPublicKey)> = OnceLock::new();

/// The envelope's trailing check: the first bytes of the SHA-256 of what comes before it.
const CHECK_LEN: usize = 4;

fuzz_target!(|data: &[u8]| {
    let (key, public) = KEYS.get_or_init(seal::generate_join_keypair);
    let _ = seal::open(key, data, b"spki");
    let mut checked = data.to_vec();
    checked.extend_from_slice(&bc_proto::sha256(data)[..CHECK_LEN]);
    let _ = seal::open(key, &checked, b"spki");
    if let Ok(token) = std::str::from_utf8(data)
        && let Ok(sealed) = seal::seal(public, token, b"spki")
    {
        assert_eq!(seal::open(key, &sealed, b"spki").as_deref(), Ok(token));
        assert!(seal::open(key, &sealed, b"another key").is_err());
    }
});
