//! The `instances` list of a node's desired state: what the control plane wants this node to run. Parsed strictly
//! (unknown fields, wrong types and bad values are errors naming the field, e.g. `instances[1].memory_mib`), so a
//! malformed document fails its generation with a reason instead of half-applying. Pure: [`parse`] takes the spec
//! JSON, [`InstanceSpec::immutable_change`] compares two versions of one instance.
//!
//! ```json
//! {"instances": [{"id": "inst-7", "generation": 3, "vcpus": 2, "memory_mib": 2048, "disk_gib": 20,
//!   "image": {"url": "https://artifacts.example/debian-12.qcow2", "sha256": "<64 hex>"},
//!   "user_data": "#cloud-config\n…", "meta": {"ssh_keys": ["ssh-ed25519 AAAA… ops"], "hostname": "web-1"},
//!   "gpus": ["GPU-…"], "power": "running", "reboots": 0}]}
//! ```

use serde::{Deserialize, Serialize};

/// The most instances one desired state may list.
pub const MAX_INSTANCES: usize = 256;
/// The largest user-data accepted (bytes); cloud-init itself has no limit, EC2's is 16 KiB.
pub const MAX_USER_DATA: usize = 256 * 1024;
/// The most SSH keys per instance.
pub const MAX_SSH_KEYS: usize = 32;
/// The longest instance id: it names a directory, a QMP socket and (hashed) a tap device.
pub const MAX_ID_LEN: usize = 63;

/// The power state the control plane wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Power {
    Running,
    Stopped,
}

/// The image an instance's disk is an overlay on: fetched from `url` and used only if it hashes to `sha256`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageRef {
    /// `https://` (or `http://`: the digest, not the transport, is what makes the image trusted).
    pub url: String,
    /// Lowercase hex SHA-256 of the file as served (raw or qcow2).
    pub sha256: String,
}

/// What cloud-init's meta-data carries besides the instance id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// OpenSSH public keys for the image's default user.
    #[serde(default)]
    pub ssh_keys: Vec<String>,
    /// The guest's hostname (default: the instance id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

/// One instance as the desired state lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceSpec {
    pub id: String,
    /// Increases with every change the control plane makes to this instance; reported back once acted on.
    pub generation: u64,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    pub image: ImageRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    #[serde(default)]
    pub meta: Meta,
    /// UUIDs of GPUs of this node passed through with VFIO (their whole IOMMU groups).
    #[serde(default)]
    pub gpus: Vec<String>,
    pub power: Power,
    /// A counter: each increase asks for one reset of the running VM (`instances.reboot`).
    #[serde(default)]
    pub reboots: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("desired state: {field}: {message}")]
pub struct SpecError {
    /// Where in the document, e.g. `instances[0].image.sha256`.
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError {
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Deserialize)]
struct Wire {
    #[serde(default)]
    instances: Option<Vec<InstanceSpec>>,
}

