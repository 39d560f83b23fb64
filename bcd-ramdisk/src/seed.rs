//! What the ramdisk leaves on the installed root before it kexecs into it, so that the installed system's `bcd`
//! joins once as the machine's node:
//!
//! - `/etc/bcd/join-token` (0600): the single-use join token (reclaim: the same node id), never on a kernel
//!   command line and never in the image;
//! - `/etc/bcd/bcd.toml` (0644): the control plane the ramdisk itself joined (gateway URL, CA pin, JoinService key);
//! - the cloud-init NoCloud seed, `/var/lib/cloud/seed/nocloud/{meta-data,user-data}`: the operator's meta-data (or
//!   an instance id and host name), and user-data as a MIME multipart whose first part is a shell script that runs
//!   `bcd join` with the token file once and removes it, followed by the operator's user-data as its own part (so
//!   neither replaces the other's `runcmd`).
//!
//! An image without cloud-init joins the same way by running that one command at first boot (the lab OS's init
//! does). [`render`] is pure (golden-file tested); [`write`] puts the files under a mounted root.

use std::fs;
use std::io;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where cloud-init's NoCloud datasource looks on the root file system.
pub const SEED_DIR: &str = "var/lib/cloud/seed/nocloud";
/// The token file and the node configuration, inside the installed root.
pub const TOKEN_FILE: &str = "etc/bcd/join-token";
pub const CONFIG_FILE: &str = "etc/bcd/bcd.toml";
/// The largest operator user-data or meta-data carried.
pub const MAX_OPERATOR_DATA: usize = 64 * 1024;
const BOUNDARY: &str = "==BC-SEED-7f3a9c1e==";

/// The control plane the installed system joins (what the ramdisk was given on its kernel command line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlPlane {
    pub gateway_url: String,
    /// `sha256:<hex>`.
    pub ca_pin: String,
    pub join_public_key: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedInput {
    /// cloud-init runs its per-instance modules once per instance id: a fresh one per install.
    pub instance_id: String,
    pub hostname: String,
    /// The single-use token `bcd join` spends on first boot.
    pub join_token: String,
    /// Where to join; without it the image must carry its own `/etc/bcd/bcd.toml`.
    pub control: Option<ControlPlane>,
    /// The operator's cloud-init user-data and meta-data (empty: none).
    pub user_data: String,
    pub meta_data: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("{field} {value:?} is not allowed in a seed: {why}")]
    Invalid {
        field: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The rendered files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seed {
    pub meta_data: String,
    pub user_data: String,
    pub join_token: String,
    pub bcd_toml: Option<String>,
}

fn check(field: &'static str, value: &str, extra: &[u8], max: usize) -> Result<(), SeedError> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || extra.contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SeedError::Invalid {
            field,
            value: value.chars().take(16).collect(),
            why: "expected a short value of A-Z a-z 0-9 and a few separators (nothing YAML, TOML or a shell would interpret)",
        })
    }
}

fn check_operator(field: &'static str, value: &str) -> Result<(), SeedError> {
    if value.len() > MAX_OPERATOR_DATA || value.contains('\0') || value.contains(BOUNDARY) {
        return Err(SeedError::Invalid {
            field,
            value: value.chars().take(16).collect(),
            why: "at most 64 KiB of text without NUL bytes or the seed's MIME boundary",
        });
    }
    Ok(())
}

/// The MIME type cloud-init gives a user-data part by how it begins.
fn part_type(user_data: &str) -> &'static str {
    let head = user_data.trim_start();
    [
        ("#cloud-config", "text/cloud-config"),
        ("#!", "text/x-shellscript"),
        ("#cloud-boothook", "text/cloud-boothook"),
        ("#include", "text/x-include-url"),
        ("#part-handler", "text/part-handler"),
    ]
    .iter()
    .find(|(prefix, _)| head.starts_with(prefix))
    .map_or("text/plain", |(_, t)| t)
}

/// Render the files. Every value of ours is checked against a small alphabet, so nothing can break out of the YAML,
/// TOML or shell it lands in; the operator's data is carried as its own part, untouched.
pub fn render(input: &SeedInput) -> Result<Seed, SeedError> {
    check("instance_id", &input.instance_id, b"-_.", 128)?;
    check("hostname", &input.hostname, b"-.", 128)?;
    check("join_token", &input.join_token, b"-_.:", 128)?;
    check_operator("user_data", &input.user_data)?;
    check_operator("meta_data", &input.meta_data)?;
    let bcd_toml = match &input.control {
        None => None,
        Some(c) => {
            check("gateway_url", &c.gateway_url, b"-_.:/[]", 256)?;
            check("ca_pin", &c.ca_pin, b":", 128)?;
            check("join_public_key", &c.join_public_key, b"-_=", 256)?;
            Some(format!(
                "# Written by bcd-ramdisk: the control plane this machine joined from its ramdisk.\n\
                 gateway_url = \"{}\"\nca_pin = \"{}\"\njoin_public_key = \"{}\"\n",
                c.gateway_url, c.ca_pin, c.join_public_key
            ))
        }
    };
    let meta_data = if input.meta_data.trim().is_empty() {
        format!(
            "instance-id: {}\nlocal-hostname: {}\n",
            input.instance_id, input.hostname
        )
    } else {
        input.meta_data.clone()
    };
    let mut user_data = format!(
        "Content-Type: multipart/mixed; boundary=\"{BOUNDARY}\"\n\
         MIME-Version: 1.0\n\
         \n\
         --{BOUNDARY}\n\
         Content-Type: text/x-shellscript; charset=\"us-ascii\"\n\
         Content-Disposition: attachment; filename=\"bcd-join.sh\"\n\
         \n\
         #!/bin/sh\n\
         # Written by bcd-ramdisk: joins this machine to Better Compute once, as the same node, with the single-use\n\
         # token it left in /{TOKEN_FILE}, then removes the token.\n\
         bcd --config /{CONFIG_FILE} join --token-file /{TOKEN_FILE} && rm -f /{TOKEN_FILE}\n"
    );
    if !input.user_data.trim().is_empty() {
        user_data.push_str(&format!(
            "--{BOUNDARY}\nContent-Type: {}; charset=\"utf-8\"\nContent-Disposition: attachment; filename=\"operator\"\n\n{}",
            part_type(&input.user_data),
            input.user_data
        ));
        if !input.user_data.ends_with('\n') {
            user_data.push('\n');
        }
    }
    user_data.push_str(&format!("--{BOUNDARY}--\n"));
    Ok(Seed {
        meta_data,
        user_data,
        join_token: input.join_token.clone(),
        bcd_toml,
    })
}

