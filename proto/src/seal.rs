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
//!
//! Sealing (the node) uses the `hpke` crate. Opening (JoinService, once per join) is RFC 9180's receiver written
//! out here ([`open`]): the `hpke` crate's `decap` recomputes the recipient's public key from its private key
//! (an X25519 base-point multiplication) on every open, for the KEM context; [`JoinPrivateKey`] computes it once.
//! The rest is the RFC's: DH with X25519 (x25519-dalek, an all-zero result refused), `ExtractAndExpand`,
//! the base-mode key schedule and ChaCha20-Poly1305 with HKDF-SHA256 (ring). The tests open, side by side with the
//! `hpke` crate's own `single_shot_open`, what it seals.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hpke::{Deserializable as _, Kem as _, OpModeS, Serializable as _};

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

/// JoinService's private key; kept by the control plane (0600). Its public key is computed once, here.
pub struct JoinPrivateKey {
    sk: x25519_dalek::StaticSecret,
    /// The serialized public key (`pkRm`), part of every open's KEM context.
    pk: [u8; 32],
}

/// Generates a new JoinService key pair.
pub fn generate_join_keypair() -> (JoinPrivateKey, JoinPublicKey) {
    let (sk, pk) = Kem::gen_keypair();
    let mut bytes = [0u8; 32];
    bytes.copy_from_slice(&sk.to_bytes());
    (JoinPrivateKey::from_array(bytes), JoinPublicKey(pk))
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
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| SealError::BadPrivateKey)?;
        Ok(JoinPrivateKey::from_array(bytes))
    }

    fn from_array(bytes: [u8; 32]) -> JoinPrivateKey {
        let sk = x25519_dalek::StaticSecret::from(bytes);
        let pk = x25519_dalek::PublicKey::from(&sk).to_bytes();
        JoinPrivateKey { sk, pk }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.sk.to_bytes().to_vec()
    }

    pub fn public_key(&self) -> JoinPublicKey {
        // Always valid: any 32 bytes are an X25519 public key to the hpke crate.
        JoinPublicKey(
            <Kem as hpke::Kem>::PublicKey::from_bytes(&self.pk)
                .unwrap_or_else(|_| unreachable!("32 bytes are an X25519 public key")),
        )
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
    let mut enc = [0u8; ENC_LEN];
    enc.copy_from_slice(&body[1..1 + ENC_LEN]);
    let ct = &body[1 + ENC_LEN..];
    let aad = csr_key_binding(spki_der);
    let plain = receiver::open_base(key, &enc, INFO, ct, &aad).ok_or(SealError::WrongKey)?;
    String::from_utf8(plain).map_err(|_| SealError::Malformed {
        reason: "plaintext is not UTF-8",
    })
}

/// RFC 9180's receiver for this suite (DHKEM(X25519, HKDF-SHA256) 0x0020, HKDF-SHA256 0x0001, ChaCha20Poly1305
/// 0x0003), base mode, single shot: `Decap`, `KeySchedule`, then `Open` with sequence number 0.
mod receiver {
    use super::JoinPrivateKey;
    use ring::{aead, hkdf};

    const KEM_SUITE: &[u8] = b"KEM\x00\x20";
    const HPKE_SUITE: &[u8] = b"HPKE\x00\x20\x00\x01\x00\x03";
    const MODE_BASE: u8 = 0;

