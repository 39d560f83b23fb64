//! Ramdisk parameters from the kernel command line (`/proc/cmdline`).
//!
//! | parameter | meaning |
//! |---|---|
//! | `bc.url=` | the gateway URL, `https://host:port`; required in `agent` mode (`http://` only outside agent mode) |
//! | `bc.ca_pin=` | SHA-256 of the control-plane CA's SubjectPublicKeyInfo (as `bcd.toml`'s `ca_pin`), `sha256:<64 hex>` or bare hex; required for https |
//! | `bc.join_key=` | JoinService's HPKE public key (base64url, as `bcd.toml`'s `join_public_key`); required in `agent` mode |
//! | `bc.boot_token=` | the single-use boot token: a join token minted with `--uses 1` (`bcjt_…`, what agent mode joins with), or in `run` mode a reference for the NoCloud seed; site tokens and API keys are refused |
//! | `bc.mode=` | `agent` (default: join as the machine's node and answer commands), `diagnose` (report and power off), `rescue` (stop after bring-up), `run` (the `bc.action` list, then power off; implied by `bc.action`) |
//! | `bc.debug` | verbose logs (`bc.debug`, `bc.debug=1|0|true|false`) |
//! | `bc.action=` | comma-separated, run in order: `diagnose`, `wipe`, `stream`, `kexec` (write the NoCloud seed onto the installed root, then kexec into its kernel) |
//! | `bc.disks=` | what `wipe` erases: `all` (default: every whole disk but read-only and removable media) or a comma-separated list of names (`vda,nvme0n1`) |
//! | `bc.image=` | image URL for `stream` (`http://` or `https://`) |
//! | `bc.image_sha256=`, `bc.image_sha512=` | digest of the image bytes as served (exactly one, required with `stream`) |
//! | `bc.target=` | disk `stream` writes and `kexec` boots from (`vda`, `nvme0n1`) |
//! | `bc.kexec_cmdline=` | command line of the installed kernel (default: the installed root's `/etc/kernel/cmdline`) |
//! | `bc.nic=` | the boot NIC by name; default: `BOOTIF=` (PXE) by MAC, else the first NIC with a carrier |
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
    Run,
}

/// One step of `bc.action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Diagnose,
    Wipe,
    Stream,
    Kexec,
}

/// Which disks `wipe` erases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DiskSelection {
    #[default]
    All,
    Named(Vec<String>),
}

/// Digest algorithm and hex value of `bc.image_sha256` / `bc.image_sha512`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageDigest {
    pub sha512: bool,
    pub hex: String,
}

/// SHA-256 of the control-plane CA certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaPin(pub [u8; 32]);

/// The single-use boot token: a one-use join token (`bcjt_…`, agent mode joins with it) or an opaque reference
/// (`run` mode writes it into the NoCloud seed). Its `Debug` never shows a join token's secret.
#[derive(Clone, PartialEq, Eq)]
pub struct BootTokenRef(pub String);

impl BootTokenRef {
    /// Whether this is a join token (`bcjt_<id>.<secret>`, already checked well-formed).
    pub fn is_join_token(&self) -> bool {
        self.0
            .starts_with(bc_proto::token::TokenKind::Join.prefix())
    }
}

impl std::fmt::Debug for BootTokenRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_join_token() {
            let id = self.0.split('.').next().unwrap_or_default();
            write!(f, "BootTokenRef({id}.…)")
        } else {
            write!(f, "BootTokenRef({:?})", self.0)
        }
    }
}

