//! The gateway's TLS configuration: its own certificate chain, and client certificates verified against the
//! control-plane CA when presented. Join needs no client certificate (the joining node has none yet), so client
//! authentication is optional at the handshake and enforced per service.
//!
//! Revocation is checked in the handshake: after the chain verifies, the leaf's SPIFFE ID, and the key it certifies
//! when any key is revoked (node keys a reclaim superseded), are looked up in [`Revocations`], sets the control
//! plane fills at start and keeps current (on its own tick, and at once when a revoke happens in the same process).
//! A revoked identity or key gets the `certificate_revoked` alert; each lookup is one hash probe whatever the number
//! of revocations.
//!
//! Sessions resume (TLS 1.3 tickets, [`bc_proto::tickets`]) when the gateway is given the tickets' key: a resumed
//! handshake carries no certificate, so the client certificate the ticket holds is checked after the handshake,
//! against its dates and the same sets ([`ServerTls::admit`]), and a connection that fails is closed before any
//! request is read. A client that held a session before its revocation is refused either way; what it learns is a
//! closed connection, and its next full handshake (the daemons' revocation probe never resumes) the
//! `certificate_revoked` alert.

use bc_proto::spiffe::SpiffeId;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("gateway TLS configuration")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier")]
    Verifier(String),
}

/// Revoked workload identities (SPIFFE IDs) and revoked keys. Cloning shares the sets; updates are seen by the next
/// handshake.
///
/// Keyed by identity rather than by certificate serial: revoking a node must refuse every certificate it holds,
/// including earlier ones superseded by renewal but not yet expired, and the store records only the latest serial.
/// Likewise a node key a reclaim superseded (the node lives on with a new key) is refused by key, whatever
/// certificate of it is presented.
#[derive(Clone, Default)]
pub struct Revocations {
    inner: Arc<RwLock<HashSet<SpiffeId>>>,
    /// SHA-256 of the SubjectPublicKeyInfo of revoked keys.
    keys: Arc<RwLock<HashSet<[u8; 32]>>>,
}

impl std::fmt::Debug for Revocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Revocations")
            .field("len", &self.len())
            .finish()
    }
}

impl Revocations {
    /// Adds revoked identities; returns those that were not known yet.
    pub fn extend(&self, ids: impl IntoIterator<Item = SpiffeId>) -> Vec<SpiffeId> {
        let Ok(mut set) = self.inner.write() else {
            return Vec::new();
        };
        ids.into_iter()
            .filter(|id| set.insert(id.clone()))
            .collect()
    }

    /// Adds revoked keys (SHA-256 of their SubjectPublicKeyInfo); returns how many were not known yet.
    pub fn extend_keys(&self, keys: impl IntoIterator<Item = [u8; 32]>) -> usize {
        let Ok(mut set) = self.keys.write() else {
            return 0;
        };
        keys.into_iter().filter(|k| set.insert(*k)).count()
    }

    /// Revoked keys known.
    pub fn keys_len(&self) -> usize {
        self.keys.read().map(|s| s.len()).unwrap_or(0)
    }

    /// Why a client certificate is refused: its identity is revoked, or the key it certifies is. Unparseable
    /// certificates are not refused here (the chain was already verified; the services refuse what they cannot
    /// read). The key is only looked at when some key is revoked.
    pub fn refusal(&self, cert_der: &[u8]) -> Option<String> {
        if let Some(id) = self.revoked_identity(cert_der) {
            return Some(format!("identity {id} revoked"));
        }
        let any_key = self.keys.read().map(|s| !s.is_empty()).unwrap_or(false);
        if any_key && let Some(hash) = bc_proto::channel::key_hash_of(cert_der) {
            let revoked = match self.keys.read() {
                Ok(set) => set.contains(&hash),
                Err(poisoned) => poisoned.get_ref().contains(&hash),
            };
            if revoked {
                return Some(format!(
                    "key {} revoked (superseded by a reclaim)",
                    hex::encode(hash)
                ));
            }
        }
        None
    }

