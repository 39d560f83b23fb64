//! Ramdisk parameters from the kernel command line (`/proc/cmdline`).
//!
//! | parameter | meaning |
//! |---|---|
//! | `bc.url=` | control-plane URL (`https://…`, or `http://…` in a lab); required in `agent` mode |
//! | `bc.ca_pin=` | SHA-256 of the control-plane CA certificate (DER), `sha256:<64 hex>` or bare hex; required for https |
//! | `bc.boot_token=` | reference to a single-use boot token; never a join/site token (those are reusable secrets) |
//! | `bc.mode=` | `agent` (default: join and run commands), `diagnose` (report and power off), `rescue` (stop after bring-up) |
//! | `bc.debug` | verbose logs (`bc.debug`, `bc.debug=1|0|true|false`) |
//!
//! Values may be quoted as the kernel allows (`bc.url="…"` or `"bc.url=…"`). Other parameters are ignored; an
//! unknown or repeated `bc.*` parameter is an error, so a typo does not silently change behaviour.

use reqwest::Url;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    #[default]
    Agent,
    Diagnose,
    Rescue,
}

/// SHA-256 of the control-plane CA certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaPin(pub [u8; 32]);

/// A reference to a single-use boot token held by the control plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootTokenRef(pub String);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamdiskParams {
    pub control_url: Option<Url>,
    pub ca_pin: Option<CaPin>,
    pub boot_token: Option<BootTokenRef>,
    pub mode: Mode,
    pub debug: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CmdlineError {
    #[error("kernel command line has an unterminated quote")]
    UnterminatedQuote,
    #[error("unknown parameter {key} (known: bc.url, bc.ca_pin, bc.boot_token, bc.mode, bc.debug)")]
    Unknown { key: String },
    #[error("{key} is given more than once")]
    Duplicate { key: String },
    #[error("{key} needs a value ({key}=...)")]
    MissingValue { key: String },
    #[error("{key}={value:?} is invalid: {reason}")]
    Invalid {
        key: &'static str,
        value: String,
        reason: String,
    },
    #[error("{key} is required: {reason}")]
    Required {
        key: &'static str,
        reason: &'static str,
    },
}

/// Split a command line into parameters the way the kernel does: whitespace separates, double quotes group (and
/// are removed).
pub fn split(cmdline: &str) -> Result<Vec<String>, CmdlineError> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut in_token = false;
    let mut quoted = false;
    for c in cmdline.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                in_token = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_token {
                    out.push(std::mem::take(&mut current));
                    in_token = false;
                }
            }
            c => {
                current.push(c);
                in_token = true;
            }
        }
    }
    if quoted {
        return Err(CmdlineError::UnterminatedQuote);
    }
    if in_token {
        out.push(current);
    }
    Ok(out)
}

/// Parse the ramdisk parameters out of a kernel command line.
pub fn parse(cmdline: &str) -> Result<RamdiskParams, CmdlineError> {
    let mut params = RamdiskParams {
        control_url: None,
        ca_pin: None,
        boot_token: None,
        mode: Mode::Agent,
        debug: false,
    };
    let mut seen: Vec<&'static str> = Vec::new();
    for token in split(cmdline)? {
        let (key, value) = match token.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (token.as_str(), None),
        };
        if !key.starts_with("bc.") {
            continue;
        }
        let key: &'static str = match key {
            "bc.url" => "bc.url",
            "bc.ca_pin" => "bc.ca_pin",
            "bc.boot_token" => "bc.boot_token",
            "bc.mode" => "bc.mode",
            "bc.debug" => "bc.debug",
            other => return Err(CmdlineError::Unknown { key: clip(other) }),
        };
        if seen.contains(&key) {
            return Err(CmdlineError::Duplicate {
                key: key.to_string(),
            });
        }
        seen.push(key);
        if key == "bc.debug" {
            params.debug = match value {
                None | Some("1" | "true" | "yes" | "on") => true,
                Some("0" | "false" | "no" | "off") => false,
                Some(v) => return Err(invalid(key, v, "use bc.debug, bc.debug=1 or bc.debug=0")),
            };
            continue;
        }
        let value = value
            .filter(|v| !v.is_empty())
            .ok_or(CmdlineError::MissingValue {
                key: key.to_string(),
            })?;
        match key {
            "bc.url" => params.control_url = Some(parse_url(value)?),
            "bc.ca_pin" => params.ca_pin = Some(parse_pin(value)?),
            "bc.boot_token" => params.boot_token = Some(parse_token_ref(value)?),
            _ => {
                params.mode = match value {
                    "agent" => Mode::Agent,
                    "diagnose" => Mode::Diagnose,
                    "rescue" => Mode::Rescue,
                    v => return Err(invalid(key, v, "expected agent, diagnose or rescue")),
                }
            }
        }
    }
    if params.mode == Mode::Agent && params.control_url.is_none() {
        return Err(CmdlineError::Required {
            key: "bc.url",
            reason: "agent mode joins the control plane",
        });
    }
    if params
        .control_url
        .as_ref()
        .is_some_and(|u| u.scheme() == "https")
        && params.ca_pin.is_none()
    {
        return Err(CmdlineError::Required {
            key: "bc.ca_pin",
            reason: "an https control URL is trusted only through the CA pin",
        });
    }
    Ok(params)
}

fn clip(s: &str) -> String {
    s.chars().take(64).collect()
}

fn invalid(key: &'static str, value: &str, reason: &str) -> CmdlineError {
    CmdlineError::Invalid {
        key,
        value: clip(value),
        reason: reason.to_string(),
    }
}

