//! The typed requests and responses of the sites module's methods (`sites`, `site-tokens`, `machines`, `secrets`,
//! `artifacts`), shared by its handlers and by the CLI's client. The JSON on the wire is what the untyped
//! handlers answered before: field names and defaults are unchanged.

use crate::ids::{MachineId, SiteId};
use serde::{Deserialize, Deserializer, Serialize};

/// The longest site id a site token may be created for (it becomes `spiffe://<domain>/site/<site>`).
pub const MAX_SITE_NAME: usize = 64;

/// Why `site` cannot name a site that enrolls agents, or None when it can: 1-64 characters of `[A-Za-z0-9.-_]`
/// (stricter than [`SiteId`]: no `/`, `:` or `@`, since it is one segment of a SPIFFE path and of a grant scope).
pub fn site_name_error(site: &str) -> Option<String> {
    let ok = !site.is_empty()
        && site.len() <= MAX_SITE_NAME
        && site
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    (!ok).then(|| {
        format!(
            "site {site:?}: must be 1-{MAX_SITE_NAME} characters of [A-Za-z0-9.-_] (it becomes the SPIFFE ID \
             spiffe://<domain>/site/<site>)"
        )
    })
}

/// Deserializes a site id that [`site_name_error`] accepts (a request that names one site to act on).
pub fn site_name<'de, D: Deserializer<'de>>(d: D) -> Result<SiteId, D::Error> {
    let s = String::deserialize(d)?;
    if let Some(why) = site_name_error(&s) {
        return Err(serde::de::Error::custom(why));
    }
    SiteId::new(s).map_err(serde::de::Error::custom)
}

/// A machine's desired boot as the API takes it and the store keeps it (`machines.boot`). `kernel` and `initrd`
/// are an http(s) URL, a path under the site's artifact cache, or `sha256:<hex>` of a stored artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BootSpec {
    pub kernel: String,
    #[serde(default)]
    pub initrd: Option<String>,
    #[serde(default)]
    pub cmdline: String,
}

/// `sites.revoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RevokeSiteRequest {
    #[serde(deserialize_with = "site_name")]
    pub site: SiteId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RevokeSiteResponse {
    pub site: SiteId,
    pub revoked: bool,
    /// True when the site was revoked before this call (nothing changed).
    pub already_revoked: bool,
    pub tokens_revoked: u64,
    pub lease_released: bool,
}

fn two() -> i32 {
    2
}

fn day() -> i64 {
    86_400
}

/// `site-tokens.create`: one use per site agent (an active one and a standby: 2).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSiteTokenRequest {
    #[serde(deserialize_with = "site_name")]
    pub site: SiteId,
    #[serde(default = "two")]
    pub uses: i32,
    #[serde(default = "day")]
    pub ttl_seconds: i64,
}

/// The new token: `token` (the secret) is shown only here.
#[derive(Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CreateSiteTokenResponse {
    pub id: String,
    pub token: String,
    pub site: SiteId,
    pub uses: i32,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub expires_at_ms: i64,
}

/// `site-tokens.list` and `machines.list`: one site, or every site the caller's grant reaches.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BySite {
    #[serde(default)]
    pub site: Option<SiteId>,
}

/// A site token as listed (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SiteToken {
    pub id: String,
    pub site_id: SiteId,
    pub uses_total: i32,
    pub uses_left: i32,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub expires_at_ms: i64,
    pub revoked: bool,
    pub created_by: String,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ListSiteTokensResponse {
    pub tokens: Vec<SiteToken>,
}

/// `site-tokens.revoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RevokeSiteTokenRequest {
    pub id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RevokeSiteTokenResponse {
    pub id: String,
    pub revoked: bool,
}

/// A machine of a site: its MAC in canonical form (`aa:bb:cc:dd:ee:ff`) and what it netboots (None: it must not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Machine {
    pub mac: MachineId,
    pub site_id: SiteId,
    pub boot: Option<BootSpec>,
}

