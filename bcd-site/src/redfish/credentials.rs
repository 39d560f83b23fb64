//! BMC credentials and their secret format. A BMC secret stored in the control plane (`better-compute secrets put`)
//! is a JSON object with exactly two string members:
//!
//! ```json
//! {"username": "root", "password": "…"}
//! ```
//!
//! Anything else is refused by [`Credentials::from_secret_json`] with a reason that never quotes the secret: no
//! value, no key name, no fragment of the text (a JSON syntax error gives only its line and column). The password is
//! wiped from memory when the [`Credentials`] are dropped, and `Debug` never prints it.

use serde_json::Value;
use zeroize::{Zeroize as _, Zeroizing};

/// A BMC user. `Debug` does not print the password; drop wipes it.
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <password>)", self.username)
    }
}

impl Drop for Credentials {
    fn drop(&mut self) {
        self.password.zeroize();
    }
}

/// Why a secret is not BMC credentials. The messages name what is wrong, never what the secret holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsFormatError {
    #[error("is not JSON (syntax error at line {line}, column {column})")]
    NotJson { line: usize, column: usize },
    #[error("is JSON but not an object")]
    NotObject,
    #[error("has no \"{0}\" member")]
    Missing(&'static str),
    #[error("has a \"{0}\" member that is not a string")]
    NotString(&'static str),
    #[error("has an empty \"{0}\"")]
    Empty(&'static str),
    #[error("has a \"username\" with a control character")]
    ControlCharacter,
    #[error("has {0} member(s) other than \"username\" and \"password\"")]
    Unknown(usize),
}

/// What an operator should store, for error messages.
pub const SECRET_FORMAT: &str = r#"{"username": "<BMC user>", "password": "<BMC password>"}"#;

impl Credentials {
    /// Parses a BMC secret: `{"username": "…", "password": "…"}`, both non-empty strings, nothing else.
    pub fn from_secret_json(text: &str) -> Result<Credentials, CredentialsFormatError> {
        // Parsed as a `Value` (not a typed struct): serde's type errors quote the offending value.
        let value: Value =
            serde_json::from_str(text).map_err(|e| CredentialsFormatError::NotJson {
                line: e.line(),
                column: e.column(),
            })?;
        let Value::Object(mut map) = value else {
            let mut value = value;
            wipe(&mut value);
            return Err(CredentialsFormatError::NotObject);
        };
        let username = take(&mut map, "username");
        // Zeroizing: wiped on every path out of here, the password moved into the result included.
        let password = take(&mut map, "password").map(Zeroizing::new);
        let unknown = map.len();
        map.values_mut().for_each(wipe);
        let username = username?;
        let mut password = password?;
        if username.chars().any(char::is_control) {
            return Err(CredentialsFormatError::ControlCharacter);
        }
        if unknown > 0 {
            return Err(CredentialsFormatError::Unknown(unknown));
        }
        Ok(Credentials {
            username,
            password: std::mem::take(&mut *password),
        })
    }
}

/// Removes `key`: a non-empty string, or why not (a non-string is wiped).
fn take(
    map: &mut serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<String, CredentialsFormatError> {
    match map.remove(key) {
        None => Err(CredentialsFormatError::Missing(key)),
        Some(Value::String(s)) if s.is_empty() => Err(CredentialsFormatError::Empty(key)),
        Some(Value::String(s)) => Ok(s),
        Some(mut other) => {
            wipe(&mut other);
            Err(CredentialsFormatError::NotString(key))
        }
    }
}

/// Wipes the strings of a JSON value (best effort: what the parser copied on the way is out of reach).
fn wipe(v: &mut Value) {
    match v {
        Value::String(s) => s.zeroize(),
        Value::Array(a) => a.iter_mut().for_each(wipe),
        Value::Object(o) => o.values_mut().for_each(wipe),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_format_is_strict_and_errors_never_quote_it() {
        let c = Credentials::from_secret_json(r#"{"username":"root","password":"s3cr3t-pw"}"#)
            .expect("valid");
        assert_eq!(c.username, "root");
        assert_eq!(c.password, "s3cr3t-pw");
        assert!(!format!("{c:?}").contains("s3cr3t"));
        let c = Credentials::from_secret_json(
            " {\n \"password\": \"p\\u00e9\", \"username\": \"u\" }\n",
        )
        .expect("whitespace, order and escapes");
        assert_eq!(c.password, "p\u{e9}");

        use CredentialsFormatError::*;
        for (text, want) in [
            ("s3cr3t-pw", NotJson { line: 1, column: 1 }),
            (
                r#"{"username":"root","password":"s3cr3t-pw""#,
                NotJson {
                    line: 1,
                    column: 41,
                },
            ),
            (r#""s3cr3t-pw""#, NotObject),
            (r#"["root","s3cr3t-pw"]"#, NotObject),
            (r#"{"password":"s3cr3t-pw"}"#, Missing("username")),
            (r#"{"username":"root"}"#, Missing("password")),
            (
                r#"{"username":"root","password":12345678}"#,
                NotString("password"),
            ),
            (
                r#"{"username":"root","password":["s3cr3t-pw"]}"#,
                NotString("password"),
            ),
            (
                r#"{"username":"","password":"s3cr3t-pw"}"#,
                Empty("username"),
            ),
            (r#"{"username":"root","password":""}"#, Empty("password")),
            (
                r#"{"username":"ro\not","password":"s3cr3t-pw"}"#,
                ControlCharacter,
            ),
            (
                r#"{"username":"root","password":"x","s3cr3t-pw":"y"}"#,
                Unknown(1),
            ),
            (r#"{"user":"root","pass":"s3cr3t-pw"}"#, Missing("username")),
        ] {
            let e = Credentials::from_secret_json(text).expect_err(text);
            assert_eq!(e, want, "{text}");
            let shown = e.to_string();
            for leak in ["s3cr3t", "12345678", "root", "user\"", "pass\""] {
                assert!(
                    !shown.contains(leak),
                    "{shown:?} quotes the secret {text:?}"
                );
            }
        }
    }
}