    pub fn is_revoked(&self, id: &SpiffeId) -> bool {
        // A poisoned lock means a writer panicked mid-insert; refusing everyone would be worse than the set as it is.
        match self.inner.read() {
            Ok(set) => set.contains(id),
            Err(poisoned) => poisoned.get_ref().contains(id),
        }
    }

    pub fn len(&self) -> usize {
        self.inner.read().map(|s| s.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The identity of a client certificate when it is revoked. The certificate comes from the peer: anything that
    /// does not parse is not revoked here (the chain was already verified; the services refuse what they cannot
    /// read).
    pub fn revoked_identity(&self, cert_der: &[u8]) -> Option<SpiffeId> {
        let id = SpiffeId::from_cert_der(cert_der).ok()?;
        self.is_revoked(&id).then_some(id)
    }
}

/// WebPKI client verification against the CA, then the revocation set.
#[derive(Debug)]
struct RevocationChecking {
    inner: Arc<dyn ClientCertVerifier>,
    revoked: Revocations,
}

impl ClientCertVerifier for RevocationChecking {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if let Some(why) = self.revoked.refusal(end_entity) {
            tracing::warn!(
                reason = why,
                "client certificate refused at the TLS handshake"
            );
            return Err(rustls::Error::InvalidCertificate(CertificateError::Revoked));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The gateway's TLS: rustls' configuration, and what a resumed session must pass after its handshake.
#[derive(Clone, Debug)]
pub struct ServerTls {
    pub config: Arc<rustls::ServerConfig>,
    revoked: Revocations,
    counts: Arc<HandshakeCounts>,
}

/// Handshakes the gateway completed since start, by kind ([`ServerTls::counts`]).
#[derive(Debug, Default)]
pub struct HandshakeCounts {
    pub full: AtomicU64,
    pub resumed: AtomicU64,
    /// Resumed sessions closed because the certificate their ticket holds no longer passes.
    pub resumed_refused: AtomicU64,
}

/// How a connection's handshake went, as the gateway counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    Full,
    Resumed,
}

impl ServerTls {
    /// Whether an established connection may be served: a full handshake verified its certificate already; a
    /// resumed one is refused when the client certificate its ticket holds is out of its dates at `now_ms` or
    /// revoked (the sets as they are now, not as they were when the ticket was sealed).
    pub fn admit(&self, conn: &rustls::ServerConnection, now_ms: i64) -> Result<Handshake, String> {
        let counted = |c: &AtomicU64| c.fetch_add(1, Ordering::Relaxed);
        if conn.handshake_kind() != Some(rustls::HandshakeKind::Resumed) {
            counted(&self.counts.full);
            return Ok(Handshake::Full);
        }
        let refusal = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|leaf| self.refusal_of_resumed(leaf, now_ms));
        match refusal {
            Some(why) => {
                counted(&self.counts.resumed_refused);
                Err(why)
            }
            None => {
                counted(&self.counts.resumed);
                Ok(Handshake::Resumed)
            }
        }
    }

    /// Why the certificate a resumed session's ticket holds is refused at `now_ms`, if it is.
    fn refusal_of_resumed(&self, leaf: &CertificateDer<'_>, now_ms: i64) -> Option<String> {
        match bc_proto::channel::cert_validity_ms(leaf) {
            Some((from, to)) if from <= now_ms && now_ms <= to => self.revoked.refusal(leaf),
            Some((_, to)) if now_ms > to => Some("its certificate expired".into()),
            Some(_) => Some("its certificate is not valid yet".into()),
            None => Some("its certificate does not parse".into()),
        }
    }

    /// The handshakes counted since start (shared: the counts go on).
    pub fn counts(&self) -> Arc<HandshakeCounts> {
        self.counts.clone()
    }
}

/// Tickets sent after each handshake: a daemon's reconnect attempts while the gateways are down each spend one
/// (the client sends it before it learns the gateway is gone), so one ticket would be used up by the first such
/// attempt.
pub const TICKETS_PER_HANDSHAKE: usize = 4;

/// A server config with ALPN h2, presenting `chain` (leaf first, then the CA) and verifying optional client
/// certificates against `client_cas`, refusing identities in `revoked`. With `tickets`, sessions resume with the
/// tickets they seal (every gateway given the same key opens them); without, sessions are never resumed.
pub fn server_config(
    identity: Arc<Renewable>,
    client_cas: &[CertificateDer<'static>],
    revoked: Revocations,
    tickets: Option<Arc<bc_proto::tickets::SessionTickets>>,
) -> Result<ServerTls, TlsError> {
    let provider = Arc::new(bc_proto::tls_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in client_cas {
        roots.add(ca.clone())?;
    }
    let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let verifier = Arc::new(RevocationChecking {
        inner,
        revoked: revoked.clone(),
    });
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(identity);
    // Stateless tickets only: nothing is kept per session on the gateway.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    match tickets {
        Some(t) => {
            config.ticketer = t;
            config.send_tls13_tickets = TICKETS_PER_HANDSHAKE;
        }
        None => config.send_tls13_tickets = 0,
    }
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(ServerTls {
        config: Arc::new(config),
        revoked,
        counts: Arc::default(),
    })
}

/// One TLS handshake of `client` with `server` in memory, as `localhost` (no sockets: both sides' work and nothing
/// else), until the client has also read what the server sends after it (its session tickets). For benchmarks and
/// tests of the handshake's cost and of resumption; the server's side of the connection is returned.
pub fn handshake_in_memory(
    client: &Arc<rustls::ClientConfig>,
    server: &Arc<rustls::ServerConfig>,
) -> Result<rustls::ServerConnection, rustls::Error> {
    let name = rustls::pki_types::ServerName::from(
        rustls::pki_types::DnsName::try_from("localhost")
            .map_err(|e| rustls::Error::General(e.to_string()))?,
    );
    let mut c = rustls::ClientConnection::new(client.clone(), name)?;
    let mut s = rustls::ServerConnection::new(server.clone())?;
    let io = |e: std::io::Error| rustls::Error::General(e.to_string());
    let mut buf = Vec::new();
    for _ in 0..8 {
        if !c.is_handshaking() && !s.is_handshaking() && !s.wants_write() {
            return Ok(s);
        }
        buf.clear();
        while c.wants_write() {
            c.write_tls(&mut buf).map_err(io)?;
        }
        s.read_tls(&mut buf.as_slice()).map_err(io)?;
        s.process_new_packets()?;
        buf.clear();
        while s.wants_write() {
            s.write_tls(&mut buf).map_err(io)?;
        }
        c.read_tls(&mut buf.as_slice()).map_err(io)?;
        c.process_new_packets()?;
    }
    Err(rustls::Error::General(
        "the in-memory handshake did not finish".into(),
    ))
}

/// A certificate chain and key that can be replaced while connections use it: a gateway's serving certificate and a
/// relay's client certificate, issued at start with a 30-day lifetime and re-issued by the process while it runs
/// (each handshake takes the current one; open connections keep theirs).
pub struct Renewable {
    provider: Arc<rustls::crypto::CryptoProvider>,
    current: RwLock<Arc<rustls::sign::CertifiedKey>>,
}

impl std::fmt::Debug for Renewable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewable").finish_non_exhaustive()
    }
}

impl Renewable {
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<Arc<Renewable>, TlsError> {
        let provider = Arc::new(bc_proto::tls_provider());
        let certified = certified(&provider, chain, key)?;
        Ok(Arc::new(Renewable {
            provider,
            current: RwLock::new(certified),
        }))
    }

