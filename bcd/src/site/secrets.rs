//! Secrets from the control plane's broker (`SecretService.SecretRequest`): each request carries a fresh P-256 key,
//! the answer is a JWE to that key (which the gateway relaying it cannot open), checked to be the secret asked for,
//! for this site, and held in a [`Zeroizing`] string wiped when dropped. BMC credentials are fetched this way per
//! operation ([`fetch_bmc_credentials`]).

use super::{SiteError, site_identity, tls_of};
use crate::config::Config;
use crate::state::StateDir;
use bc_error_chain::chain;
use bc_proto::channel;
use bc_proto::v1;
use zeroize::Zeroizing;

/// What a secret JWE carries (typed in bc-proto: the control plane seals the same type).
pub use bc_proto::payloads::SecretClaims;

#[derive(Debug, thiserror::Error)]
pub enum SecretFetchError {
    #[error("site state")]
    Site(#[from] SiteError),
    #[error("connecting to the gateway at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("the control plane refused secret {name:?} ({code:?}): {message}")]
    Refused {
        name: String,
        code: tonic::Code,
        message: String,
    },
    #[error(
        "the secret's JWE does not open with this request's key (tampered, or not meant for it): {0}"
    )]
    Jwe(String),
    #[error("the JWE carries secret {got:?} for {subject:?}, not {want:?} for this site")]
    Mismatch {
        want: String,
        got: String,
        subject: String,
    },
}

/// Opens a secret JWE with the request's ephemeral key and checks it is the secret asked for, for `site_id`. The
/// value comes back in a [`Zeroizing`] string: wiped when dropped.
pub fn open_secret(
    key: &jwt_simple::prelude::EcdhEsA256KWDecryptionKey,
    jwe: &str,
    name: &str,
    site_id: &str,
) -> Result<Zeroizing<String>, SecretFetchError> {
    let mut claims = key
        .decrypt_token::<SecretClaims>(jwe, None)
        .map_err(|e| SecretFetchError::Jwe(e.to_string()))?;
    let value = Zeroizing::new(std::mem::take(&mut claims.custom.value));
    let subject = claims.subject.clone().unwrap_or_default();
    if claims.custom.name != name || subject != site_id {
        return Err(SecretFetchError::Mismatch {
            want: name.to_string(),
            got: claims.custom.name,
            subject,
        });
    }
    Ok(value)
}

/// Asks the control plane for secret `name` of this agent's site, with a fresh P-256 key used for this request
/// only; the answer is a JWE to that key, which the gateway relaying it cannot open.
pub async fn fetch_secret(
    config: &Config,
    name: &str,
) -> Result<Zeroizing<String>, SecretFetchError> {
    fetch_secret_in(&config.state_dir, name).await
}

/// [`fetch_secret`] with the identity of the site agent whose state directory is `state_dir` (the gateway is the
/// one it enrolled with).
pub async fn fetch_secret_in(
    state_dir: &std::path::Path,
    name: &str,
) -> Result<Zeroizing<String>, SecretFetchError> {
    let state = StateDir::open(state_dir).map_err(SiteError::from)?;
    let identity = site_identity(&state, state_dir)?;
    let tls = tls_of(&state)?;
    let revoked = || {
        SecretFetchError::Site(SiteError::Revoked {
            spiffe_id: identity.spiffe_id.clone(),
        })
    };
    let ch = match channel::connect(&identity.gateway_url, tls.clone()).await {
        Ok(ch) => ch,
        Err(e) if crate::session::revoked_at_handshake(&e) => return Err(revoked()),
        Err(e) => {
            return Err(SecretFetchError::Connect {
                url: identity.gateway_url.clone(),
                message: chain(&e),
            });
        }
    };
    let key = jwt_simple::prelude::EcdhEsA256KWDecryptionKey::generate();
    let response = match v1::secret_service_client::SecretServiceClient::new(ch)
        .secret_request(v1::SecretRequestMessage {
            secret_ref: name.to_string(),
            recipient_jwk: key.encryption_key().to_jwk(),
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) if crate::session::refused_as_revoked(&s, &identity.gateway_url, tls).await => {
            return Err(revoked());
        }
        Err(s) => {
            return Err(SecretFetchError::Refused {
                name: name.to_string(),
                code: s.code(),
                message: s.message().to_string(),
            });
        }
    };
    open_secret(&key, &response.jwe, name, &identity.node_id)
}

/// Why BMC credentials could not be had from the broker.
#[derive(Debug, thiserror::Error)]
pub enum BmcSecretError {
    #[error("fetching BMC secret {name:?}")]
    Fetch {
        name: String,
        #[source]
        source: SecretFetchError,
    },
    #[error(
        "secret {name:?} of site {site} {why}: BMC credentials are stored as {format} \
         (`better-compute secrets put {name} --site {site}`, value in BC_SECRET_VALUE)",
        format = bcd_site::redfish::SECRET_FORMAT
    )]
    Format {
        name: String,
        site: String,
        why: bcd_site::redfish::CredentialsFormatError,
    },
}

/// BMC credentials from the control plane's secret broker: secret `name` of the site whose agent state is
/// `state_dir`, in the format of [`bcd_site::redfish::Credentials::from_secret_json`]. Neither the secret nor the
/// password is logged or kept: the JSON is wiped once parsed, the password when the credentials are dropped.
pub async fn fetch_bmc_credentials(
    state_dir: &std::path::Path,
    name: &str,
) -> Result<bcd_site::redfish::Credentials, BmcSecretError> {
    let fetch = |source| BmcSecretError::Fetch {
        name: name.to_string(),
        source,
    };
    let value = fetch_secret_in(state_dir, name).await.map_err(fetch)?;
    bcd_site::redfish::Credentials::from_secret_json(&value).map_err(|why| {
        let site = StateDir::open(state_dir)
            .ok()
            .and_then(|s| s.identity().ok().flatten())
            .map_or_else(|| "<site>".to_string(), |i| i.node_id);
        BmcSecretError::Format {
            name: name.to_string(),
            site,
            why,
        }
    })
}
