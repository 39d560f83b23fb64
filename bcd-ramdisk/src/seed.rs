//! The cloud-init NoCloud seed the ramdisk leaves on the installed root before it kexecs into it:
//! `/var/lib/cloud/seed/nocloud/meta-data` and `user-data`. The user-data writes the single-use join token to a
//! 0600 file and runs `bcd join --token-file` once, then deletes the file, so the installed system comes back as
//! the same machine without a reusable secret ever touching the image or the kernel command line.
//!
//! [`render`] is pure (golden-file tested); [`write`] puts the files under a mounted root.

use std::fs;
use std::io;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where cloud-init's NoCloud datasource looks on the root file system.
pub const SEED_DIR: &str = "var/lib/cloud/seed/nocloud";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedInput {
    /// cloud-init runs its per-instance modules once per instance id: a fresh one per install.
    pub instance_id: String,
    pub hostname: String,
    /// The single-use token (or its reference) `bcd join` spends on first boot.
    pub join_token: String,
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
}

fn check(field: &'static str, value: &str, extra: &[u8]) -> Result<(), SeedError> {
    let ok = !value.is_empty()
        && value.len() <= 128
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || extra.contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SeedError::Invalid {
            field,
            value: value.chars().take(16).collect(),
            why: "expected 1..=128 characters of A-Z a-z 0-9 and a few separators (nothing YAML or a shell would interpret)",
        })
    }
}

/// Render meta-data and user-data. Every value is checked against a small alphabet, so nothing in them can break
/// out of the YAML scalars or the shell command they land in.
pub fn render(input: &SeedInput) -> Result<Seed, SeedError> {
    check("instance_id", &input.instance_id, b"-_.")?;
    check("hostname", &input.hostname, b"-.")?;
    check("join_token", &input.join_token, b"-_.:")?;
    let meta_data = format!(
        "instance-id: {}\nlocal-hostname: {}\n",
        input.instance_id, input.hostname
    );
    let user_data = format!(
        "#cloud-config\n\
         # Written by bcd-ramdisk. Joins this machine to Better Compute once with a single-use token.\n\
         write_files:\n\
         \x20 - path: /etc/bcd/join-token\n\
         \x20   owner: root:root\n\
         \x20   permissions: '0600'\n\
         \x20   content: '{token}'\n\
         runcmd:\n\
         \x20 - [sh, -c, 'bcd join --token-file /etc/bcd/join-token; rm -f /etc/bcd/join-token']\n",
        token = input.join_token
    );
    Ok(Seed {
        meta_data,
        user_data,
    })
}

/// Write the seed under `root` (the installed system's mounted root): directories 0755, meta-data 0644,
/// user-data 0600 (it holds the token). Existing files are replaced.
pub fn write(root: &Path, seed: &Seed) -> Result<PathBuf, SeedError> {
    let dir = root.join(SEED_DIR);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&dir)
        .map_err(|source| SeedError::Write {
            path: dir.clone(),
            source,
        })?;
    for (name, content, mode) in [
        ("meta-data", &seed.meta_data, 0o644),
        ("user-data", &seed.user_data, 0o600),
    ] {
        let path = dir.join(name);
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
        result.map_err(|source| SeedError::Write { path, source })?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> SeedInput {
        SeedInput {
            instance_id: "bc-52540012345600".into(),
            hostname: "gpu-node-7".into(),
            join_token: "bt_01HZX3KJ".into(),
        }
    }

    #[test]
    fn matches_the_golden_files() {
        let seed = render(&input()).expect("renders");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
        bc_testkit::assert_golden(dir.join("nocloud-meta-data"), &seed.meta_data);
        bc_testkit::assert_golden(dir.join("nocloud-user-data"), &seed.user_data);
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
        assert_eq!(
            fs::read_to_string(dir.join("user-data")).expect("read"),
            seed.user_data
        );
    }
}
