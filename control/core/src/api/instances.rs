//! The typed requests and responses of the instances module's methods
//! (`instances.create|show|list|stop|start|reboot|delete` and `instances.set-pool`), shared by its handlers and
//! the CLI's client, and the pure decisions they rest on: the request's validation (the same limits bcd's
//! desired-state parser applies, so a request the API admits is one the node accepts), its body hash for
//! idempotency, and which node of a hosted pool an instance fits on ([`choose_node`]).

use crate::ids::{NodeId, TenantId};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The image an instance's disk is an overlay on: fetched by the node over HTTP(S) and trusted by its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct InstanceImage {
    pub url: String,
    /// SHA-256 of the file as served, 64 lowercase hex.
    pub sha256: String,
}

/// What an instance is: everything but its idempotency key. Its [`InstanceRequest::body_hash`] tells a replay
/// from a conflicting reuse of a key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct InstanceRequest {
    pub tenant: String,
    /// The pool to run in: a `vps-host` pool's nodes run it (`instances.set-pool`).
    pub pool: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_gib: u32,
    /// GPUs passed through to the VM (whole devices).
    #[serde(default)]
    pub gpus: u32,
    pub image: InstanceImage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

/// Why a request is not one an instance can be made from; the message names the field and its limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct InvalidInstance {
    pub field: &'static str,
    pub why: String,
}

fn invalid(field: &'static str, why: impl Into<String>) -> Result<(), InvalidInstance> {
    Err(InvalidInstance {
        field,
        why: why.into(),
    })
}

fn range(field: &'static str, v: u32, lo: u32, hi: u32, unit: &str) -> Result<(), InvalidInstance> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        invalid(field, format!("{v} is not in {lo}..={hi}{unit}"))
    }
}

/// A host name as bcd takes it: RFC 1123 labels of `a-z 0-9 -`, not starting or ending with `-`, at most 63
/// characters in all.
fn hostname_ok(h: &str) -> bool {
    h.len() <= 63
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

/// An OpenSSH public key line as bcd takes it: `<type> <base64> [comment]` of printable ASCII, at most 16 KiB, the
/// type `ssh-…`, `ecdsa-…` or `sk-…` and the key at least 16 base64 characters. bcd's desired-state parser
/// (`bcd::vmm::spec`) applies the same rule; the `instance_request` fuzz target holds the two together (a key the
/// API admitted and the node refused failed the node's whole desired state).
fn ssh_key_ok(k: &str) -> bool {
    let mut parts = k.split(' ');
    let kind = parts.next().unwrap_or_default();
    let blob = parts.next().unwrap_or_default();
    k.len() <= 16 * 1024
        && k.bytes().all(|b| (0x20..0x7f).contains(&b))
        && ["ssh-", "ecdsa-", "sk-"]
            .iter()
            .any(|p| kind.starts_with(p))
        && blob.len() >= 16
        && blob
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
}

impl InstanceRequest {
    /// The limits of bcd's desired-state parser (docs/instances.md), checked before anything is recorded.
    pub fn validate(&self) -> Result<(), InvalidInstance> {
        if !crate::reservation::valid_id(&self.tenant) {
            return invalid("tenant", "must be 1 to 64 of a-z A-Z 0-9 - _");
        }
        if !crate::reservation::valid_id(&self.pool) {
            return invalid("pool", "must be 1 to 64 of a-z A-Z 0-9 - _");
        }
        range("vcpus", self.vcpus, 1, 256, "")?;
        range("memory_mib", self.memory_mib, 64, 4_194_304, " (MiB)")?;
        range("disk_gib", self.disk_gib, 1, 65_536, " (GiB)")?;
        range("gpus", self.gpus, 0, 16, "")?;
        let url = &self.image.url;
        let rest = url
            .strip_prefix("https://")
            .or_else(|| url.strip_prefix("http://"));
        match rest {
            // The host ends at the first `/`, `?` or `#`, as bcd reads it.
            Some(r)
                if !r
                    .split(['/', '?', '#'])
                    .next()
                    .unwrap_or_default()
                    .is_empty() =>
            {
                let authority = r.split(['/', '?', '#']).next().unwrap_or_default();
                if authority.contains('@') {
                    return invalid("image.url", "must carry no user info");
                }
                if url.len() > 2048 || !url.bytes().all(|b| b.is_ascii_graphic()) {
                    return invalid(
                        "image.url",
                        "must be at most 2048 printable ASCII characters",
                    );
                }
            }
            _ => {
                return invalid(
                    "image.url",
                    format!("{url:?} is not an http(s) URL with a host"),
                );
            }
        }
        let sha = &self.image.sha256;
        if sha.len() != 64
            || !sha
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return invalid(
                "image.sha256",
                "must be 64 lowercase hex digits (the image file's SHA-256)",
            );
        }
        if let Some(u) = &self.user_data {
            if u.len() > 256 * 1024 {
                return invalid("user_data", "exceeds 256 KiB");
            }
            if u.contains('\0') {
                return invalid("user_data", "contains a NUL byte");
            }
        }
        if self.ssh_keys.len() > 32 {
            return invalid(
                "ssh_keys",
                format!("{} keys: at most 32", self.ssh_keys.len()),
            );
        }
        if let Some(k) = self.ssh_keys.iter().find(|k| !ssh_key_ok(k)) {
            return invalid(
                "ssh_keys",
                format!(
                    "{:?} is not one OpenSSH public key line (`ssh-ed25519 AAAA… comment`, printable ASCII)",
                    k.chars().take(40).collect::<String>()
                ),
            );
        }
        if let Some(h) = &self.hostname
            && !hostname_ok(h)
        {
            return invalid("hostname", format!("{h:?} is not an RFC 1123 host name"));
        }
        Ok(())
    }

    /// SHA-256 (hex) of the canonical request.
    pub fn body_hash(&self) -> String {
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(Sha256::digest(&canonical))
    }
}

