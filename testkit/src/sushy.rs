//! sushy-tools' Redfish emulator, for the tests and benches that drive a BMC: where its fake driver's
//! `sushy-emulator` is, an htpasswd line for its HTTP Basic auth, a status probe, and [`FakeBmc`], the fake driver
//! on a free loopback port in a directory of its own. Std only.
//!
//! The fake driver keeps its machines in SQLite under `<TMPDIR>/sushy-emulator/` unless told a state directory, and
//! its indicators there in any case. So [`FakeBmc`] gives the emulator its own directory as both TMPDIR and
//! `SUSHY_EMULATOR_STATE_DIR`: each emulator starts from the driver's defaults (or the systems its config names) and
//! leaves nothing behind; the directory goes when the emulator is stopped.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Where to get the fake driver's emulator, for a skip's reason.
const INSTALL: &str = "set BC_SUSHY_EMULATOR or put sushy-emulator on PATH; scripts/setup installs it into .venv-sushy";

/// The fake driver's `sushy-emulator`: `BC_SUSHY_EMULATOR`, else the checkout's `.venv-sushy` (scripts/setup makes
/// it), else the PATH. The error says why none is usable (a test skips with it).
pub fn fake_emulator() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("BC_SUSHY_EMULATOR") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "BC_SUSHY_EMULATOR={} is not a file ({INSTALL})",
                p.display()
            ))
        };
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-sushy/bin/sushy-emulator");
    if venv.is_file() {
        return Ok(venv);
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("sushy-emulator"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| format!("sushy-emulator not found ({INSTALL})"))
}

/// One htpasswd line, `user:<bcrypt hash>` (no newline), hashed by `python` (the emulator's own, with bcrypt: a
/// sushy-tools dependency, and the module sushy checks passwords with). The password goes through the environment,
/// not the command line. Cost 4: sushy checks every request, and cost 10 adds about 0.1 s to each.
pub fn htpasswd_line(python: &Path, user: &str, password: &str) -> Result<String, String> {
    if user.contains(':') || user.contains('\n') {
        return Err("a BMC user name may not contain ':' or a newline".into());
    }
    let out = Command::new(python)
        .args([
            "-c",
            "import bcrypt, os; print(bcrypt.hashpw(os.environ['BC_PW'].encode(), bcrypt.gensalt(4)).decode())",
        ])
        .env("BC_PW", password)
        .output()
        .map_err(|e| format!("hashing the BMC password with {}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!(
            "hashing the BMC password with {}'s bcrypt: {}",
            python.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(format!(
        "{user}:{}",
        String::from_utf8_lossy(&out.stdout).trim()
    ))
}

/// `GET <path>` (HTTP/1.0, no credentials) on 127.0.0.1:`port`: the status, if an HTTP server answered within 5 s.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: bmc\r\n\r\n").as_bytes())
        .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    if !head.starts_with(b"HTTP/1.") {
        return None;
    }
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// How to start a [`FakeBmc`].
#[derive(Clone, Debug, Default)]
pub struct FakeOptions {
    /// HTTP Basic auth for this user and password (the service root stays open, as sushy serves it).
    pub basic_auth: Option<(String, String)>,
    /// More lines for the emulator's config (Python), such as `SUSHY_EMULATOR_FAKE_SYSTEMS = [...]`.
    pub config: String,
}

/// `sushy-emulator` with its fake driver on a free loopback port, killed and its directory removed on drop.
pub struct FakeBmc {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for FakeBmc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl FakeBmc {
    /// Starts `bin` (see [`fake_emulator`]) and returns once it serves its service root (within 60 s) and, with
    /// Basic auth, refuses its systems without credentials. Its stderr goes to `sushy.log` in its directory, whose
    /// last lines a failure to start carries.
    pub fn start(bin: &Path, opts: &FakeOptions) -> Result<FakeBmc, String> {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "bc-sushy-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let io = |what: &str, e: std::io::Error| format!("{what} in {}: {e}", dir.display());
        std::fs::create_dir_all(&dir).map_err(|e| io("creating the emulator's directory", e))?;
        let port = crate::gateways::free_port()?;
        let mut config = format!(
            "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\nSUSHY_EMULATOR_LISTEN_PORT = {port}\n\
             SUSHY_EMULATOR_FAKE_DRIVER = True\nSUSHY_EMULATOR_STATE_DIR = {:?}\n",
            dir.display().to_string()
        );
        if let Some((user, password)) = &opts.basic_auth {
            let auth = dir.join("htpasswd");
            let line = htpasswd_line(&bin.with_file_name("python3"), user, password)?;
            std::fs::write(&auth, line + "\n").map_err(|e| io("writing htpasswd", e))?;
            config.push_str(&format!(
                "SUSHY_EMULATOR_AUTH_FILE = {:?}\n",
                auth.display().to_string()
            ));
        }
        config.push_str(&opts.config);
        let conf = dir.join("emulator.conf");
        std::fs::write(&conf, config).map_err(|e| io("writing emulator.conf", e))?;
        let log = dir.join("sushy.log");
        let stderr = std::fs::File::create(&log).map_err(|e| io("creating sushy.log", e))?;
        let child = Command::new(bin)
            .arg("--config")
            .arg(&conf)
            .env("TMPDIR", &dir)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let mut bmc = FakeBmc { child, port, dir };
        bmc.wait_ready(Duration::from_secs(60), opts.basic_auth.is_some())?;
        Ok(bmc)
    }

    fn wait_ready(&mut self, within: Duration, auth: bool) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(self.failed(&format!("exited ({status})")));
            }
            if http_status(self.port, "/redfish/v1/") == Some(200) {
                break;
            }
            if Instant::now() > deadline {
                return Err(self.failed(&format!(
                    "did not serve /redfish/v1/ within {} s",
                    within.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let systems = http_status(self.port, "/redfish/v1/Systems");
        if auth && systems != Some(401) {
            return Err(self.failed(&format!(
                "served its systems without credentials ({systems:?}): the auth file was not applied"
            )));
        }
        Ok(())
    }

    fn failed(&self, what: &str) -> String {
        format!(
            "sushy-emulator on 127.0.0.1:{} {what}; the end of its log:\n{}",
            self.port,
            crate::log_tail(&self.dir.join("sushy.log"), 20)
        )
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The emulator's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}
