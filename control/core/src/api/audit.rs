//! The typed request and response of `audit.list`: the audit log (who did what to which subject, when), newest
//! first, filtered and paged.

use serde::{Deserialize, Serialize};

/// `audit.list`: events matching every filter given, newest first, a page at a time (`before` the previous page's
/// `next`, at most `limit`, [`super::MAX_PAGE`] when absent).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ListAudit {
    /// The actor exactly (`principal/admin`, `node/n-…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    /// The action exactly, or a prefix ending in `.` or `*` (`machine.` or `machine.*`: every machine action).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// The subject exactly, or a prefix ending in `/` or `*` (`site/rack-1/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// Events at or after this instant (Unix milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub since_ms: Option<i64>,
    /// Events before this instant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::api::EpochMs>"))]
    pub until_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Events older than this one (an event id: the previous page's `next`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<i64>,
}

/// An audit event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AuditEvent {
    pub id: i64,
    #[cfg_attr(feature = "schema", schemars(with = "crate::api::EpochMs"))]
    pub at_ms: i64,
    pub actor: String,
    pub action: String,
    pub subject: String,
    pub detail: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AuditEvents {
    pub events: Vec<AuditEvent>,
    /// The `before` of the next (older) page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<i64>,
}

/// A filter's text as SQL `LIKE` matches it: exact, or a prefix where it ends in `*` (the `*` dropped) or in the
/// separator `sep` (kept); `%`, `_` and `\` are escaped.
pub fn like_pattern(filter: &str, sep: char) -> String {
    let escaped: String = filter
        .chars()
        .flat_map(|c| match c {
            '%' | '_' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect();
    if let Some(prefix) = escaped.strip_suffix('*') {
        format!("{prefix}%")
    } else if escaped.ends_with(sep) {
        format!("{escaped}%")
    } else {
        escaped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_exact_or_prefixes_and_never_wildcards_by_accident() {
        assert_eq!(like_pattern("machine.create", '.'), "machine.create");
        assert_eq!(like_pattern("machine.", '.'), "machine.%");
        assert_eq!(like_pattern("machine*", '.'), "machine%");
        assert_eq!(like_pattern("site/rack_1/", '/'), "site/rack\\_1/%");
        assert_eq!(like_pattern("100%", '/'), "100\\%");
    }
}
