//! `bcd join <token>`: persist the node key, build a CSR, seal the token to JoinService bound to the CSR key,
//! collect hardware claims, send Join (retrying with backoff while the gateway is unreachable), check the answer
//! and store certificate, trust bundle and identity.

use crate::config::Config;
use crate::state::{NodeIdentity, StateDir, StateError};
use bc_error_chain::{InlineErrorChain, chain};
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
    #[error("{0}")]
    WrongTokenKind(String),
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
    #[error(
        "the gateway at {url} is not the control plane this node pins: {detail}. Check ca_pin (--ca-pin or \
         bcd.toml) against `better-compute info` on the control plane; if it matches, something else answers at \
         that address"
    )]
    PinMismatch { url: String, detail: String },
}

/// The pin mismatch in a failed call's text, if that is why it failed: not a transport failure to retry.
fn pin_mismatch(status: &tonic::Status) -> Option<String> {
    let text = describe(status);
    let at = text.find(channel::PIN_MISMATCH)?;
    Some(text[at..].to_string())
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

/// Whether a failed Join is worth sending again. Only the server's explicit refusals are final: a status the
/// control plane sent (no transport cause) with a code that says the request itself is wrong (bad token, spent,
/// expired, hardware taken). Everything else is retried: a status built from a transport failure (connection
/// refused or reset mid-call: tonic reports `Unknown: transport error`, h2 errors), and the codes the server uses for
/// "try again" (its database briefly unavailable, a reclaim that raced). A retry is idempotent by design: the same
/// token and key within the replay window get the same node without spending a use.
pub fn retryable(status: &tonic::Status) -> bool {
    use tonic::Code;
    if std::error::Error::source(status).is_some() {
        return true;
    }
    !matches!(
        status.code(),
        Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::ResourceExhausted
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss
            | Code::Unauthenticated
    )
}

/// Which kind of token `token` is by its prefix: a site token (`bcst_`, `bcd site enroll`) or else a join token.
/// Both travel the same way: sealed to JoinService, bound to the CSR key.
pub fn token_kind(token: &str) -> TokenKind {
    let t = token.trim();
    if t.starts_with(TokenKind::Site.prefix()) {
        TokenKind::Site
    } else if t.starts_with(TokenKind::ApiKey.prefix()) {
        TokenKind::ApiKey
    } else {
        TokenKind::Join
    }
}

/// Refuses a token of another kind than `purpose` (a join token for `bcd join`, a site token for `bcd site
/// enroll`), naming the command that takes it. JoinService refuses the same mismatch on its side.
pub fn check_token_kind(purpose: TokenKind, token: &str) -> Result<(), JoinError> {
    let given = token_kind(token);
    if given == purpose {
        return Ok(());
    }
    let (command, takes) = match purpose {
        TokenKind::Site => ("`bcd site enroll`", "a site token (bcst_…)"),
        _ => ("`bcd join`", "a join token (bcjt_…)"),
    };
    let what = match given {
        TokenKind::Site => {
            "this is a site token (bcst_…): it enrolls a rack agent, run `bcd site enroll` with it"
        }
        TokenKind::ApiKey => {
            "this is an API key (bcak_…), not a token a machine can use: create a join token with `better-compute join-tokens create`"
        }
        TokenKind::Join => "this is a join token (bcjt_…): it joins a node, run `bcd join` with it",
    };
    Err(JoinError::WrongTokenKind(format!(
        "{command} takes {takes}; {what}"
    )))
}

fn purpose_of(kind: TokenKind) -> v1::JoinPurpose {
    match kind {
        TokenKind::Site => v1::JoinPurpose::Site,
        _ => v1::JoinPurpose::Node,
    }
}

/// A node join request for `token` from the key in `state` (creating the key first if needed).
pub fn build_request(
    config: &Config,
    state: &StateDir,
    token: &str,
    claims: v1::HardwareClaims,
) -> Result<v1::JoinRequest, JoinError> {
    let key = state.load_or_create_key()?;
    request_for_key(config, &key, token, claims)
}

/// A node join request for `token` from `key` (no state directory: load generators and tests).
pub fn request_for_key(
    config: &Config,
    key: &rcgen::KeyPair,
    token: &str,
    claims: v1::HardwareClaims,
) -> Result<v1::JoinRequest, JoinError> {
    request_as(config, key, TokenKind::Join, token, claims)
}

/// A request for `token` from `key` with the purpose `kind` (a node join or a site enrollment); a token of the
/// other kind is refused here.
pub fn request_as(
    config: &Config,
    key: &rcgen::KeyPair,
    kind: TokenKind,
    token: &str,
    claims: v1::HardwareClaims,
) -> Result<v1::JoinRequest, JoinError> {
    check_token_kind(kind, token)?;
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
        purpose: purpose_of(kind).into(),
    })
}

/// Sends one Join over a fresh pinned-TLS connection; DEADLINE_EXCEEDED when the gateway has not answered within
/// [`channel::CALL_DEADLINE`].
pub async fn send(
    config: &Config,
    request: v1::JoinRequest,
) -> Result<v1::JoinResponse, tonic::Status> {
    send_within(config, request, channel::CALL_DEADLINE).await
}

