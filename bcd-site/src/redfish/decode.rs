//! Lenient decoding of BMC documents into the typed models (sans-I/O: bytes in, a model and warnings out).
//!
//! BMCs send numbers as strings (`"Members@odata.count": "4"`), floats where the schema says integer
//! (`"TotalCores": 16.0`), a string where an object belongs. A strict decode would drop the whole resource for one
//! odd property, or fail every command that reads it. [`decode`] decodes strictly first; when that fails it finds
//! the offending property (its path, with `serde_path_to_error`), repairs it where the intent is plain (a numeric
//! string or an integral float read as the number, a scalar read as a string) or else leaves it out, and decodes
//! again, keeping everything else. Each repair is a [`FieldWarning`] that names the property and the decoder's
//! reason. A body that is not JSON, not an object, or a Redfish error (`{"error": …}`) is an error, never a resource.

#![deny(clippy::disallowed_methods)]

use std::fmt;

use serde::de::DeserializeOwned;
use serde_json::{Map, Number, Value};

use super::models::ErrorBody;

/// Repairs per document at most; a document that needs more is taken as it is left then.
const MAX_REPAIRS: usize = 64;

/// One property that did not have the type the schema gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldWarning {
    /// `Status.State`, `Members[3]`, `MemorySummary.TotalSystemMemoryGiB`.
    pub field: String,
    /// What the decoder said (`invalid type: string "64", expected f64`).
    pub reason: String,
    /// What was done: `read as 64` or `ignored`.
    pub action: String,
}

impl fmt::Display for FieldWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field {}: {}; {}", self.field, self.reason, self.action)
    }
}

/// Why a document could not be decoded at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not JSON ({0})")]
    NotJson(String),
    #[error("a JSON {0}, not an object")]
    NotObject(&'static str),
    /// A Redfish error body (`{"error": {…}}`), with its most useful text.
    #[error("a Redfish error instead of the resource: {0}")]
    ErrorBody(String),
    #[error("{0}")]
    Unrepairable(String),
}

