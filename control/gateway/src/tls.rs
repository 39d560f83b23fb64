//! The gateway's TLS configuration: its own certificate chain, and client certificates verified against the
//! control-plane CA when presented. Join needs no client certificate (the joining node has none yet), so client
//! authentication is optional at the handshake and enforced per service.

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("gateway TLS configuration")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier")]
    Verifier(String),
}

/// A server config with ALPN h2, presenting `chain` (leaf first, then the CA) and verifying optional client
/// certificates against `client_cas`.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_cas: &[CertificateDer<'static>],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(bc_proto::tls_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in client_cas {
        roots.add(ca.clone())?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