/// `instances.create`: an [`InstanceRequest`] and, optionally, the caller's idempotency key (one key and one body
/// replay the instance it created; the same key with another body is CONFLICT).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateInstance {
    pub tenant: String,
    pub pool: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_gib: u32,
    #[serde(default)]
    pub gpus: u32,
    pub image: InstanceImage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// 1 to 128 printable ASCII characters; the instance's id when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl CreateInstance {
    /// The request without its idempotency key.
    pub fn request(&self) -> InstanceRequest {
        InstanceRequest {
            tenant: self.tenant.clone(),
            pool: self.pool.clone(),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            disk_gib: self.disk_gib,
            gpus: self.gpus,
            image: self.image.clone(),
            user_data: self.user_data.clone(),
            ssh_keys: self.ssh_keys.clone(),
            hostname: self.hostname.clone(),
        }
    }

    /// Whether the idempotency key, if any, is 1 to 128 printable ASCII characters.
    pub fn key_is_valid(&self) -> bool {
        self.idempotency_key.as_ref().is_none_or(|k| {
            !k.is_empty() && k.len() <= 128 && k.bytes().all(|b| b.is_ascii_graphic())
        })
    }
}

/// `instances.show|stop|start|reboot|delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct InstanceById {
    pub id: String,
}

/// `instances.list`: a tenant's instances (the caller's own tenant when absent, every tenant's for a root caller),
/// newest first, deleted ones only with `deleted`, at most `limit` (1 to 1000, default 100).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListInstances {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default)]
    pub deleted: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
}

/// Where an instance stands in the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Admitted (tx 1), not placed yet.
    Pending,
    /// Placed on a node: in its desired state.
    Placed,
    /// Not placed (no capacity), or lost (its node revoked, its provider instance gone): the reason is in
    /// `error`; nothing is held.
    Failed,
    /// Deleted, not confirmed yet: off its node's desired state (or being terminated by its provider) and still
    /// holding its atoms until the node reports the VM gone (or the provider the instance terminated).
    Deleting,
    /// Deleted: the node confirmed the VM gone (or the provider the instance), its atoms back in the pool.
    Deleted,
}

impl InstanceState {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Pending => "pending",
            InstanceState::Placed => "placed",
            InstanceState::Failed => "failed",
            InstanceState::Deleting => "deleting",
            InstanceState::Deleted => "deleted",
        }
    }

    pub fn parse(s: &str) -> Option<InstanceState> {
        [
            InstanceState::Pending,
            InstanceState::Placed,
            InstanceState::Failed,
            InstanceState::Deleting,
            InstanceState::Deleted,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }
}

/// The power an instance should have (its node starts or stops the VM to match).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Power {
    Running,
    Stopped,
}

impl Power {
    pub fn as_str(self) -> &'static str {
        match self {
            Power::Running => "running",
            Power::Stopped => "stopped",
        }
    }

    pub fn parse(s: &str) -> Option<Power> {
        match s {
            "running" => Some(Power::Running),
            "stopped" => Some(Power::Stopped),
            _ => None,
        }
    }
}

/// What the node last reported about the instance (its `instances` inventory section), if anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ObservedInstance {
    /// The instance generation the report is about.
    pub generation: i64,
    /// `starting`, `running`, `stopping`, `stopped`, `failed` or `deleting`, as bcd reports it.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default)]
    pub cloud_init_done: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<String>,
    /// On a provider pool: the provider's id of the instance (`i-…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<String>,
}

