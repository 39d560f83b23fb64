#![no_main]
//! What a TFTP file name or a boot-HTTP request target may open, against a real directory: a public file, a
//! private one, a subdirectory, and symlinks inside, outside and to a directory outside. The input is tried as a
//! TFTP name and as an HTTP target (percent-decoded as the server does, under `/ipxe/`); whatever resolves must be
//! a public regular file inside the root, never the secret beside it.
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::PathBuf;
use std::sync::OnceLock;

use bcd_site::http::request::target_path;
use bcd_site::tftp::root::ServeRoot;
use libfuzzer_sys::fuzz_target;

struct Tree {
    _dir: tempfile::TempDir,
    root: ServeRoot,
    canonical: PathBuf,
}

fn tree() -> &'static Tree {
    static TREE: OnceLock<Tree> = OnceLock::new();
    TREE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("efi")).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        let public = |p: PathBuf, data: &[u8]| {
            std::fs::write(&p, data).expect("write");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        };
        public(root.join("undionly.kpxe"), b"loader");
        public(root.join("efi/snponly.efi"), b"efi loader");
        public(outside.join("secret"), b"secret");
        std::fs::write(root.join("private.bin"), b"private").expect("write");
        std::fs::set_permissions(
            root.join("private.bin"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("chmod");
        symlink(outside.join("secret"), root.join("escape")).expect("symlink");
        symlink(&outside, root.join("away")).expect("symlink");
        symlink("undionly.kpxe", root.join("alias")).expect("symlink");
        let served = ServeRoot::new(&root).expect("root");
        let canonical = served.path().to_owned();
        Tree {
            _dir: dir,
            root: served,
            canonical,
        }
    })
}

fn check(t: &Tree, name: &str) {
    if let Ok((path, meta)) = t.root.resolve(name) {
        assert!(
            path.starts_with(&t.canonical),
            "{name:?} resolved to {path:?}"
        );
        assert!(meta.is_file(), "{name:?}");
        assert!(
            meta.permissions().mode() & 0o004 != 0,
            "{name:?} is not public"
        );
        assert!(
            !path.ends_with("private.bin") && !path.ends_with("secret"),
            "{name:?} → {path:?}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let t = tree();
    check(t, s);
    if let Ok(path) = target_path(&format!("/ipxe/{s}")) {
        if let Some(name) = path.strip_prefix("/ipxe/") {
            check(t, name);
        }
    }
});
