//! bc-proto: the contract between Better Compute's parties.
//!
//! It owns the `bettercompute.v1` protobuf services (generated tonic code, checked in, with a drift test), the
//! join-token format ([`token`]), HPKE sealing of tokens to JoinService ([`seal`]), SPIFFE IDs ([`spiffe`]), the
//! signed-result envelope ([`envelope`]) and the client channel builder: mTLS, CA pinning, reconnect backoff with
//! full jitter ([`channel`], the policy from bc-backoff).
//!
//! It imports no other crate of the workspace but the leaf bc-backoff (which imports nothing); every party depends
//! on it. Start with `proto/bettercompute/v1/
//! node.proto`, then [`token`] and [`seal`].

pub mod channel;
pub mod codec;
pub mod duration;
pub mod envelope;
pub mod payloads;
pub mod proxy_protocol;
pub mod runtime;
pub mod seal;
pub mod spiffe;
pub mod tickets;
pub mod token;
pub mod tunnel;

/// Generated protobuf messages and gRPC clients/servers for `bettercompute.v1`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    include!("gen/bettercompute.v1.rs");
}

/// The agent version every binary reports (from the workspace version).
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// The rustls provider every party uses: ring, with TLS 1.3 AES-128-GCM-SHA256 preferred. SHA-256 runs on the CPU's
/// SHA extensions where SHA-384's key schedule does not, which is measurable when every join is a fresh handshake;
/// the other suites stay enabled.
pub fn tls_provider() -> rustls::crypto::CryptoProvider {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    p
}

/// Installs ring as the process-wide rustls crypto provider. Every binary calls this first (the graph holds exactly
/// one provider; see CRATES.md pitfall 1). Calling it twice is harmless.
pub fn install_crypto_provider() {
    let _ = tls_provider().install_default();
}