/// An instance as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Instance {
    pub id: String,
    pub tenant: TenantId,
    pub principal: String,
    pub state: InstanceState,
    pub request: InstanceRequest,
    /// The node it runs on, once placed (none on a provider pool).
    pub node: Option<NodeId>,
    /// That node's lifecycle state when it is not `adopted` (`draining`, `failed`, `revoked`): the instance still
    /// runs there (a revoked node's instances fail), and nothing new is placed there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_state: Option<String>,
    /// UUIDs of the GPUs booked for it on that node.
    pub gpus: Vec<String>,
    pub power: Power,
    /// How many reboots were asked for (each increase resets the running VM once).
    pub reboots: i64,
    /// Raised with every change to the instance's desired state.
    pub generation: i64,
    /// Why it was not placed.
    pub error: Option<String>,
    /// The node's report, when it has sent one for this instance.
    pub observed: Option<ObservedInstance>,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub deleted_at_ms: Option<i64>,
}

/// The answer of `create`, `show`, `stop`, `start`, `reboot` and `delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct InstanceAnswer {
    pub instance: Instance,
}

/// The answer of `list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct InstanceList {
    pub instances: Vec<Instance>,
}

/// What a pool's nodes are for, as far as instances go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum PoolClass {
    /// Its nodes run bcd with `[vmm]` and host the instances placed on them.
    VpsHost,
    /// A cloud provider's API makes the instances; no platform agent runs in them.
    Provider,
}

impl PoolClass {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolClass::VpsHost => "vps-host",
            PoolClass::Provider => "provider",
        }
    }

    pub fn parse(s: &str) -> Option<PoolClass> {
        match s {
            "vps-host" => Some(PoolClass::VpsHost),
            "provider" => Some(PoolClass::Provider),
            _ => None,
        }
    }
}

/// `instances.set-pool`: makes an existing pool a hosted (`vps-host`) or provider pool; a provider pool needs its
/// `provider` configuration (a hosted one takes none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SetInstancePool {
    pub pool: String,
    pub class: PoolClass,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<crate::provider::ProviderPool>,
}

impl SetInstancePool {
    /// A provider pool's configuration is present and valid; a hosted pool has none.
    pub fn validate(&self) -> Result<(), String> {
        match (self.class, &self.provider) {
            (PoolClass::VpsHost, None) => Ok(()),
            (PoolClass::VpsHost, Some(_)) => {
                Err("provider: a vps-host pool takes no provider configuration".into())
            }
            (PoolClass::Provider, None) => Err(
                "provider: a provider pool needs its configuration (kind, endpoint, region, credentials, \
                 instance_types, images)"
                    .into(),
            ),
            (PoolClass::Provider, Some(p)) => p.validate().map_err(|e| e.to_string()),
        }
    }
}

/// The answer of `set-pool`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct InstancePool {
    pub pool: String,
    pub class: PoolClass,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<crate::provider::ProviderPool>,
}

// === the node's desired state ===

/// One instance as the node's desired state lists it (the contract of docs/instances.md).
pub fn desired_entry(
    id: &str,
    generation: i64,
    r: &InstanceRequest,
    gpus: serde_json::Value,
    power: &str,
    reboots: i64,
) -> serde_json::Value {
    let mut v = placement_entry(id, r, gpus);
    v["generation"] = serde_json::json!(generation);
    v["power"] = serde_json::json!(power);
    v["reboots"] = serde_json::json!(reboots);
    v
}

/// What a placement appends to the node's desired `instances`: [`desired_entry`] without the fields the instance's
/// row holds (`generation`, `power`, `reboots`), which the placement's statement adds from the row it wrote.
pub fn placement_entry(
    id: &str,
    r: &InstanceRequest,
    gpus: serde_json::Value,
) -> serde_json::Value {
    let mut meta = serde_json::json!({ "ssh_keys": r.ssh_keys });
    if let Some(h) = &r.hostname {
        meta["hostname"] = serde_json::json!(h);
    }
    let mut v = serde_json::json!({
        "id": id,
        "vcpus": r.vcpus,
        "memory_mib": r.memory_mib,
        "disk_gib": r.disk_gib,
        "image": {"url": r.image.url, "sha256": r.image.sha256},
        "meta": meta,
        "gpus": gpus,
    });
    if let Some(u) = &r.user_data {
        v["user_data"] = serde_json::json!(u);
    }
    v
}

// === placement ===

/// A hosted-pool node's free atoms: what its inventory advertises (`cpu.threads`, `memory.total_bytes`, the sum of
/// its fixed disks) less what the instances placed on it hold, and its unbooked GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeAtoms {
    pub node: String,
    pub vcpus: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub gpus: i64,
}

impl FreeAtoms {
    pub fn fits(&self, r: &InstanceRequest) -> bool {
        self.vcpus >= i64::from(r.vcpus)
            && self.memory_mib >= i64::from(r.memory_mib)
            && self.disk_gib >= i64::from(r.disk_gib)
            && self.gpus >= i64::from(r.gpus)
    }
}