    /// The next handshakes present `chain`.
    pub fn replace(
        &self,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<(), TlsError> {
        let certified = certified(&self.provider, chain, key)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = certified;
        Ok(())
    }

    /// The leaf certificate handshakes present now.
    pub fn leaf(&self) -> Option<CertificateDer<'static>> {
        self.now().cert.first().cloned()
    }

    fn now(&self) -> Arc<rustls::sign::CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn certified(
    provider: &rustls::crypto::CryptoProvider,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<rustls::sign::CertifiedKey>, TlsError> {
    let signer = provider.key_provider.load_private_key(key)?;
    Ok(Arc::new(rustls::sign::CertifiedKey::new(chain, signer)))
}

impl rustls::server::ResolvesServerCert for Renewable {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.now())
    }
}

impl rustls::client::ResolvesClientCert for Renewable {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.now())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_proto::spiffe::Role;

    #[test]
    fn a_renewed_identity_is_presented_by_the_next_handshake()
    -> Result<(), Box<dyn std::error::Error>> {
        let issue = |name: &str| -> Result<_, Box<dyn std::error::Error>> {
            let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
            let cert = rcgen::CertificateParams::new(vec![name.to_string()])?.self_signed(&key)?;
            Ok((
                vec![cert.der().clone()],
                PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            ))
        };
        let (first, key) = issue("first.test")?;
        let r = Renewable::new(first.clone(), key)?;
        assert_eq!(r.leaf(), first.first().cloned());
        let (second, key) = issue("second.test")?;
        let second_leaf = second.first().cloned();
        r.replace(second.clone(), key)?;
        assert_eq!(r.leaf(), second_leaf);
        let client: &dyn rustls::client::ResolvesClientCert = r.as_ref();
        assert!(client.has_certs());
        assert_eq!(
            client.resolve(&[], &[]).map(|c| c.cert.clone()),
            Some(second)
        );
        // A key that is not a key is refused, and the current identity kept.
        let bad = PrivateKeyDer::Pkcs8(vec![1, 2, 3].into());
        let (third, _) = issue("third.test")?;
        assert!(r.replace(third, bad).is_err());
        assert_eq!(r.leaf(), second_leaf);
        Ok(())
    }

