//! The systemd unit `scripts/install.sh` writes: it parses cleanly (`systemd-analyze verify`), and under the sandbox
//! it declares the installed daemon can do its work. systemd is not PID 1 where these tests run, so the sandbox is
//! reproduced from the unit's own lines with the documented semantics (systemd.exec(5)): `ProtectSystem=` makes
//! /usr, /boot, /efi (`yes`), also /etc (`full`), or everything (`strict`) read-only; `ReadWritePaths=` and
//! `StateDirectory=` stay writable and must exist. The paths are those of the staging root (DESTDIR) the script
//! installed into, in a private mount namespace that dies with the daemon.

mod common;

use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use tokio::process::Command;

const UNIT: &str = "etc/systemd/system/bcd.service";

/// The sandbox lines of a unit's `[Service]` section.
#[derive(Debug, Default)]
struct Sandbox {
    protect_system: String,
    /// (path, optional: a leading `-`)
    read_write: Vec<(String, bool)>,
    state_directories: Vec<String>,
}

impl Sandbox {
    fn parse(unit: &str) -> Sandbox {
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
            match key.trim() {
                "ProtectSystem" => s.protect_system = value.trim().to_string(),
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
    fn script(&self, root: &Path) -> Result<String, String> {
        let mut sh = String::from("set -e\n");
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
        sh.push_str("exec \"$@\"\n");
        Ok(sh)
    }
}

/// Runs `args` under `sandbox` over `root` (unshare: a private mount namespace).
fn sandboxed(sandbox: &Sandbox, root: &Path, args: &[&std::ffi::OsStr]) -> Result<Command, String> {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(sandbox.script(root)?)
        .arg("sh")
        .args(args);
    Ok(cmd)
}

/// Whether this process may make mount namespaces (root, or CAP_SYS_ADMIN), with `unshare` and `mount` present.
async fn can_unshare() -> Result<(), String> {
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
        .await
        .map_err(|e| format!("unshare is unavailable: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "cannot make a mount namespace here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

async fn install(
    p: &Plane,
    root: &Path,
    token: Option<&str>,
    extra: &[&str],
) -> std::process::Output {
    let hw = p.dir.path().join("hw");
    fake_hardware(&hw, "unit").expect("hardware");
    let fixture = p.dir.path().join("gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(2, "unit")).expect("fixture");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install.sh");
    let mut cmd = Command::new("sh");
    cmd.arg(&script)
        .args(["--gateway-url", &p.running.gateway_url])
        .args(["--ca-pin", &p.running.ca_pin])
        .args(["--join-public-key", &p.running.join_public_key])
        .args(["--binary", env!("CARGO_BIN_EXE_bcd")])
        .arg("--gpu-backend")
        .arg(format!("fixture:{}", fixture.display()))
        .arg("--hardware-root")
        .arg(&hw)
        .args(extra)
        .env("DESTDIR", root)
        .env_remove("BCD_JOIN_TOKEN");
    match token {
        Some(t) => cmd.env("BCD_JOIN_TOKEN", t),
        None => cmd.arg("--no-join"),
    };
    cmd.output().await.expect("run install.sh")
}

/// Issue 10 item 13: the installed daemon, run under the sandbox its own unit declares, applies a booking: the
/// CDI spec appears in the CDI directory while the rest of /etc stays read-only. (With `ProtectSystem=full` and
/// no writable CDI directory, every booking on an installed node failed with "Read-only file system".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installed_daemon_under_its_units_sandbox_writes_the_cdi_spec() -> TestResult {
    if let Err(why) = can_unshare().await {
        bc_testkit::skip!("{why}");
    }
    let p = plane_with(Options {
        controllers: true,
        fast: true,
        leaf_lifetime: None,
    })
    .await;
    let root = p.dir.path().join("stage");
    let token = p.token(json!({"pool": "default", "uses": 1})).await;
    let out = install(&p, &root, Some(&token), &[]).await;
    assert!(
        out.status.success(),
        "install.sh failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let unit = std::fs::read_to_string(root.join(UNIT))?;
    let sandbox = Sandbox::parse(&unit);
    assert_eq!(sandbox.protect_system, "full", "{unit}");
    let state: Value = serde_json::from_slice(&std::fs::read(root.join("var/lib/bcd/node.json"))?)?;
    let node_id = state["node_id"].as_str().unwrap_or_default().to_string();

    // The sandbox is real: inside it /etc (of the staging root) refuses writes.
    let probe = root.join("etc/bcd/probe");
    let touch = sandboxed(&sandbox, &root, &["touch".as_ref(), probe.as_os_str()])?
        .output()
        .await?;
    assert!(
        !touch.status.success() && String::from_utf8_lossy(&touch.stderr).contains("Read-only"),
        "the emulated ProtectSystem=full did not make /etc read-only: {}",
        String::from_utf8_lossy(&touch.stderr)
    );

    // The daemon as the unit runs it (ExecStart), with the staging root's paths for the default ones.
    let bin = root.join("usr/local/bin/bcd");
    let config = root.join("etc/bcd/bcd.toml");
    let state_dir = root.join("var/lib/bcd");
    let cdi = root.join("etc/cdi");
    let args: Vec<&std::ffi::OsStr> = vec![
        bin.as_os_str(),
        "--config".as_ref(),
        config.as_os_str(),
        "--state-dir".as_ref(),
        state_dir.as_os_str(),
        "run".as_ref(),
        "--cdi-dir".as_ref(),
        cdi.as_os_str(),
    ];
    let _daemon = sandboxed(&sandbox, &root, &args)?
        .env("BCD_LOG", "info")
        .kill_on_drop(true)
        .spawn()?;
    wait_node(&p, &node_id, 60, "adoption", |n| {
        n.state == "adopted" && n.acked_generation == 1
    })
    .await;
    let r = p
        .admin
        .call(
            "reservations",
            "create",
            json!({"tenant": "root", "gpus": 1, "duration_s": 600}),
        )
        .await?;
    let id = r["reservation"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let delivered = loop {
        let v = p
            .admin
            .call("reservations", "get", json!({"id": id}))
            .await?;
        let state = v["reservation"]["delivery"]["state"].clone();
        if state == "applied" || state == "failed" || tokio::time::Instant::now() > deadline {
            break v["reservation"].clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(
        delivered["delivery"]["state"], "applied",
        "the booking did not apply under the unit's sandbox: {delivered}"
    );
    let spec = std::fs::read_to_string(cdi.join(bcd::cdi::FILE_NAME))?;
    let booked = delivered["gpus"][0]["uuid"].as_str().unwrap_or_default();
    assert!(spec.contains(booked), "{spec}");
    assert!(!probe.exists());
    Ok(())
}

/// The unit parses without a warning (`systemd-analyze verify` against the staging root), also with a custom CDI
/// directory, which it makes writable; a relative CDI directory is refused by the script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unit_verifies_and_names_every_path_the_daemon_writes() -> TestResult {
    let p = plane().await;
    for (cdi, want) in [
        (None, "/etc/cdi"),
        (Some("/var/lib/cdi-custom"), "/var/lib/cdi-custom"),
    ] {
        let root: PathBuf = p
            .dir
            .path()
            .join(format!("stage-{}", want.replace('/', "_")));
        let extra: Vec<&str> = cdi.map(|c| vec!["--cdi-dir", c]).unwrap_or_default();
        let out = install(&p, &root, None, &extra).await;
        assert!(
            out.status.success(),
            "install.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let unit = std::fs::read_to_string(root.join(UNIT))?;
        let sandbox = Sandbox::parse(&unit);
        assert!(
            sandbox.read_write.iter().any(|(p, _)| p == want),
            "{want} is not writable under the unit: {unit}"
        );
        assert!(
            root.join(want.trim_start_matches('/')).is_dir(),
            "{want} not created"
        );
        assert!(sandbox.script(&root).is_ok());
        match Command::new("systemd-analyze")
            .args(["verify", "--recursive-errors=no", "--man=no"])
            .arg(format!("--root={}", root.display()))
            .arg(format!("/{UNIT}"))
            .output()
            .await
        {
            Err(e) => println!("not verified by systemd-analyze (it could not run: {e})"),
            Ok(out) => {
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    out.status.success() && err.trim().is_empty(),
                    "systemd-analyze verify: {err}\n{unit}"
                );
            }
        }
    }
    let out = install(
        &p,
        &p.dir.path().join("stage-rel"),
        None,
        &["--cdi-dir", "cdi"],
    )
    .await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--cdi-dir must be an absolute path"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
