//! The ramdisk's session commands: their arguments, parsed strictly ([`parse`]), and how each runs with the
//! functions of [`crate::actions`] (the same ones the kernel command line's `bc.action` runs).
//!
//! | kind | args | answer |
//! |---|---|---|
//! | `ramdisk.diagnose` | ignored | the diagnose report |
//! | `ramdisk.wipe` | `{"disks": ["vda", "nvme0n1"]}` or `{"disks": "all"}` | per-device evidence, and which failed |
//! | `ramdisk.stream` | `{"url", "sha256" or "sha512", "device"}` | the stream's report (digest, sizes, read-back) |
//! | `ramdisk.kexec` | `{"target", "kernel"?, "initrd"?, "cmdline"?, "seed"?: {"join_token", "user_data"?, "meta_data"?}}` | `{"loaded": true, "reboot_in_ms"}`, then the hand-over once the answer left |
//!
//! Safety: `"disks": "all"` and `ramdisk.kexec` run only when this process is PID 1, i.e. really the ramdisk; a
//! test or operator process refuses them, so it can never wipe or kexec the host it runs on. A named device that is
//! mounted or held is refused by the wipe probe, and likewise before a stream.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::actions::{self, KexecSpec, StreamOptions, WipeView};
use crate::stream::{DigestAlgo, DigestOver, ExpectedDigest};

pub const DIAGNOSE_KIND: &str = "ramdisk.diagnose";
pub const WIPE_KIND: &str = "ramdisk.wipe";
pub const STREAM_KIND: &str = "ramdisk.stream";
pub const KEXEC_KIND: &str = "ramdisk.kexec";
/// Every kind the ramdisk answers.
pub const KINDS: &[&str] = &[DIAGNOSE_KIND, WIPE_KIND, STREAM_KIND, KEXEC_KIND];

pub const WIPE_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.ramdisk-wipe+json";
pub const STREAM_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.ramdisk-stream+json";
pub const KEXEC_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.ramdisk-kexec+json";

/// How long after the answer to `ramdisk.kexec` was handed to the session's HTTP/2 stream the machine jumps: time
/// for the frame to cross the network and the gateway to store it.
pub const KEXEC_DELAY: Duration = Duration::from_secs(2);
/// How long the staged kernel waits for its answer to be handed to a session (one may be reconnecting) before it
/// jumps anyway: the installed system joins with its seed regardless, the command then expires unanswered.
pub const KEXEC_DELIVERY_WAIT: Duration = Duration::from_secs(60);

/// A parsed ramdisk command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RamdiskCommand {
    Diagnose,
    Wipe(WipeArgs),
    Stream(StreamArgs),
    Kexec(KexecArgs),
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WipeArgs {
    pub disks: Disks,
}

/// Which disks to wipe: every whole non-removable disk, or the named ones.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub enum Disks {
    All,
    Named(Vec<String>),
}

