//! The cloud-init NoCloud seed bcd attaches to an instance: a small FAT volume labelled `cidata` holding
//! `meta-data` (instance id, hostname, SSH keys) and `user-data` (the request's, verbatim). [`render`] is pure and
//! golden-file tested; [`build`] makes the volume with Debian's dosfstools and mtools (`mkfs.vfat` + `mcopy`: no
//! mounting, no root) into a temporary file, then fsyncs and renames it into place.
//!
//! Every value bcd itself puts in `meta-data` is JSON-quoted (a YAML double-quoted scalar) after the spec parser
//! limited it to printable ASCII, so nothing a tenant sends can break out of its scalar. The user-data is the
//! tenant's own program for its own VM and is not interpreted by bcd.

use crate::vmm::spec::InstanceSpec;
#[cfg(feature = "vmm")]
use std::path::Path;
use std::path::PathBuf;

/// The volume label cloud-init's NoCloud datasource looks for.
pub const LABEL: &str = "cidata";

/// The rendered files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub meta_data: String,
    pub user_data: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("running {tool} (install dosfstools and mtools: scripts/setup)")]
    Spawn {
        tool: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed: {stderr}")]
    Tool { tool: &'static str, stderr: String },
    #[error("{tool} did not finish within {} s and was killed (a hung file system or tool)", .after.as_secs())]
    Timeout {
        tool: &'static str,
        after: std::time::Duration,
    },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Renders meta-data and user-data for `spec`. The instance id cloud-init sees is the instance's own id: it runs
/// its per-instance modules once per id, so a stop/start keeps the first boot's work.
pub fn render(spec: &InstanceSpec) -> Seed {
    let mut meta_data = format!(
        "instance-id: {}\nlocal-hostname: {}\n",
        quoted(&spec.id),
        quoted(spec.hostname())
    );
    if !spec.meta.ssh_keys.is_empty() {
        meta_data.push_str("public-keys:\n");
        for k in &spec.meta.ssh_keys {
            meta_data.push_str(&format!("  - {}\n", quoted(k)));
        }
    }
    let user_data = spec
        .user_data
        .clone()
        .unwrap_or_else(|| "#cloud-config\n{}\n".to_string());
    Seed {
        meta_data,
        user_data,
    }
}

#[cfg(feature = "vmm")]
/// The volume's size in KiB: 1 MiB plus twice the files (FAT's own tables and slack), rounded to 64 KiB.
fn size_kib(seed: &Seed) -> u64 {
    let files = (seed.meta_data.len() + seed.user_data.len()) as u64;
    (1024 + 2 * files.div_ceil(1024)).div_ceil(64) * 64
}

/// How long mkfs.vfat or mcopy may take on a volume of a few MiB before it is killed.
#[cfg(feature = "vmm")]
const TOOL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

#[cfg(feature = "vmm")]
fn run(tool: &'static str, cmd: &mut std::process::Command) -> Result<(), SeedError> {
    run_within(tool, cmd, TOOL_DEADLINE)
}

/// Runs `cmd` to its end, or kills it at `deadline` (its output is a few lines: the pipes never fill while it
/// runs). Before, a tool that hung (a stuck file system under the instance directory) held the blocking thread and
/// the instance's creation for ever.
#[cfg(feature = "vmm")]
fn run_within(
    tool: &'static str,
    cmd: &mut std::process::Command,
    deadline: std::time::Duration,
) -> Result<(), SeedError> {
    use std::io::Read as _;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| SeedError::Spawn { tool, source })?;
    let began = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if began.elapsed() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SeedError::Timeout {
                    tool,
                    after: deadline,
                });
            }
            Err(source) => return Err(SeedError::Spawn { tool, source }),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    Err(SeedError::Tool {
        tool,
        stderr: stderr.trim().to_string(),
    })
}

