//! A systemd unit's sandbox, reproduced for a daemon started by a test where systemd is not PID 1.
//!
//! The sandbox comes from the unit's own `[Service]` lines, with their documented semantics (systemd.exec(5)),
//! over a staging root (the tree an install wrote, with the unit's paths under it):
//! - `ProtectSystem=` makes /usr, /boot, /efi (`yes`), also /etc (`full`), or everything (`strict`) read-only;
//!   `ReadWritePaths=` (a leading `-`: optional) and `StateDirectory=` stay writable and must exist, or systemd
//!   refuses the unit (226/NAMESPACE);
//! - `CapabilityBoundingSet=` bounds what the daemon (root or not) can ever hold, `AmbientCapabilities=` is what
//!   a non-root daemon keeps, `DynamicUser=yes` runs it as an unprivileged user (nobody here), `NoNewPrivileges=`
//!   and `UMask=` apply as written.
//!
//! The mounts are made in a private mount namespace (`unshare`) that dies with the daemon; the credentials are
//! set by util-linux's `setpriv` right before the daemon is executed. Paths outside the staging root are not
//! made read-only: what this proves is that the daemon does its job with what its unit leaves it.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

/// The uid and gid a `DynamicUser=yes` unit runs as here (nobody/nogroup).
pub const DYNAMIC_USER: u32 = 65534;

/// The sandbox lines of a unit's `[Service]` section.
#[derive(Debug, Default, Clone)]
pub struct Sandbox {
    pub protect_system: String,
    /// (path, optional: a leading `-`)
    pub read_write: Vec<(String, bool)>,
    /// As absolute paths (/var/lib/<name>).
    pub state_directories: Vec<String>,
    /// None: the line is absent (every capability). Names lower-case without `cap_` (setpriv's spelling).
    pub bounding: Option<Vec<String>>,
    pub ambient: Vec<String>,
    pub dynamic_user: bool,
    pub no_new_privileges: bool,
    pub umask: Option<String>,
    /// Also a private network namespace with only `lo` (up): a test's own copy of fixed ports (67, 69, 80).
    /// Not a unit line (`PrivateNetwork=` would cut a daemon off its segment); set by the test.
    pub private_network: bool,
}

fn caps(value: &str) -> Vec<String> {
    value
        .split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_ascii_lowercase())
        .collect()
}

fn yes(value: &str) -> bool {
    matches!(value.trim(), "yes" | "true" | "1" | "on")
}

impl Sandbox {
    pub fn parse(unit: &str) -> Sandbox {
        let mut s = Sandbox::default();
        let mut service = false;
        for line in unit.lines().map(str::trim) {
            if line.starts_with('[') {
                service = line == "[Service]";
                continue;
            }
            let Some((key, value)) = line.split_once('=').filter(|_| service) else {
                continue;
            };
            let value = value.trim();
            match key.trim() {
                "ProtectSystem" => s.protect_system = value.to_string(),
                "ReadWritePaths" => s.read_write.extend(value.split_whitespace().map(|p| {
                    let p = p.trim_start_matches('+');
                    match p.strip_prefix('-') {
                        Some(rest) => (rest.to_string(), true),
                        None => (p.to_string(), false),
                    }
                })),
                "StateDirectory" => s
                    .state_directories
                    .extend(value.split_whitespace().map(|d| format!("/var/lib/{d}"))),
                // Lines add up; an empty assignment resets to "none" (systemd.exec(5)).
                "CapabilityBoundingSet" => {
                    let b = s.bounding.get_or_insert_with(Vec::new);
                    if value.is_empty() {
                        b.clear();
                    } else {
                        b.extend(caps(value));
                    }
                }
                "AmbientCapabilities" => s.ambient.extend(caps(value)),
                "DynamicUser" => s.dynamic_user = yes(value),
                "NoNewPrivileges" => s.no_new_privileges = yes(value),
                "UMask" => s.umask = Some(value.to_string()),
                _ => {}
            }
        }
        s
    }