/// The instances of a desired-state spec (absent or null means none). Strict: see the module documentation.
pub fn parse(spec: &serde_json::Value) -> Result<Vec<InstanceSpec>, SpecError> {
    let Some(list) = spec.get("instances") else {
        return Ok(Vec::new());
    };
    if list.is_null() {
        return Ok(Vec::new());
    }
    // Only the `instances` member is read here (the rest of the document belongs to other parts of bcd).
    let wire = serde_json::json!({ "instances": list });
    let parsed: Wire = serde_path_to_error::deserialize(&wire).map_err(|e| {
        let path = e.path().to_string();
        err(path, e.inner().to_string())
    })?;
    let instances = parsed.instances.unwrap_or_default();
    if instances.len() > MAX_INSTANCES {
        return Err(err(
            "instances",
            format!("{} instances; at most {MAX_INSTANCES}", instances.len()),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, inst) in instances.iter().enumerate() {
        inst.validate(&format!("instances[{i}]"))?;
        if !seen.insert(inst.id.as_str()) {
            return Err(err(
                format!("instances[{i}].id"),
                format!("{:?} is listed twice", inst.id),
            ));
        }
    }
    Ok(instances)
}

/// An instance id: 1–63 of `a-z 0-9 -`, starting with a letter or digit (it names files and devices).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && id.as_bytes()[0] != b'-'
}

/// A hostname: RFC 1123 labels of `a-z 0-9 -`, at most 63 characters in all (cloud-init sets it as given).
fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 63
        && h.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

/// An OpenSSH public key line: `<type> <base64> [comment]`, printable ASCII only (it lands in YAML and in
/// authorized_keys).
fn valid_ssh_key(k: &str) -> bool {
    let printable = k.bytes().all(|b| (0x20..0x7f).contains(&b));
    let mut parts = k.split(' ');
    let kind = parts.next().unwrap_or_default();
    let blob = parts.next().unwrap_or_default();
    printable
        && k.len() <= 16 * 1024
        && (kind.starts_with("ssh-") || kind.starts_with("ecdsa-") || kind.starts_with("sk-"))
        && blob.len() >= 16
        && blob
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
}

impl InstanceSpec {
    fn validate(&self, at: &str) -> Result<(), SpecError> {
        let f = |name: &str| format!("{at}.{name}");
        if !valid_id(&self.id) {
            return Err(err(
                f("id"),
                format!(
                    "{:?} must be 1–{MAX_ID_LEN} characters of a-z, 0-9 and '-', not starting with '-'",
                    self.id.chars().take(80).collect::<String>()
                ),
            ));
        }
        if self.generation == 0 {
            return Err(err(f("generation"), "must be at least 1"));
        }
        if !(1..=256).contains(&self.vcpus) {
            return Err(err(f("vcpus"), format!("{} is not in 1..=256", self.vcpus)));
        }
        if !(64..=4 * 1024 * 1024).contains(&self.memory_mib) {
            return Err(err(
                f("memory_mib"),
                format!("{} is not in 64..=4194304 (MiB)", self.memory_mib),
            ));
        }
        if !(1..=65_536).contains(&self.disk_gib) {
            return Err(err(
                f("disk_gib"),
                format!("{} is not in 1..=65536 (GiB)", self.disk_gib),
            ));
        }
        let url = check_url(&self.image.url);
        if let Err(why) = url {
            return Err(err(f("image.url"), why));
        }
        if !crate::vmm::is_sha256_hex(&self.image.sha256) {
            return Err(err(
                f("image.sha256"),
                "must be 64 lowercase hex characters (the SHA-256 of the image file)",
            ));
        }
        if let Some(u) = &self.user_data {
            if u.len() > MAX_USER_DATA {
                return Err(err(
                    f("user_data"),
                    format!("{} bytes; at most {MAX_USER_DATA}", u.len()),
                ));
            }
            if u.contains('\0') {
                return Err(err(f("user_data"), "contains a NUL byte"));
            }
        }
        if self.meta.ssh_keys.len() > MAX_SSH_KEYS {
            return Err(err(
                f("meta.ssh_keys"),
                format!("{} keys; at most {MAX_SSH_KEYS}", self.meta.ssh_keys.len()),
            ));
        }
        for (k, key) in self.meta.ssh_keys.iter().enumerate() {
            if !valid_ssh_key(key) {
                return Err(err(
                    f(&format!("meta.ssh_keys[{k}]")),
                    "is not an OpenSSH public key line (`ssh-ed25519 AAAA… comment`, printable ASCII)",
                ));
            }
        }
        if let Some(h) = &self.meta.hostname
            && !valid_hostname(h)
        {
            return Err(err(
                f("meta.hostname"),
                format!(
                    "{:?} is not a hostname (labels of a-z, 0-9 and '-', at most 63 characters)",
                    h.chars().take(80).collect::<String>()
                ),
            ));
        }
        let mut gpus = std::collections::BTreeSet::new();
        for (g, uuid) in self.gpus.iter().enumerate() {
            let ok = !uuid.is_empty()
                && uuid.len() <= 128
                && uuid
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
            if !ok {
                return Err(err(f(&format!("gpus[{g}]")), "is not a GPU UUID"));
            }
            if !gpus.insert(uuid) {
                return Err(err(
                    f(&format!("gpus[{g}]")),
                    format!("{uuid} is listed twice"),
                ));
            }
        }
        Ok(())
    }

    /// The hostname the guest gets.
    pub fn hostname(&self) -> &str {
        self.meta.hostname.as_deref().unwrap_or(&self.id)
    }

    /// The first field that differs from `created` and cannot change on an existing instance (its disk and seed
    /// were made from them): `image`, `disk_gib`, `user_data`, `meta`. vCPUs, memory and GPUs may change: they
    /// take effect at the next start.
    pub fn immutable_change(&self, created: &InstanceSpec) -> Option<&'static str> {
        if self.image != created.image {
            Some("image")
        } else if self.disk_gib != created.disk_gib {
            Some("disk_gib")
        } else if self.user_data != created.user_data {
            Some("user_data")
        } else if self.meta != created.meta {
            Some("meta")
        } else {
            None
        }
    }
}