/// `machines.create`: `mac` in any common form (`52-54-00-AA-BB-01`); it is answered canonical.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateMachineRequest {
    pub mac: String,
    #[serde(deserialize_with = "site_name")]
    pub site: SiteId,
    #[serde(default)]
    pub boot: Option<BootSpec>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CreateMachineResponse {
    pub machine: Machine,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ListMachinesResponse {
    pub machines: Vec<Machine>,
}

/// `machines.set-boot`: `boot` null stops the machine netbooting.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SetMachineBootRequest {
    pub mac: String,
    #[serde(default)]
    pub boot: Option<BootSpec>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SetMachineBootResponse {
    pub mac: MachineId,
    pub site: SiteId,
    pub boot: Option<BootSpec>,
}

/// `secrets.put` (no `Debug`: it carries the value).
#[derive(Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PutSecretRequest {
    #[serde(deserialize_with = "site_name")]
    pub site: SiteId,
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PutSecretResponse {
    pub site: SiteId,
    pub name: String,
    pub stored: bool,
}

/// `artifacts.list` takes nothing.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListArtifactsRequest {}

/// An artifact the control plane stores (the bytes are in its state directory, content-addressed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Artifact {
    pub sha256: String,
    pub name: String,
    pub size: i64,
    pub created_by: String,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ListArtifactsResponse {
    pub artifacts: Vec<Artifact>,
}

/// `artifacts.delete`: the row and the file. Refused (FAILED_PRECONDITION, naming them) while a machine's boot or a
/// metal machine's record references it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DeleteArtifactRequest {
    /// The hash, as 64 hex or `sha256:<hex>`.
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeleteArtifactResponse {
    pub sha256: String,
    pub deleted: bool,
}

/// `sites.list`: every site the caller's grant reaches.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListSitesRequest {}

/// A site as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Site {
    pub id: SiteId,
    pub name: String,
    pub created_by: String,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub revoked_at_ms: Option<i64>,
    /// Agents enrolled (active and standby).
    pub agents: i64,
    pub machines: i64,
    pub secrets: i64,
    /// The agent holding the boot lease now, if one does.
    pub boot_holder: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ListSitesResponse {
    pub sites: Vec<Site>,
}

/// `machines.delete`: forgets a machine of a site. Refused (FAILED_PRECONDITION) while the metal flow holds it
/// (`metal release` or `metal abort` it first).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DeleteMachineRequest {
    pub mac: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeleteMachineResponse {
    pub mac: MachineId,
    pub site: SiteId,
    pub deleted: bool,
}

/// A secret as listed: its name and when and by whom it was last put, never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SecretInfo {
    pub site_id: SiteId,
    pub name: String,
    pub created_by: String,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub updated_at_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ListSecretsResponse {
    pub secrets: Vec<SecretInfo>,
}

/// `secrets.delete`. Refused (FAILED_PRECONDITION, naming them) while a metal machine's BMC credentials name it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DeleteSecretRequest {
    #[serde(deserialize_with = "site_name")]
    pub site: SiteId,
    pub name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeleteSecretResponse {
    pub site: SiteId,
    pub name: String,
    pub deleted: bool,
}

/// What `PUT /api/artifacts` answers: the row and the reference a boot spec names it by (`sha256:<hex>`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PutArtifactResponse {
    pub artifact: Artifact,
    pub reference: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_to_act_on_is_one_spiffe_segment() {
        let ok: Result<RevokeSiteRequest, _> = serde_json::from_str(r#"{"site":"rack-1.a_b"}"#);
        assert!(ok.is_ok());
        for bad in [
            r#""a/b""#,
            r#""""#,
            r#""a:b""#,
            &format!("{:?}", "x".repeat(65)),
        ] {
            let e = serde_json::from_str::<RevokeSiteRequest>(&format!(r#"{{"site":{bad}}}"#))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("[A-Za-z0-9.-_]"), "{bad}: {e}");
        }
    }

    #[test]
    fn boot_specs_keep_their_wire_form() -> Result<(), serde_json::Error> {
        let b: BootSpec = serde_json::from_str(r#"{"kernel":"ramdisk/vmlinuz"}"#)?;
        assert_eq!(
            serde_json::to_value(&b)?,
            serde_json::json!({"kernel": "ramdisk/vmlinuz", "initrd": null, "cmdline": ""})
        );
        assert!(serde_json::from_str::<BootSpec>(r#"{"kernel":"k","extra":1}"#).is_err());
        Ok(())
    }
}
