//! The control plane's certificate authority and JoinService key, kept under the state directory:
//! `ca.key` (0600), `ca.crt`, `join.key` (0600). Generated on first start, loaded afterwards.
//!
//! Certificates are never signed from a CSR's own parameters (they would copy requested SANs, EKUs and the CA
//! flag): each is built fresh with a random serial, explicit dates and exactly the SAN we decide.

use bc_proto::seal::{self, JoinPrivateKey};
use bc_proto::spiffe::{Role, SpiffeId};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PublicKeyData as _,
    SanType, SerialNumber,
};
use rustls::pki_types::{
    CertificateDer, CertificateSigningRequestDer, PrivateKeyDer, PrivatePkcs8KeyDer,
};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

/// Node and site certificates live 24 hours by default; renewal happens at about half of that.
pub const LEAF_LIFETIME: Duration = Duration::hours(24);
/// NotBefore is backdated so a node whose clock runs a little behind still accepts its certificate.
pub const BACKDATE: Duration = Duration::minutes(5);

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid {what}")]
    Invalid { what: &'static str, path: PathBuf },
    #[error("certificate generation")]
    Rcgen(#[from] rcgen::Error),
    #[error("random number generator")]
    Rng,
}

/// Why a CSR is refused.
#[derive(Debug, thiserror::Error)]
pub enum CsrError {
    #[error("csr_der is not a DER PKCS#10 certificate signing request")]
    Unparseable,
    #[error("the CSR's signature does not verify with its own public key")]
    BadSignature,
    #[error("the CSR's key must be ECDSA P-256")]
    KeyAlgorithm,
    #[error("the CSR is not acceptable: {0}")]
    Other(String),
}

/// A verified CSR: its public key (SPKI DER) is what a certificate will certify.
pub struct VerifiedCsr {
    params: CertificateSigningRequestParams,
    pub spki_der: Vec<u8>,
    /// The raw public key (uncompressed P-256 point).
    pub public_point: Vec<u8>,
}

pub fn verify_csr(der: &[u8]) -> Result<VerifiedCsr, CsrError> {
    let params =
        CertificateSigningRequestParams::from_der(&CertificateSigningRequestDer::from(der))
            .map_err(|e| match e {
                rcgen::Error::CouldNotParseCertificationRequest => CsrError::Unparseable,
                rcgen::Error::InvalidCertificationRequestSignature => CsrError::BadSignature,
                other => CsrError::Other(other.to_string()),
            })?;
    if params.public_key.algorithm() != &rcgen::PKCS_ECDSA_P256_SHA256 {
        return Err(CsrError::KeyAlgorithm);
    }
    let spki_der = params.public_key.subject_public_key_info();
    let public_point = params.public_key.der_bytes().to_vec();
    Ok(VerifiedCsr {
        params,
        spki_der,
        public_point,
    })
}

pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    trust_domain: String,
    leaf_lifetime: Duration,
}

/// An issued leaf certificate.
pub struct Issued {
    pub cert_der: Vec<u8>,
    pub serial_hex: String,
    pub not_after_ms: i64,
}