    fn read_only(&self) -> &'static [&'static str] {
        match self.protect_system.as_str() {
            "yes" | "true" => &["/usr", "/boot", "/efi"],
            "full" => &["/usr", "/boot", "/efi", "/etc"],
            "strict" => &["/"],
            _ => &[],
        }
    }

    /// A shell script that sets up this sandbox over the staging root `root` and then runs its arguments.
    /// Err when a required writable path is missing (systemd refuses such a unit: 226/NAMESPACE).
    pub fn script(&self, root: &Path) -> Result<String, String> {
        let mut sh = String::from("set -e\n");
        if self.private_network {
            sh.push_str("ip link set lo up\n");
        }
        let at = |p: &str| root.join(p.trim_start_matches('/'));
        for p in self.read_only() {
            let path = at(p);
            if path.exists() {
                sh.push_str(&format!(
                    "mount --bind '{0}' '{0}'\nmount -o remount,bind,ro '{0}'\n",
                    path.display()
                ));
            }
        }
        let writable = self
            .read_write
            .iter()
            .cloned()
            .chain(self.state_directories.iter().map(|d| (d.clone(), false)));
        for (p, optional) in writable {
            let path = at(&p);
            if !path.is_dir() {
                if optional {
                    continue;
                }
                return Err(format!(
                    "{p} is writable in the unit but does not exist: systemd would refuse to start it"
                ));
            }
            sh.push_str(&format!(
                "mount --bind '{0}' '{0}'\nmount -o remount,bind,rw '{0}'\n",
                path.display()
            ));
        }
        // systemd names the main process as the watchdog's (sd_watchdog_enabled(3) checks it): this shell's PID,
        // which the daemon keeps through the execs below.
        sh.push_str("if [ -n \"${WATCHDOG_USEC:-}\" ]; then export WATCHDOG_PID=$$; fi\n");
        if let Some(mask) = &self.umask {
            sh.push_str(&format!("umask {mask}\n"));
        }
        sh.push_str(&format!(
            "exec setpriv {} -- \"$@\"\n",
            self.setpriv_args().join(" ")
        ));
        Ok(sh)
    }

    /// setpriv's options for the unit's credentials.
    fn setpriv_args(&self) -> Vec<String> {
        let list = |names: &[String]| {
            std::iter::once("-all".to_string())
                .chain(names.iter().map(|c| format!("+{c}")))
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut a = Vec::new();
        if self.no_new_privileges {
            a.push("--no-new-privs".to_string());
        }
        if let Some(b) = &self.bounding {
            a.push(format!("--bounding-set={}", list(b)));
        }
        if self.dynamic_user {
            a.push(format!(
                "--reuid={DYNAMIC_USER} --regid={DYNAMIC_USER} --clear-groups"
            ));
            a.push(format!("--inh-caps={}", list(&self.ambient)));
            if !self.ambient.is_empty() {
                a.push(format!("--ambient-caps={}", list(&self.ambient)));
            }
        }
        a
    }

    /// `args` run under this sandbox over `root`: a private mount namespace (`unshare`), then setpriv.
    pub fn command(&self, root: &Path, args: &[&OsStr]) -> Result<Command, String> {
        let mut cmd = Command::new("unshare");
        if self.private_network {
            cmd.arg("--net");
        }
        cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(self.script(root)?)
            .arg("sh")
            .args(args);
        Ok(cmd)
    }
}

/// Whether this process may reproduce a sandbox: make mount namespaces (root, or CAP_SYS_ADMIN) with `unshare`
/// and `mount`, and set credentials with `setpriv`. Err says what is missing.
pub fn can_sandbox() -> Result<(), String> {
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "mount",
            "--bind",
            "/",
            "/",
        ])
        .output()
        .map_err(|e| format!("unshare is unavailable: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cannot make a mount namespace here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    match Command::new("setpriv").args(["--dump"]).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "setpriv --dump failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("setpriv (util-linux) is unavailable: {e}")),
    }
}

