//! Rendering a machine's desired boot as an iPXE script (pure: desired boot in, script text out).
//!
//! The script is `#!ipxe`, then `kernel <url> initrd=<name> <cmdline>`, `initrd --name <name> <url>` and `boot`.
//! iPXE's EFI build hands the kernel its initrd only when the command line names it (`initrd=<name>`), so the
//! initrd is always fetched under an explicit name. Artifact references that are not absolute `http(s)://` URLs
//! are served by this site under `/artifacts/`; iPXE resolves them against the script's own URL.
//!
//! Everything rendered is checked first: a control character in a reference or the command line would let the
//! control plane's data inject iPXE commands, so it is refused instead of rendered.

#![deny(clippy::disallowed_methods)]

use std::fmt::Write as _;

use crate::dhcp::MacAddr;

/// What a machine should boot next: kernel, optional initrd and kernel command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredBoot {
    /// `http(s)://…` URL, or a path relative to the artifact cache (`ramdisk/vmlinuz`).
    pub kernel: String,
    /// Same forms as `kernel`.
    pub initrd: Option<String>,
    /// Kernel command line (without `initrd=`, which is added).
    pub cmdline: String,
}

/// A desired boot that cannot be rendered safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("desired boot for {mac} cannot be rendered: {field} {why}")]
pub struct RenderError {
    pub mac: MacAddr,
    pub field: &'static str,
    pub why: &'static str,
}

/// The script for `mac`. Deterministic: golden tests compare it byte for byte.
pub fn render_script(mac: &MacAddr, boot: &DesiredBoot) -> Result<String, RenderError> {
    let err = |field, why| RenderError {
        mac: *mac,
        field,
        why,
    };
    let kernel = reference(&boot.kernel).map_err(|why| err("kernel", why))?;
    check_text(&boot.cmdline).map_err(|why| err("cmdline", why))?;
    if boot
        .cmdline
        .split_whitespace()
        .any(|w| w.starts_with("initrd="))
    {
        return Err(err(
            "cmdline",
            "must not carry initrd= (the script adds it)",
        ));
    }
    let initrd = match &boot.initrd {
        Some(initrd) => {
            let url = reference(initrd).map_err(|why| err("initrd", why))?;
            let name = initrd_name(initrd);
            if name.is_empty() {
                return Err(err("initrd", "has no file name"));
            }
            Some((url, name))
        }
        None => None,
    };

    let mut script = String::new();
    // `write!` to a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(script, "#!ipxe");
    let _ = writeln!(script, "# bcd site: desired boot for {mac}");
    let _ = write!(script, "kernel {kernel}");
    if let Some((_, name)) = &initrd {
        let _ = write!(script, " initrd={name}");
    }
    let cmdline = boot
        .cmdline
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if !cmdline.is_empty() {
        let _ = write!(script, " {cmdline}");
    }
    script.push('\n');
    if let Some((url, name)) = &initrd {
        let _ = writeln!(script, "initrd --name {name} {url}");
    }
    let _ = writeln!(script, "boot");
    Ok(script)
}

/// Absolute URLs pass through; anything else is a path in the artifact cache.
fn reference(r: &str) -> Result<String, &'static str> {
    check_text(r)?;
    let r = r.trim();
    if r.is_empty() {
        return Err("is empty");
    }
    if r.chars().any(char::is_whitespace) {
        return Err("contains whitespace");
    }
    if r.starts_with("http://") || r.starts_with("https://") {
        return Ok(r.to_owned());
    }
    if r.contains("://") {
        return Err("uses a scheme other than http(s)");
    }
    let path = r.trim_start_matches('/');
    if path.split('/').any(|c| c == "..") {
        return Err("contains '..'");
    }
    Ok(format!("/artifacts/{path}"))
}

/// The initrd's name as the kernel sees it: the last path component, without query or fragment.
fn initrd_name(r: &str) -> String {
    let r = r.trim();
    let r = r.split(['?', '#']).next().unwrap_or(r);
    let name = r.rsplit('/').next().unwrap_or(r);
    name.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        .collect()
}

fn check_text(s: &str) -> Result<(), &'static str> {
    if s.chars().any(|c| c.is_control() && c != '\t') {
        return Err("contains a control character (newline?)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac() -> MacAddr {
        MacAddr([0x52, 0x54, 0, 0x12, 0x34, 0x56])
    }

    #[test]
    fn refuses_injection_and_escapes() {
        let ok = DesiredBoot {
            kernel: "k".into(),
            initrd: Some("i.img".into()),
            cmdline: "console=ttyS0".into(),
        };
        assert!(render_script(&mac(), &ok).is_ok());
        let bad = |b: DesiredBoot| render_script(&mac(), &b).err().map(|e| e.field);
        let with = |f: fn(&mut DesiredBoot)| {
            let mut b = ok.clone();
            f(&mut b);
            b
        };
        assert_eq!(
            bad(with(|b| b.cmdline = "x\nshell".into())),
            Some("cmdline")
        );
        assert_eq!(
            bad(with(|b| b.kernel = "../etc/passwd".into())),
            Some("kernel")
        );
        assert_eq!(
            bad(with(|b| b.kernel = "tftp://x/k".into())),
            Some("kernel")
        );
        assert_eq!(bad(with(|b| b.kernel = "a b".into())), Some("kernel"));
        assert_eq!(
            bad(with(|b| b.initrd = Some("http://x/".into()))),
            Some("initrd")
        );
        assert_eq!(
            bad(with(|b| b.cmdline = "initrd=x".into())),
            Some("cmdline")
        );
    }

    #[test]
    fn names_initrd_from_its_last_component() {
        assert_eq!(initrd_name("http://h/a/b/initrd.zst?x=1"), "initrd.zst");
        assert_eq!(initrd_name("ramdisk/initramfs"), "initramfs");
    }
}