fn parse_url(value: &str) -> Result<Url, CmdlineError> {
    let url = Url::parse(value).map_err(|e| invalid("bc.url", value, &e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(
            "bc.url",
            value,
            "scheme must be https (or http in a lab)",
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid("bc.url", value, "no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            "bc.url",
            value,
            "credentials do not belong on the kernel command line",
        ));
    }
    Ok(url)
}

fn parse_pin(value: &str) -> Result<CaPin, CmdlineError> {
    let hex_value = value.strip_prefix("sha256:").unwrap_or(value);
    if hex_value.len() != 64 {
        return Err(invalid(
            "bc.ca_pin",
            value,
            "expected sha256:<64 hex characters>",
        ));
    }
    let mut pin = [0u8; 32];
    hex::decode_to_slice(hex_value, &mut pin)
        .map_err(|_| invalid("bc.ca_pin", value, "not hexadecimal"))?;
    Ok(CaPin(pin))
}

fn parse_token_ref(value: &str) -> Result<BootTokenRef, CmdlineError> {
    if ["bcjt_", "bcst_", "bcak_"]
        .iter()
        .any(|p| value.starts_with(p))
    {
        return Err(invalid(
            "bc.boot_token",
            // Do not echo a secret into logs.
            &value.chars().take(5).chain("…".chars()).collect::<String>(),
            "this is a reusable token; pass the reference of a single-use boot token instead",
        ));
    }
    if value.len() > 128
        || !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
    {
        return Err(invalid(
            "bc.boot_token",
            value,
            "expected up to 128 characters of A-Z a-z 0-9 . _ : -",
        ));
    }
    Ok(BootTokenRef(value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PIN: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_a_full_command_line() {
        let line = format!(
            "BOOT_IMAGE=/vmlinuz console=ttyS0 bc.url=https://cp.example:8443/ bc.ca_pin={PIN} bc.boot_token=bt_01HZX bc.mode=diagnose bc.debug quiet\n"
        );
        let p = parse(&line).expect("valid");
        assert_eq!(
            p.control_url.as_ref().map(Url::as_str),
            Some("https://cp.example:8443/")
        );
        assert_eq!(p.ca_pin.map(|c| c.0[0]), Some(0x01));
        assert_eq!(p.boot_token, Some(BootTokenRef("bt_01HZX".into())));
        assert_eq!(p.mode, Mode::Diagnose);
        assert!(p.debug);
    }

    #[test]
    fn quoting_follows_the_kernel() {
        assert_eq!(
            split(r#"a "b c" d="e f" "g=h i""#).expect("balanced"),
            ["a", "b c", "d=e f", "g=h i"]
        );
        let p = parse(r#""bc.url=http://10.0.0.1:8080/x y" bc.mode="rescue""#).expect("quoted");
        assert_eq!(p.mode, Mode::Rescue);
        assert!(p.control_url.is_some());
        assert_eq!(split(r#"bc.url="x"#), Err(CmdlineError::UnterminatedQuote));
    }

    #[test]
    fn clear_errors() {
        let cases: &[(&str, &str)] = &[
            ("bc.mode=rescue bc.urll=x", "unknown parameter bc.urll"),
            (
                "bc.url=http://a/ bc.url=http://b/",
                "bc.url is given more than once",
            ),
            ("bc.url=", "bc.url needs a value"),
            ("bc.url", "bc.url needs a value"),
            ("bc.url=ftp://a/", "scheme must be https"),
            ("bc.url=http://u:p@a/", "credentials"),
            ("bc.url=https://a/", "bc.ca_pin is required"),
            ("bc.mode=diagnose bc.ca_pin=abc", "expected sha256:<64"),
            ("bc.mode=party", "expected agent, diagnose or rescue"),
            ("quiet", "bc.url is required"),
            ("bc.mode=rescue bc.debug=maybe", "bc.debug=1"),
            ("bc.mode=rescue bc.boot_token=a/b", "expected up to 128"),
        ];
        for (line, needle) in cases {
            let err = parse(line).expect_err(line).to_string();
            assert!(err.contains(needle), "{line}: {err}");
        }
    }

    #[test]
    fn reusable_tokens_are_refused_without_echoing_them() {
        let err = parse("bc.mode=rescue bc.boot_token=bcjt_abc.supersecret")
            .expect_err("join token")
            .to_string();
        assert!(err.contains("reusable"), "{err}");
        assert!(!err.contains("supersecret"), "{err}");
    }

    #[test]
    fn http_lab_url_without_pin_is_allowed() {
        let p = parse("bc.url=http://192.168.100.1:8080").expect("lab");
        assert_eq!(p.mode, Mode::Agent);
        assert_eq!(p.ca_pin, None);
    }

    proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,200}") {
            let _ = parse(&s);
        }

        #[test]
        fn never_panics_on_bc_shaped_input(
            parts in prop::collection::vec(
                ("(bc\\.(url|ca_pin|boot_token|mode|debug|x)|[a-z]{1,4})", prop::option::of("[\"a-z0-9:/._= -]{0,20}")),
                0..8,
            )
        ) {
            let line: Vec<String> = parts.iter().map(|(k, v)| match v { Some(v) => format!("{k}={v}"), None => k.clone() }).collect();
            let _ = parse(&line.join(" "));
        }

        #[test]
        fn unquoted_tokens_round_trip(tokens in prop::collection::vec("[a-z0-9._=:/-]{1,12}", 0..10)) {
            prop_assert_eq!(split(&tokens.join("  ")).expect("no quotes"), tokens);
        }
    }
}