/// What a daemon told its service manager (sd_notify(3)), received on a datagram socket of the test's, as
/// systemd would on `NOTIFY_SOCKET`. Blocking: from an async test call it inside `tokio::task::block_in_place`.
pub struct Notifications {
    socket: std::os::unix::net::UnixDatagram,
    /// Give the daemon `NOTIFY_SOCKET=<path>`.
    pub path: std::path::PathBuf,
    /// Every line received so far, in order.
    pub seen: Vec<String>,
}

impl Notifications {
    /// Binds `<dir>/notify.sock`, writable by any user (a `DynamicUser=` daemon sends to it too).
    pub fn bind(dir: &Path) -> std::io::Result<Notifications> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.join("notify.sock");
        let socket = std::os::unix::net::UnixDatagram::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))?;
        Ok(Notifications {
            socket,
            path,
            seen: Vec::new(),
        })
    }

    /// Waits (at most `secs`) for a line that begins with `want` and returns it; every line seen is kept.
    pub fn until(&mut self, want: &str, secs: u64) -> Result<String, String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        let mut buf = vec![0u8; 4096];
        loop {
            if let Some(l) = self.seen.iter().find(|l| l.starts_with(want)) {
                return Ok(l.clone());
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no {want:?} within {secs} s; seen: {:?}",
                    self.seen
                ));
            }
            self.socket
                .set_read_timeout(Some(left))
                .map_err(|e| format!("notify socket: {e}"))?;
            match self.socket.recv(&mut buf) {
                Ok(n) => self.seen.extend(
                    String::from_utf8_lossy(&buf[..n])
                        .lines()
                        .map(str::to_string),
                ),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(format!("notify socket: {e}")),
            }
        }
    }

    /// Waits for `n` more watchdog pings (each within `secs`).
    pub fn pings(&mut self, n: usize, secs: u64) -> Result<(), String> {
        for _ in 0..n {
            self.seen.retain(|l| !l.starts_with("WATCHDOG=1"));
            self.until("WATCHDOG=1", secs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_units_lines_become_mounts_and_credentials() {
        let s = Sandbox::parse(
            "[Unit]\nReadWritePaths=/nope\n[Service]\nProtectSystem=strict\nReadWritePaths=/etc/cdi -/opt/x\n\
             StateDirectory=bcd\nCapabilityBoundingSet=CAP_NET_ADMIN\nCapabilityBoundingSet=CAP_IPC_LOCK\n\
             NoNewPrivileges=yes\nUMask=0077\n",
        );
        assert_eq!(s.protect_system, "strict");
        assert_eq!(
            s.read_write,
            vec![
                ("/etc/cdi".to_string(), false),
                ("/opt/x".to_string(), true)
            ]
        );
        assert_eq!(s.state_directories, vec!["/var/lib/bcd"]);
        assert_eq!(
            s.bounding.as_deref(),
            Some(&["net_admin".to_string(), "ipc_lock".to_string()][..])
        );
        assert_eq!(
            s.setpriv_args(),
            vec!["--no-new-privs", "--bounding-set=-all,+net_admin,+ipc_lock"]
        );
        let dynamic = Sandbox::parse(
            "[Service]\nDynamicUser=yes\nCapabilityBoundingSet=\nAmbientCapabilities=CAP_NET_BIND_SERVICE\n",
        );
        assert_eq!(dynamic.bounding.as_deref(), Some(&[][..]));
        assert!(
            dynamic
                .setpriv_args()
                .contains(&"--ambient-caps=-all,+net_bind_service".to_string())
        );
        // A writable path that does not exist is refused, as systemd does; an optional one is skipped.
        let root = std::env::temp_dir().join(format!("bc-unit-{}", std::process::id()));
        std::fs::create_dir_all(root.join("var/lib/bcd")).expect("dir");
        let err = s.script(&root).expect_err("/etc/cdi is missing");
        assert!(
            err.contains("/etc/cdi is writable in the unit but does not exist"),
            "{err}"
        );
        std::fs::create_dir_all(root.join("etc/cdi")).expect("dir");
        let sh = s.script(&root).expect("script");
        assert!(!sh.contains("/opt/x") && sh.contains("umask 0077"), "{sh}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
