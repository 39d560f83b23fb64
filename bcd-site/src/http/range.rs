//! `Range` request header parsing (RFC 9110 §14.2), sans I/O.
//!
//! Only single byte ranges are served as 206. A header this server does not understand (another unit, a syntax
//! error, several ranges) is ignored and the whole file is sent, which RFC 9110 allows; a well-formed single range
//! that lies wholly past the end of the file is unsatisfiable (416).

#![deny(clippy::disallowed_methods)]

/// What to send for a file of a known length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeDecision {
    /// No (usable) range: 200 with the whole file.
    Full,
    /// 206: bytes `first..=last`.
    Partial { first: u64, last: u64 },
    /// 416 with `Content-Range: bytes */<len>`.
    Unsatisfiable,
}

/// Decides how to answer `Range: <header>` for a file of `len` bytes.
pub fn decide(header: Option<&str>, len: u64) -> RangeDecision {
    let Some(header) = header else {
        return RangeDecision::Full;
    };
    let Some(spec) = strip_unit(header.trim()) else {
        return RangeDecision::Full;
    };
    if spec.contains(',') {
        // Several ranges would need multipart/byteranges; the whole file is a valid answer.
        return RangeDecision::Full;
    }
    let Some((start, end)) = spec.trim().split_once('-') else {
        return RangeDecision::Full;
    };
    let (start, end) = (start.trim(), end.trim());
    match (parse(start), parse(end)) {
        // bytes=first-[last]
        (Some(first), last) if !start.is_empty() => {
            if !end.is_empty() && last.is_none() {
                return RangeDecision::Full;
            }
            if let Some(last) = last
                && last < first
            {
                return RangeDecision::Full;
            }
            if first >= len {
                return RangeDecision::Unsatisfiable;
            }
            let last = last.map_or(len - 1, |l| l.min(len - 1));
            RangeDecision::Partial { first, last }
        }
        // bytes=-suffix
        (None, Some(suffix)) if start.is_empty() => {
            if suffix == 0 || len == 0 {
                return RangeDecision::Unsatisfiable;
            }
            RangeDecision::Partial {
                first: len.saturating_sub(suffix),
                last: len - 1,
            }
        }
        _ => RangeDecision::Full,
    }
}

fn strip_unit(h: &str) -> Option<&str> {
    let (unit, rest) = h.split_once('=')?;
    unit.trim().eq_ignore_ascii_case("bytes").then_some(rest)
}

fn parse(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::RangeDecision::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn single_ranges() {
        assert_eq!(decide(None, 10), Full);
        assert_eq!(decide(Some("bytes=0-0"), 10), Partial { first: 0, last: 0 });
        assert_eq!(decide(Some("bytes=2-"), 10), Partial { first: 2, last: 9 });
        assert_eq!(
            decide(Some("bytes=2-100"), 10),
            Partial { first: 2, last: 9 }
        );
        assert_eq!(decide(Some("bytes=-3"), 10), Partial { first: 7, last: 9 });
        assert_eq!(decide(Some("bytes=-30"), 10), Partial { first: 0, last: 9 });
        assert_eq!(
            decide(Some("Bytes = 1-2"), 10),
            Partial { first: 1, last: 2 }
        );
        assert_eq!(decide(Some("bytes=10-"), 10), Unsatisfiable);
        assert_eq!(decide(Some("bytes=-0"), 10), Unsatisfiable);
        assert_eq!(decide(Some("bytes=0-"), 0), Unsatisfiable);
        assert_eq!(decide(Some("bytes=5-2"), 10), Full);
        assert_eq!(decide(Some("bytes=0-1,4-5"), 10), Full);
        assert_eq!(decide(Some("items=0-1"), 10), Full);
        assert_eq!(decide(Some("bytes=a-b"), 10), Full);
        assert_eq!(decide(Some("bytes=+1-2"), 10), Full);
        assert_eq!(decide(Some("bytes=1-x"), 10), Full);
        assert_eq!(decide(Some("bytes=99999999999999999999999-"), 10), Full);
    }

    proptest! {
        #[test]
        fn partial_ranges_lie_inside_the_file(h in "\\PC{0,24}", len in 0u64..1000) {
            if let Partial { first, last } = decide(Some(&h), len) {
                prop_assert!(first <= last && last < len);
            }
        }
    }
}
