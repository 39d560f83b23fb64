//! The typed requests and responses of the server's IAM methods (`tenants.create`, `principals.create`).

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
