//! The lean, local IAM: a principal's grants are (permission, scope) pairs; `*` matches a whole segment and a
//! trailing `*` matches the rest. Example: `compute:join-tokens:create` on `pool/gpu-a`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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

/// A pattern as [`matches`] reads it: its leading segments (`*` among them matches any one segment) and whether a
/// final `*` lets it match any number of further segments (a bare `*` is one `*` segment and that tail).
struct Pattern<'a> {
    segments: Vec<&'a str>,
    open_tail: bool,
}

impl<'a> Pattern<'a> {
    fn parse(pattern: &'a str, sep: char) -> Pattern<'a> {
        let mut segments: Vec<&str> = pattern.split(sep).collect();
        let open_tail = segments.last() == Some(&"*");
        // A value has at least one segment, so a bare `*` is the same as `*` followed by the open tail.
        if open_tail && segments.len() > 1 {
            segments.pop();
        }
        Pattern {
            segments,
            open_tail,
        }
    }

    /// Whether every value `narrow` matches is matched by `self`.
    fn contains(&self, narrow: &Pattern<'_>) -> bool {
        let lengths_fit = if self.open_tail {
            narrow.segments.len() >= self.segments.len()
        } else {
            !narrow.open_tail && narrow.segments.len() == self.segments.len()
        };
        // A `*` segment of `narrow` stands for any segment, so only a `*` of `self` covers it.
        lengths_fit
            && self
                .segments
                .iter()
                .zip(&narrow.segments)
                .all(|(wide, n)| *wide == "*" || wide == n)
    }
}

/// Whether `wide` matches every value `narrow` matches (patterns as in [`allows`], segments split at `sep`).
pub fn pattern_covers(wide: &str, narrow: &str, sep: char) -> bool {
    Pattern::parse(wide, sep).contains(&Pattern::parse(narrow, sep))
}

/// Whether `held` allows everything `wanted` would: one held grant whose permission pattern covers the wanted
/// permission and whose scope pattern covers the wanted scope. This is what a principal may hand out (a caller
/// never grants more than it holds). Coverage by several grants together is not counted: a wildcard the caller
/// holds only piecewise is refused, and the caller grants the pieces instead.
pub fn covers(held: &[Grant], wanted: &Grant) -> bool {
    held.iter().any(|g| {
        pattern_covers(&g.permission, &wanted.permission, ':')
            && pattern_covers(&g.scope, &wanted.scope, '/')
    })
}

/// The first of `wanted` that `held` does not cover (None: the caller may grant them all).
pub fn first_uncovered<'a>(held: &[Grant], wanted: &'a [Grant]) -> Option<&'a Grant> {
    wanted.iter().find(|w| !covers(held, w))
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

    /// What a caller holding `held` may grant: (held permission, held scope, wanted permission, wanted scope,
    /// may grant).
    #[rustfmt::skip]
    const COVERAGE: &[(&str, &str, &str, &str, bool)] = &[
        // Exact.
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "pool/a", true),
        ("compute:nodes:get", "pool/a", "compute:nodes:drain", "pool/a", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "pool/b", false),
        ("compute:nodes:get", "pool/a", "compute:nodes", "pool/a", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:get:x", "pool/a", false),
        // A wildcard permission covers what it matches, never a wider wildcard.
        ("compute:nodes:*", "pool/a", "compute:nodes:get", "pool/a", true),
        ("compute:nodes:*", "pool/a", "compute:nodes:*", "pool/a", true),
        ("compute:nodes:*", "pool/a", "compute:*", "pool/a", false),
        ("compute:nodes:*", "pool/a", "*", "pool/a", false),
        ("compute:nodes:*", "pool/a", "compute:join-tokens:create", "pool/a", false),
        ("compute:*", "pool/a", "compute:nodes:*", "pool/a", true),
        ("compute:*", "pool/a", "compute:nodes:get", "pool/a", true),
        ("compute:*", "pool/a", "compute", "pool/a", true),
        ("compute:*", "pool/a", "billing:read", "pool/a", false),
        ("compute:*:get", "pool/a", "compute:nodes:get", "pool/a", true),
        ("compute:*:get", "pool/a", "compute:*:get", "pool/a", true),
        ("compute:*:get", "pool/a", "compute:nodes:*", "pool/a", false),
        ("compute:*:get", "pool/a", "compute:*", "pool/a", false),
        ("compute:nodes:get", "pool/a", "compute:*:get", "pool/a", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:*", "pool/a", false),
        ("compute:nodes:get", "pool/a", "*", "pool/a", false),
        // A wildcard scope covers narrower scopes, never a wider one.
        ("compute:nodes:get", "pool/*", "compute:nodes:get", "pool/a", true),
        ("compute:nodes:get", "pool/*", "compute:nodes:get", "pool/*", true),
        ("compute:nodes:get", "pool/*", "compute:nodes:get", "pool/a/b", true),
        ("compute:nodes:get", "pool/*", "compute:nodes:get", "*", false),
        ("compute:nodes:get", "pool/*", "compute:nodes:get", "tenant/t", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "pool/*", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "*", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "pool/a/*", false),
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "pool", false),
        ("compute:nodes:get", "*/a", "compute:nodes:get", "pool/a", true),
        ("compute:nodes:get", "*/a", "compute:nodes:get", "*/a", true),
        ("compute:nodes:get", "pool/a", "compute:nodes:get", "*/a", false),
        ("compute:nodes:get", "*/a", "compute:nodes:get", "*/*", false),
        // The tenant a principal administers, and another tenant.
        ("*", "tenant/t", "compute:reservations:create", "tenant/t", true),
        ("*", "tenant/t", "*", "tenant/t", true),
        ("*", "tenant/t", "*", "tenant/u", false),
        ("*", "tenant/t", "*", "tenant/*", false),
        ("*", "tenant/t", "*", "*", false),
        ("compute:principals:create", "tenant/t", "*", "tenant/t", false),
        ("compute:principals:create", "tenant/t", "compute:principals:create", "tenant/t", true),
        ("compute:principals:create", "tenant/t", "compute:principals:*", "tenant/t", false),
        // Root: only `*` on `*` makes an administrator.
        ("*", "*", "*", "*", true),
        ("*", "*", "compute:nodes:get", "pool/a", true),
        ("compute:*", "*", "*", "*", false),
        ("*", "tenant/*", "*", "*", false),
        ("*", "tenant/*", "*", "tenant/root", true),
        ("compute:principals:create", "tenant/root", "*", "*", false),
        ("compute:principals:create", "tenant/root", "compute:principals:create", "tenant/root", true),
        ("compute:principals:create", "*", "compute:principals:create", "tenant/t", true),
        ("compute:principals:create", "*", "compute:tenants:create", "tenant/t", false),
    ];

    #[test]
    fn a_caller_may_grant_only_what_its_own_grants_cover() {
        for &(hp, hs, wp, ws, want) in COVERAGE {
            assert_eq!(
                covers(&[g(hp, hs)], &g(wp, ws)),
                want,
                "holding {hp} on {hs}, granting {wp} on {ws}"
            );
        }
    }

    #[test]
    fn coverage_agrees_with_matching_on_concrete_values() {
        // Whatever a wanted grant allows on a concrete value, a covering held grant allows too.
        let values = [
            ("compute:nodes:get", "pool/a"),
            ("compute:nodes:drain", "pool/b"),
            ("compute:join-tokens:create", "pool/a/b"),
            ("compute", "pool"),
            ("billing:read", "tenant/t"),
            ("compute:reservations:create", "tenant/u"),
        ];
        for &(hp, hs, wp, ws, _) in COVERAGE {
            if !covers(&[g(hp, hs)], &g(wp, ws)) {
                continue;
            }
            for (vp, vs) in values {
                if allows(&[g(wp, ws)], vp, vs) {
                    assert!(
                        allows(&[g(hp, hs)], vp, vs),
                        "{hp} on {hs} covers {wp} on {ws} but not {vp} on {vs}"
                    );
                }
            }
        }
    }

    /// Every string over `alphabet` of 1 to `max` segments joined by `:`.
    fn strings(alphabet: &[&str], max: usize) -> Vec<String> {
        let mut all: Vec<Vec<&str>> = alphabet.iter().map(|a| vec![*a]).collect();
        let mut last = all.clone();
        for _ in 1..max {
            last = last
                .iter()
                .flat_map(|p| {
                    alphabet.iter().map(move |a| {
                        let mut q = p.clone();
                        q.push(a);
                        q
                    })
                })
                .collect();
            all.extend(last.iter().cloned());
        }
        all.into_iter().map(|p| p.join(":")).collect()
    }

    /// Exhaustively, over patterns of up to 3 segments and values of up to 4 (one letter no pattern uses): a
    /// pattern covers another exactly when it matches every value the other matches.
    #[test]
    fn pattern_coverage_is_set_containment() {
        let patterns = strings(&["a", "b", "*"], 3);
        let values = strings(&["a", "b", "c"], 4);
        for wide in &patterns {
            for narrow in &patterns {
                let contained = values
                    .iter()
                    .all(|v| !matches(narrow, v, ':') || matches(wide, v, ':'));
                assert_eq!(
                    pattern_covers(wide, narrow, ':'),
                    contained,
                    "{wide} covers {narrow}?"
                );
            }
        }
    }

    #[test]
    fn several_grants_each_need_a_cover_and_coverage_is_not_pooled() {
        let held = [
            g("compute:nodes:*", "pool/a"),
            g("compute:reservations:*", "tenant/t"),
        ];
        let ok = [
            g("compute:nodes:get", "pool/a"),
            g("compute:reservations:create", "tenant/t"),
        ];
        assert_eq!(first_uncovered(&held, &ok), None);
        let too_much = [g("compute:nodes:get", "pool/a"), g("compute:*", "pool/a")];
        assert_eq!(first_uncovered(&held, &too_much), Some(&too_much[1]));
        assert_eq!(first_uncovered(&[], &[]), None);
        assert_eq!(first_uncovered(&[], &ok), Some(&ok[0]));
    }
}