impl TryFrom<serde_json::Value> for Disks {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        const WANT: &str = r#"expected "all" or a list of device names such as ["vda", "nvme0n1"]"#;
        match v {
            serde_json::Value::String(s) if s == "all" => Ok(Disks::All),
            serde_json::Value::Array(items) if items.is_empty() => {
                Err(format!("the list is empty; {WANT}"))
            }
            serde_json::Value::Array(items) if items.len() > 256 => {
                Err(format!("{} devices is more than 256", items.len()))
            }
            serde_json::Value::Array(items) => {
                let mut names = Vec::with_capacity(items.len());
                for (i, item) in items.into_iter().enumerate() {
                    let serde_json::Value::String(name) = item else {
                        return Err(format!("entry {i} is not a string; {WANT}"));
                    };
                    check_device(&name).map_err(|e| format!("entry {i}: {e}"))?;
                    if names.contains(&name) {
                        return Err(format!("entry {i}: {name:?} is named twice"));
                    }
                    names.push(name);
                }
                Ok(Disks::Named(names))
            }
            other => Err(format!("{other} is not allowed; {WANT}")),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamArgs {
    /// `http://…` or `https://…`; https servers must chain to the control plane's CA (from join) or `ca_pem`.
    pub url: String,
    pub sha256: Option<String>,
    pub sha512: Option<String>,
    /// The block device to write (`vda`, `nvme0n1`).
    pub device: String,
    /// Extra CA certificates (PEM) to trust for this download, e.g. an internal mirror's. The command is signed by
    /// the control plane's session, so this is the control plane vouching for the mirror.
    pub ca_pem: Option<String>,
}

/// The certificates of a PEM text (at least one, at most 16, nothing else but whitespace between them).
pub fn parse_ca_pem(pem: &str) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    if pem.len() > 256 * 1024 {
        return Err("larger than 256 KiB".into());
    }
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    match certs.len() {
        0 => Err("no CERTIFICATE block".into()),
        n if n > 16 => Err(format!("{n} certificates; at most 16")),
        _ => Ok(certs),
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KexecArgs {
    /// The disk holding the installed root (`vda`).
    pub target: String,
    /// Paths inside the installed root; its `boot/vmlinuz` and `boot/initrd.img` when absent.
    pub kernel: Option<String>,
    pub initrd: Option<String>,
    /// The new kernel's command line; the root's `etc/kernel/cmdline` when absent.
    pub cmdline: Option<String>,
    /// A NoCloud seed for the installed system to join with.
    pub seed: Option<SeedArgs>,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeedArgs {
    /// A single-use join token (`bcjt_…`).
    pub join_token: String,
    /// The operator's cloud-init user-data and meta-data for the NoCloud seed (at most 64 KiB each).
    #[serde(default)]
    pub user_data: String,
    #[serde(default)]
    pub meta_data: String,
}

/// A device name under `/dev`: `vda`, `nvme0n1`, `loop3` — never a path.
fn check_device(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} is not a device name (expected e.g. \"vda\" or \"nvme0n1\", not a path)",
            name.chars().take(40).collect::<String>()
        ))
    }
}

/// A relative path inside the installed root, without `..`.
fn check_root_path(field: &str, p: &str) -> Result<(), String> {
    if p.is_empty() || p.len() > 256 || p.split('/').any(|c| c == "..") || p.contains('\0') {
        return Err(format!(
            "{field}: {:?} must be a path inside the installed root (e.g. boot/vmlinuz) without ..",
            p.chars().take(40).collect::<String>()
        ));
    }
    Ok(())
}

/// Parses the arguments of a ramdisk command (`kind` one of [`KINDS`]). Strict: unknown fields, wrong types and
/// bad values are errors that name the field. `ramdisk.diagnose` takes no arguments and ignores what is sent.
pub fn parse(kind: &str, args: &[u8]) -> Result<RamdiskCommand, String> {
    fn de<T: for<'de> Deserialize<'de>>(kind: &str, args: &[u8]) -> Result<T, String> {
        let args: &[u8] = if args.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            args
        };
        let mut d = serde_json::Deserializer::from_slice(args);
        let v = serde_path_to_error::deserialize(&mut d).map_err(|e| {
            let path = e.path().to_string();
            if path == "." {
                format!("{kind} arguments: {}", e.inner())
            } else {
                format!("{kind} arguments: {path}: {}", e.inner())
            }
        })?;
        d.end()
            .map_err(|e| format!("{kind} arguments: trailing data: {e}"))?;
        Ok(v)
    }
    match kind {
        DIAGNOSE_KIND => Ok(RamdiskCommand::Diagnose),
        WIPE_KIND => de(kind, args).map(RamdiskCommand::Wipe),
        STREAM_KIND => {
            let a: StreamArgs = de(kind, args)?;
            let bad = |field: &str, why: String| format!("{kind} arguments: {field}: {why}");
            let url = reqwest::Url::parse(&a.url).map_err(|e| bad("url", e.to_string()))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(bad(
                    "url",
                    format!("scheme {:?}: only http and https", url.scheme()),
                ));
            }
            if let Some(pem) = &a.ca_pem {
                parse_ca_pem(pem).map_err(|e| bad("ca_pem", e))?;
            }
            match (&a.sha256, &a.sha512) {
                (Some(h), None) => {
                    ExpectedDigest::from_hex(DigestAlgo::Sha256, DigestOver::Compressed, h)
                        .map_err(|e| bad("sha256", e.to_string()))?
                }
                (None, Some(h)) => {
                    ExpectedDigest::from_hex(DigestAlgo::Sha512, DigestOver::Compressed, h)
                        .map_err(|e| bad("sha512", e.to_string()))?
                }
                _ => {
                    return Err(bad(
                        "sha256",
                        "give exactly one of sha256 and sha512 (the image's digest as served)"
                            .into(),
                    ));
                }
            };
            check_device(&a.device).map_err(|e| bad("device", e))?;
            Ok(RamdiskCommand::Stream(a))
        }
        KEXEC_KIND => {
            let a: KexecArgs = de(kind, args)?;
            let bad = |field: &str, why: String| format!("{kind} arguments: {field}: {why}");
            check_device(&a.target).map_err(|e| bad("target", e))?;
            for (field, p) in [("kernel", &a.kernel), ("initrd", &a.initrd)] {
                if let Some(p) = p {
                    check_root_path(field, p).map_err(|e| format!("{kind} arguments: {e}"))?;
                }
            }
            if let Some(c) = &a.cmdline
                && (c.len() > 4096 || c.contains(['\0', '\n']))
            {
                return Err(bad("cmdline", "at most 4096 bytes on one line".into()));
            }
            if let Some(s) = &a.seed {
                if !s.join_token.starts_with("bcjt_") {
                    return Err(bad(
                        "seed.join_token",
                        "expected a single-use join token (bcjt_…)".into(),
                    ));
                }
                for (field, v) in [
                    ("seed.user_data", &s.user_data),
                    ("seed.meta_data", &s.meta_data),
                ] {
                    if v.len() > crate::seed::MAX_OPERATOR_DATA {
                        return Err(bad(field, "at most 64 KiB".into()));
                    }
                }
            }
            Ok(RamdiskCommand::Kexec(a))
        }
        other => Err(format!("{other} is not a ramdisk command")),
    }
}

