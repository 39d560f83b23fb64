//! The served directory and the rules for what a request may open in it.
//!
//! TFTP has no authentication, so the rules are strict: relative names only, no `..` component, nothing a
//! symlink leads outside the root, regular files only, and — like tftpd-hpa — only files readable by everyone
//! (mode `o+r`), so a file's permissions decide what is public even when the server runs as root.

use std::fs::{File, Metadata};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::codec::ErrorCode;

/// A request the root will not serve, with the TFTP error to send and a reason for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}: {detail}")]
pub struct Refusal {
    pub code: ErrorCode,
    /// Sent to the client.
    pub message: &'static str,
    /// For the server's log only (may name server paths).
    pub detail: String,
}

/// The root directory could not be used.
#[derive(Debug, thiserror::Error)]
#[error("TFTP root {path}")]
pub struct RootError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// A canonicalized, existing directory.
#[derive(Debug, Clone)]
pub struct ServeRoot {
    dir: PathBuf,
}

fn refuse(code: ErrorCode, message: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message,
        detail: detail.into(),
    }
}

impl ServeRoot {
    pub fn new(path: &Path) -> Result<Self, RootError> {
        let err = |source| RootError {
            path: path.to_owned(),
            source,
        };
        let dir = path.canonicalize().map_err(err)?;
        if !dir.is_dir() {
            return Err(err(io::Error::new(
                io::ErrorKind::NotADirectory,
                "not a directory",
            )));
        }
        Ok(ServeRoot { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Checks the name, resolves it inside the root and opens it. Returns the file and its length. Blocking.
    pub fn open(&self, requested: &str) -> Result<(File, u64), Refusal> {
        let (path, meta) = self.resolve(requested)?;
        let file = File::open(&path).map_err(|e| not_found(requested, e))?;
        Ok((file, meta.len()))
    }

    /// Checks the name and resolves it inside the root to a public regular file, without opening it: the
    /// canonical path and its metadata (which a cache compares to decide whether its copy is current). Blocking,
    /// metadata only.
    pub fn resolve(&self, requested: &str) -> Result<(PathBuf, Metadata), Refusal> {
        if requested.starts_with(['/', '\\']) {
            return Err(refuse(
                ErrorCode::AccessViolation,
                "absolute paths are refused",
                requested,
            ));
        }
        if requested.split(['/', '\\']).any(|c| c == "..") {
            return Err(refuse(
                ErrorCode::AccessViolation,
                "'..' is refused",
                requested,
            ));
        }
        let path = self
            .dir
            .join(requested)
            .canonicalize()
            .map_err(|e| not_found(requested, e))?;
        if !path.starts_with(&self.dir) {
            return Err(refuse(
                ErrorCode::AccessViolation,
                "outside the served directory",
                format!("{requested} resolves to {}", path.display()),
            ));
        }
        let meta = path.metadata().map_err(|e| not_found(requested, e))?;
        if !meta.is_file() {
            return Err(refuse(
                ErrorCode::AccessViolation,
                "not a regular file",
                requested,
            ));
        }
        if meta.permissions().mode() & 0o004 == 0 {
            return Err(refuse(
                ErrorCode::AccessViolation,
                "file is not public",
                format!("{requested} lacks o+r"),
            ));
        }
        Ok((path, meta))
    }
}

/// The refusal for an I/O error while resolving or opening `requested`.
pub(crate) fn not_found(requested: &str, e: io::Error) -> Refusal {
    match e.kind() {
        // ENAMETOOLONG: a component over 255 bytes or a path over 4096 names no file there can be.
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory | io::ErrorKind::InvalidFilename => {
            refuse(ErrorCode::FileNotFound, "file not found", requested)
        }
        io::ErrorKind::PermissionDenied => refuse(
            ErrorCode::AccessViolation,
            "access denied",
            format!("{requested}: {e}"),
        ),
        _ => refuse(
            ErrorCode::NotDefined,
            "cannot open file",
            format!("{requested}: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    #[test]
    fn refuses_escapes_and_private_files() -> Result<(), Box<dyn std::error::Error>> {
        let outside = tempfile::tempdir()?;
        fs::write(outside.path().join("secret"), b"x")?;
        let dir = tempfile::tempdir()?;
        let root_dir = dir.path().join("root");
        fs::create_dir_all(root_dir.join("sub"))?;
        fs::write(root_dir.join("sub/ok.efi"), b"loader")?;
        fs::set_permissions(
            root_dir.join("sub/ok.efi"),
            fs::Permissions::from_mode(0o644),
        )?;
        fs::write(root_dir.join("private"), b"p")?;
        fs::set_permissions(root_dir.join("private"), fs::Permissions::from_mode(0o600))?;
        symlink(outside.path().join("secret"), root_dir.join("escape"))?;
        symlink("sub/ok.efi", root_dir.join("inside-link"))?;
        let root = ServeRoot::new(&root_dir)?;

        assert_eq!(root.open("sub/ok.efi").map(|(_, len)| len), Ok(6));
        assert_eq!(root.open("./sub/ok.efi").map(|(_, len)| len), Ok(6));
        assert_eq!(root.open("inside-link").map(|(_, len)| len), Ok(6));
        let code = |name: &str| root.open(name).err().map(|r| r.code);
        assert_eq!(code("/etc/passwd"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("../root/sub/ok.efi"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("sub/../../x"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("sub\\..\\private"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("escape"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("private"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("sub"), Some(ErrorCode::AccessViolation));
        assert_eq!(code("missing"), Some(ErrorCode::FileNotFound));
        assert_eq!(code("sub/ok.efi/x"), Some(ErrorCode::FileNotFound));
        // Longer than a file name (255) or a path (4096) can be: no such file, not a server error.
        assert_eq!(code(&"a".repeat(300)), Some(ErrorCode::FileNotFound));
        assert_eq!(code(&"a/".repeat(2100)), Some(ErrorCode::FileNotFound));
        Ok(())
    }
}
