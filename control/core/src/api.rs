//! The API's stable error codes ([`ApiCode`]) and how a library error names its code ([`Coded`]): the store's
//! errors implement it, so the kernel turns them into `{code, message}` without either crate knowing the other.
//!
//! The typed requests and responses of each module's methods live in the submodules, shared by the handlers and
//! the CLI's client.

use std::fmt;

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
}
