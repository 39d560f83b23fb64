//! HPKE (RFC 9180) sealing of a join token to JoinService's public key.
//!
//! Suite: DHKEM(X25519, HKDF-SHA256) / HKDF-SHA256 / ChaCha20-Poly1305, base mode, single shot. The associated data
//! is the SHA-256 of the CSR's SubjectPublicKeyInfo, so a captured blob cannot be replayed with another key: it
//! simply does not open.
//!
//! Wire form of a sealed token: `0x01 | enc (32) | ciphertext | check (4)`, where `check` is the first four bytes of
//! SHA-256 over everything before it. The check is not a security measure (anyone can recompute it); it lets the
//! server tell a corrupted or truncated blob ("tampered") from one that is intact but was sealed for another CSR
//! key or another JoinService key, so each rejection can say what went wrong.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hpke::{Deserializable as _, Kem as _, OpModeR, OpModeS, Serializable as _};

type Kem = hpke::kem::X25519HkdfSha256;
type Kdf = hpke::kdf::HkdfSha256;
type Aead = hpke::aead::ChaCha20Poly1305;

const VERSION: u8 = 1;
const ENC_LEN: usize = 32;
const CHECK_LEN: usize = 4;
const INFO: &[u8] = b"bettercompute.v1 join token";
/// Largest plaintext we seal (a token is ~65 bytes); anything bigger on the wire is rejected before any crypto.
const MAX_PLAINTEXT: usize = 256;
const TAG_LEN: usize = 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    #[error("JoinService public key must be 32 bytes of base64url (X25519)")]
    BadPublicKey,
    #[error("JoinService private key must be 32 bytes (X25519)")]
    BadPrivateKey,
    #[error("sealed token is malformed: {reason}")]
    Malformed { reason: &'static str },
    #[error(
        "sealed token is corrupt: its checksum does not match (tampered or truncated in transit)"
    )]
    Corrupt,
    #[error(
        "sealed token does not open with this CSR's key: it was sealed for another key (a replayed blob) or to \
         another JoinService key"
    )]
    WrongKey,
    #[error("sealing failed")]
    SealFailed,
}

/// JoinService's public key, shipped to nodes by the install script.
#[derive(Clone)]
pub struct JoinPublicKey(<Kem as hpke::Kem>::PublicKey);

impl std::fmt::Debug for JoinPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JoinPublicKey({})", self.encode())
    }
}

/// JoinService's private key; kept by the control plane (0600).
pub struct JoinPrivateKey(<Kem as hpke::Kem>::PrivateKey);

/// Generates a new JoinService key pair.
pub fn generate_join_keypair() -> (JoinPrivateKey, JoinPublicKey) {
    let (sk, pk) = Kem::gen_keypair();
    (JoinPrivateKey(sk), JoinPublicKey(pk))
}

impl JoinPublicKey {
    pub fn parse(s: &str) -> Result<JoinPublicKey, SealError> {
        let bytes = URL_SAFE_NO_PAD
            .decode(s.trim())
            .map_err(|_| SealError::BadPublicKey)?;
        <Kem as hpke::Kem>::PublicKey::from_bytes(&bytes)
            .map(JoinPublicKey)
            .map_err(|_| SealError::BadPublicKey)
    }

    pub fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.0.to_bytes())
    }
}

impl JoinPrivateKey {
    pub fn from_bytes(bytes: &[u8]) -> Result<JoinPrivateKey, SealError> {
        <Kem as hpke::Kem>::PrivateKey::from_bytes(bytes)
            .map(JoinPrivateKey)
            .map_err(|_| SealError::BadPrivateKey)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.to_bytes().to_vec()
    }

    pub fn public_key(&self) -> JoinPublicKey {
        JoinPublicKey(<Kem as hpke::Kem>::sk_to_pk(&self.0))
    }
}

/// The associated data for a CSR key: SHA-256 of its SubjectPublicKeyInfo DER.
pub fn csr_key_binding(spki_der: &[u8]) -> [u8; 32] {
    crate::sha256(spki_der)
}

