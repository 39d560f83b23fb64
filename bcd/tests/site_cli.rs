//! `bcd site redfish` against a real Redfish emulator (sushy-tools' fake driver, installed by scripts/setup).
//! Skips with a printed reason when the emulator is absent.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

fn emulator() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("BC_SUSHY_EMULATOR")?);
    p.is_file().then_some(p)
}

struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bcd(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bcd"))
        .args(["site", "redfish", url, "--user", "admin"])
        .args(args)
        .env("BMC_PASSWORD", "password")
        .output()
        .expect("run bcd")
}

#[test]
fn inspect_and_an_unapplied_boot_override_through_the_cli() {
    let Some(bin) = emulator() else {
        bc_testkit::skip!(
            "sushy-emulator not found (set BC_SUSHY_EMULATOR; scripts/setup installs it)"
        );
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    // The fake driver keeps its state in SQLite under `<TMPDIR>/sushy-emulator/`: a directory of this test's own,
    // removed after the emulator (locals drop in reverse order).
    let state = tempfile::tempdir().expect("state directory");
    let _emu = Kill(
        Command::new(bin)
            .args(["--fake", "-i", "127.0.0.1", "-p", &port.to_string()])
            .env("TMPDIR", state.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sushy-emulator"),
    );
    let url = format!("http://127.0.0.1:{port}");
    let mut out = bcd(&url, &["inspect"]);
    for _ in 0..100 {
        if out.status.success() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        out = bcd(&url, &["inspect"]);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.to_lowercase().contains("system"), "{text}");
    // The fake driver accepts a one-time override but keeps it Continuous: the CLI must say so and fail.
    let out = bcd(&url, &["boot-once", "pxe"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an override that was not applied was reported as success"
    );
    assert!(
        err.to_lowercase().contains("continuous") || err.to_lowercase().contains("not applied"),
        "{err}"
    );
}
