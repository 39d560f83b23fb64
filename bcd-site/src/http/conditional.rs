//! Conditional requests (RFC 9110 §13), sans I/O: [`evaluate`] decides 304 / 412 / proceed from a file's
//! validators, in the order of §13.2.2:
//! 1. `If-Match` (strong comparison; `*` matches any file): false → 412.
//! 2. Without `If-Match`, `If-Unmodified-Since`: modified after the date → 412.
//! 3. `If-None-Match` (weak comparison; `*` matches any file): a match → 304 for GET and HEAD, 412 otherwise.
//! 4. Without `If-None-Match`, for GET and HEAD only, `If-Modified-Since`: not modified since the date → 304.
//!
//! Then `If-Range` ([`if_range_holds`]) decides whether a `Range` applies. A field that does not parse (an
//! invalid date, a broken entity-tag list) is ignored, as if it had not been sent.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The precondition fields of a request, as sent (lists joined with `, `).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conditions {
    pub if_match: Option<String>,
    pub if_none_match: Option<String>,
    pub if_modified_since: Option<String>,
    pub if_unmodified_since: Option<String>,
}

/// What the server knows of the file it would send: a strong entity-tag and the modification time in whole
/// seconds (what `Last-Modified` carries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Validators {
    /// `"<mtime hex>-<len hex>"`, quotes included.
    pub etag: String,
    pub modified_secs: u64,
}

impl Validators {
    pub fn for_file(modified_secs: u64, len: u64) -> Self {
        Validators {
            etag: format!("\"{modified_secs:x}-{len:x}\""),
            modified_secs,
        }
    }

    /// The `Last-Modified` value.
    pub fn last_modified(&self) -> String {
        httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(self.modified_secs))
    }
}

/// What to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    /// Serve the file (200, or 206 for a range).
    Proceed,
    /// 304: the client's copy is current.
    NotModified,
    /// 412.
    Failed,
}

/// Evaluates the preconditions for a request of method `get_or_head` (GET or HEAD) or another. Pure.
pub fn evaluate(c: &Conditions, get_or_head: bool, v: &Validators) -> Precondition {
    let opaque = strip_quotes(&v.etag);
    if let Some(tags) = c.if_match.as_deref().and_then(entity_tags) {
        let matched = match tags {
            Tags::Any => true,
            Tags::List(list) => list.iter().any(|t| !t.weak && Some(t.opaque) == opaque),
        };
        if !matched {
            return Precondition::Failed;
        }
    } else if let Some(date) = c.if_unmodified_since.as_deref().and_then(http_date_secs)
        && v.modified_secs > date
    {
        return Precondition::Failed;
    }
    if let Some(tags) = c.if_none_match.as_deref().and_then(entity_tags) {
        let matched = match tags {
            Tags::Any => true,
            Tags::List(list) => list.iter().any(|t| Some(t.opaque) == opaque),
        };
        if matched {
            return if get_or_head {
                Precondition::NotModified
            } else {
                Precondition::Failed
            };
        }
    } else if get_or_head
        && let Some(date) = c.if_modified_since.as_deref().and_then(http_date_secs)
        && v.modified_secs <= date
    {
        return Precondition::NotModified;
    }
    Precondition::Proceed
}

/// Whether `If-Range: <value>` lets a `Range` apply (RFC 9110 §13.1.5): an entity-tag must equal ours by strong
/// comparison (a weak tag never does), a date must equal our `Last-Modified` exactly.
pub fn if_range_holds(value: &str, v: &Validators) -> bool {
    let value = value.trim();
    if value.starts_with('"') || value.starts_with("W/") {
        return value == v.etag;
    }
    http_date_secs(value) == Some(v.modified_secs)
}

fn http_date_secs(text: &str) -> Option<u64> {
    let t: SystemTime = httpdate::parse_http_date(text.trim()).ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_secs())
}

fn strip_quotes(tag: &str) -> Option<&str> {
    tag.strip_prefix('"')?.strip_suffix('"')
}

#[derive(Debug, PartialEq, Eq)]
struct Tag<'a> {
    weak: bool,
    opaque: &'a str,
}

#[derive(Debug, PartialEq, Eq)]
enum Tags<'a> {
    Any,
    List(Vec<Tag<'a>>),
}