/// A decoded document with the repairs it needed.
#[derive(Debug, Clone)]
pub struct Decoded<T> {
    pub value: T,
    pub warnings: Vec<FieldWarning>,
    /// The document as received (for `@odata.etag` and vendor extensions).
    pub raw: Value,
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Parses `data` as one JSON object and decodes it leniently. Never panics.
pub fn decode<T: DeserializeOwned>(data: &[u8]) -> Result<Decoded<T>, DecodeError> {
    let raw: Value =
        serde_json::from_slice(data).map_err(|e| DecodeError::NotJson(e.to_string()))?;
    decode_value(raw)
}

/// [`decode`] for a document already parsed (a member inlined by `$expand`).
pub fn decode_value<T: DeserializeOwned>(raw: Value) -> Result<Decoded<T>, DecodeError> {
    let Value::Object(map) = &raw else {
        return Err(DecodeError::NotObject(kind(&raw)));
    };
    if let Some(summary) = error_body(map) {
        return Err(DecodeError::ErrorBody(summary));
    }
    let mut doc = raw.clone();
    let mut warnings = Vec::new();
    for _ in 0..=MAX_REPAIRS {
        let err = match serde_path_to_error::deserialize::<_, T>(&doc) {
            Ok(value) => {
                return Ok(Decoded {
                    value,
                    warnings,
                    raw,
                });
            }
            Err(e) => e,
        };
        let path: Vec<Segment> = err.path().iter().filter_map(Segment::from_path).collect();
        let reason = err.inner().to_string();
        let field = render(&path);
        if path.is_empty() || warnings.len() >= MAX_REPAIRS {
            return Err(DecodeError::Unrepairable(format!("{field}: {reason}")));
        }
        let already = warnings
            .iter()
            .any(|w: &FieldWarning| w.field == field && w.action != "ignored");
        let wants_integer = ["expected u", "expected i"]
            .iter()
            .any(|w| reason.contains(w));
        let action = repair(&mut doc, &path, already, wants_integer);
        let Some(action) = action else {
            return Err(DecodeError::Unrepairable(format!("{field}: {reason}")));
        };
        warnings.push(FieldWarning {
            field,
            reason,
            action,
        });
    }
    Err(DecodeError::Unrepairable("too many odd properties".into()))
}

/// The summary of a Redfish error body, when `map` is one: `{"error": {…}}` and nothing that makes it a resource.
fn error_body(map: &Map<String, Value>) -> Option<String> {
    let err = map.get("error")?;
    if !err.is_object() || map.contains_key("@odata.id") {
        return None;
    }
    let body: ErrorBody = serde_json::from_value(Value::Object(map.clone())).unwrap_or_default();
    Some(body.summary().unwrap_or_else(|| "no message".to_owned()))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

impl Segment {
    fn from_path(s: &serde_path_to_error::Segment) -> Option<Segment> {
        match s {
            serde_path_to_error::Segment::Map { key } => Some(Segment::Key(key.clone())),
            serde_path_to_error::Segment::Seq { index } => Some(Segment::Index(*index)),
            _ => None,
        }
    }
}

fn render(path: &[Segment]) -> String {
    let mut out = String::new();
    for s in path {
        match s {
            Segment::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Segment::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    if out.is_empty() {
        "(document)".into()
    } else {
        out
    }
}

/// Repairs the value at `path`: converted when the intent is plain and this is the first try, else removed. Returns
/// what was done, or `None` when the path does not lead to a value.
fn repair(
    doc: &mut Value,
    path: &[Segment],
    tried_conversion: bool,
    wants_integer: bool,
) -> Option<String> {
    let (last, parents) = path.split_last()?;
    let mut parent = &mut *doc;
    for seg in parents {
        parent = match (seg, parent) {
            (Segment::Key(k), Value::Object(m)) => m.get_mut(k)?,
            (Segment::Index(i), Value::Array(a)) => a.get_mut(*i)?,
            _ => return None,
        };
    }
    let slot = match (last, &mut *parent) {
        (Segment::Key(k), Value::Object(m)) => m.get_mut(k)?,
        (Segment::Index(i), Value::Array(a)) => a.get_mut(*i)?,
        _ => return None,
    };
    if !tried_conversion && let Some(converted) = convert(slot, wants_integer) {
        let shown = match &converted {
            Value::String(s) => format!("{s:?}"),
            other => other.to_string(),
        };
        *slot = converted;
        return Some(format!("read as {shown}"));
    }
    match (last, parent) {
        (Segment::Key(k), Value::Object(m)) => {
            m.remove(k);
        }
        (Segment::Index(i), Value::Array(a)) => {
            a.remove(*i);
        }
        _ => return None,
    }
    Some("ignored".into())
}

/// The plain reading of a mistyped scalar: a numeric string as the number, a float as the (rounded) integer where an
/// integer is wanted, a number or boolean as a string. The next decode says whether that was the type wanted.
fn convert(v: &Value, wants_integer: bool) -> Option<Value> {
    match v {
        Value::String(s) => {
            let t = s.trim();
            if let Ok(n) = t.parse::<u64>() {
                Some(Value::Number(n.into()))
            } else if let Ok(n) = t.parse::<i64>() {
                Some(Value::Number(n.into()))
            } else {
                t.parse::<f64>()
                    .ok()
                    .filter(|f| f.is_finite())
                    .and_then(Number::from_f64)
                    .map(Value::Number)
            }
        }
        Value::Number(n) if n.is_f64() && wants_integer => {
            let f = n.as_f64()?.round();
            if (0.0..=u64::MAX as f64).contains(&f) {
                Some(Value::Number((f as u64).into()))
            } else if (i64::MIN as f64..0.0).contains(&f) {
                Some(Value::Number((f as i64).into()))
            } else {
                None
            }
        }
        Value::Number(n) => Some(Value::String(n.to_string())),
        Value::Bool(b) => Some(Value::String(b.to_string())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redfish::models::{Collection, ComputerSystem, Processor};

    #[test]
    fn one_odd_property_keeps_the_rest_and_says_which() {
        let d: Decoded<Processor> = decode(
            br#"{"Id": "CPU1", "Model": "EPYC", "TotalCores": "64", "TotalThreads": 128.0,
                 "MaxSpeedMHz": 3.5e3, "Status": "Enabled"}"#,
        )
        .expect("decodes");
        assert_eq!(d.value.id.as_deref(), Some("CPU1"));
        assert_eq!(d.value.total_cores, Some(64));
        assert_eq!(d.value.total_threads, Some(128));
        assert_eq!(d.value.max_speed_mhz, Some(3500));
        assert_eq!(d.value.status, None);
        let shown: Vec<String> = d.warnings.iter().map(ToString::to_string).collect();
        assert!(
            shown.iter().any(
                |w| w.starts_with("field TotalCores: invalid type: string \"64\"")
                    && w.ends_with("read as 64")
            ),
            "{shown:?}"
        );
        assert!(
            shown
                .iter()
                .any(|w| w.starts_with("field Status:") && w.ends_with("ignored")),
            "{shown:?}"
        );
    }

    #[test]
    fn a_string_count_and_a_bad_member_are_repaired() {
        let d: Decoded<Collection> = decode(
            br#"{"Members@odata.count": "2", "Members": [{"@odata.id": "/a"}, "junk", {"@odata.id": "/b"}]}"#,
        )
        .expect("decodes");
        assert_eq!(d.value.count, Some(2));
        let ids: Vec<&str> = d
            .value
            .members
            .iter()
            .map(|m| m.odata_id.as_str())
            .collect();
        assert_eq!(ids, ["/a", "/b"]);
        assert_eq!(d.warnings.len(), 2, "{:?}", d.warnings);
        let fields: Vec<&str> = d.warnings.iter().map(|w| w.field.as_str()).collect();
        assert!(
            fields.contains(&"Members[1]") && fields.contains(&"Members@odata.count"),
            "{fields:?}"
        );
    }

    #[test]
    fn error_bodies_and_non_objects_are_errors() {
        let e = decode::<ComputerSystem>(
            br#"{"error": {"code": "Base.1.8.GeneralError", "message": "x",
                "@Message.ExtendedInfo": [{"MessageId": "Base.1.8.InternalError", "Message": "internal"}]}}"#,
        )
        .err();
        assert_eq!(
            e,
            Some(DecodeError::ErrorBody(
                "internal (Base.1.8.InternalError)".into()
            ))
        );
        assert_eq!(
            decode::<ComputerSystem>(b"[1]").err(),
            Some(DecodeError::NotObject("array"))
        );
        assert!(matches!(
            decode::<ComputerSystem>(b"{").err(),
            Some(DecodeError::NotJson(_))
        ));
    }

    #[test]
    fn nested_odd_properties_are_found_by_path() {
        let d: Decoded<ComputerSystem> = decode(
            br#"{"Id": "1", "MemorySummary": {"TotalSystemMemoryGiB": "512"},
                 "ProcessorSummary": {"Count": 2.0, "Model": 7}, "Boot": {"BootSourceOverrideTarget": ["Pxe"]}}"#,
        )
        .expect("decodes");
        assert_eq!(
            d.value
                .memory_summary
                .as_ref()
                .and_then(|m| m.total_system_memory_gib),
            Some(512.0)
        );
        let ps = d.value.processor_summary.clone().unwrap_or_default();
        assert_eq!(ps.count, Some(2));
        assert_eq!(ps.model.as_deref(), Some("7"));
        assert!(d.value.boot.is_some());
        let fields: Vec<&str> = d.warnings.iter().map(|w| w.field.as_str()).collect();
        assert!(
            fields.contains(&"Boot.BootSourceOverrideTarget"),
            "{fields:?}"
        );
    }
}
