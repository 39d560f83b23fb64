//! SPIFFE IDs: `spiffe://<trust-domain>/<kind>/<id>` for nodes, sites and gateways, and extraction from an X.509
//! certificate (exactly one `spiffe://` URI SAN).

use std::fmt;
use std::str::FromStr;

/// What a workload identity is for; the first path segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Node,
    Site,
    Gateway,
    /// A control-plane process (an API process reaching a gateway over internal mTLS: the tunnel relay).
    Control,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Site => "site",
            Role::Gateway => "gateway",
            Role::Control => "control",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SpiffeId {
    trust_domain: String,
    role: Role,
    id: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpiffeError {
    #[error("SPIFFE ID must start with spiffe://")]
    Scheme,
    #[error("trust domain must be 1-255 characters of [a-z0-9.-_]")]
    TrustDomain,
    #[error("SPIFFE path must be /<node|site|gateway|control>/<id>")]
    Path,
    #[error("id must be 1-128 characters of [A-Za-z0-9.-_]")]
    Id,
    #[error("certificate is not valid X.509 DER")]
    Certificate,
    #[error("certificate must carry exactly one spiffe:// URI SAN, found {found}")]
    UriSanCount { found: usize },
}

fn valid_trust_domain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
        })
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

impl SpiffeId {
    pub fn new(trust_domain: &str, role: Role, id: &str) -> Result<SpiffeId, SpiffeError> {
        if !valid_trust_domain(trust_domain) {
            return Err(SpiffeError::TrustDomain);
        }
        if !valid_id(id) {
            return Err(SpiffeError::Id);
        }
        Ok(SpiffeId {
            trust_domain: trust_domain.to_string(),
            role,
            id: id.to_string(),
        })
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The single SPIFFE ID carried by a certificate's URI SANs.
    pub fn from_cert_der(der: &[u8]) -> Result<SpiffeId, SpiffeError> {
        use x509_parser::prelude::*;
        let (_, cert) = X509Certificate::from_der(der).map_err(|_| SpiffeError::Certificate)?;
        let mut uris = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                if let GeneralName::URI(uri) = name
                    && uri.starts_with("spiffe://")
                {
                    uris.push(*uri);
                }
            }
        }
        match uris.as_slice() {
            [one] => one.parse(),
            other => Err(SpiffeError::UriSanCount { found: other.len() }),
        }
    }
}

impl FromStr for SpiffeId {
    type Err = SpiffeError;

    fn from_str(s: &str) -> Result<SpiffeId, SpiffeError> {
        let rest = s.strip_prefix("spiffe://").ok_or(SpiffeError::Scheme)?;
        let (domain, path) = rest.split_once('/').ok_or(SpiffeError::Path)?;
        let (role, id) = path.split_once('/').ok_or(SpiffeError::Path)?;
        let role = match role {
            "node" => Role::Node,
            "site" => Role::Site,
            "gateway" => Role::Gateway,
            "control" => Role::Control,
            _ => return Err(SpiffeError::Path),
        };
        SpiffeId::new(domain, role, id)
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/{}/{}",
            self.trust_domain,
            self.role.as_str(),
            self.id
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parse_and_format() -> Result<(), SpiffeError> {
        let id: SpiffeId = "spiffe://bc.example/node/0193a-b".parse()?;
        assert_eq!(id.role(), Role::Node);
        assert_eq!(id.id(), "0193a-b");
        assert_eq!(id.to_string(), "spiffe://bc.example/node/0193a-b");
        assert_eq!(
            "http://x/node/a".parse::<SpiffeId>(),
            Err(SpiffeError::Scheme)
        );
        assert_eq!(
            "spiffe://x/tenant/a".parse::<SpiffeId>(),
            Err(SpiffeError::Path)
        );
        assert_eq!(
            "spiffe://x/node/a/b".parse::<SpiffeId>(),
            Err(SpiffeError::Id)
        );
        assert_eq!(
            "spiffe://X/node/a".parse::<SpiffeId>(),
            Err(SpiffeError::TrustDomain)
        );
        assert_eq!(
            SpiffeId::from_cert_der(b"junk"),
            Err(SpiffeError::Certificate)
        );
        Ok(())
    }

    proptest! {
        #[test]
        fn parse_never_panics_and_round_trips(s in "spiffe://[a-z.]{0,8}/(node|site|x)/[a-z0-9/]{0,8}") {
            if let Ok(id) = s.parse::<SpiffeId>() {
                prop_assert_eq!(id.to_string(), s);
            }
        }
    }
}