/// `http://` or `https://` with a host, no user info, no whitespace.
fn check_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| "must be an http:// or https:// URL".to_string())?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if host.is_empty() || host.contains('@') {
        return Err("must name a host (and no user:password@)".into());
    }
    if url.len() > 2048 || url.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err("must be at most 2048 printable characters without spaces".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn one() -> serde_json::Value {
        json!({
            "id": "inst-1", "generation": 1, "vcpus": 2, "memory_mib": 512, "disk_gib": 4,
            "image": {"url": "http://127.0.0.1:1/i.qcow2", "sha256": "a".repeat(64)},
            "meta": {"ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBc ops@example"]},
            "power": "running"
        })
    }

    fn field_of(v: serde_json::Value) -> String {
        parse(&json!({ "instances": [v] }))
            .err()
            .map(|e| e.field)
            .unwrap_or_else(|| "parsed".into())
    }

    #[test]
    fn a_full_instance_parses_and_absent_means_none() {
        let list =
            parse(&json!({"version": 1, "bookings": [], "instances": [one()]})).expect("parses");
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].power, Power::Running);
        assert_eq!(list[0].hostname(), "inst-1");
        assert_eq!(list[0].reboots, 0);
        assert!(parse(&json!({"bookings": []})).expect("none").is_empty());
        assert!(parse(&json!({"instances": null})).expect("none").is_empty());
    }

    #[test]
    fn every_rejection_names_its_field() {
        type Edit = Box<dyn Fn(&mut serde_json::Value)>;
        let cases: Vec<(&str, Edit)> = vec![
            (
                "instances[0].colour",
                Box::new(|v| v["colour"] = json!("red")),
            ),
            (
                "instances[0].vcpus",
                Box::new(|v| v["vcpus"] = json!("two")),
            ),
            ("instances[0].vcpus", Box::new(|v| v["vcpus"] = json!(0))),
            (
                "instances[0].memory_mib",
                Box::new(|v| v["memory_mib"] = json!(1)),
            ),
            (
                "instances[0].disk_gib",
                Box::new(|v| v["disk_gib"] = json!(0)),
            ),
            ("instances[0].id", Box::new(|v| v["id"] = json!("../etc"))),
            (
                "instances[0].id",
                Box::new(|v| v["id"] = json!("x".repeat(64))),
            ),
            (
                "instances[0].generation",
                Box::new(|v| v["generation"] = json!(0)),
            ),
            (
                "instances[0].image.sha256",
                Box::new(|v| v["image"]["sha256"] = json!("AB")),
            ),
            (
                "instances[0].image.url",
                Box::new(|v| v["image"]["url"] = json!("file:///etc/shadow")),
            ),
            (
                "instances[0].image.url",
                Box::new(|v| v["image"]["url"] = json!("https://u:p@h/x")),
            ),
            (
                "instances[0].image.size",
                Box::new(|v| v["image"]["size"] = json!(1)),
            ),
            (
                "instances[0].power",
                Box::new(|v| v["power"] = json!("paused")),
            ),
            (
                "instances[0].meta.ssh_keys[0]",
                Box::new(|v| v["meta"]["ssh_keys"] = json!(["ssh-rsa AAAA\nroot"])),
            ),
            (
                "instances[0].meta.hostname",
                Box::new(|v| v["meta"]["hostname"] = json!("Bad_Host")),
            ),
            (
                "instances[0].gpus[1]",
                Box::new(|v| v["gpus"] = json!(["GPU-1", "GPU-1"])),
            ),
            (
                "instances[0].user_data",
                Box::new(|v| v["user_data"] = json!("a\u{0}b")),
            ),
            (
                "instances[0]",
                Box::new(|v| {
                    v.as_object_mut().map(|o| o.remove("power"));
                }),
            ),
        ];
        for (want, edit) in cases {
            let mut v = one();
            edit(&mut v);
            let got = field_of(v.clone());
            assert_eq!(got, want, "for {v}");
        }
        let twice = parse(&json!({"instances": [one(), one()]}))
            .err()
            .map(|e| e.field);
        assert_eq!(twice.as_deref(), Some("instances[1].id"));
        let e = parse(&json!({"instances": {"id": 1}}))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.starts_with("desired state: instances:"), "{e}");
    }

    #[test]
    fn only_disk_shaping_fields_are_immutable() {
        let a: InstanceSpec = serde_json::from_value(one()).expect("spec");
        let mut b = a.clone();
        b.vcpus = 4;
        b.memory_mib = 4096;
        b.power = Power::Stopped;
        b.generation = 7;
        assert_eq!(b.immutable_change(&a), None);
        b.disk_gib = 8;
        assert_eq!(b.immutable_change(&a), Some("disk_gib"));
        let mut c = a.clone();
        c.user_data = Some("#cloud-config\n".into());
        assert_eq!(c.immutable_change(&a), Some("user_data"));
    }
}
