//! sushy-tools' libvirt driver as the lab's BMC: its configuration, its Basic-auth file, and a readiness probe.
//!
//! sushy runs in the site namespace (where `bcd site` runs, as a site agent reaches its BMCs) and listens on that
//! namespace's 127.0.0.1; it reaches libvirtd through libvirtd's unix socket in the lab folder, which no network
//! namespace hides. It needs python3-libvirt: the venv is made with Debian's python3 and
//! `--system-site-packages` (scripts/setup: `.venv-sushy-libvirt`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

/// The port sushy listens on in the site namespace (a fresh namespace: nothing else holds it).
pub const PORT: u16 = 8000;

/// `BC_SUSHY_LIBVIRT` (a `sushy-emulator` whose python can import `libvirt`), else the checkout's
/// `.venv-sushy-libvirt`.
pub fn emulator() -> PathBuf {
    std::env::var_os("BC_SUSHY_LIBVIRT").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-sushy-libvirt/bin/sushy-emulator"),
        PathBuf::from,
    )
}

/// Why the emulator cannot run here, if it cannot.
pub fn missing() -> Option<String> {
    let bin = emulator();
    if !bin.is_file() {
        return Some(format!(
            "{} missing (scripts/setup makes the venv; or set BC_SUSHY_LIBVIRT)",
            bin.display()
        ));
    }
    let python = bin.with_file_name("python3");
    match Command::new(&python)
        .args(["-c", "import libvirt, sushy_tools, bcrypt"])
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{} cannot import libvirt/sushy_tools/bcrypt (python3-libvirt, and a venv with \
             --system-site-packages): {}",
            python.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("{}: {e}", python.display())),
    }
}

/// The emulator's config file (it is Python).
pub fn config(libvirt_uri: &str, state_dir: &Path, auth_file: Option<&Path>) -> String {
    let mut c = format!(
        "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\nSUSHY_EMULATOR_LISTEN_PORT = {PORT}\n\
         SUSHY_EMULATOR_LIBVIRT_URI = '{libvirt_uri}'\nSUSHY_EMULATOR_STATE_DIR = '{}'\n",
        state_dir.display()
    );
    if let Some(a) = auth_file {
        c.push_str(&format!("SUSHY_EMULATOR_AUTH_FILE = '{}'\n", a.display()));
    }
    c
}

/// One htpasswd line with its newline, `user:<bcrypt>`, hashed by the venv's own bcrypt (bc_testkit::sushy).
pub fn htpasswd_line(user: &str, password: &str) -> Result<String> {
    let python = emulator().with_file_name("python3");
    bc_testkit::sushy::htpasswd_line(&python, user, password)
        .map(|line| line + "\n")
        .map_err(anyhow::Error::msg)
}

/// `GET /redfish/v1/` on 127.0.0.1:[`PORT`] of the calling thread's namespace: the HTTP status, if it answered.
pub fn probe() -> Option<u16> {
    bc_testkit::sushy::http_status(PORT, "/redfish/v1/")
}
