//! `bcd join <token>`: persist the node key, build a CSR, seal the token to JoinService bound to the CSR key,
//! collect hardware claims, send Join (retrying with backoff while the gateway is unreachable), check the answer
//! and store certificate, trust bundle and identity.

use crate::config::Config;
use crate::state::{NodeIdentity, StateDir, StateError};
use bc_error_chain::chain;
use bc_proto::channel::{self, ExponentialBackoff, Jitter, ServerTrust};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::token::{Token, TokenKind};
use bc_proto::v1;
use rcgen::{CertificateParams, DistinguishedName, DnType, PublicKeyData as _};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("the join token is malformed: {0}")]
    Token(#[from] bc_proto::token::TokenError),
    #[error("node state")]
    State(#[from] StateError),
    #[error("building the certificate request")]
    Csr(#[source] rcgen::Error),
    #[error("sealing the token")]
    Seal(#[from] bc_proto::seal::SealError),
    #[error("TLS configuration")]
    Channel(#[from] channel::ChannelError),
    #[error("the control plane refused the join ({code:?}): {message}")]
    Refused { code: tonic::Code, message: String },
    #[error("the gateway at {url} was unreachable after {attempts} attempts; last error: {last}")]
    Unreachable {
        url: String,
        attempts: u32,
        last: String,
    },
    #[error("the control plane's answer is not acceptable: {0}")]
    BadResponse(String),
}

#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// How many times to try while the gateway is unreachable or unavailable.
    pub attempts: u32,
    /// Where /sys and /proc are read.
    pub claims: v1::HardwareClaims,
}

#[derive(Debug, Clone)]
pub struct JoinOutcome {
    pub identity: NodeIdentity,
    pub reclaimed: bool,
    pub replayed: bool,
}

/// Between join attempts while the gateway is unreachable: 0.25 s doubling to 10 s, full jitter.
pub const JOIN_RETRY: ExponentialBackoff = ExponentialBackoff::new(
    Duration::from_millis(250),
    Duration::from_secs(10),
    Jitter::Fraction(1.0),
);

/// Codes worth retrying: the gateway or database is briefly unavailable, or the reclaim raced.
fn retryable(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable | tonic::Code::Aborted | tonic::Code::DeadlineExceeded
    )
}

/// Which kind of token `token` is by its prefix: a site token (`bcst_`, `bcd site enroll`) or else a join token.
/// Both travel the same way: sealed to JoinService, bound to the CSR key.
pub fn token_kind(token: &str) -> TokenKind {
    if token.trim().starts_with(TokenKind::Site.prefix()) {
        TokenKind::Site
    } else {
        TokenKind::Join
    }
}

/// A request for `token` from the key in `state` (creating the key first if needed).
pub fn build_request(
    config: &Config,
    state: &StateDir,
    token: &str,
    claims: v1::HardwareClaims,
) -> Result<v1::JoinRequest, JoinError> {
    let key = state.load_or_create_key()?;
    request_for_key(config, &key, token, claims)
}

/// A request for `token` from `key` (no state directory: load generators and tests).
pub fn request_for_key(
    config: &Config,
    key: &rcgen::KeyPair,
    token: &str,
    claims: v1::HardwareClaims,
) -> Result<v1::JoinRequest, JoinError> {
    let kind = token_kind(token);
    let parsed = Token::parse(kind, token)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        if kind == TokenKind::Site {
            "bcd site"
        } else {
            "bcd node"
        },
    );
    params.distinguished_name = dn;
    let csr = params.serialize_request(key).map_err(JoinError::Csr)?;
    let sealed = bc_proto::seal::seal(
        &config.join_public_key,
        &parsed.reveal(),
        &key.subject_public_key_info(),
    )?;
    Ok(v1::JoinRequest {
        sealed_token: sealed,
        csr_der: csr.der().to_vec(),
        claims: Some(claims),
        agent_version: bc_proto::AGENT_VERSION.to_string(),
    })
}

/// Sends one Join over a fresh pinned-TLS connection.
pub async fn send(
    config: &Config,
    request: v1::JoinRequest,
) -> Result<v1::JoinResponse, tonic::Status> {
    let tls = channel::client_config(ServerTrust::Pin(config.ca_pin.clone()), None)
        .map_err(|e| tonic::Status::invalid_argument(chain(&e)))?;
    let ch = channel::connect(&config.gateway_url, tls)
        .await
        .map_err(|e| tonic::Status::unavailable(chain(&e)))?;
    let mut client = v1::join_service_client::JoinServiceClient::new(ch);
    client.join(request).await.map(tonic::Response::into_inner)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Checks the answer belongs to us: the certificate names the node, certifies our key, and the trust bundle holds
/// the pinned CA.
fn check_response(
    config: &Config,
    key: &rcgen::KeyPair,
    r: &v1::JoinResponse,
    role: Role,
) -> Result<(), JoinError> {
    let bad = |m: String| JoinError::BadResponse(m);
    let id = SpiffeId::from_cert_der(&r.cert_der).map_err(|e| bad(format!("certificate: {e}")))?;
    if id.role() != role {
        return Err(bad(format!(
            "certificate names {id}, a {} identity; expected a {} identity",
            id.role().as_str(),
            role.as_str()
        )));
    }
    if id.to_string() != r.spiffe_id || id.id() != r.node_id {
        return Err(bad(format!(
            "certificate names {id}, the answer says {} / {}",
            r.spiffe_id, r.node_id
        )));
    }
    let cert_key =
        bc_proto::envelope::cert_public_point(&r.cert_der).map_err(|e| bad(e.to_string()))?;
    if cert_key != key.public_key_raw() {
        return Err(bad("certificate does not certify this node's key".into()));
    }
    if !r
        .trust_bundle_der
        .iter()
        .any(|c| channel::ca_pin_of(c).as_deref() == Some(config.ca_pin.as_str()))
    {
        return Err(bad("trust bundle does not contain the pinned CA".into()));
    }
    Ok(())
}

/// Joins with `token` (a join token; or a site token, which enrolls a site agent: `bcd site enroll`), retrying
/// while the gateway is unreachable. Safe to run again after a crash at any point:
/// the key is reused, and the control plane answers a retry within 10 minutes with the same node.
///
/// A node whose certificate expired (it was offline past its renewal) rejoins: with a reclaim token it is
/// re-adopted under the same node id. JoinService reclaims only for a key other than the one it holds for the node
/// (a retry of a committed reclaim, same token and same key, is recognised as a retry), so a rejoin uses a fresh
/// key, `node.key.next`, persisted before the first attempt and promoted to `node.key` with the new certificate.
pub async fn join(
    config: &Config,
    token: &str,
    opts: JoinOptions,
) -> Result<JoinOutcome, JoinError> {
    let state = StateDir::open(&config.state_dir)?;
    state.finish_rejoin()?;
    let rejoin = state
        .identity()?
        .is_some_and(|i| i.not_after_ms <= now_ms());
    let key = if rejoin {
        state.load_or_create_next_key()?
    } else {
        state.load_or_create_key()?
    };
    let request = request_for_key(config, &key, token, opts.claims)?;
    let mut backoff = JOIN_RETRY.start();
    let mut attempt = 0;
    let response = loop {
        attempt += 1;
        match send(config, request.clone()).await {
            Ok(r) => break r,
            Err(s) if retryable(s.code()) && attempt < opts.attempts => {
                let wait = backoff.next_delay(rand::random::<f64>());
                tracing::warn!(attempt, error = %s.message(), ?wait, "join attempt failed; retrying");
                tokio::time::sleep(wait).await;
            }
            Err(s) if retryable(s.code()) => {
                return Err(JoinError::Unreachable {
                    url: config.gateway_url.clone(),
                    attempts: attempt,
                    last: s.message().to_string(),
                });
            }
            Err(s) => {
                return Err(JoinError::Refused {
                    code: s.code(),
                    message: s.message().to_string(),
                });
            }
        }
    };
    // Fault injection for the crash-retry test: die exactly between the server's commit and our store.
    if std::env::var("BCD_FAULT").as_deref() == Ok("exit-after-join-reply") {
        std::process::exit(137);
    }
    let role = match token_kind(token) {
        TokenKind::Site => Role::Site,
        _ => Role::Node,
    };
    check_response(config, &key, &response, role)?;
    let identity = NodeIdentity {
        node_id: response.node_id.clone(),
        spiffe_id: response.spiffe_id.clone(),
        pool: response.pool.clone(),
        gateway_url: config.gateway_url.clone(),
        not_after_ms: response.not_after_unix_ms,
        issued_at_ms: now_ms(),
    };
    if rejoin {
        state.store_rejoin(&response.cert_der, &response.trust_bundle_der, &identity)?;
    } else {
        state.store_join(&response.cert_der, &response.trust_bundle_der, &identity)?;
    }
    Ok(JoinOutcome {
        identity,
        reclaimed: response.reclaimed,
        replayed: response.replayed,
    })
}