/// Builds the `cidata` volume for `seed` at `path` (0600): mkfs.vfat and mcopy into a temporary file beside it,
/// fsync, rename. Blocking (two short child processes). Feature `vmm`.
#[cfg(feature = "vmm")]
pub fn build(seed: &Seed, path: &Path) -> Result<(), SeedError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| SeedError::Io { what, path, source }
    };
    let work = tempfile::Builder::new()
        .prefix(".seed-")
        .tempdir_in(dir)
        .map_err(io("creating a temporary directory in", dir))?;
    let meta = work.path().join("meta-data");
    let user = work.path().join("user-data");
    // A fixed file time (2000-01-01) and mkfs's --invariant: the same seed makes the same bytes.
    let fixed = std::time::UNIX_EPOCH + std::time::Duration::from_secs(946_684_800);
    for (path, text) in [(&meta, &seed.meta_data), (&user, &seed.user_data)] {
        std::fs::write(path, text).map_err(io("writing", path))?;
        std::fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_times(std::fs::FileTimes::new().set_modified(fixed)))
            .map_err(io("setting the time of", path))?;
    }
    let img = work.path().join("seed.img");
    run(
        "mkfs.vfat",
        std::process::Command::new("mkfs.vfat")
            .args(["-n", "CIDATA", "--invariant", "-C"])
            .arg(&img)
            .arg(size_kib(seed).to_string()),
    )?;
    run(
        "mcopy",
        std::process::Command::new("mcopy")
            .env("MTOOLS_SKIP_CHECK", "1")
            .arg("-m")
            .arg("-i")
            .arg(&img)
            .arg(&meta)
            .arg(&user)
            .arg("::/"),
    )?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        let f = std::fs::File::open(&img).map_err(io("opening", &img))?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io("setting the mode of", &img))?;
        f.sync_all().map_err(io("syncing", &img))?;
    }
    std::fs::rename(&img, path).map_err(io("moving into place", path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::vmm::spec::{ImageRef, Meta, Power};

    pub(crate) fn spec() -> InstanceSpec {
        InstanceSpec {
            id: "inst-7".into(),
            generation: 3,
            vcpus: 2,
            memory_mib: 1024,
            disk_gib: 8,
            image: ImageRef {
                url: "https://artifacts.example/debian-12.qcow2".into(),
                sha256: "0".repeat(64),
            },
            user_data: Some(
                "#cloud-config\nruncmd:\n  - [sh, -c, 'echo hello > /dev/ttyS0']\n".into(),
            ),
            meta: Meta {
                ssh_keys: vec![
                    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcN0tArEaLkEy ops@example".into(),
                    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTY= \"quoted\" comment"
                        .into(),
                ],
                hostname: Some("web-1".into()),
            },
            gpus: vec![],
            power: Power::Running,
            reboots: 0,
        }
    }

    fn golden(name: &str, got: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/vmm/golden")
            .join(name);
        bc_testkit::assert_golden(path, got);
    }

    #[test]
    fn meta_data_and_user_data_match_the_golden_files() {
        let seed = render(&spec());
        golden("seed-meta-data", &seed.meta_data);
        golden("seed-user-data", &seed.user_data);
        let mut bare = spec();
        bare.user_data = None;
        bare.meta = Meta::default();
        let seed = render(&bare);
        golden("seed-meta-data-bare", &seed.meta_data);
        assert_eq!(seed.user_data, "#cloud-config\n{}\n");
    }

    #[cfg(feature = "vmm")]
    fn have(tool: &str) -> bool {
        std::process::Command::new(tool)
            .arg("--help")
            .output()
            .is_ok()
    }

    /// A tool that does not finish is killed at the deadline with an error naming it; one that fails says why.
    #[cfg(feature = "vmm")]
    #[test]
    fn a_tool_that_hangs_is_killed_at_the_deadline() {
        let began = std::time::Instant::now();
        let e = run_within(
            "sleep",
            std::process::Command::new("sleep").arg("60"),
            std::time::Duration::from_millis(300),
        )
        .expect_err("killed");
        assert!(matches!(e, SeedError::Timeout { tool: "sleep", .. }), "{e}");
        assert!(
            began.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        let e = run_within(
            "sh",
            std::process::Command::new("sh").args(["-c", "echo no space left >&2; exit 1"]),
            std::time::Duration::from_secs(10),
        )
        .expect_err("failed");
        assert_eq!(e.to_string(), "sh failed: no space left");
    }

    /// The volume holds exactly the rendered files under the `cidata` label (read back with mtools).
    #[cfg(feature = "vmm")]
    #[test]
    fn the_volume_is_labelled_cidata_and_holds_the_files() {
        if !have("mkfs.vfat") || !have("mcopy") {
            bc_testkit::skip!(
                "mkfs.vfat or mcopy missing (scripts/setup installs dosfstools and mtools)"
            );
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("seed.img");
        let seed = render(&spec());
        build(&seed, &path).expect("build");
        let read = |name: &str| {
            let out = std::process::Command::new("mtype")
                .env("MTOOLS_SKIP_CHECK", "1")
                .arg("-i")
                .arg(&path)
                .arg(format!("::/{name}"))
                .output()
                .expect("mtype");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        assert_eq!(read("meta-data"), seed.meta_data);
        assert_eq!(read("user-data"), seed.user_data);
        let label = std::process::Command::new("mlabel")
            .env("MTOOLS_SKIP_CHECK", "1")
            .args(["-s", "-i"])
            .arg(&path)
            .arg("::")
            .output()
            .expect("mlabel");
        let label = String::from_utf8_lossy(&label.stdout).to_ascii_lowercase();
        assert!(label.contains(LABEL), "label: {label}");
        // Deterministic: the same seed makes the same bytes; nothing is left beside it.
        let again = dir.path().join("again.img");
        build(&seed, &again).expect("build again");
        assert_eq!(std::fs::read(&path).ok(), std::fs::read(&again).ok());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