    #[test]
    fn revoked_identities_are_found_and_others_are_not() -> Result<(), Box<dyn std::error::Error>> {
        let r = Revocations::default();
        let a = SpiffeId::new("test.bc", Role::Node, "a")?;
        let b = SpiffeId::new("test.bc", Role::Node, "b")?;
        assert!(!r.is_revoked(&a));
        assert_eq!(r.extend([a.clone()]), vec![a.clone()]);
        assert!(r.extend([a.clone()]).is_empty(), "already known");
        let shared = r.clone();
        assert!(shared.is_revoked(&a), "clones share the set");
        assert!(!shared.is_revoked(&b));
        assert_eq!(r.len(), 1);
        // Garbage from a peer is not an identity, and never a panic.
        assert_eq!(r.revoked_identity(b"\x30\x03\x02\x01\x01"), None);
        assert_eq!(r.revoked_identity(&[]), None);
        Ok(())
    }

    #[test]
    fn a_revoked_key_refuses_every_certificate_of_it_and_no_other()
    -> Result<(), Box<dyn std::error::Error>> {
        let cert = |key: &rcgen::KeyPair, id: &str| -> Result<Vec<u8>, rcgen::Error> {
            let mut p = rcgen::CertificateParams::default();
            p.subject_alt_names = vec![rcgen::SanType::URI(
                format!("spiffe://test.bc/node/{id}").try_into()?,
            )];
            Ok(p.self_signed(key)?.der().to_vec())
        };
        let old = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let new = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let (old_a, old_b, current) = (cert(&old, "n1")?, cert(&old, "n1")?, cert(&new, "n1")?);
        let r = Revocations::default();
        assert_eq!(r.refusal(&old_a), None);
        let hash = bc_proto::channel::key_hash_of(&old_a).ok_or("key hash")?;
        assert_eq!(r.extend_keys([hash, hash]), 1);
        assert_eq!(r.keys_len(), 1);
        for c in [&old_a, &old_b] {
            let why = r
                .refusal(c)
                .ok_or("a certificate of the revoked key passed")?;
            assert!(why.contains("superseded"), "{why}");
        }
        assert_eq!(
            r.refusal(&current),
            None,
            "the node's current key is refused"
        );
        assert_eq!(r.refusal(b"\x30\x03\x02\x01\x01"), None);
        Ok(())
    }
}