/// Writes `bytes` to `path` with mode 0600, atomically (temporary file, fsync, rename).
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), CaError> {
    let io = |source| CaError::Io {
        what: "writing",
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

fn read(path: &Path) -> Result<Option<String>, CaError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CaError::Io {
            what: "reading",
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn random_serial() -> Result<SerialNumber, CaError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|_| CaError::Rng)?;
    b[0] &= 0x7f; // positive
    b[0] |= 0x01; // and never shortened by DER's leading-zero rule
    Ok(SerialNumber::from_slice(&b))
}

fn ms(t: OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

impl Ca {
    /// Loads the CA from `dir`, or creates it (key 0600) on first start.
    pub fn load_or_create(dir: &Path, trust_domain: &str) -> Result<Ca, CaError> {
        std::fs::create_dir_all(dir).map_err(|source| CaError::Io {
            what: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
        let key_path = dir.join("ca.key");
        let cert_path = dir.join("ca.crt");
        let (key, cert_pem) = match (read(&key_path)?, read(&cert_path)?) {
            (Some(k), Some(c)) => (
                KeyPair::from_pem(&k).map_err(|_| CaError::Invalid {
                    what: "CA key",
                    path: key_path.clone(),
                })?,
                c,
            ),
            _ => {
                let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
                let mut p = CertificateParams::default();
                let mut dn = DistinguishedName::new();
                dn.push(
                    DnType::CommonName,
                    format!("Better Compute CA {trust_domain}"),
                );
                dn.push(DnType::OrganizationName, "Better Compute");
                p.distinguished_name = dn;
                p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
                p.key_usages = vec![
                    KeyUsagePurpose::KeyCertSign,
                    KeyUsagePurpose::CrlSign,
                    KeyUsagePurpose::DigitalSignature,
                ];
                let now = OffsetDateTime::now_utc();
                p.not_before = now - BACKDATE;
                p.not_after = now + Duration::days(3650);
                p.serial_number = Some(random_serial()?);
                let cert = p.self_signed(&key)?;
                write_private(&key_path, key.serialize_pem().as_bytes())?;
                write_private(&cert_path, cert.pem().as_bytes())?;
                (key, cert.pem())
            }
        };
        let cert_der = rustls_pemfile_cert(&cert_pem).ok_or_else(|| CaError::Invalid {
            what: "CA certificate",
            path: cert_path.clone(),
        })?;
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)?;
        Ok(Ca {
            issuer,
            cert_der,
            trust_domain: trust_domain.to_string(),
            leaf_lifetime: LEAF_LIFETIME,
        })
    }

    /// The gateways' TLS session-ticket key: derived (HKDF) from this CA's private key and certificate, so every
    /// process holding the CA seals and opens the same tickets, and sealing one (which resumes a session as the node
    /// its certificate names) takes no more than issuing that node a certificate already does.
    pub fn session_tickets(&self) -> bc_proto::tickets::SessionTickets {
        bc_proto::tickets::SessionTickets::new(&self.issuer.key().serialize_der(), &self.cert_der)
    }

    /// Issues workload certificates of `lifetime` instead of 24 h (tests of renewal).
    pub fn with_leaf_lifetime(mut self, lifetime: Duration) -> Ca {
        self.leaf_lifetime = lifetime;
        self
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// `sha256:<hex>` of the CA's SubjectPublicKeyInfo: what nodes pin before they hold the trust bundle.
    pub fn pin(&self) -> String {
        bc_proto::channel::ca_pin_of(&self.cert_der).unwrap_or_default()
    }

    /// A 24 h client certificate for a workload: exactly one SPIFFE URI SAN, random serial, backdated NotBefore.
    pub fn issue_workload(
        &self,
        csr: &VerifiedCsr,
        role: Role,
        id: &str,
        now: OffsetDateTime,
    ) -> Result<Issued, CaError> {
        let spiffe = SpiffeId::new(&self.trust_domain, role, id)
            .map_err(|e| CaError::Rcgen(rcgen::Error::X509(e.to_string())))?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, id);
        p.distinguished_name = dn;
        p.subject_alt_names = vec![SanType::URI(spiffe.to_string().try_into()?)];
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        p.use_authority_key_identifier_extension = true;
        p.not_before = now - BACKDATE;
        p.not_after = now + self.leaf_lifetime;
        let serial = random_serial()?;
        let serial_hex = hex::encode(serial.to_bytes());
        p.serial_number = Some(serial);
        let cert = p.signed_by(&csr.params.public_key, &self.issuer)?;
        Ok(Issued {
            cert_der: cert.der().to_vec(),
            serial_hex,
            not_after_ms: ms(p.not_after),
        })
    }

    /// A client certificate and its fresh key for a control-plane process (`spiffe://<domain>/control/<id>`): how an
    /// API process authenticates to the gateways (the tunnel relay). Valid 30 days, like a gateway's; a process
    /// issues its own at start.
    pub fn issue_control(
        &self,
        id: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), CaError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let spiffe = SpiffeId::new(&self.trust_domain, Role::Control, id)
            .map_err(|e| CaError::Rcgen(rcgen::Error::X509(e.to_string())))?;
        let mut p = CertificateParams::default();
        p.subject_alt_names = vec![SanType::URI(spiffe.to_string().try_into()?)];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("control {id}"));
        p.distinguished_name = dn;
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        p.use_authority_key_identifier_extension = true;
        let now = OffsetDateTime::now_utc();
        p.not_before = now - BACKDATE;
        p.not_after = now + Duration::days(30);
        p.serial_number = Some(random_serial()?);
        let cert = p.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone(), self.cert_der.clone()], key_der))
    }

    /// A fresh gateway server certificate (new key each start) for `hosts` (DNS names or IP addresses), plus the
    /// gateway's SPIFFE ID. Returns the chain (leaf, CA) and the key.
    pub fn issue_gateway(
        &self,
        gateway_id: &str,
        hosts: &[String],
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), CaError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut p = CertificateParams::new(hosts.to_vec())?;
        let spiffe = SpiffeId::new(&self.trust_domain, Role::Gateway, gateway_id)
            .map_err(|e| CaError::Rcgen(rcgen::Error::X509(e.to_string())))?;
        p.subject_alt_names
            .push(SanType::URI(spiffe.to_string().try_into()?));
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("gateway {gateway_id}"));
        p.distinguished_name = dn;
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let now = OffsetDateTime::now_utc();
        p.not_before = now - BACKDATE;
        p.not_after = now + Duration::days(30);
        p.serial_number = Some(random_serial()?);
        let cert = p.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone(), self.cert_der.clone()], key_der))
    }
}

fn rustls_pemfile_cert(pem: &str) -> Option<CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::from_pem_slice(pem.as_bytes()).ok()
}

/// Loads JoinService's HPKE key from `dir/join.key`, or creates it (0600).
pub fn load_or_create_join_key(dir: &Path) -> Result<JoinPrivateKey, CaError> {
    let path = dir.join("join.key");
    match std::fs::read(&path) {
        Ok(bytes) => JoinPrivateKey::from_bytes(&bytes).map_err(|_| CaError::Invalid {
            what: "JoinService key",
            path,
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let (sk, _) = seal::generate_join_keypair();
            write_private(&path, &sk.to_bytes())?;
            Ok(sk)
        }
        Err(source) => Err(CaError::Io {
            what: "reading",
            path,
            source,
        }),
    }
}
