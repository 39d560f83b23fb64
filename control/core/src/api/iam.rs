//! The typed requests and responses of the server's IAM methods (`tenants.create|list`,
//! `principals.create|list`).

use crate::iam::Grant;
use serde::{Deserialize, Serialize};

/// `tenants.create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A tenant as created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Tenant {
    pub id: String,
    pub name: String,
}

/// `principals.create`: a principal of `tenant` holding `grants` (each covered by one of the caller's own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreatePrincipal {
    pub id: String,
    pub tenant: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub grants: Vec<Grant>,
}

/// A principal as created, with its API key (shown once: the store keeps only its hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PrincipalCreated {
    pub id: String,
    pub tenant: String,
    pub api_key: String,
}

/// `tenants.list`: every tenant for a root caller, its own for any other.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListTenants {}

/// A tenant as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TenantInfo {
    pub id: String,
    pub name: String,
    pub is_root: bool,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Tenants {
    pub tenants: Vec<TenantInfo>,
}

/// `principals.list`: the principals of `tenant` (the caller's own tenant when absent; another only for a root
/// caller), with their grants and API key ids, never a key.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListPrincipals {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// A principal as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PrincipalInfo {
    pub id: String,
    pub tenant: String,
    pub name: String,
    pub api_key_id: Option<String>,
    pub disabled: bool,
    pub grants: Vec<Grant>,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub created_at_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Principals {
    pub principals: Vec<PrincipalInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_forms_are_the_old_ones() -> Result<(), serde_json::Error> {
        let p: CreatePrincipal = serde_json::from_value(serde_json::json!({
            "id": "ops", "tenant": "acme",
            "grants": [{"permission": "compute:nodes:get", "scope": "pool/a"}]
        }))?;
        assert_eq!((p.name.as_deref(), p.grants.len()), (None, 1));
        let unknown =
            serde_json::from_value::<CreateTenant>(serde_json::json!({"id": "a", "nmae": "x"}));
        assert!(unknown.is_err_and(|e| e.to_string().contains("unknown field")));
        Ok(())
    }
}
