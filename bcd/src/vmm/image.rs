//! Instance images: fetched over HTTP(S) into `<state_dir>/images/sha256/<hex>` through the site agent's verified
//! writer ([`crate::site::cache::write_verified`]: a temporary file hashed as it is written, fsynced and renamed
//! only when its length and SHA-256 match, removed otherwise), so a file under its hash is always complete and
//! verified, and a bad digest leaves nothing behind. The digest, not the transport, is what makes an image trusted;
//! HTTPS is verified against the system's roots or `[vmm] image_ca_file`.
//!
//! Before an instance's disk is made on an image, `qemu-img info` must find it raw or qcow2 with no backing file
//! of its own (a qcow2 naming a backing file could make QEMU open any file of the host) and no larger than the
//! instance's disk. The disk is then a qcow2 overlay (`qemu-img create -b <image> -F <format>`): the image itself
//! is never written, and is shared by every instance made from it.

use bc_proto::v1;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a fetch may go without a response (each chunk then has the writer's own stall limit).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest `qemu-img` may run.
const QEMU_IMG_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {url}: {message}")]
    Fetch { url: String, message: String },
    #[error("image {url}")]
    Verify {
        url: String,
        #[source]
        source: crate::site::cache::FetchError,
    },
    #[error("image {sha256}: {message}")]
    Unfit { sha256: String, message: String },
    #[error("image client: {0}")]
    Client(String),
}

/// The verified images of this node.
#[derive(Clone)]
pub struct ImageStore {
    dir: PathBuf,
    client: reqwest::Client,
    /// One download per digest at a time.
    fetching: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl ImageStore {
    pub fn new(dir: &Path, ca_file: Option<&Path>) -> Result<ImageStore, ImageError> {
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!("bcd/", env!("CARGO_PKG_VERSION")))
            .tls_backend_preconfigured(tls(ca_file)?)
            .build()
            .map_err(|e| ImageError::Client(e.to_string()))?;
        Ok(ImageStore {
            dir: dir.to_path_buf(),
            client,
            fetching: Arc::default(),
        })
    }

