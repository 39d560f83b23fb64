//! TLS to BMCs on the one crypto provider of the workspace (ring): either a CA the site trusts, or a pinned
//! certificate. BMCs ship self-signed certificates whose names and dates are rarely right, so a pin checks the
//! SHA-256 of the exact certificate (name and validity are not checked) and the handshake signatures.

use std::fmt;
use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// How the BMC's certificate is checked (`http://` BMC URLs use no TLS at all).
#[derive(Clone)]
pub enum TlsTrust {
    /// Only the certificate whose DER SHA-256 is this (see [`fingerprint`]).
    PinnedSha256([u8; 32]),
    /// Chains to one of these roots, with the name checked (a site CA that signed the BMC certificates).
    Roots(Vec<CertificateDer<'static>>),
}

impl fmt::Debug for TlsTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsTrust::PinnedSha256(pin) => write!(f, "PinnedSha256({})", hex(pin)),
            TlsTrust::Roots(r) => write!(f, "Roots({} certificates)", r.len()),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a certificate's DER: the value to pin.
pub fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// Parses a pin written as 64 hex digits, optionally `:`-separated (as `openssl x509 -fingerprint -sha256` prints).
pub fn parse_pin(s: &str) -> Option<[u8; 32]> {
    let digits: String = s.chars().filter(|c| *c != ':').collect();
    if digits.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(digits.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The rustls client configuration for a trust choice, on the ring provider.
pub fn client_config(trust: &TlsTrust) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    Ok(match trust {
        TlsTrust::Roots(certs) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certs {
                roots
                    .add(cert.clone())
                    .map_err(|e| format!("root certificate: {e}"))?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        TlsTrust::PinnedSha256(pin) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinnedCert {
                pin: *pin,
                provider,
            }))
            .with_no_client_auth(),
    })
}

/// Accepts exactly the pinned certificate; still verifies that the peer holds its key.
pub struct PinnedCert {
    pin: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl PinnedCert {
    pub fn new(pin: [u8; 32]) -> Self {
        PinnedCert {
            pin,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        }
    }
}

impl fmt::Debug for PinnedCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedCert({})", hex(&self.pin))
    }
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let seen = fingerprint(end_entity);
        // A certificate is public: a plain comparison is fine.
        if seen == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "BMC certificate sha256 {} does not match the pinned {}",
                hex(&seen),
                hex(&self.pin)
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_accepts_only_the_pinned_certificate() {
        let a = CertificateDer::from(vec![1u8, 2, 3]);
        let b = CertificateDer::from(vec![1u8, 2, 4]);
        let verifier = PinnedCert::new(fingerprint(&a));
        let name = ServerName::try_from("bmc.example").map(|n| n.to_owned());
        let Ok(name) = name else {
            panic!("server name")
        };
        assert!(
            verifier
                .verify_server_cert(&a, &[], &name, &[], UnixTime::now())
                .is_ok()
        );
        assert!(
            verifier
                .verify_server_cert(&b, &[], &name, &[], UnixTime::now())
                .is_err()
        );
        let pin = hex(&fingerprint(&a));
        assert_eq!(parse_pin(&pin), Some(fingerprint(&a)));
        let colons: Vec<String> = fingerprint(&a).iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(parse_pin(&colons.join(":")), Some(fingerprint(&a)));
        assert_eq!(parse_pin("abc"), None);
        assert!(client_config(&TlsTrust::PinnedSha256([0; 32])).is_ok());
    }
}