/// Whether this process is PID 1: only the ramdisk itself may wipe "all" disks or kexec.
pub fn is_pid1() -> bool {
    std::process::id() == 1
}

fn refuse_unless_pid1(what: &str, consequence: &str) -> Result<(), String> {
    if is_pid1() {
        Ok(())
    } else {
        Err(format!(
            "{what} is refused: this process is not PID 1 (pid {}), so it is not the ramdisk and {consequence}",
            std::process::id()
        ))
    }
}

// === execution ===

/// The answer to `ramdisk.wipe`: every device's evidence, and which failed.
#[derive(Clone, Debug, Serialize)]
pub struct WipeResult {
    /// True when every device was wiped.
    pub wiped: bool,
    pub failed: Vec<String>,
    pub devices: Vec<WipeView>,
    /// Disks `"all"` left out (read-only, removable), with why.
    pub skipped: Vec<String>,
}

/// Runs `ramdisk.wipe`; `progress` sees each device as it starts. No device is started past `deadline` (the
/// command's): the control plane has given up by then.
pub fn wipe(
    root: &Path,
    args: &WipeArgs,
    deadline: Option<std::time::Instant>,
    progress: &dyn Fn(serde_json::Value),
) -> Result<WipeResult, String> {
    let (names, skipped) = match &args.disks {
        Disks::All => {
            refuse_unless_pid1(
                r#"disks "all""#,
                "\"all\" would mean the host's own disks; name the devices instead",
            )?;
            actions::all_disks(root)
        }
        Disks::Named(n) => (n.clone(), Vec::new()),
    };
    if names.is_empty() {
        return Err(format!(
            "no disks to wipe (left out: {})",
            skipped.join("; ")
        ));
    }
    let mut devices = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Err(format!(
                "the command's deadline passed with {i} of {} disks done; not started: {} (the control plane \
                 has given up on this wipe and may ask again)",
                names.len(),
                names[i..].join(", ")
            ));
        }
        progress(serde_json::json!({"device": name, "index": i, "of": names.len()}));
        devices.extend(actions::wipe_disks(std::slice::from_ref(name)));
    }
    let failed: Vec<String> = devices
        .iter()
        .filter(|v| !v.wiped)
        .map(|v| v.device.clone())
        .collect();
    Ok(WipeResult {
        wiped: failed.is_empty(),
        failed,
        devices,
        skipped,
    })
}

