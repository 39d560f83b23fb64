//! The signed-result envelope: every result a node reports (diagnostics, wipe evidence, deploy completion) is
//! signed by the node key, so a gateway relaying it can delay or drop it but not forge it.
//!
//! The signature covers DSSE's pre-authentication encoding (PAE):
//! `"DSSEv1" SP len(type) SP type SP len(body) SP body`, with ECDSA P-256 / SHA-256 (ASN.1 DER signatures).

use crate::v1::SignedEnvelope;
use ring::signature::{self, EcdsaKeyPair, KeyPair as _};

pub const ALGORITHM: &str = "ecdsa-p256-sha256";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("signing key is not a PKCS#8 ECDSA P-256 key")]
    BadKey,
    #[error("signing failed")]
    SignFailed,
    #[error("envelope algorithm {found:?} is not {ALGORITHM}")]
    Algorithm { found: String },
    #[error("envelope signer {found:?} is not the expected {expected:?}")]
    Signer { found: String, expected: String },
    #[error("envelope signature does not verify with the signer's public key")]
    BadSignature,
    #[error("signer certificate is not valid X.509")]
    BadCertificate,
}

/// DSSE pre-authentication encoding.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload_type.len() + payload.len() + 32);
    out.extend_from_slice(
        format!(
            "DSSEv1 {} {} {} ",
            payload_type.len(),
            payload_type,
            payload.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(payload);
    out
}

/// Signs with a node key (PKCS#8 DER of an ECDSA P-256 key).
pub struct EnvelopeSigner {
    key: EcdsaKeyPair,
    signer: String,
    rng: ring::rand::SystemRandom,
}

impl EnvelopeSigner {
    pub fn new(
        pkcs8_der: &[u8],
        signer_spiffe_id: String,
    ) -> Result<EnvelopeSigner, EnvelopeError> {
        let rng = ring::rand::SystemRandom::new();
        let key =
            EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8_der, &rng)
                .map_err(|_| EnvelopeError::BadKey)?;
        Ok(EnvelopeSigner {
            key,
            signer: signer_spiffe_id,
            rng,
        })
    }

    /// The uncompressed public point, as found in the node certificate.
    pub fn public_key(&self) -> &[u8] {
        self.key.public_key().as_ref()
    }

    pub fn sign(
        &self,
        payload_type: &str,
        payload: Vec<u8>,
    ) -> Result<SignedEnvelope, EnvelopeError> {
        let sig = self
            .key
            .sign(&self.rng, &pae(payload_type, &payload))
            .map_err(|_| EnvelopeError::SignFailed)?;
        Ok(SignedEnvelope {
            payload_type: payload_type.to_string(),
            payload,
            signer: self.signer.clone(),
            algorithm: ALGORITHM.to_string(),
            signature: sig.as_ref().to_vec(),
        })
    }
}

/// Verifies `env` against the signer's uncompressed P-256 public point and expected SPIFFE ID.
pub fn verify(
    env: &SignedEnvelope,
    public_point: &[u8],
    expected_signer: &str,
) -> Result<(), EnvelopeError> {
    if env.algorithm != ALGORITHM {
        return Err(EnvelopeError::Algorithm {
            found: env.algorithm.clone(),
        });
    }
    if env.signer != expected_signer {
        return Err(EnvelopeError::Signer {
            found: env.signer.clone(),
            expected: expected_signer.to_string(),
        });
    }
    signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, public_point)
        .verify(&pae(&env.payload_type, &env.payload), &env.signature)
        .map_err(|_| EnvelopeError::BadSignature)
}

/// The raw public key (uncompressed point) of a certificate, for [`verify`].
pub fn cert_public_point(cert_der: &[u8]) -> Result<Vec<u8>, EnvelopeError> {
    use x509_parser::prelude::*;
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|_| EnvelopeError::BadCertificate)?;
    Ok(cert.public_key().subject_public_key.data.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_verify_and_reject() -> Result<(), Box<dyn std::error::Error>> {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
            .map_err(|_| EnvelopeError::BadKey)?;
        let signer = EnvelopeSigner::new(pkcs8.as_ref(), "spiffe://d/node/n1".into())?;
        let env = signer.sign("application/vnd.bc.diag+json", b"{\"ok\":true}".to_vec())?;
        verify(&env, signer.public_key(), "spiffe://d/node/n1")?;
        let mut forged = env.clone();
        forged.payload = b"{\"ok\":false}".to_vec();
        assert_eq!(
            verify(&forged, signer.public_key(), "spiffe://d/node/n1"),
            Err(EnvelopeError::BadSignature)
        );
        assert!(matches!(
            verify(&env, signer.public_key(), "spiffe://d/node/n2"),
            Err(EnvelopeError::Signer { .. })
        ));
        assert_eq!(pae("t", b"ab"), b"DSSEv1 1 t 2 ab".to_vec());
        Ok(())
    }
}
