//! The secret broker. Secrets (BMC credentials) are sealed at rest with AES-256-GCM under a key kept in the state
//! directory (`secrets.key`, 0600, never in the database); the associated data names the row (`site/<id>/secret/
//! <name>`), so a ciphertext copied to another row does not open. A site agent asks with a per-request ephemeral
//! P-256 public key (JWK) and gets the secret back as a JWE (ECDH-ES+A256KW / A256GCM, jwt-simple) encrypted here,
//! in the control plane: the gateway relaying it cannot read it. A site gets only its own site's secrets.

use bc_ca::CaError;
use bc_gateway::site::SiteAgent;
use bc_proto::v1;
use bc_store::Store;
use bc_store::sites::SealedSecret;
use jwt_simple::prelude::*;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use std::path::Path;
use tonic::Status;

/// How long a delivered JWE is valid.
pub const JWE_LIFETIME_S: u64 = 60;
pub const MAX_NAME: usize = 128;
pub const MAX_VALUE: usize = 16 * 1024;
const MAX_JWK: usize = 1024;

/// What the JWE carries (typed in bc-proto: the site agent opens the same type).
pub use bc_proto::payloads::SecretClaims;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret name must be 1-{MAX_NAME} characters of [A-Za-z0-9._/-]")]
    BadName,
    #[error("secret value must be at most {MAX_VALUE} bytes")]
    TooLarge,
    #[error("no randomness for a nonce")]
    Random,
    #[error(
        "stored secret does not open with this control plane's secrets.key (tampered, or another key)"
    )]
    Open,
}

pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-'))
}

pub struct SecretBox {
    key: LessSafeKey,
}

fn aad(site: &str, name: &str) -> String {
    format!("site/{site}/secret/{name}")
}

impl SecretBox {
    /// Loads `dir/secrets.key`, or creates it (32 random bytes, 0600).
    pub fn load_or_create(dir: &Path) -> Result<SecretBox, CaError> {
        let path = dir.join("secrets.key");
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut k = [0u8; 32];
                getrandom::fill(&mut k).map_err(|_| CaError::Invalid {
                    what: "secrets key (no randomness)",
                    path: path.clone(),
                })?;
                bc_ca::write_private(&path, &k)?;
                k.to_vec()
            }
            Err(source) => {
                return Err(CaError::Io {
                    what: "reading",
                    path,
                    source,
                });
            }
        };
        let key = UnboundKey::new(&AES_256_GCM, &bytes).map_err(|_| CaError::Invalid {
            what: "secrets key (must be 32 bytes)",
            path: path.clone(),
        })?;
        Ok(SecretBox {
            key: LessSafeKey::new(key),
        })
    }

    pub fn seal(&self, site: &str, name: &str, value: &[u8]) -> Result<SealedSecret, SecretError> {
        if !valid_name(name) {
            return Err(SecretError::BadName);
        }
        if value.len() > MAX_VALUE {
            return Err(SecretError::TooLarge);
        }
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|_| SecretError::Random)?;
        let mut buf = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(site, name).as_bytes()),
                &mut buf,
            )
            .map_err(|_| SecretError::Random)?;
        Ok(SealedSecret {
            nonce: nonce.to_vec(),
            ciphertext: buf,
        })
    }

    pub fn open(&self, site: &str, name: &str, s: &SealedSecret) -> Result<Vec<u8>, SecretError> {
        let nonce: [u8; NONCE_LEN] = s
            .nonce
            .as_slice()
            .try_into()
            .map_err(|_| SecretError::Open)?;
        let mut buf = s.ciphertext.clone();
        let plain = self
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(site, name).as_bytes()),
                &mut buf,
            )
            .map_err(|_| SecretError::Open)?;
        Ok(plain.to_vec())
    }

    /// Answers a site's SecretRequest: the secret of the agent's own site, as a JWE to the request's key.
    pub async fn answer(
        &self,
        store: &Store,
        agent: &SiteAgent,
        req: v1::SecretRequestMessage,
    ) -> Result<v1::SecretResponse, Status> {
        if !valid_name(&req.secret_ref) {
            return Err(Status::invalid_argument(SecretError::BadName.to_string()));
        }
        if req.recipient_jwk.len() > MAX_JWK {
            return Err(Status::invalid_argument(format!(
                "recipient_jwk is longer than {MAX_JWK} bytes"
            )));
        }
        let recipient = EcdhEsA256KWEncryptionKey::from_jwk(&req.recipient_jwk).map_err(|e| {
            Status::invalid_argument(format!(
                "recipient_jwk must be a P-256 public key as a JWK (ECDH-ES+A256KW): {e}"
            ))
        })?;
        let sealed = store
            .secret(&agent.site_id, &req.secret_ref)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "reading a secret");
                Status::unavailable("reading the secret failed; retry later")
            })?
            .ok_or_else(|| {
                tracing::warn!(site_id = agent.site_id, name = req.secret_ref, "secret refused: none for this site");
                Status::not_found(format!(
                    "site {} has no secret {:?}: store it with `better-compute secrets put --site {} {}`",
                    agent.site_id, req.secret_ref, agent.site_id, req.secret_ref
                ))
            })?;
        let plain = self
            .open(&agent.site_id, &req.secret_ref, &sealed)
            .map_err(|e| {
                tracing::error!(site_id = agent.site_id, name = req.secret_ref, error = %e, "secret does not open");
                Status::failed_precondition(e.to_string())
            })?;
        let value = String::from_utf8(plain)
            .map_err(|_| Status::failed_precondition("stored secret is not UTF-8"))?;
        let claims = Claims::with_custom_claims(
            SecretClaims {
                name: req.secret_ref.clone(),
                value,
            },
            Duration::from_secs(JWE_LIFETIME_S),
        )
        .with_subject(&agent.site_id)
        .with_audience(&agent.agent_id);
        let jwe = recipient.encrypt(claims).map_err(|e| {
            tracing::error!(error = %e, "encrypting a secret");
            Status::internal("encrypting the secret failed")
        })?;
        store
            .audit_secret_delivery(&agent.site_id, &req.secret_ref, &agent.agent_id)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "auditing a secret delivery");
                Status::unavailable("recording the delivery failed; retry later")
            })?;
        tracing::info!(
            site_id = agent.site_id,
            agent = agent.agent_id,
            name = req.secret_ref,
            "secret delivered"
        );
        Ok(v1::SecretResponse { jwe })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_binds_the_row() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let b = SecretBox::load_or_create(dir.path())?;
        let s = b.seal("s1", "bmc/a", b"hunter2")?;
        assert!(!s.ciphertext.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(b.open("s1", "bmc/a", &s)?, b"hunter2");
        assert!(matches!(b.open("s2", "bmc/a", &s), Err(SecretError::Open)));
        assert!(matches!(b.open("s1", "bmc/b", &s), Err(SecretError::Open)));
        let again = SecretBox::load_or_create(dir.path())?;
        assert_eq!(again.open("s1", "bmc/a", &s)?, b"hunter2");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("secrets.key"))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(matches!(
            b.seal("s1", "../x y", b""),
            Err(SecretError::BadName)
        ));
        Ok(())
    }
}
