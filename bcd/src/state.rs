//! The node's state directory (default `/var/lib/bcd`, 0700): `node.key` (PKCS#8 PEM, 0600, created before any
//! network call and reused on every retry), `node.crt`, `bundle.pem` (the CAs the node trusts) and `node.json`.
//! Every file is written to a temporary name, synced and renamed, so a crash leaves the old or the new file.

use rcgen::KeyPair;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use serde::{Deserialize, Serialize};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid {what}; move it away to start over")]
    Invalid { what: &'static str, path: PathBuf },
    #[error("generating the node key")]
    KeyGen(#[source] rcgen::Error),
}

/// What the node knows about its identity after a join.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeIdentity {
    pub node_id: String,
    pub spiffe_id: String,
    pub pool: String,
    pub gateway_url: String,
    pub not_after_ms: i64,
    /// When the node received its current certificate (renewal is scheduled from here, not from the backdated
    /// NotBefore).
    #[serde(default)]
    pub issued_at_ms: i64,
}

pub struct StateDir {
    dir: PathBuf,
}

/// The key of a rejoin in progress.
const NEXT_KEY: &str = "node.key.next";

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// PEM-encodes DER under `label`.
pub fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

impl StateDir {
    pub fn open(dir: &Path) -> Result<StateDir, StateError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("creating", dir))?;
        Ok(StateDir {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory itself.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes a file in the state directory atomically.
    pub fn write_file(&self, name: &str, bytes: &[u8], mode: u32) -> Result<(), StateError> {
        self.write(name, bytes, mode)
    }

    fn write(&self, name: &str, bytes: &[u8], mode: u32) -> Result<(), StateError> {
        let path = self.path(name);
        let tmp = self.path(&format!(".{name}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(mode)
            .open(&tmp)
            .map_err(io("writing", &tmp))?;
        f.write_all(bytes).map_err(io("writing", &tmp))?;
        f.sync_all().map_err(io("syncing", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(io("renaming into", &path))?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// The node key: loaded if present, else generated and persisted (0600) before it is used.
    pub fn load_or_create_key(&self) -> Result<KeyPair, StateError> {
        let path = self.path("node.key");
        match std::fs::read_to_string(&path) {
            Ok(pem) => KeyPair::from_pem(&pem).map_err(|_| StateError::Invalid {
                what: "node key",
                path,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                    .map_err(StateError::KeyGen)?;
                self.write("node.key", key.serialize_pem().as_bytes(), 0o600)?;
                Ok(key)
            }
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    /// The key a rejoin uses (`node.key.next`, 0600): loaded if present, else generated and persisted before it is
    /// used, so a retry after a crash sends the same key. It becomes `node.key` when the new certificate is stored.
    pub fn load_or_create_next_key(&self) -> Result<KeyPair, StateError> {
        let path = self.path(NEXT_KEY);
        match std::fs::read_to_string(&path) {
            Ok(pem) => KeyPair::from_pem(&pem).map_err(|_| StateError::Invalid {
                what: "node key",
                path,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                    .map_err(StateError::KeyGen)?;
                self.write(NEXT_KEY, key.serialize_pem().as_bytes(), 0o600)?;
                Ok(key)
            }
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    /// Stores a rejoin's results (certificate, trust bundle, identity), then makes `node.key.next` the node key.
    pub fn store_rejoin(
        &self,
        cert_der: &[u8],
        bundle: &[Vec<u8>],
        identity: &NodeIdentity,
    ) -> Result<(), StateError> {
        self.store_join(cert_der, bundle, identity)?;
        self.promote_next_key()
    }

    /// Completes a rejoin interrupted between storing the certificate and promoting its key: when `node.key.next`
    /// exists and `node.crt` certifies it, it becomes `node.key`. Returns whether it did.
    pub fn finish_rejoin(&self) -> Result<bool, StateError> {
        let path = self.path(NEXT_KEY);
        let Ok(pem) = std::fs::read_to_string(&path) else {
            return Ok(false);
        };
        let Ok(next) = KeyPair::from_pem(&pem) else {
            return Ok(false);
        };
        let certified = self
            .certificate()
            .ok()
            .and_then(|c| bc_proto::envelope::cert_public_point(&c).ok());
        if certified.as_deref() != Some(next.public_key_raw()) {
            return Ok(false);
        }
        self.promote_next_key()?;
        Ok(true)
    }

    fn promote_next_key(&self) -> Result<(), StateError> {
        let next = self.path(NEXT_KEY);
        let key = self.path("node.key");
        std::fs::rename(&next, &key).map_err(io("renaming into", &key))?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Stores the results of a join: certificate, trust bundle, identity (identity last: its presence means joined).
    pub fn store_join(
        &self,
        cert_der: &[u8],
        bundle: &[Vec<u8>],
        identity: &NodeIdentity,
    ) -> Result<(), StateError> {
        self.write("node.crt", pem("CERTIFICATE", cert_der).as_bytes(), 0o644)?;
        let bundle_pem: String = bundle.iter().map(|c| pem("CERTIFICATE", c)).collect();
        self.write("bundle.pem", bundle_pem.as_bytes(), 0o644)?;
        let json = serde_json::to_vec_pretty(identity).map_err(|e| StateError::Io {
            what: "encoding",
            path: self.path("node.json"),
            source: std::io::Error::other(e),
        })?;
        self.write("node.json", &json, 0o644)
    }

    pub fn identity(&self) -> Result<Option<NodeIdentity>, StateError> {
        let path = self.path("node.json");
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|_| StateError::Invalid {
                    what: "node identity",
                    path,
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    pub fn certificate(&self) -> Result<CertificateDer<'static>, StateError> {
        let path = self.path("node.crt");
        CertificateDer::from_pem_file(&path).map_err(|_| StateError::Invalid {
            what: "certificate",
            path,
        })
    }

    pub fn trust_bundle(&self) -> Result<Vec<CertificateDer<'static>>, StateError> {
        let path = self.path("bundle.pem");
        CertificateDer::pem_file_iter(&path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|_| StateError::Invalid {
                what: "trust bundle",
                path,
            })
    }
}
