//! The lean, local IAM: a principal's grants are (permission, scope) pairs; `*` matches a whole segment and a
//! trailing `*` matches the rest. Example: `compute:join-tokens:create` on `pool/gpu-a`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub permission: String,
    pub scope: String,
}

/// Matches a `:`- or `/`-separated pattern: `*` as a whole segment matches one segment; a final `*` matches any
/// remaining segments (including none).
fn matches(pattern: &str, value: &str, sep: char) -> bool {
    if pattern == "*" {
        return true;
    }
    let mut p = pattern.split(sep).peekable();
    let mut v = value.split(sep);
    while let Some(ps) = p.next() {
        if ps == "*" && p.peek().is_none() {
            return true;
        }
        match v.next() {
            Some(vs) if ps == "*" || ps == vs => {}
            _ => return false,
        }
    }
    v.next().is_none()
}

/// Whether any grant allows `permission` on `scope`.
pub fn allows(grants: &[Grant], permission: &str, scope: &str) -> bool {
    grants
        .iter()
        .any(|g| matches(&g.permission, permission, ':') && matches(&g.scope, scope, '/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(p: &str, s: &str) -> Grant {
        Grant {
            permission: p.into(),
            scope: s.into(),
        }
    }

    #[test]
    fn wildcards() {
        let perm = "compute:join-tokens:create";
        assert!(allows(&[g("*", "*")], perm, "pool/a"));
        assert!(allows(
            &[g("compute:join-tokens:*", "pool/a")],
            perm,
            "pool/a"
        ));
        assert!(allows(&[g("compute:*", "pool/*")], perm, "pool/a"));
        assert!(!allows(
            &[g("compute:join-tokens:create", "pool/b")],
            perm,
            "pool/a"
        ));
        assert!(!allows(
            &[g("compute:join-tokens:list", "*")],
            perm,
            "pool/a"
        ));
        assert!(!allows(&[g("compute:join-tokens", "*")], perm, "pool/a"));
        assert!(!allows(&[], perm, "pool/a"));
    }
}
