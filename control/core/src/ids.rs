//! The domain's identifiers as types: a node id is never passed where a site id is expected. Each is parsed once,
//! at the boundary (a request body, a database row, a certificate), and is then known to be well formed: 1 to 128
//! characters of ASCII letters, digits and `-_.:/@` (the store's ids are UUIDs and prefixed UUIDs; the SPIFFE path
//! and audit subjects embed them).

use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;
use std::str::FromStr;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} id {value:?} is malformed: {why}")]
pub struct BadId {
    pub kind: &'static str,
    pub value: String,
    pub why: &'static str,
}

/// The longest identifier accepted.
pub const MAX_ID_LEN: usize = 128;

/// What [`check`] accepts, as a JSON Schema pattern (the API document's).
#[cfg(feature = "schema")]
const ID_PATTERN: &str = "^[A-Za-z0-9_.:/@-]+$";

fn check(kind: &'static str, s: &str) -> Result<(), BadId> {
    let bad = |why| {
        Err(BadId {
            kind,
            value: s.chars().take(MAX_ID_LEN + 8).collect(),
            why,
        })
    };
    if s.is_empty() {
        return bad("empty");
    }
    if s.len() > MAX_ID_LEN {
        return bad("longer than 128 characters");
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b))
    {
        return bad("only ASCII letters, digits and -_.:/@ are allowed");
    }
    Ok(())
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// What this id names, as error messages say it.
            pub const KIND: &'static str = $kind;

            /// Parses an id from outside input.
            pub fn parse(s: &str) -> Result<$name, BadId> {
                check($kind, s).map(|()| $name(s.to_string()))
            }

            /// Takes an owned string as the id, checked.
            pub fn new(s: String) -> Result<$name, BadId> {
                check($kind, &s).map(|()| $name(s))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = BadId;
            fn from_str(s: &str) -> Result<$name, BadId> {
                $name::parse(s)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        #[cfg(feature = "schema")]
        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_ID_LEN,
                    "pattern": ID_PATTERN,
                    "description": concat!("A ", $kind, " id: 1 to 128 ASCII letters, digits and -_.:/@."),
                })
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                let s = String::deserialize(d)?;
                $name::new(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_type!(
    /// A node: a machine running bcd (or the ramdisk) that joined.
    NodeId,
    "node"
);
id_type!(
    /// A site: a rack or room with a site agent.
    SiteId,
    "site"
);
id_type!(
    /// A bare-metal machine enrolled at a site.
    MachineId,
    "machine"
);
id_type!(
    /// A GPU reservation.
    ReservationId,
    "reservation"
);
id_type!(
    /// A command queued for a node.
    CommandId,
    "command"
);
id_type!(
    /// A pool of nodes.
    PoolId,
    "pool"
);
id_type!(
    /// A tenant.
    TenantId,
    "tenant"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_once_and_refuse_what_is_malformed() {
        let id = NodeId::parse("0193a5b2-7c1e-7d2a-9f00-1234567890ab").expect("a node id");
        assert_eq!(id.as_str(), "0193a5b2-7c1e-7d2a-9f00-1234567890ab");
        assert_eq!(
            ReservationId::parse("rsv-0193a5b27c1e")
                .expect("a reservation id")
                .to_string(),
            "rsv-0193a5b27c1e"
        );
        for bad in ["", "a b", "x\n", "é", &"a".repeat(129)] {
            let e = NodeId::parse(bad).expect_err("malformed");
            assert_eq!(e.kind, "node");
            assert!(e.to_string().starts_with("node id"), "{e}");
        }
        let json: Result<SiteId, _> = serde_json::from_str("\"rack 1\"");
        assert!(json.expect_err("malformed").to_string().contains("site id"));
        let ok: SiteId = serde_json::from_str("\"rack-1\"").expect("a site id");
        assert_eq!(serde_json::to_string(&ok).expect("encode"), "\"rack-1\"");
    }
}