/// JoinService's public key as given (base64url), checked to decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinKey(pub String);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamdiskParams {
    pub control_url: Option<Url>,
    pub ca_pin: Option<CaPin>,
    pub join_key: Option<JoinKey>,
    pub boot_token: Option<BootTokenRef>,
    pub mode: Mode,
    pub debug: bool,
    pub actions: Vec<Action>,
    pub disks: DiskSelection,
    pub image: Option<Url>,
    pub image_digest: Option<ImageDigest>,
    pub target: Option<String>,
    pub kexec_cmdline: Option<String>,
    pub nic: Option<String>,
    /// The PXE boot NIC's MAC from `BOOTIF=01-aa-bb-cc-dd-ee-ff` (pxelinux and iPXE convention).
    pub boot_mac: Option<[u8; 6]>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CmdlineError {
    #[error("kernel command line has an unterminated quote")]
    UnterminatedQuote,
    #[error(
        "unknown parameter {key} (known: bc.url, bc.ca_pin, bc.join_key, bc.boot_token, bc.mode, bc.debug, bc.action, bc.disks, bc.image, bc.image_sha256, bc.image_sha512, bc.target, bc.kexec_cmdline, bc.nic)"
    )]
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
        join_key: None,
        boot_token: None,
        mode: Mode::Agent,
        debug: false,
        actions: Vec::new(),
        disks: DiskSelection::All,
        image: None,
        image_digest: None,
        target: None,
        kexec_cmdline: None,
        nic: None,
        boot_mac: None,
    };
    let mut mode_given = false;
    let mut seen: Vec<&'static str> = Vec::new();
    for token in split(cmdline)? {
        let (key, value) = match token.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (token.as_str(), None),
        };
        if key == "BOOTIF" {
            // Not ours to police: a malformed BOOTIF is ignored (the NIC is then chosen by carrier).
            params.boot_mac = value.and_then(parse_bootif);
            continue;
        }
        if !key.starts_with("bc.") {
            continue;
        }
        const KEYS: [&str; 14] = [
            "bc.url",
            "bc.ca_pin",
            "bc.join_key",
            "bc.boot_token",
            "bc.mode",
            "bc.debug",
            "bc.action",
            "bc.disks",
            "bc.image",
            "bc.image_sha256",
            "bc.image_sha512",
            "bc.target",
            "bc.kexec_cmdline",
            "bc.nic",
        ];
        let key: &'static str = match KEYS.iter().find(|k| **k == key) {
            Some(k) => k,
            None => return Err(CmdlineError::Unknown { key: clip(key) }),
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
            "bc.join_key" => {
                bc_proto::seal::JoinPublicKey::parse(value).map_err(|_| {
                    invalid(
                        key,
                        value,
                        "expected JoinService's public key, base64url (join_public_key in bcd.toml)",
                    )
                })?;
                params.join_key = Some(JoinKey(value.to_string()));
            }
            "bc.boot_token" => params.boot_token = Some(parse_token_ref(value)?),
            "bc.action" => params.actions = parse_actions(value)?,
            "bc.disks" => params.disks = parse_disks(value)?,
            "bc.image" => params.image = Some(parse_url_for("bc.image", value)?),
            "bc.image_sha256" | "bc.image_sha512" => {
                if params.image_digest.is_some() {
                    return Err(invalid(
                        key,
                        value,
                        "give bc.image_sha256 or bc.image_sha512, not both",
                    ));
                }
                let sha512 = key == "bc.image_sha512";
                let want = if sha512 { 128 } else { 64 };
                if value.len() != want || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(invalid(
                        key,
                        value,
                        &format!("expected {want} hex characters"),
                    ));
                }
                params.image_digest = Some(ImageDigest {
                    sha512,
                    hex: value.to_ascii_lowercase(),
                });
            }
            "bc.target" => params.target = Some(parse_disk_name(key, value)?),
            "bc.nic" => params.nic = Some(parse_disk_name(key, value)?),
            "bc.kexec_cmdline" => {
                if value.len() > 2048 {
                    return Err(invalid(key, value, "longer than 2048 bytes"));
                }
                params.kexec_cmdline = Some(value.to_string());
            }
            _ => {
                mode_given = true;
                params.mode = match value {
                    "agent" => Mode::Agent,
                    "diagnose" => Mode::Diagnose,
                    "rescue" => Mode::Rescue,
                    "run" => Mode::Run,
                    v => return Err(invalid(key, v, "expected agent, diagnose, rescue or run")),
                }
            }
        }
    }
    if !params.actions.is_empty() {
        if !mode_given {
            params.mode = Mode::Run;
        } else if params.mode != Mode::Run {
            return Err(CmdlineError::Required {
                key: "bc.mode",
                reason: "bc.action runs only with bc.mode=run (or no bc.mode)",
            });
        }
    }
    if params.mode == Mode::Diagnose && params.actions.is_empty() {
        params.actions.push(Action::Diagnose);
    }
    if params.mode == Mode::Run && params.actions.is_empty() {
        return Err(CmdlineError::Required {
            key: "bc.action",
            reason: "bc.mode=run needs the actions to run",
        });
    }
    if params.actions.contains(&Action::Stream) {
        if params.image.is_none() {
            return Err(CmdlineError::Required {
                key: "bc.image",
                reason: "the stream action needs the image URL",
            });
        }
        if params.image_digest.is_none() {
            return Err(CmdlineError::Required {
                key: "bc.image_sha256",
                reason: "an image is written only when its digest is known (or bc.image_sha512)",
            });
        }
    }
    if params.target.is_none()
        && params
            .actions
            .iter()
            .any(|a| matches!(a, Action::Stream | Action::Kexec))
    {
        return Err(CmdlineError::Required {
            key: "bc.target",
            reason: "stream and kexec need the disk that holds the installed system",
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
    if params.mode == Mode::Agent {
        check_agent(&params)?;
    }
    Ok(params)
}

/// Agent mode joins the control plane: the gateway's https URL, the CA pin, JoinService's key and a one-use join
/// token must all be on the command line.
fn check_agent(params: &RamdiskParams) -> Result<(), CmdlineError> {
    let Some(url) = &params.control_url else {
        return Err(CmdlineError::Required {
            key: "bc.url",
            reason: "agent mode joins the control plane (bc.url=https://<gateway>:<port>)",
        });
    };
    if url.scheme() != "https" {
        return Err(invalid(
            "bc.url",
            url.as_str(),
            "agent mode talks to the gateway over mutual TLS: use https://<gateway>:<port>",
        ));
    }
    if params.join_key.is_none() {
        return Err(CmdlineError::Required {
            key: "bc.join_key",
            reason: "agent mode seals the boot token to JoinService's public key",
        });
    }
    if !params
        .boot_token
        .as_ref()
        .is_some_and(BootTokenRef::is_join_token)
    {
        return Err(CmdlineError::Required {
            key: "bc.boot_token",
            reason: "agent mode joins with a one-use join token (bcjt_…, created with --uses 1)",
        });
    }
    Ok(())
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
    parse_url_for("bc.url", value)
}

fn parse_url_for(key: &'static str, value: &str) -> Result<Url, CmdlineError> {
    let url = Url::parse(value).map_err(|e| invalid(key, value, &e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(
            key,
            value,
            "scheme must be https (or http in a lab)",
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(key, value, "no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            key,
            value,
            "credentials do not belong on the kernel command line",
        ));
    }
    Ok(url)
}

fn parse_actions(value: &str) -> Result<Vec<Action>, CmdlineError> {
    let mut out = Vec::new();
    for word in value.split(',') {
        let action = match word {
            "diagnose" => Action::Diagnose,
            "wipe" => Action::Wipe,
            "stream" => Action::Stream,
            "kexec" => Action::Kexec,
            w => {
                return Err(invalid(
                    "bc.action",
                    w,
                    "expected a comma-separated list of diagnose, wipe, stream, kexec",
                ));
            }
        };
        if out.contains(&action) {
            return Err(invalid("bc.action", value, "an action is listed twice"));
        }
        out.push(action);
    }
    if out
        .iter()
        .position(|a| *a == Action::Kexec)
        .is_some_and(|k| k + 1 != out.len())
    {
        return Err(invalid(
            "bc.action",
            value,
            "kexec leaves the ramdisk and must come last",
        ));
    }
    let wipe = out.iter().position(|a| *a == Action::Wipe);
    let stream = out.iter().position(|a| *a == Action::Stream);
    if let (Some(w), Some(s)) = (wipe, stream)
        && w > s
    {
        return Err(invalid(
            "bc.action",
            value,
            "wipe after stream would erase the new image",
        ));
    }
    Ok(out)
}

fn parse_disks(value: &str) -> Result<DiskSelection, CmdlineError> {
    if value == "all" {
        return Ok(DiskSelection::All);
    }
    value
        .split(',')
        .map(|d| parse_disk_name("bc.disks", d))
        .collect::<Result<Vec<_>, _>>()
        .map(DiskSelection::Named)
}

/// A kernel device or interface name: 1..=32 of `a-z A-Z 0-9 _ . -`, no slash (it is joined to `/dev/`).
fn parse_disk_name(key: &'static str, value: &str) -> Result<String, CmdlineError> {
    if value.is_empty()
        || value.len() > 32
        || value.starts_with('.')
        || !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
    {
        return Err(invalid(
            key,
            value,
            "expected a device name such as vda or nvme0n1",
        ));
    }
    Ok(value.to_string())
}

/// `01-aa-bb-cc-dd-ee-ff` (ARP type 1, Ethernet) → the MAC.
fn parse_bootif(value: &str) -> Option<[u8; 6]> {
    let rest = value.strip_prefix("01-")?;
    let parts: Vec<&str> = rest.split(['-', ':']).collect();
    if parts.len() != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return None;
        }
        *m = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
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

/// The boot token rule: a join token (`bcjt_`) is accepted as the single-use boot token — the command line is
/// readable by anything on the machine, so it must be minted with `--uses 1` (the ramdisk cannot see the count;
/// once the ramdisk has joined, the copy on the command line is spent). Site tokens (`bcst_`) and API keys
/// (`bcak_`) are reusable credentials and are refused. Neither message echoes a secret.
fn parse_token_ref(value: &str) -> Result<BootTokenRef, CmdlineError> {
    use bc_proto::token::{Token, TokenKind};
    let redacted = || value.chars().take(5).chain("…".chars()).collect::<String>();
    if value.starts_with(TokenKind::Join.prefix()) {
        return match Token::parse(TokenKind::Join, value) {
            Ok(_) => Ok(BootTokenRef(value.to_string())),
            Err(e) => Err(invalid("bc.boot_token", &redacted(), &e.to_string())),
        };
    }
    if [TokenKind::Site, TokenKind::ApiKey]
        .iter()
        .any(|k| value.starts_with(k.prefix()))
    {
        return Err(invalid(
            "bc.boot_token",
            &redacted(),
            "site tokens and API keys are reusable credentials and never go on a kernel command line; \
             pass a one-use join token (bcjt_…, join-tokens create --uses 1)",
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
            ("bc.mode=party", "expected agent, diagnose, rescue or run"),
            (
                "bc.action=diagnose,dance",
                "expected a comma-separated list",
            ),
            ("bc.action=kexec,diagnose bc.target=vda", "must come last"),
            ("bc.action=stream,wipe bc.target=vda", "wipe after stream"),
            ("bc.action=diagnose,diagnose", "listed twice"),
            ("bc.action=stream bc.target=vda", "bc.image is required"),
            (
                "bc.action=stream bc.target=vda bc.image=http://a/i",
                "bc.image_sha256 is required",
            ),
            (
                "bc.action=stream bc.image=http://a/i bc.image_sha256=00",
                "expected 64 hex",
            ),
            ("bc.action=kexec", "bc.target is required"),
            ("bc.action=wipe bc.disks=../sda", "expected a device name"),
            (
                "bc.action=wipe bc.mode=agent bc.url=http://a/",
                "bc.action runs only with bc.mode=run",
            ),
            ("bc.mode=run", "bc.action is required"),
            ("quiet", "bc.url is required"),
            ("bc.mode=rescue bc.debug=maybe", "bc.debug=1"),
            ("bc.mode=rescue bc.boot_token=a/b", "expected up to 128"),
        ];
        for (line, needle) in cases {
            let err = parse(line).expect_err(line).to_string();
            assert!(err.contains(needle), "{line}: {err}");
        }
    }

    /// A syntactically valid join token (not a real one).
    const JOIN_TOKEN: &str = "bcjt_0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

    fn join_key() -> String {
        bc_proto::seal::generate_join_keypair().1.encode()
    }

    #[test]
    fn reusable_tokens_are_refused_without_echoing_them() {
        for t in [
            "bcst_0123456789abcdef.supersecretsupersecretsupersecretsupersecr",
            "bcak_0123456789abcdef.supersecretsupersecretsupersecretsupersecr",
        ] {
            let err = parse(&format!("bc.mode=rescue bc.boot_token={t}"))
                .expect_err("reusable token")
                .to_string();
            assert!(err.contains("reusable"), "{err}");
            assert!(!err.contains("supersecret"), "{err}");
        }
        let err = parse("bc.mode=rescue bc.boot_token=bcjt_abc.supersecret")
            .expect_err("malformed join token")
            .to_string();
        assert!(err.contains("token id must be"), "{err}");
        assert!(!err.contains("supersecret"), "{err}");
    }

    #[test]
    fn agent_mode_needs_gateway_pin_key_and_a_join_token() {
        let key = join_key();
        let ok = format!(
            "bc.url=https://10.99.0.1:8443 bc.ca_pin={PIN} bc.join_key={key} bc.boot_token={JOIN_TOKEN}"
        );
        let p = parse(&ok).expect("agent");
        assert_eq!(p.mode, Mode::Agent);
        assert!(
            p.boot_token
                .as_ref()
                .is_some_and(BootTokenRef::is_join_token)
        );
        assert_eq!(p.join_key, Some(JoinKey(key.clone())));
        assert!(
            !format!("{p:?}").contains("AAAAAAAA"),
            "Debug shows the secret: {p:?}"
        );
        let cases = [
            (
                format!(
                    "bc.url=http://10.99.0.1:8443 bc.join_key={key} bc.boot_token={JOIN_TOKEN}"
                ),
                "use https",
            ),
            (
                format!("bc.url=https://a:1 bc.ca_pin={PIN} bc.boot_token={JOIN_TOKEN}"),
                "bc.join_key is required",
            ),
            (
                format!("bc.url=https://a:1 bc.ca_pin={PIN} bc.join_key={key}"),
                "bc.boot_token is required",
            ),
            (
                format!(
                    "bc.url=https://a:1 bc.ca_pin={PIN} bc.join_key={key} bc.boot_token=bt_ref_1"
                ),
                "one-use join token",
            ),
            (
                format!("bc.url=https://a:1 bc.join_key={key} bc.boot_token={JOIN_TOKEN}"),
                "bc.ca_pin is required",
            ),
            (
                "bc.mode=rescue bc.join_key=notakey".to_string(),
                "JoinService's public key",
            ),
        ];
        for (line, needle) in &cases {
            let err = parse(line).expect_err(line).to_string();
            assert!(err.contains(needle), "{line}: {err}");
        }
    }

    #[test]
    fn actions_and_their_parameters() {
        let sha = "ab".repeat(32);
        let p = parse(&format!(
            "console=ttyS0 BOOTIF=01-52-54-00-12-34-56 bc.action=diagnose,wipe,stream,kexec bc.disks=vda,nvme0n1 \
             bc.image=http://10.0.0.1:8080/os.img bc.image_sha256={sha} bc.target=vda \
             \"bc.kexec_cmdline=console=ttyS0 quiet\" bc.boot_token=bt_1"
        ))
        .expect("valid");
        assert_eq!(p.mode, Mode::Run);
        assert_eq!(
            p.actions,
            [
                Action::Diagnose,
                Action::Wipe,
                Action::Stream,
                Action::Kexec
            ]
        );
        assert_eq!(
            p.disks,
            DiskSelection::Named(vec!["vda".into(), "nvme0n1".into()])
        );
        assert_eq!(p.image_digest.as_ref().map(|d| d.sha512), Some(false));
        assert_eq!(p.target.as_deref(), Some("vda"));
        assert_eq!(p.kexec_cmdline.as_deref(), Some("console=ttyS0 quiet"));
        assert_eq!(p.boot_mac, Some([0x52, 0x54, 0, 0x12, 0x34, 0x56]));
        let p = parse("bc.mode=diagnose").expect("diagnose");
        assert_eq!(p.actions, [Action::Diagnose]);
        assert_eq!(
            parse("bc.action=wipe").expect("wipe").disks,
            DiskSelection::All
        );
        assert_eq!(
            parse("BOOTIF=zz bc.mode=rescue")
                .expect("bad BOOTIF ignored")
                .boot_mac,
            None
        );
    }

    #[test]
    fn http_lab_url_without_pin_is_allowed_outside_agent_mode() {
        let p = parse("bc.mode=diagnose bc.url=http://192.168.100.1:8080").expect("lab");
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
                ("(bc\\.(url|ca_pin|join_key|boot_token|mode|debug|x)|[a-z]{1,4})", prop::option::of("[\"a-z0-9:/._= -]{0,20}")),
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