/// The nodes an instance fits on, best first: the fullest that still fits (least vCPUs left after it, then least
/// memory), so large holes stay free for large instances; ties by node id, so the order is the same everywhere.
pub fn choose_node(candidates: &[FreeAtoms], r: &InstanceRequest) -> Vec<String> {
    let mut fit: Vec<&FreeAtoms> = candidates.iter().filter(|c| c.fits(r)).collect();
    fit.sort_by(|a, b| {
        (a.vcpus, a.memory_mib, a.disk_gib, &a.node).cmp(&(
            b.vcpus,
            b.memory_mib,
            b.disk_gib,
            &b.node,
        ))
    });
    fit.into_iter().map(|c| c.node.clone()).collect()
}

/// The error of a create that found no node: what was asked and what the pool has, so the caller knows whether
/// to ask for less or wait.
pub fn no_capacity(pool: &str, r: &InstanceRequest, candidates: &[FreeAtoms]) -> String {
    let best = |f: fn(&FreeAtoms) -> i64| candidates.iter().map(f).max().unwrap_or(0);
    format!(
        "no node of pool {pool} has {} vCPU, {} MiB, {} GiB and {} GPU(s) free ({} adopted node(s); the most free on \
         one node: {} vCPU, {} MiB, {} GiB, {} GPU(s))",
        r.vcpus,
        r.memory_mib,
        r.disk_gib,
        r.gpus,
        candidates.len(),
        best(|c| c.vcpus),
        best(|c| c.memory_mib),
        best(|c| c.disk_gib),
        best(|c| c.gpus),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> InstanceRequest {
        serde_json::from_value(serde_json::json!({
            "tenant": "t", "pool": "vps", "vcpus": 2, "memory_mib": 1024, "disk_gib": 10,
            "image": {"url": "http://127.0.0.1:8080/img.qcow2", "sha256": "ab".repeat(32)}
        }))
        .expect("request")
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(request().validate(), Ok(()));
        let mut r = request();
        r.memory_mib = 1;
        assert_eq!(r.validate().map_err(|e| e.field), Err("memory_mib"));
        let mut r = request();
        r.image.url = "http://user:pw@host/x".into();
        assert_eq!(r.validate().map_err(|e| e.field), Err("image.url"));
        let mut r = request();
        r.image.url = "file:///etc/passwd".into();
        assert_eq!(r.validate().map_err(|e| e.field), Err("image.url"));
        let mut r = request();
        r.image.sha256 = "AB".repeat(32);
        assert_eq!(r.validate().map_err(|e| e.field), Err("image.sha256"));
        let mut r = request();
        r.hostname = Some("-bad".into());
        assert_eq!(r.validate().map_err(|e| e.field), Err("hostname"));
        let mut r = request();
        r.ssh_keys = vec!["ssh-ed25519 AAAA\nevil".into()];
        assert_eq!(r.validate().map_err(|e| e.field), Err("ssh_keys"));
        // What bcd refuses, the API refuses (found by the `instance_request` fuzz target: the API admitted these
        // and the node refused its whole desired state).
        for key in [
            "ssh-ed25519 AAAAC3NzaC1lZDI0NT#5AAAAIBcN0tArEaLkEy ops@example",
            "hello world",
            "ssh-ed25519 short",
        ] {
            r.ssh_keys = vec![key.into()];
            assert_eq!(r.validate().map_err(|e| e.field), Err("ssh_keys"), "{key}");
        }
        r.ssh_keys = vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN0tArEaLkEy ops@example".into()];
        assert_eq!(r.validate(), Ok(()));
        for url in ["https://?x", "https://#frag", "http://@h/x"] {
            r.image.url = url.into();
            assert_eq!(r.validate().map_err(|e| e.field), Err("image.url"), "{url}");
        }
    }

    #[test]
    fn body_hash_follows_the_body() {
        let a = request();
        let mut b = request();
        assert_eq!(a.body_hash(), b.body_hash());
        b.vcpus = 3;
        assert_ne!(a.body_hash(), b.body_hash());
    }

    #[test]
    fn the_fullest_node_that_fits_comes_first() {
        let n = |node: &str, vcpus, gpus| FreeAtoms {
            node: node.into(),
            vcpus,
            memory_mib: 8192,
            disk_gib: 100,
            gpus,
        };
        let c = [n("a", 16, 0), n("b", 4, 0), n("c", 1, 0), n("d", 4, 1)];
        let r = request();
        assert_eq!(choose_node(&c, &r), vec!["b", "d", "a"]);
        let mut g = request();
        g.gpus = 1;
        assert_eq!(choose_node(&c, &g), vec!["d"]);
        g.gpus = 2;
        assert!(choose_node(&c, &g).is_empty());
        assert!(no_capacity("vps", &g, &c).contains("the most free on one node: 16 vCPU"));
    }
}