/// Seals `token` (the full `bcjt_…` string) to `recipient`, bound to the CSR key whose SPKI is `spki_der`.
pub fn seal(recipient: &JoinPublicKey, token: &str, spki_der: &[u8]) -> Result<Vec<u8>, SealError> {
    if token.len() > MAX_PLAINTEXT {
        return Err(SealError::SealFailed);
    }
    let aad = csr_key_binding(spki_der);
    let (enc, ct) = hpke::single_shot_seal::<Aead, Kdf, Kem>(
        &OpModeS::Base,
        &recipient.0,
        INFO,
        token.as_bytes(),
        &aad,
    )
    .map_err(|_| SealError::SealFailed)?;
    let mut out = Vec::with_capacity(1 + ENC_LEN + ct.len() + CHECK_LEN);
    out.push(VERSION);
    out.extend_from_slice(&enc.to_bytes());
    out.extend_from_slice(&ct);
    let check = crate::sha256(&out);
    out.extend_from_slice(&check[..CHECK_LEN]);
    Ok(out)
}

/// Opens a sealed token with JoinService's key for the CSR key whose SPKI is `spki_der`. Returns the token string.
pub fn open(key: &JoinPrivateKey, sealed: &[u8], spki_der: &[u8]) -> Result<String, SealError> {
    let min = 1 + ENC_LEN + TAG_LEN + CHECK_LEN;
    if sealed.len() < min {
        return Err(SealError::Malformed {
            reason: "too short",
        });
    }
    if sealed.len() > min + MAX_PLAINTEXT {
        return Err(SealError::Malformed { reason: "too long" });
    }
    if sealed[0] != VERSION {
        return Err(SealError::Malformed {
            reason: "unknown version byte",
        });
    }
    let (body, check) = sealed.split_at(sealed.len() - CHECK_LEN);
    if crate::sha256(body)[..CHECK_LEN] != *check {
        return Err(SealError::Corrupt);
    }
    let enc = <Kem as hpke::Kem>::EncappedKey::from_bytes(&body[1..1 + ENC_LEN]).map_err(|_| {
        SealError::Malformed {
            reason: "bad encapsulated key",
        }
    })?;
    let ct = &body[1 + ENC_LEN..];
    let aad = csr_key_binding(spki_der);
    let plain =
        hpke::single_shot_open::<Aead, Kdf, Kem>(&OpModeR::Base, &key.0, &enc, INFO, ct, &aad)
            .map_err(|_| SealError::WrongKey)?;
    String::from_utf8(plain).map_err(|_| SealError::Malformed {
        reason: "plaintext is not UTF-8",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TOKEN: &str = "bcjt_0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

    #[test]
    fn seal_open_round_trip_and_binding() -> Result<(), SealError> {
        let (sk, pk) = generate_join_keypair();
        let pk = JoinPublicKey::parse(&pk.encode())?;
        let blob = seal(&pk, TOKEN, b"spki-a")?;
        assert_eq!(open(&sk, &blob, b"spki-a")?, TOKEN);
        assert_eq!(open(&sk, &blob, b"spki-b"), Err(SealError::WrongKey));
        let (other_sk, _) = generate_join_keypair();
        assert_eq!(open(&other_sk, &blob, b"spki-a"), Err(SealError::WrongKey));
        let mut tampered = blob.clone();
        tampered[40] ^= 1;
        assert_eq!(open(&sk, &tampered, b"spki-a"), Err(SealError::Corrupt));
        assert!(matches!(
            open(&sk, &blob[..10], b"spki-a"),
            Err(SealError::Malformed { .. })
        ));
        let restored = JoinPrivateKey::from_bytes(&sk.to_bytes())?;
        assert_eq!(open(&restored, &blob, b"spki-a")?, TOKEN);
        assert_eq!(restored.public_key().encode(), pk.encode());
        Ok(())
    }

    proptest! {
        #[test]
        fn open_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let (sk, _) = generate_join_keypair();
            let _ = open(&sk, &bytes, b"k");
        }
    }
}
