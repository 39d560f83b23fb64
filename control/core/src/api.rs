//! The API's stable error codes ([`ApiCode`]) and how a library error names its code ([`Coded`]): the store's
//! errors implement it, so the kernel turns them into `{code, message}` without either crate knowing the other.
//!
//! The typed requests and responses of each module's methods live in the submodules, shared by the handlers and
//! the CLI's client.

use std::fmt;

pub mod audit;
pub mod capacity;
pub mod fleet;
pub mod iam;
pub mod instances;
pub mod inventory;
pub mod metal;
pub mod nodes;
pub mod sites;
pub mod system;
pub mod tunnels;

/// The most items one page of a list answers (a request's `limit` is capped to it).
pub const MAX_PAGE: u32 = 1000;

/// One page of `items` (sorted by `key`, ascending): those after `after`, at most `limit` (capped to
/// [`MAX_PAGE`]), and the `after` of the next page when more remain.
pub fn page<T>(
    items: Vec<T>,
    key: impl Fn(&T) -> &str,
    after: Option<&str>,
    limit: Option<u32>,
) -> (Vec<T>, Option<String>) {
    let limit = limit.unwrap_or(MAX_PAGE).clamp(1, MAX_PAGE) as usize;
    let mut rest = items
        .into_iter()
        .filter(|i| after.is_none_or(|a| key(i) > a))
        .peekable();
    let shown: Vec<T> = rest.by_ref().take(limit).collect();
    let next = match (rest.peek(), shown.last()) {
        (Some(_), Some(last)) => Some(key(last).to_string()),
        _ => None,
    };
    (shown, next)
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (none included) and every other
/// character itself (`gpu-*`, `*-a-*`).
pub fn glob_matches(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

/// The stable error codes of the API. Every error the API answers, its own and the HTTP layer's (a malformed or
/// oversized body, a wrong content type or method, an unknown route), is `{code, message}` with one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiCode {
    InvalidConfig,
    InvalidArgument,
    Unauthenticated,
    AccessDenied,
    NotFound,
    Conflict,
    FailedPrecondition,
    Unavailable,
}

impl ApiCode {
    pub const ALL: [ApiCode; 8] = [
        ApiCode::InvalidConfig,
        ApiCode::InvalidArgument,
        ApiCode::Unauthenticated,
        ApiCode::AccessDenied,
        ApiCode::NotFound,
        ApiCode::Conflict,
        ApiCode::FailedPrecondition,
        ApiCode::Unavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ApiCode::InvalidConfig => "INVALID_CONFIG",
            ApiCode::InvalidArgument => "INVALID_ARGUMENT",
            ApiCode::Unauthenticated => "UNAUTHENTICATED",
            ApiCode::AccessDenied => "ACCESS_DENIED",
            ApiCode::NotFound => "NOT_FOUND",
            ApiCode::Conflict => "CONFLICT",
            ApiCode::FailedPrecondition => "FAILED_PRECONDITION",
            ApiCode::Unavailable => "UNAVAILABLE",
        }
    }

    /// The code a wire string names (None for a code this build does not know).
    pub fn parse(s: &str) -> Option<ApiCode> {
        ApiCode::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ApiCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for ApiCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for ApiCode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ApiCode, D::Error> {
        let s = String::deserialize(d)?;
        ApiCode::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown error code {s:?}")))
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for ApiCode {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ApiCode".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let codes: Vec<&str> = ApiCode::ALL.iter().map(|c| c.as_str()).collect();
        schemars::json_schema!({
            "type": "string",
            "enum": codes,
            "description": "A stable error code; the message says what to do next.",
        })
    }
}

/// The API document's name for an instant sent as an integer: milliseconds since 1970-01-01T00:00:00Z (UTC).
/// Every `*_ms` instant of the typed API carries it (`#[schemars(with = "EpochMs")]`), so a client (the CLI's
/// RFC 3339 output) reads the format from the schema instead of guessing from the name.
pub const EPOCH_MS_FORMAT: &str = "unix-epoch-ms";

/// A schema-only type: an instant as epoch milliseconds (`{"type": "integer", "format": "unix-epoch-ms"}`).
#[cfg(feature = "schema")]
pub struct EpochMs;

#[cfg(feature = "schema")]
impl schemars::JsonSchema for EpochMs {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> std::borrow::Cow<'static, str> {
        "EpochMs".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "integer",
            "format": EPOCH_MS_FORMAT,
            "description": "An instant: milliseconds since 1970-01-01T00:00:00Z.",
        })
    }
}

/// A library error that knows which API code it is and what the caller may be told. The cause of an UNAVAILABLE
/// error stays in the server's log; the caller reads only [`Coded::public_message`].
pub trait Coded {
    fn api_code(&self) -> ApiCode;
    /// What the caller is told (never a database's or a library's internals).
    fn public_message(&self) -> String;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_parses_back_from_its_wire_name() {
        for c in ApiCode::ALL {
            assert_eq!(ApiCode::parse(c.as_str()), Some(c));
        }
        assert_eq!(ApiCode::parse("internal"), None);
    }

    #[test]
    fn pages_follow_their_cursor_to_the_end() {
        let items: Vec<String> = (0..5).map(|i| format!("n-{i}")).collect();
        let (p1, next) = page(items.clone(), |s| s.as_str(), None, Some(2));
        assert_eq!(
            (p1, next.as_deref()),
            (vec!["n-0".into(), "n-1".into()], Some("n-1"))
        );
        let (p2, next) = page(items.clone(), |s| s.as_str(), next.as_deref(), Some(2));
        assert_eq!(
            (p2, next.as_deref()),
            (vec!["n-2".into(), "n-3".into()], Some("n-3"))
        );
        let (p3, next) = page(items.clone(), |s| s.as_str(), next.as_deref(), Some(2));
        assert_eq!((p3, next), (vec!["n-4".to_string()], None));
        // Exactly a page left: no next page to ask for.
        let (p, next) = page(items.clone(), |s| s.as_str(), Some("n-2"), Some(2));
        assert_eq!((p.len(), next), (2, None));
        assert_eq!(page(items, |s| s.as_str(), None, Some(0)).0.len(), 1);
    }

    #[test]
    fn globs_match_runs_of_characters() {
        assert!(glob_matches("gpu-*", "gpu-a1"));
        assert!(glob_matches("*", ""));
        assert!(glob_matches("*-a-*", "rack-a-7"));
        assert!(glob_matches("a*b*c", "aXbYbc"));
        assert!(glob_matches("exact", "exact"));
        assert!(!glob_matches("exact", "exact2"));
        assert!(!glob_matches("gpu-*", "cpu-1"));
        assert!(!glob_matches("ab*ba", "aba"));
        assert!(!glob_matches("*x*", "abc"));
    }
}