    /// Where the image with this digest lives once verified.
    pub fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join("sha256").join(sha256)
    }

    /// The verified image for `(url, sha256)`: from the store, else fetched and verified first.
    pub async fn ensure(&self, url: &str, sha256: &str) -> Result<PathBuf, ImageError> {
        let path = self.path(sha256);
        if path.is_file() {
            return Ok(path);
        }
        let lock = {
            let mut m = self.fetching.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(sha256.to_string()).or_default().clone()
        };
        let _held = lock.lock().await;
        if path.is_file() {
            return Ok(path);
        }
        let fetch_err = |message: String| ImageError::Fetch {
            url: url.to_string(),
            message,
        };
        let resp = tokio::time::timeout(CONNECT_TIMEOUT, self.client.get(url).send())
            .await
            .map_err(|_| {
                fetch_err(format!(
                    "no response within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|e| fetch_err(crate::join::error_chain(&e)))?;
        if !resp.status().is_success() {
            return Err(fetch_err(format!("the server answered {}", resp.status())));
        }
        let size = resp.content_length().ok_or_else(|| {
            fetch_err(
                "the server sent no Content-Length (the size is checked with the digest)".into(),
            )
        })?;
        // The response body as the verified writer's chunk stream.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut resp = resp;
        let pump = tokio::spawn(async move {
            loop {
                let item = match resp.chunk().await {
                    Ok(Some(data)) => Ok(v1::ArtifactChunk {
                        data: data.to_vec(),
                    }),
                    Ok(None) => break,
                    Err(e) => Err(tonic::Status::unavailable(crate::join::error_chain(&e))),
                };
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    break;
                }
            }
        });
        let result = crate::site::cache::write_verified(
            &self.dir,
            sha256,
            size,
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )
        .await;
        pump.abort();
        result.map_err(|source| ImageError::Verify {
            url: url.to_string(),
            source,
        })
    }

    /// Removes an image no instance uses any more.
    pub fn remove(&self, sha256: &str) {
        let path = self.path(sha256);
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(sha256, "image removed: no instance uses it"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(sha256, error = %e, "removing an unused image failed"),
        }
    }
}

fn tls(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, ImageError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| ImageError::Client(format!("{}: {e}", path.display())))?;
            for c in certs {
                roots
                    .add(c)
                    .map_err(|e| ImageError::Client(format!("{}: {e}", path.display())))?;
            }
        }
        None => {
            for c in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(c);
            }
        }
    }
    Ok(
        rustls::ClientConfig::builder_with_provider(Arc::new(bc_proto::tls_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| ImageError::Client(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// What `qemu-img info` says of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: String,
    pub virtual_size: u64,
    pub backing: Option<String>,
}

/// Reads `qemu-img info --output=json` (pure: the JSON text).
pub fn parse_info(json: &str) -> Result<ImageInfo, String> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("qemu-img info: not JSON: {e}"))?;
    let format = v["format"]
        .as_str()
        .ok_or("qemu-img info: no format")?
        .to_string();
    let virtual_size = v["virtual-size"]
        .as_u64()
        .ok_or("qemu-img info: no virtual-size")?;
    let backing = v["backing-filename"]
        .as_str()
        .or_else(|| v["full-backing-filename"].as_str())
        .map(str::to_string);
    Ok(ImageInfo {
        format,
        virtual_size,
        backing,
    })
}

/// Checks that `info` may back a disk of `disk_bytes`: raw or qcow2, no backing file, not larger.
pub fn check_fit(info: &ImageInfo, disk_bytes: u64) -> Result<(), String> {
    if !matches!(info.format.as_str(), "raw" | "qcow2") {
        return Err(format!(
            "format {} is not supported: use raw or qcow2",
            info.format
        ));
    }
    if let Some(b) = &info.backing {
        return Err(format!(
            "it names a backing file ({b:?}); an image must be self-contained (qemu-img convert it)"
        ));
    }
    if info.virtual_size > disk_bytes {
        return Err(format!(
            "its virtual size ({} bytes) exceeds the instance's disk ({disk_bytes} bytes): raise disk_gib",
            info.virtual_size
        ));
    }
    Ok(())
}

async fn qemu_img(qemu_img: &Path, args: &[&std::ffi::OsStr]) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(qemu_img);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(QEMU_IMG_TIMEOUT, cmd.output())
        .await
        .map_err(|_| {
            format!(
                "qemu-img did not finish within {} s",
                QEMU_IMG_TIMEOUT.as_secs()
            )
        })?
        .map_err(|e| format!("running {}: {e}", qemu_img.display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "qemu-img {}: {}",
            args.first()
                .map(|a| a.to_string_lossy())
                .unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Inspects `image` and makes `overlay` (qcow2 of `disk_bytes` backed by it) through a temporary name.
pub async fn make_overlay(
    qemu_img_bin: &Path,
    image: &Path,
    overlay: &Path,
    disk_bytes: u64,
) -> Result<ImageInfo, String> {
    let json = qemu_img(
        qemu_img_bin,
        &["info".as_ref(), "--output=json".as_ref(), image.as_os_str()],
    )
    .await?;
    let info = parse_info(&json)?;
    check_fit(&info, disk_bytes)?;
    let tmp = overlay.with_extension("qcow2.tmp");
    let size = disk_bytes.to_string();
    qemu_img(
        qemu_img_bin,
        &[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-F".as_ref(),
            info.format.as_ref(),
            "-b".as_ref(),
            image.as_os_str(),
            tmp.as_os_str(),
            size.as_ref(),
        ],
    )
    .await?;
    let sync = std::fs::File::open(&tmp).and_then(|f| f.sync_all());
    if let Err(e) = sync.and_then(|()| std::fs::rename(&tmp, overlay)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("moving the overlay into place: {e}"));
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_self_contained_raw_or_qcow2_images_that_fit_are_used() {
        let qcow = parse_info(
            r#"{"virtual-size": 1073741824, "filename": "x", "format": "qcow2", "actual-size": 1}"#,
        )
        .expect("parse");
        assert_eq!(qcow.format, "qcow2");
        assert!(check_fit(&qcow, 1 << 30).is_ok());
        let e = check_fit(&qcow, (1 << 30) - 1).err().unwrap_or_default();
        assert!(e.contains("raise disk_gib"), "{e}");
        let backed = parse_info(
            r#"{"virtual-size": 1, "format": "qcow2", "backing-filename": "/etc/shadow"}"#,
        )
        .expect("parse");
        assert!(
            check_fit(&backed, 1 << 30)
                .err()
                .unwrap_or_default()
                .contains("backing file")
        );
        let vmdk = parse_info(r#"{"virtual-size": 1, "format": "vmdk"}"#).expect("parse");
        assert!(check_fit(&vmdk, 1 << 30).is_err());
        assert!(parse_info("not json").is_err());
        assert!(parse_info(r#"{"format": "raw"}"#).is_err());
    }
}