    /// An output length for ring's HKDF-Expand.
    struct Len(usize);

    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }

    /// `LabeledExtract(salt, label, ikm)`.
    fn labeled_extract(suite: &[u8], salt: &[u8], label: &[u8], ikm: &[u8]) -> hkdf::Prk {
        hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(&labeled_ikm(suite, label, ikm))
    }

    /// `"HPKE-v1" || suite_id || label || ikm`.
    fn labeled_ikm(suite: &[u8], label: &[u8], ikm: &[u8]) -> Vec<u8> {
        let mut labeled = Vec::with_capacity(7 + suite.len() + label.len() + ikm.len());
        labeled.extend_from_slice(b"HPKE-v1");
        labeled.extend_from_slice(suite);
        labeled.extend_from_slice(label);
        labeled.extend_from_slice(ikm);
        labeled
    }

    /// `LabeledExpand(prk, label, info, L)` into `out` (L = its length, at most 255 × 32).
    fn labeled_expand(
        suite: &[u8],
        prk: &hkdf::Prk,
        label: &[u8],
        info: &[u8],
        out: &mut [u8],
    ) -> Option<()> {
        let len = u16::try_from(out.len()).ok()?.to_be_bytes();
        let parts = [&len[..], b"HPKE-v1", suite, label, info];
        prk.expand(&parts, Len(out.len())).ok()?.fill(out).ok()
    }

    /// The plaintext, or None when it does not open (another key, another associated data, a forged blob).
    pub(super) fn open_base(
        key: &JoinPrivateKey,
        enc: &[u8; 32],
        info: &[u8],
        ct: &[u8],
        aad: &[u8],
    ) -> Option<Vec<u8>> {
        // Decap: dh = DH(skR, pkE), refused when all zero (a small-order pkE); kem_context = enc || pkRm.
        let dh = key.sk.diffie_hellman(&x25519_dalek::PublicKey::from(*enc));
        if !dh.was_contributory() {
            return None;
        }
        let mut kem_context = [0u8; 64];
        kem_context[..32].copy_from_slice(enc);
        kem_context[32..].copy_from_slice(&key.pk);
        let eae_prk = labeled_extract(KEM_SUITE, b"", b"eae_prk", dh.as_bytes());
        let mut shared_secret = [0u8; 32];
        labeled_expand(
            KEM_SUITE,
            &eae_prk,
            b"shared_secret",
            &kem_context,
            &mut shared_secret,
        )?;
        // KeySchedule, base mode (empty psk and psk_id): context = mode || psk_id_hash || info_hash, the two hashes
        // being LabeledExtract outputs used as bytes.
        let mut context = [0u8; 65];
        context[0] = MODE_BASE;
        context[1..33].copy_from_slice(&extract_bytes(HPKE_SUITE, b"psk_id_hash", b""));
        context[33..].copy_from_slice(&extract_bytes(HPKE_SUITE, b"info_hash", info));
        let secret = labeled_extract(HPKE_SUITE, &shared_secret, b"secret", b"");
        let mut key_bytes = [0u8; 32];
        labeled_expand(HPKE_SUITE, &secret, b"key", &context, &mut key_bytes)?;
        let mut nonce = [0u8; 12];
        labeled_expand(HPKE_SUITE, &secret, b"base_nonce", &context, &mut nonce)?;
        let unbound = aead::UnboundKey::new(&aead::CHACHA20_POLY1305, &key_bytes).ok()?;
        let mut in_out = ct.to_vec();
        let plain = aead::LessSafeKey::new(unbound)
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(aad),
                &mut in_out,
            )
            .ok()?;
        let n = plain.len();
        in_out.truncate(n);
        Some(in_out)
    }

    /// `LabeledExtract("", label, ikm)` as bytes: HKDF-Extract is HMAC(salt, ikm) and ring keeps its PRKs opaque,
    /// so this one is ring's HMAC (an empty salt is HashLen zero bytes, RFC 5869).
    fn extract_bytes(suite: &[u8], label: &[u8], ikm: &[u8]) -> [u8; 32] {
        let labeled = labeled_ikm(suite, label, ikm);
        let tag = ring::hmac::sign(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[0u8; 32]),
            &labeled,
        );
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hpke::OpModeR;
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

    /// The `hpke` crate's own open, the reference [`open`]'s receiver is checked against.
    fn reference_open(sk: &JoinPrivateKey, blob: &[u8], spki: &[u8]) -> Option<Vec<u8>> {
        let sk = <Kem as hpke::Kem>::PrivateKey::from_bytes(&sk.to_bytes()).ok()?;
        let body = &blob[..blob.len() - CHECK_LEN];
        let enc = <Kem as hpke::Kem>::EncappedKey::from_bytes(&body[1..1 + ENC_LEN]).ok()?;
        hpke::single_shot_open::<Aead, Kdf, Kem>(
            &OpModeR::Base,
            &sk,
            &enc,
            INFO,
            &body[1 + ENC_LEN..],
            &csr_key_binding(spki),
        )
        .ok()
    }

    #[test]
    fn the_receiver_agrees_with_the_hpke_crate_and_its_public_key_is_the_crates() {
        for i in 0..64u32 {
            let (sk, pk) = generate_join_keypair();
            let (other, _) = generate_join_keypair();
            assert_eq!(
                JoinPrivateKey::from_bytes(&sk.to_bytes())
                    .expect("sk")
                    .public_key()
                    .encode(),
                pk.encode()
            );
            let token = format!("{TOKEN}{}", "x".repeat(i as usize));
            let blob = seal(&pk, &token, b"spki").expect("seal");
            assert_eq!(
                reference_open(&sk, &blob, b"spki"),
                Some(token.clone().into_bytes())
            );
            assert_eq!(open(&sk, &blob, b"spki"), Ok(token));
            // Where the crate refuses, so does the receiver.
            assert_eq!(reference_open(&sk, &blob, b"other"), None);
            assert_eq!(open(&sk, &blob, b"other"), Err(SealError::WrongKey));
            assert_eq!(reference_open(&other, &blob, b"spki"), None);
            assert_eq!(open(&other, &blob, b"spki"), Err(SealError::WrongKey));
        }
        // A small-order encapsulated key (all zero: the DH result is zero) is refused by both.
        let (sk, pk) = generate_join_keypair();
        let mut blob = seal(&pk, TOKEN, b"spki").expect("seal");
        blob[1..1 + ENC_LEN].fill(0);
        let n = blob.len() - CHECK_LEN;
        let check = crate::sha256(&blob[..n]);
        blob[n..].copy_from_slice(&check[..CHECK_LEN]);
        assert_eq!(reference_open(&sk, &blob, b"spki"), None);
        assert_eq!(open(&sk, &blob, b"spki"), Err(SealError::WrongKey));
    }

    proptest! {
        #[test]
        fn open_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let (sk, _) = generate_join_keypair();
            let _ = open(&sk, &bytes, b"k");
        }
    }
}
