//! sushy-tools' Redfish emulator (`sushy-emulator --fake`) on loopback with HTTP Basic auth (a bcrypt htpasswd
//! file through `SUSHY_EMULATOR_AUTH_FILE`), for the tests that drive a BMC: `BC_SUSHY_EMULATOR` (scripts/setup
//! installs it into .venv-sushy) or `sushy-emulator` on the PATH. Without it a test skips with the reason.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const USER: &str = "bmc-admin";
pub const PASSWORD: &str = "Sushy-pw-7f3a9c1e";

pub struct Emulator {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find_emulator() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BC_SUSHY_EMULATOR") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("sushy-emulator"))
            .find(|p| p.is_file())
    })
}

/// `user:<bcrypt hash>` made by the emulator's own python (bcrypt is a sushy-tools dependency); the password goes
/// through the environment. Cost 4 keeps the per-request check fast (the emulator checks every request).
fn htpasswd_line(python: &Path, user: &str, password: &str) -> anyhow::Result<String> {
    let out = Command::new(python)
        .args([
            "-c",
            "import bcrypt, os; print(bcrypt.hashpw(os.environ['PW'].encode(), bcrypt.gensalt(rounds=4)).decode())",
        ])
        .env("PW", password)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "bcrypt hash: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(format!(
        "{user}:{}",
        String::from_utf8_lossy(&out.stdout).trim()
    ))
}

/// Starts the emulator with Basic auth for USER/PASSWORD, or says why it cannot (then the test skips).
pub async fn start_emulator() -> anyhow::Result<Result<Emulator, String>> {
    let Some(bin) = find_emulator() else {
        return Ok(Err(
            "sushy-emulator not found (set BC_SUSHY_EMULATOR or put it on PATH; scripts/setup installs it)".into(),
        ));
    };
    let python = bin.with_file_name("python3");
    if !python.is_file() {
        return Ok(Err(format!(
            "no python3 beside {} to hash the htpasswd file with bcrypt",
            bin.display()
        )));
    }
    let dir = tempfile::tempdir()?;
    let auth = dir.path().join("htpasswd");
    std::fs::write(&auth, htpasswd_line(&python, USER, PASSWORD)? + "\n")?;
    let config = dir.path().join("emulator.conf");
    std::fs::write(
        &config,
        format!(
            "SUSHY_EMULATOR_AUTH_FILE = {:?}\n",
            auth.display().to_string()
        ),
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(&bin)
        .arg("--config")
        .arg(&config)
        .args(["--fake", "-i", "127.0.0.1", "-p", &port.to_string()])
        // The fake driver's SQLite state goes under `<TMPDIR>/sushy-emulator/`: here, removed with the emulator.
        .env("TMPDIR", dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let emu = Emulator {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    };
    let probe = reqwest::Client::new();
    for _ in 0..100 {
        // The service root is readable without credentials; the systems are not.
        if let Ok(r) = probe
            .get(format!("{}/redfish/v1/Systems", emu.url))
            .send()
            .await
        {
            anyhow::ensure!(
                r.status() == 401,
                "the emulator serves its systems without credentials (HTTP {}): auth file not applied",
                r.status()
            );
            return Ok(Ok(emu));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("sushy-emulator at {} did not answer within 20 s", emu.url)
}
