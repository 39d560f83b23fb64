//! Provider pools: instances a cloud provider's API makes, with no platform agent in them (DESIGN.md
//! "Instances"). What an operator configures for such a pool ([`ProviderPool`], set with `instances.set-pool`):
//! the provider's endpoint and region, its credentials as a reference to a control-plane secret (never inline),
//! the instance types it offers and which provider image stands for which image digest. What an instance becomes
//! there ([`ProviderPool::launch_for`]: the smallest type that fits, the image, the user data). The provider
//! workflow's decisions are [`workflow::plan`] and [`workflow::after`] (pure, `now` as an argument); EC2's Query
//! API is [`ec2`] (forms and the decoder of its answers, sans I/O).

pub mod ec2;
pub mod workflow;

use crate::api::instances::InstanceRequest;
use serde::{Deserialize, Serialize};

/// Which provider's API a pool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum ProviderKind {
    /// EC2's Query API (signed with SigV4).
    Ec2,
}

/// A control-plane secret, by reference: the site it is stored under and its name (`better-compute secrets put
/// --site <site> <name>`). Its value for EC2 is a JSON object `{"access_key_id": "…", "secret_access_key": "…"}`
/// (and `"session_token"` for temporary credentials), read at each operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    pub site: String,
    pub name: String,
}

/// An instance type a provider pool offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ProviderInstanceType {
    /// The provider's name for it (`t3.micro`).
    pub name: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    #[serde(default)]
    pub gpus: u32,
}

/// A provider image standing for an image digest: an instance asking for `sha256` boots `image_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ProviderImage {
    pub sha256: String,
    pub image_id: String,
}

/// A provider pool's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ProviderPool {
    pub kind: ProviderKind,
    /// The API's base URL (`https://ec2.us-east-1.amazonaws.com`).
    pub endpoint: String,
    pub region: String,
    pub credentials: SecretRef,
    pub instance_types: Vec<ProviderInstanceType>,
    pub images: Vec<ProviderImage>,
}

/// Why a provider pool's configuration is refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("provider.{field}: {why}")]
pub struct InvalidProviderPool {
    pub field: &'static str,
    pub why: String,
}

fn bad(field: &'static str, why: impl Into<String>) -> Result<(), InvalidProviderPool> {
    Err(InvalidProviderPool {
        field,
        why: why.into(),
    })
}

fn token_ok(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'))
}

impl ProviderPool {
    pub fn validate(&self) -> Result<(), InvalidProviderPool> {
        let rest = self
            .endpoint
            .strip_prefix("https://")
            .or_else(|| self.endpoint.strip_prefix("http://"));
        match rest {
            Some(r) if !r.is_empty() && !r.starts_with('/') && !r.contains('@') => {}
            _ => {
                return bad(
                    "endpoint",
                    "must be an http(s) URL with a host and no user info",
                );
            }
        }
        if self.endpoint.len() > 512 || !self.endpoint.bytes().all(|b| b.is_ascii_graphic()) {
            return bad("endpoint", "must be at most 512 printable ASCII characters");
        }
        if self.region.is_empty()
            || self.region.len() > 32
            || !self
                .region
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return bad("region", "must be 1 to 32 of a-z 0-9 -");
        }
        if !crate::reservation::valid_id(&self.credentials.site) {
            return bad(
                "credentials.site",
                "must be a site id (1 to 64 of a-z A-Z 0-9 - _)",
            );
        }
        if !token_ok(&self.credentials.name, 128) {
            return bad(
                "credentials.name",
                "must be 1 to 128 of A-Z a-z 0-9 . _ / -",
            );
        }
        if self.instance_types.is_empty() || self.instance_types.len() > 256 {
            return bad("instance_types", "list 1 to 256 instance types");
        }
        for t in &self.instance_types {
            if !token_ok(&t.name, 64) || t.vcpus == 0 || t.memory_mib == 0 {
                return bad(
                    "instance_types",
                    format!(
                        "{:?}: a name of A-Z a-z 0-9 . _ / - and vcpus, memory_mib above 0",
                        t.name
                    ),
                );
            }
        }
        if self.images.is_empty() || self.images.len() > 256 {
            return bad("images", "list 1 to 256 images");
        }
        for i in &self.images {
            let hex = i.sha256.len() == 64
                && i.sha256
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            if !hex || !token_ok(&i.image_id, 128) {
                return bad(
                    "images",
                    format!(
                        "{:?}: sha256 of 64 lowercase hex digits and a provider image id",
                        i.image_id
                    ),
                );
            }
        }
        Ok(())
    }

    /// What instance request `r` launches in this pool: the smallest instance type with at least its vCPUs,
    /// memory and GPUs, the provider image of its image digest and its user data. An error says what the pool
    /// offers instead.
    pub fn launch_for(&self, r: &InstanceRequest) -> Result<LaunchSpec, String> {
        let fits = self
            .instance_types
            .iter()
            .filter(|t| t.vcpus >= r.vcpus && t.memory_mib >= r.memory_mib && t.gpus >= r.gpus);
        let Some(t) = fits.min_by_key(|t| (t.gpus, t.vcpus, t.memory_mib, t.name.clone())) else {
            let offered: Vec<String> = self
                .instance_types
                .iter()
                .map(|t| {
                    format!(
                        "{} ({} vCPU, {} MiB, {} GPU)",
                        t.name, t.vcpus, t.memory_mib, t.gpus
                    )
                })
                .collect();
            return Err(format!(
                "no instance type of pool {} has {} vCPU, {} MiB and {} GPU(s); it offers {}",
                r.pool,
                r.vcpus,
                r.memory_mib,
                r.gpus,
                offered.join(", ")
            ));
        };
        let Some(image) = self.images.iter().find(|i| i.sha256 == r.image.sha256) else {
            return Err(format!(
                "pool {} has no provider image for image sha256 {}: add one to the pool's images",
                r.pool, r.image.sha256
            ));
        };
        let user_data = match (&r.user_data, r.ssh_keys.is_empty() && r.hostname.is_none()) {
            (Some(u), true) => Some(u.clone()),
            (None, true) => None,
            (None, false) => Some(cloud_config(&r.ssh_keys, r.hostname.as_deref())),
            (Some(_), false) => {
                return Err(
                    "on a provider pool give either user_data or ssh_keys/hostname (they become the user data): \
                     put the keys in your cloud-config"
                        .into(),
                );
            }
        };
        Ok(LaunchSpec {
            instance_type: t.name.clone(),
            image_id: image.image_id.clone(),
            user_data,
        })
    }
}