fn write_file(path: PathBuf, content: &str, mode: u32) -> Result<(), SeedError> {
    let result = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&path)
        .and_then(|mut f| {
            f.write_all(content.as_bytes())?;
            f.sync_all()
        });
    result.map_err(|source| SeedError::Write { path, source })
}

fn make_dir(dir: &Path) -> Result<(), SeedError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|source| SeedError::Write {
            path: dir.to_path_buf(),
            source,
        })
}

/// Write the files under `root` (the installed system's mounted root): directories 0755, meta-data and bcd.toml
/// 0644, user-data and the token 0600. Existing files are replaced. Returns the seed's folder.
pub fn write(root: &Path, seed: &Seed) -> Result<PathBuf, SeedError> {
    let dir = root.join(SEED_DIR);
    make_dir(&dir)?;
    make_dir(&root.join("etc/bcd"))?;
    write_file(
        root.join(TOKEN_FILE),
        &format!("{}\n", seed.join_token),
        0o600,
    )?;
    if let Some(toml) = &seed.bcd_toml {
        write_file(root.join(CONFIG_FILE), toml, 0o644)?;
    }
    write_file(dir.join("meta-data"), &seed.meta_data, 0o644)?;
    write_file(dir.join("user-data"), &seed.user_data, 0o600)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> SeedInput {
        SeedInput {
            instance_id: "bc-52540012345600".into(),
            hostname: "gpu-node-7".into(),
            join_token: "bcjt_01HZX3KJ.s3cr3t".into(),
            control: Some(ControlPlane {
                gateway_url: "https://10.78.0.2:7443".into(),
                ca_pin: format!("sha256:{}", "ab".repeat(32)),
                join_public_key: "Xk3-_q9".into(),
            }),
            user_data: String::new(),
            meta_data: String::new(),
        }
    }

    #[test]
    fn matches_the_golden_files() {
        let seed = render(&input()).expect("renders");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
        bc_testkit::assert_golden(dir.join("nocloud-meta-data"), &seed.meta_data);
        bc_testkit::assert_golden(dir.join("nocloud-user-data"), &seed.user_data);
        bc_testkit::assert_golden(dir.join("bcd.toml"), seed.bcd_toml.as_deref().unwrap_or(""));
        let mut with = input();
        with.user_data = "#cloud-config\npackages: [htop]\n".into();
        with.meta_data = "instance-id: op-1\n".into();
        let seed = render(&with).expect("renders");
        bc_testkit::assert_golden(dir.join("nocloud-user-data-operator"), &seed.user_data);
        assert_eq!(
            seed.meta_data, "instance-id: op-1\n",
            "the operator's meta-data as given"
        );
        assert!(
            !seed.user_data.contains("s3cr3t"),
            "the token is not in the user-data"
        );
    }

    #[test]
    fn refuses_values_that_could_escape() {
        for bad in ["a'b", "a b", "a\nb", "", "$(reboot)", &"x".repeat(129)] {
            let mut i = input();
            i.join_token = bad.to_string();
            assert!(render(&i).is_err(), "{bad:?}");
            let mut i = input();
            i.hostname = bad.to_string();
            assert!(render(&i).is_err(), "{bad:?}");
        }
        let mut i = input();
        i.user_data = format!("#!/bin/sh\n--{BOUNDARY}--\n");
        assert!(render(&i).is_err(), "the boundary cannot be smuggled in");
        let mut i = input();
        i.user_data = "x".repeat(MAX_OPERATOR_DATA + 1);
        assert!(render(&i).is_err());
        let mut i = input();
        if let Some(c) = i.control.as_mut() {
            c.gateway_url = "https://x\"\nca_pin = \"evil".into();
        }
        assert!(
            render(&i).is_err(),
            "no TOML injection through the gateway URL"
        );
    }

    #[test]
    fn writes_with_private_user_data() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().expect("tempdir");
        let seed = render(&input()).expect("renders");
        let dir = write(t.path(), &seed).expect("writes");
        let mode = |n: &str| {
            fs::metadata(dir.join(n))
                .expect("exists")
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("user-data"), 0o600);
        assert_eq!(mode("meta-data"), 0o644);
        let root_mode = |n: &str| {
            fs::metadata(t.path().join(n))
                .expect("exists")
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(root_mode(TOKEN_FILE), 0o600);
        assert_eq!(root_mode(CONFIG_FILE), 0o644);
        assert_eq!(
            fs::read_to_string(t.path().join(TOKEN_FILE)).expect("token"),
            "bcjt_01HZX3KJ.s3cr3t\n"
        );
        assert_eq!(
            fs::read_to_string(dir.join("user-data")).expect("read"),
            seed.user_data
        );
    }
}