/// Runs `ramdisk.stream`: refuses a device in use, then streams with progress every `interval` to the console and
/// to `progress` (bytes written, rate, ETA). The download stops at `deadline` (the command's) and what was
/// written is zeroed.
pub fn stream(
    args: &StreamArgs,
    interval: Duration,
    trust: Vec<rustls::pki_types::CertificateDer<'static>>,
    deadline: Option<std::time::Instant>,
    progress: Box<dyn Fn(serde_json::Value) + Send>,
) -> Result<actions::StreamView, String> {
    let caps = crate::wipe::probe_device(&args.device)
        .map_err(|e| format!("probing {}: {}", args.device, bc_error_chain::chain(&e)))?;
    if let Some(why) = caps.in_use {
        return Err(format!("{} is in use: {why}", args.device));
    }
    if caps.read_only {
        return Err(format!("{} is read-only", args.device));
    }
    let url = reqwest::Url::parse(&args.url).map_err(|e| format!("url: {e}"))?;
    let (sha512, hex) = match (&args.sha256, &args.sha512) {
        (_, Some(h)) => (true, h.as_str()),
        (Some(h), None) => (false, h.as_str()),
        (None, None) => return Err("no digest".into()),
    };
    let device = Path::new("/dev").join(&args.device);
    let mut trust = trust;
    if let Some(pem) = &args.ca_pem {
        trust.extend(parse_ca_pem(pem).map_err(|e| format!("ca_pem: {e}"))?);
    }
    let options = StreamOptions {
        trust,
        deadline,
        progress_interval: interval,
        on_progress: Box::new(move |p| {
            progress(serde_json::json!({
                "written": p.written,
                "source_read": p.source_read,
                "source_total": p.source_total,
                "image_total": p.image_total,
                "rate_bps": p.rate_bps as u64,
                "eta_s": p.eta.map(|e| e.as_secs()),
                "elapsed_ms": p.elapsed.as_millis() as u64,
                "done": p.done,
            }))
        }),
    };
    actions::stream_with(&url, sha512, hex, &device, options)
        .map_err(|e| format!("stream to {}: {e}", device.display()))
}

/// The answer to `ramdisk.kexec`, sent before the hand-over.
#[derive(Clone, Debug, Serialize)]
pub struct KexecResult {
    pub loaded: bool,
    pub reboot_in_ms: u64,
    pub staged: actions::StagedView,
}

/// Runs `ramdisk.kexec`: only as PID 1; writes the seed (the installed system joins `control`, the control plane
/// this ramdisk joined), stages the installed kernel and answers only once the kernel accepted it. The jump is the
/// caller's: [`hand_over_once_delivered`] after the signed answer left for the gateway.
pub fn kexec(
    args: &KexecArgs,
    control: Option<crate::seed::ControlPlane>,
) -> Result<KexecResult, String> {
    refuse_unless_pid1(
        "ramdisk.kexec",
        "kexec would replace the running host's kernel",
    )?;
    let staged = actions::stage_installed(&KexecSpec {
        target: &args.target,
        kernel: args.kernel.as_deref(),
        initrd: args.initrd.as_deref(),
        cmdline: args.cmdline.as_deref(),
        join_token: args.seed.as_ref().map(|s| s.join_token.as_str()),
        control,
        user_data: args.seed.as_ref().map_or("", |s| s.user_data.as_str()),
        meta_data: args.seed.as_ref().map_or("", |s| s.meta_data.as_str()),
    })?;
    if !staged.kexec_staged {
        return Err(format!(
            "kexec_file_load of {} failed: {}; nothing staged, the ramdisk stays up",
            staged.kernel,
            staged.error.as_deref().unwrap_or("no reason given")
        ));
    }
    crate::init::report("deploy", &staged);
    Ok(KexecResult {
        loaded: true,
        reboot_in_ms: KEXEC_DELAY.as_millis() as u64,
        staged,
    })
}