/// What one instance is launched as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct LaunchSpec {
    pub instance_type: String,
    pub image_id: String,
    pub user_data: Option<String>,
}

/// The cloud-config that carries SSH keys and a host name when the request has no user data of its own (every
/// value JSON-quoted: JSON strings are YAML strings).
pub fn cloud_config(ssh_keys: &[String], hostname: Option<&str>) -> String {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let mut out = String::from("#cloud-config\n");
    if let Some(h) = hostname {
        out.push_str(&format!("hostname: {}\n", q(h)));
    }
    if !ssh_keys.is_empty() {
        out.push_str("ssh_authorized_keys:\n");
        for k in ssh_keys {
            out.push_str(&format!("  - {}\n", q(k)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn pool() -> ProviderPool {
        serde_json::from_value(serde_json::json!({
            "kind": "ec2", "endpoint": "http://127.0.0.1:5000", "region": "us-east-1",
            "credentials": {"site": "aws", "name": "ec2/lab"},
            "instance_types": [{"name": "t3.large", "vcpus": 2, "memory_mib": 8192},
                               {"name": "t3.micro", "vcpus": 2, "memory_mib": 1024},
                               {"name": "g5.xlarge", "vcpus": 4, "memory_mib": 16384, "gpus": 1}],
            "images": [{"sha256": "ab".repeat(32), "image_id": "ami-12c6146b"}]
        }))
        .expect("pool")
    }

    fn request() -> InstanceRequest {
        serde_json::from_value(serde_json::json!({
            "tenant": "t", "pool": "ec2", "vcpus": 2, "memory_mib": 1024, "disk_gib": 10,
            "image": {"url": "http://127.0.0.1:8080/img.qcow2", "sha256": "ab".repeat(32)}
        }))
        .expect("request")
    }

    #[test]
    fn the_smallest_type_that_fits_and_the_image_of_the_digest() {
        let p = pool();
        assert_eq!(p.validate(), Ok(()));
        let l = p.launch_for(&request()).expect("fits");
        assert_eq!(
            (l.instance_type.as_str(), l.image_id.as_str()),
            ("t3.micro", "ami-12c6146b")
        );
        assert_eq!(l.user_data, None);
        let mut r = request();
        r.memory_mib = 2048;
        assert_eq!(p.launch_for(&r).expect("fits").instance_type, "t3.large");
        r.gpus = 1;
        assert_eq!(p.launch_for(&r).expect("fits").instance_type, "g5.xlarge");
        r.vcpus = 64;
        assert!(
            p.launch_for(&r)
                .expect_err("none")
                .contains("it offers t3.large")
        );
        let mut r = request();
        r.image.sha256 = "cd".repeat(32);
        assert!(
            p.launch_for(&r)
                .expect_err("no image")
                .contains("no provider image")
        );
        let mut r = request();
        r.ssh_keys = vec!["ssh-ed25519 AAAA ops".into()];
        r.hostname = Some("web-1".into());
        let u = p
            .launch_for(&r)
            .expect("fits")
            .user_data
            .expect("cloud-config");
        assert_eq!(
            u,
            "#cloud-config\nhostname: \"web-1\"\nssh_authorized_keys:\n  - \"ssh-ed25519 AAAA ops\"\n"
        );
        r.user_data = Some("#cloud-config {}".into());
        assert!(p.launch_for(&r).is_err());
    }

    #[test]
    fn a_bad_pool_names_the_field() {
        let mut p = pool();
        p.endpoint = "ftp://x".into();
        assert_eq!(p.validate().map_err(|e| e.field), Err("endpoint"));
        let mut p = pool();
        p.credentials.name = "a b".into();
        assert_eq!(p.validate().map_err(|e| e.field), Err("credentials.name"));
        let mut p = pool();
        p.images[0].sha256 = "AB".repeat(32);
        assert_eq!(p.validate().map_err(|e| e.field), Err("images"));
        let mut p = pool();
        p.instance_types.clear();
        assert_eq!(p.validate().map_err(|e| e.field), Err("instance_types"));
    }
}