/// [`send`] with `deadline` for the answer.
pub async fn send_within(
    config: &Config,
    request: v1::JoinRequest,
    deadline: std::time::Duration,
) -> Result<v1::JoinResponse, tonic::Status> {
    let tls = channel::client_config(ServerTrust::Pin(config.ca_pin.clone()), None)
        .map_err(|e| tonic::Status::invalid_argument(chain(&e)))?;
    let ch = channel::connect(&config.gateway_url, tls)
        .await
        .map_err(|e| tonic::Status::unavailable(chain(&e)))?;
    let mut client = v1::join_service_client::JoinServiceClient::new(ch);
    channel::answered_within("join", deadline, client.join(request))
        .await
        .map(tonic::Response::into_inner)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The error and its causes on one line (`a: b: c`): bc-error-chain's [`chain`], under the name callers outside
/// bcd (the control plane's gateway tests) use. New code calls `bc_error_chain` directly.
pub use bc_error_chain::chain as error_chain;

/// A failed call for an operator: its code, its message and, for a transport failure, the cause.
fn describe(s: &tonic::Status) -> String {
    match std::error::Error::source(s) {
        Some(cause) => format!(
            "{:?}: {}: {}",
            s.code(),
            s.message(),
            InlineErrorChain::new(cause)
        ),
        None => format!("{:?}: {}", s.code(), s.message()),
    }
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

/// Joins as a node with a join token (`bcd join`), retrying every transport failure with backoff (see
/// [`retryable`]). Safe to run again after a crash at any point:
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
    join_as(config, TokenKind::Join, token, opts).await
}

/// Enrolls a site agent with a site token (`bcd site enroll`): the same sealed-token path and retries as [`join`].
pub async fn enroll_site(
    config: &Config,
    token: &str,
    opts: JoinOptions,
) -> Result<JoinOutcome, JoinError> {
    join_as(config, TokenKind::Site, token, opts).await
}

async fn join_as(
    config: &Config,
    kind: TokenKind,
    token: &str,
    opts: JoinOptions,
) -> Result<JoinOutcome, JoinError> {
    // A token of the wrong kind is refused before the key is made or anything is sent.
    check_token_kind(kind, token)?;
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
    let request = request_as(config, &key, kind, token, opts.claims)?;
    let mut backoff = JOIN_RETRY.start();
    let mut attempt = 0;
    let response = loop {
        attempt += 1;
        match send(config, request.clone()).await {
            Ok(r) => break r,
            Err(s) if pin_mismatch(&s).is_some() => {
                return Err(JoinError::PinMismatch {
                    url: config.gateway_url.clone(),
                    detail: pin_mismatch(&s).unwrap_or_default(),
                });
            }
            Err(s) if retryable(&s) && attempt < opts.attempts => {
                let wait = backoff.next_delay(rand::random::<f64>());
                tracing::warn!(
                    attempt,
                    error = describe(&s),
                    ?wait,
                    "join attempt failed; retrying"
                );
                tokio::time::sleep(wait).await;
            }
            Err(s) if retryable(&s) => {
                return Err(JoinError::Unreachable {
                    url: config.gateway_url.clone(),
                    attempts: attempt,
                    last: describe(&s),
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
    let role = match kind {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::{Code, Status};

    #[test]
    fn transport_failures_are_retried_and_only_explicit_refusals_stop() {
        // What tonic hands back when the connection is reset mid-call: Unknown, with the transport error as source.
        let reset = Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        )));
        assert_eq!(reset.code(), Code::Unknown);
        assert!(retryable(&reset), "a reset mid-call is retried");
        // A transport-caused status keeps being retried whatever code it maps to.
        let mut internal = Status::internal("h2 protocol error: stream no longer needed");
        internal.set_source(std::sync::Arc::new(std::io::Error::other("h2")));
        assert!(retryable(&internal));
        for code in [
            Code::Unavailable,
            Code::Aborted,
            Code::DeadlineExceeded,
            Code::Cancelled,
            Code::Unknown,
        ] {
            assert!(retryable(&Status::new(code, "from the server")), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::PermissionDenied,
            Code::ResourceExhausted,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::Unauthenticated,
        ] {
            assert!(
                !retryable(&Status::new(code, "refused by JoinService")),
                "{code:?} is a refusal"
            );
        }
        assert!(describe(&reset).contains("connection reset by peer"));
    }

    #[test]
    fn each_token_kind_is_refused_on_the_other_path_naming_the_right_command() {
        let site = "bcst_0123456789abcdef.x";
        let join = "bcjt_0123456789abcdef.x";
        let e = check_token_kind(TokenKind::Join, site)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("site token") && e.contains("bcd site enroll"),
            "{e}"
        );
        let e = check_token_kind(TokenKind::Site, join)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("join token") && e.contains("run `bcd join`"),
            "{e}"
        );
        let e = check_token_kind(TokenKind::Join, "bcak_0123456789abcdef.x")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("API key"), "{e}");
        assert!(check_token_kind(TokenKind::Join, join).is_ok());
        assert!(check_token_kind(TokenKind::Site, &format!("  {site}\n")).is_ok());
    }
}