/// On its own thread: waits until `delivered` fires (the session handed the signed answer to its stream) or
/// [`KEXEC_DELIVERY_WAIT`] passed, then [`KEXEC_DELAY`] more, then jumps ([`actions::hand_over`], which reboots
/// the firmware way when kexec fails).
pub fn hand_over_once_delivered(delivered: std::sync::mpsc::Receiver<()>) {
    std::thread::spawn(move || {
        let waited = std::time::Instant::now();
        match delivered.recv_timeout(KEXEC_DELIVERY_WAIT) {
            Ok(()) => crate::init::say(&format!(
                "bc-kexec: answer handed to the session after {} ms; jumping in {} ms",
                waited.elapsed().as_millis(),
                KEXEC_DELAY.as_millis()
            )),
            Err(_) => crate::init::say(&format!(
                "bc-kexec: the answer reached no session within {} s; jumping anyway (the command will expire)",
                KEXEC_DELIVERY_WAIT.as_secs()
            )),
        }
        std::thread::sleep(KEXEC_DELAY);
        let why = actions::hand_over(true);
        crate::init::say(&why);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(kind: &str, args: &str) -> String {
        parse(kind, args.as_bytes()).expect_err(args)
    }

    #[test]
    fn wipe_takes_all_or_named_devices() {
        assert_eq!(
            parse(WIPE_KIND, br#"{"disks": "all"}"#),
            Ok(RamdiskCommand::Wipe(WipeArgs { disks: Disks::All }))
        );
        assert_eq!(
            parse(WIPE_KIND, br#"{"disks": ["vda", "nvme0n1"]}"#),
            Ok(RamdiskCommand::Wipe(WipeArgs {
                disks: Disks::Named(vec!["vda".into(), "nvme0n1".into()])
            }))
        );
        for (args, want) in [
            (r#"{}"#, "missing field `disks`"),
            (r#"{"disks": "vda"}"#, "disks"),
            (r#"{"disks": []}"#, "empty"),
            (r#"{"disks": [3]}"#, "entry 0 is not a string"),
            (r#"{"disks": ["../etc"]}"#, "not a device name"),
            (r#"{"disks": ["/dev/vda"]}"#, "not a path"),
            (r#"{"disks": ["vda", "vda"]}"#, "named twice"),
            (
                r#"{"disks": "all", "force": true}"#,
                "unknown field `force`",
            ),
            (r#"[1]"#, "ramdisk.wipe arguments"),
            (r#"{"disks": "all"} x"#, "trailing"),
        ] {
            let e = err(WIPE_KIND, args);
            assert!(e.contains(want), "{args}: {e}");
            assert!(e.starts_with("ramdisk.wipe arguments"), "{e}");
        }
        assert!(err(WIPE_KIND, r#"{"disks": 7}"#).contains("disks:"));
    }

    #[test]
    fn stream_needs_an_http_url_one_digest_and_a_device() {
        let sha = "ab".repeat(32);
        let ok =
            format!(r#"{{"url": "http://10.0.0.1/i.zst", "sha256": "{sha}", "device": "vda"}}"#);
        assert!(matches!(
            parse(STREAM_KIND, ok.as_bytes()),
            Ok(RamdiskCommand::Stream(_))
        ));
        let sha512 = "cd".repeat(64);
        let ok512 =
            format!(r#"{{"url": "http://h/i", "sha512": "{sha512}", "device": "nvme0n1"}}"#);
        assert!(parse(STREAM_KIND, ok512.as_bytes()).is_ok());
        for (args, want) in [
            (
                format!(r#"{{"url": "http://h/i", "sha256": "{sha}"}}"#),
                "missing field `device`",
            ),
            (
                format!(r#"{{"url": "ftp://h/i", "sha256": "{sha}", "device": "vda"}}"#),
                "url: scheme",
            ),
            (
                format!(r#"{{"url": "not a url", "sha256": "{sha}", "device": "vda"}}"#),
                "url:",
            ),
            (
                r#"{"url": "http://h/i", "sha256": "abc", "device": "vda"}"#.to_string(),
                "sha256:",
            ),
            (
                r#"{"url": "http://h/i", "device": "vda"}"#.to_string(),
                "exactly one of sha256 and sha512",
            ),
            (
                format!(
                    r#"{{"url": "http://h/i", "sha256": "{sha}", "sha512": "{sha512}", "device": "vda"}}"#
                ),
                "exactly one",
            ),
            (
                format!(r#"{{"url": "http://h/i", "sha256": "{sha}", "device": "a/b"}}"#),
                "device:",
            ),
            (
                format!(
                    r#"{{"url": "http://h/i", "sha256": "{sha}", "device": "vda", "size": 1}}"#
                ),
                "unknown field `size`",
            ),
            (
                format!(r#"{{"url": 5, "sha256": "{sha}", "device": "vda"}}"#),
                "url: invalid type",
            ),
        ] {
            let e = err(STREAM_KIND, &args);
            assert!(e.contains(want), "{args}: {e}");
        }
    }

    #[test]
    fn kexec_arguments_stay_inside_the_installed_root() {
        assert!(parse(KEXEC_KIND, br#"{"target": "vda"}"#).is_ok());
        assert!(
            parse(
                KEXEC_KIND,
                br#"{"target": "vda", "kernel": "boot/vmlinuz-6.1", "initrd": "boot/initrd.img-6.1",
                     "cmdline": "root=LABEL=root ro", "seed": {"join_token": "bcjt_x.y"}}"#
            )
            .is_ok()
        );
        for (args, want) in [
            (r#"{"kernel": "boot/vmlinuz"}"#, "missing field `target`"),
            (r#"{"target": "vda", "kernel": "../../x"}"#, "kernel:"),
            (r#"{"target": "vda", "initrd": ""}"#, "initrd:"),
            (r#"{"target": "vda", "cmdline": "a\nb"}"#, "cmdline:"),
            (
                r#"{"target": "vda", "seed": {"join_token": "secret"}}"#,
                "seed.join_token",
            ),
            (
                r#"{"target": "vda", "seed": {"token": "bcjt_x"}}"#,
                "seed.token: unknown field `token`",
            ),
            (
                r#"{"target": "vda", "reboot": false}"#,
                "unknown field `reboot`",
            ),
        ] {
            let e = err(KEXEC_KIND, args);
            assert!(e.contains(want), "{args}: {e}");
        }
    }

    #[test]
    fn diagnose_ignores_its_arguments_and_other_kinds_are_not_ours() {
        assert_eq!(
            parse(DIAGNOSE_KIND, b"not json"),
            Ok(RamdiskCommand::Diagnose)
        );
        assert!(err("ramdisk.dance", "{}").contains("not a ramdisk command"));
    }

    /// Past the command's deadline no disk is started (these names do not exist: touching one would fail
    /// differently).
    #[test]
    fn a_wipe_past_its_deadline_starts_no_disk() {
        let started = std::cell::Cell::new(0);
        let e = wipe(
            Path::new("/nonexistent"),
            &WipeArgs {
                disks: Disks::Named(vec!["bc-none-0".into(), "bc-none-1".into()]),
            },
            Some(std::time::Instant::now()),
            &|_| started.set(started.get() + 1),
        )
        .expect_err("past its deadline");
        assert_eq!(
            e,
            "the command's deadline passed with 0 of 2 disks done; not started: bc-none-0, bc-none-1 (the \
             control plane has given up on this wipe and may ask again)"
        );
        assert_eq!(started.get(), 0);
    }

    #[test]
    fn all_disks_and_kexec_are_refused_outside_pid_1() {
        assert!(!is_pid1(), "tests never run as PID 1");
        let e = wipe(
            Path::new("/nonexistent"),
            &WipeArgs { disks: Disks::All },
            None,
            &|_| {},
        )
        .expect_err("refused");
        assert!(
            e.contains("not PID 1") && e.contains("name the devices"),
            "{e}"
        );
        let e = kexec(
            &KexecArgs {
                target: "vda".into(),
                kernel: None,
                initrd: None,
                cmdline: None,
                seed: None,
            },
            None,
        )
        .expect_err("refused");
        assert!(e.contains("not PID 1") && e.contains("kexec"), "{e}");
    }
}