/// `"*"` or `#entity-tag` (RFC 9110 §8.8.3): `[W/] DQUOTE *etagc DQUOTE`, separated by commas and optional
/// whitespace. `None` when the value does not parse.
fn entity_tags(value: &str) -> Option<Tags<'_>> {
    let value = value.trim();
    if value == "*" {
        return Some(Tags::Any);
    }
    let mut list = Vec::new();
    let mut rest = value;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        if rest.is_empty() {
            break;
        }
        let (weak, tail) = match rest.strip_prefix("W/") {
            Some(t) => (true, t),
            None => (false, rest),
        };
        let tail = tail.strip_prefix('"')?;
        let end = tail.find('"')?;
        let opaque = &tail[..end];
        if !opaque
            .bytes()
            .all(|b| b == 0x21 || (0x23..=0x7e).contains(&b) || b >= 0x80)
        {
            return None;
        }
        list.push(Tag { weak, opaque });
        rest = &tail[end + 1..];
        if !(rest.is_empty() || rest.starts_with([' ', '\t', ','])) {
            return None;
        }
    }
    if list.is_empty() {
        return None;
    }
    Some(Tags::List(list))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODIFIED: u64 = 784_111_777; // Sun, 06 Nov 1994 08:49:37 GMT

    fn v() -> Validators {
        Validators::for_file(MODIFIED, 42)
    }

    fn with(f: impl FnOnce(&mut Conditions)) -> Precondition {
        let mut c = Conditions::default();
        f(&mut c);
        evaluate(&c, true, &v())
    }

    #[test]
    fn validators_look_as_sent() {
        assert_eq!(v().etag, "\"2ebc98a1-2a\"");
        assert_eq!(v().last_modified(), "Sun, 06 Nov 1994 08:49:37 GMT");
    }

    #[test]
    fn if_none_match_compares_weakly_and_wins_over_if_modified_since() {
        let etag = v().etag;
        use Precondition::*;
        assert_eq!(with(|_| {}), Proceed);
        assert_eq!(with(|c| c.if_none_match = Some(etag.clone())), NotModified);
        assert_eq!(
            with(|c| c.if_none_match = Some(format!("W/{etag}"))),
            NotModified
        );
        assert_eq!(
            with(|c| c.if_none_match = Some(format!("\"x\", {etag}"))),
            NotModified
        );
        assert_eq!(with(|c| c.if_none_match = Some("*".into())), NotModified);
        assert_eq!(
            with(|c| c.if_none_match = Some("\"other\"".into())),
            Proceed
        );
        // A non-matching If-None-Match makes If-Modified-Since irrelevant, even when it says "not modified".
        assert_eq!(
            with(|c| {
                c.if_none_match = Some("\"other\"".into());
                c.if_modified_since = Some(v().last_modified());
            }),
            Proceed
        );
        // A broken list is ignored: If-Modified-Since decides.
        assert_eq!(
            with(|c| {
                c.if_none_match = Some("no-quotes".into());
                c.if_modified_since = Some(v().last_modified());
            }),
            NotModified
        );
        // Other methods get 412 for a match.
        let c = Conditions {
            if_none_match: Some(etag),
            ..Conditions::default()
        };
        assert_eq!(evaluate(&c, false, &v()), Failed);
    }

    #[test]
    fn if_modified_since_only_for_get_and_head_and_valid_dates() {
        use Precondition::*;
        let date = |secs: u64| httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(
            with(|c| c.if_modified_since = Some(date(MODIFIED))),
            NotModified
        );
        assert_eq!(
            with(|c| c.if_modified_since = Some(date(MODIFIED + 60))),
            NotModified
        );
        assert_eq!(
            with(|c| c.if_modified_since = Some(date(MODIFIED - 1))),
            Proceed
        );
        // RFC 850 and asctime forms are HTTP-dates too.
        assert_eq!(
            with(|c| c.if_modified_since = Some("Sunday, 06-Nov-94 08:49:37 GMT".into())),
            NotModified
        );
        assert_eq!(
            with(|c| c.if_modified_since = Some("Sun Nov  6 08:49:37 1994".into())),
            NotModified
        );
        assert_eq!(
            with(|c| c.if_modified_since = Some("yesterday".into())),
            Proceed
        );
        let c = Conditions {
            if_modified_since: Some(date(MODIFIED)),
            ..Conditions::default()
        };
        assert_eq!(evaluate(&c, false, &v()), Proceed);
    }

    #[test]
    fn if_match_and_if_unmodified_since_come_first() {
        use Precondition::*;
        let etag = v().etag;
        let date = |secs: u64| httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(with(|c| c.if_match = Some(etag.clone())), Proceed);
        assert_eq!(with(|c| c.if_match = Some("*".into())), Proceed);
        assert_eq!(
            with(|c| c.if_match = Some(format!("W/{etag}"))),
            Failed,
            "strong comparison"
        );
        assert_eq!(with(|c| c.if_match = Some("\"other\"".into())), Failed);
        assert_eq!(
            with(|c| c.if_unmodified_since = Some(date(MODIFIED - 1))),
            Failed
        );
        assert_eq!(
            with(|c| c.if_unmodified_since = Some(date(MODIFIED))),
            Proceed
        );
        // If-Match present: If-Unmodified-Since is not evaluated.
        assert_eq!(
            with(|c| {
                c.if_match = Some(etag.clone());
                c.if_unmodified_since = Some(date(MODIFIED - 1));
            }),
            Proceed
        );
        // A failed If-Match wins over a matching If-None-Match.
        assert_eq!(
            with(|c| {
                c.if_match = Some("\"other\"".into());
                c.if_none_match = Some(etag.clone());
            }),
            Failed
        );
    }

    #[test]
    fn if_range_is_strong_and_exact() {
        let v = v();
        assert!(if_range_holds(&v.etag, &v));
        assert!(!if_range_holds(&format!("W/{}", v.etag), &v));
        assert!(!if_range_holds("\"stale\"", &v));
        assert!(if_range_holds(&v.last_modified(), &v));
        assert!(!if_range_holds("Sun, 06 Nov 1994 08:49:38 GMT", &v));
        assert!(!if_range_holds("garbage", &v));
    }

    #[test]
    fn entity_tag_lists() {
        assert_eq!(entity_tags("*"), Some(Tags::Any));
        assert_eq!(
            entity_tags(" \"a\" ,W/\"b\",, \"\""),
            Some(Tags::List(vec![
                Tag {
                    weak: false,
                    opaque: "a"
                },
                Tag {
                    weak: true,
                    opaque: "b"
                },
                Tag {
                    weak: false,
                    opaque: ""
                },
            ]))
        );
        for bad in ["", "a", "\"a", "\"a\"b", "w/\"a\"", "\"a b\"", ","] {
            assert_eq!(entity_tags(bad), None, "{bad:?}");
        }
    }
}
