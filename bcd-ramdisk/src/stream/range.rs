//! Sans-I/O HTTP resume logic: parse `Content-Range` / `Content-Length`, decide the next request's `Range` and
//! `If-Range`, and check that each response continues exactly where the last one stopped (RFC 9110 §14).
//!
//! Every function here takes header values from the network and never panics on them (see the `http_range` fuzz
//! target).

/// A parsed `Content-Range: bytes first-last/complete` (complete may be `*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContentRange {
    pub first: u64,
    pub last: u64,
    pub complete_length: Option<u64>,
}

impl ContentRange {
    pub fn len(&self) -> u64 {
        self.last - self.first + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("malformed Content-Range {0:?}")]
    BadContentRange(String),
    #[error("malformed Content-Length {0:?}")]
    BadContentLength(String),
    #[error("206 response without a Content-Range")]
    MissingContentRange,
    #[error("server resumed at byte {got}, {expected} was asked")]
    WrongStart { expected: u64, got: u64 },
    #[error(
        "Content-Length {content_length} disagrees with Content-Range covering {range_len} bytes"
    )]
    LengthMismatch { content_length: u64, range_len: u64 },
    #[error("the image changed on the server during the download ({what})")]
    EntityChanged { what: String },
    #[error("server sent {extra} bytes more than the {total} it announced")]
    TooLong { total: u64, extra: u64 },
    #[error("HTTP status {0}")]
    Status(u16),
}

impl RangeError {
    /// Whether asking again may help (server-side errors and throttling), as opposed to a broken contract.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Status(code) if *code >= 500 || *code == 408 || *code == 429)
    }
}

/// `bytes a-b/c`, `bytes a-b/*`; unit and whitespace per RFC 9110. `bytes */c` (unsatisfied range) is an error here:
/// a download never asks for a range past the end.
pub fn parse_content_range(value: &str) -> Result<ContentRange, RangeError> {
    let bad = || RangeError::BadContentRange(truncate(value));
    let rest = value.trim().strip_prefix("bytes").ok_or_else(bad)?;
    if !rest.starts_with(' ') {
        return Err(bad());
    }
    let (range, complete) = rest.trim_start().split_once('/').ok_or_else(bad)?;
    let (first, last) = range.split_once('-').ok_or_else(bad)?;
    let first = parse_u64(first).ok_or_else(bad)?;
    let last = parse_u64(last).ok_or_else(bad)?;
    let complete_length = match complete {
        "*" => None,
        n => Some(parse_u64(n).ok_or_else(bad)?),
    };
    // `last` at u64::MAX would make the range's length 2^64 (one more than u64 holds).
    if last < first || last == u64::MAX || complete_length.is_some_and(|c| last >= c) {
        return Err(bad());
    }
    Ok(ContentRange {
        first,
        last,
        complete_length,
    })
}

pub fn parse_content_length(value: &str) -> Result<u64, RangeError> {
    parse_u64(value.trim()).ok_or_else(|| RangeError::BadContentLength(truncate(value)))
}

/// Plain decimal digits only (no sign, no spaces), without overflow.
fn parse_u64(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// The headers of one response, as strings (absent headers are `None`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ResponseHead<'a> {
    pub status: u16,
    pub content_length: Option<&'a str>,
    pub content_range: Option<&'a str>,
    pub etag: Option<&'a str>,
    pub last_modified: Option<&'a str>,
}

/// How to consume an accepted response body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodyPlan {
    /// Bytes at the start of the body already received on an earlier connection (a server that ignored `Range`
    /// answers 200 with the whole entity): drop them.
    pub skip: u64,
    /// Bytes the body should carry, when known.
    pub body_len: Option<u64>,
}

/// Where a download stands across connections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResumeState {
    received: u64,
    total: Option<u64>,
    validator: Option<String>,
}

impl ResumeState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of the entity delivered so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Entity length, once a response announced it.
    pub fn total(&self) -> Option<u64> {
        self.total
    }

    /// True when the announced length has been received.
    pub fn is_complete(&self) -> bool {
        self.total.is_some_and(|t| self.received >= t)
    }

    /// Headers for the next request: none for the first, then `Range: bytes=N-` and, when the first response had a
    /// strong validator, `If-Range` so a changed file is sent whole (and then refused) rather than spliced.
    pub fn request_headers(&self) -> Vec<(&'static str, String)> {
        if self.received == 0 {
            return Vec::new();
        }
        let mut headers = vec![("range", format!("bytes={}-", self.received))];
        if let Some(v) = &self.validator {
            headers.push(("if-range", v.clone()));
        }
        headers
    }

    /// Check a response against the state and say how to read its body.
    pub fn accept(&mut self, head: &ResponseHead<'_>) -> Result<BodyPlan, RangeError> {
        let content_length = head.content_length.map(parse_content_length).transpose()?;
        let validator = strong_validator(head);
        match head.status {
            200 => {
                if self.received > 0 {
                    if let (Some(old), Some(new)) = (&self.validator, &validator)
                        && old != new
                    {
                        return Err(RangeError::EntityChanged {
                            what: format!("validator {old} became {new}"),
                        });
                    }
                    if let (Some(total), Some(len)) = (self.total, content_length)
                        && total != len
                    {
                        return Err(RangeError::EntityChanged {
                            what: format!("length {total} became {len}"),
                        });
                    }
                }
                if self.total.is_none() {
                    self.total = content_length;
                }
                if self.validator.is_none() && self.received == 0 {
                    self.validator = validator;
                }
                Ok(BodyPlan {
                    skip: self.received,
                    body_len: content_length,
                })
            }
            206 => {
                let range = parse_content_range(
                    head.content_range.ok_or(RangeError::MissingContentRange)?,
                )?;
                if range.first != self.received {
                    return Err(RangeError::WrongStart {
                        expected: self.received,
                        got: range.first,
                    });
                }
                if let Some(len) = content_length
                    && len != range.len()
                {
                    return Err(RangeError::LengthMismatch {
                        content_length: len,
                        range_len: range.len(),
                    });
                }
                match (self.total, range.complete_length) {
                    (Some(total), Some(c)) if total != c => {
                        return Err(RangeError::EntityChanged {
                            what: format!("length {total} became {c}"),
                        });
                    }
                    (None, c) => self.total = c,
                    _ => {}
                }
                if let (Some(old), Some(new)) = (&self.validator, &validator)
                    && old != new
                {
                    return Err(RangeError::EntityChanged {
                        what: format!("validator {old} became {new}"),
                    });
                }
                if self.validator.is_none() && self.received == 0 {
                    self.validator = validator;
                }
                Ok(BodyPlan {
                    skip: 0,
                    body_len: Some(range.len()),
                })
            }
            code => Err(RangeError::Status(code)),
        }
    }

    /// Record `n` body bytes passed on (after any skip). More than the announced total is an error.
    pub fn on_data(&mut self, n: u64) -> Result<(), RangeError> {
        self.received = self.received.saturating_add(n);
        match self.total {
            Some(total) if self.received > total => Err(RangeError::TooLong {
                total,
                extra: self.received - total,
            }),
            _ => Ok(()),
        }
    }
}

/// A strong ETag, else `Last-Modified`; weak ETags cannot be used with `If-Range`.
fn strong_validator(head: &ResponseHead<'_>) -> Option<String> {
    let etag = head
        .etag
        .map(str::trim)
        .filter(|e| e.starts_with('"') && e.len() >= 2 && e.len() <= 256);
    let last_modified = head
        .last_modified
        .map(str::trim)
        .filter(|l| !l.is_empty() && l.len() <= 64);
    etag.or(last_modified)
        .filter(|v| v.is_ascii() && !v.contains(['\r', '\n']))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn head(status: u16) -> ResponseHead<'static> {
        ResponseHead {
            status,
            ..Default::default()
        }
    }

    #[test]
    fn parses_content_range() {
        assert_eq!(
            parse_content_range("bytes 100-199/1000"),
            Ok(ContentRange {
                first: 100,
                last: 199,
                complete_length: Some(1000)
            })
        );
        assert_eq!(
            parse_content_range("bytes 0-0/*"),
            Ok(ContentRange {
                first: 0,
                last: 0,
                complete_length: None
            })
        );
        for bad in [
            "",
            "bytes",
            "bytes */1000",
            "bytes 5-4/10",
            "bytes 0-10/10",
            "bytes -1-5/10",
            "items 0-1/2",
            "bytes 0-1/",
            "bytes +0-1/2",
            "bytes 0-99999999999999999999/*",
            // u64::MAX as the last byte: 2^64 bytes, whose length overflowed `len()`.
            "bytes 0-18446744073709551615/*",
        ] {
            assert!(parse_content_range(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn first_response_sets_total_and_validator() {
        let mut s = ResumeState::new();
        let h = ResponseHead {
            content_length: Some("1000"),
            etag: Some("\"abc\""),
            ..head(200)
        };
        assert_eq!(
            s.accept(&h),
            Ok(BodyPlan {
                skip: 0,
                body_len: Some(1000)
            })
        );
        assert!(s.request_headers().is_empty());
        s.on_data(400).expect("within total");
        assert_eq!(
            s.request_headers(),
            vec![
                ("range", "bytes=400-".to_string()),
                ("if-range", "\"abc\"".to_string())
            ]
        );
    }

    #[test]
    fn resume_accepts_only_the_exact_continuation() {
        let mut s = ResumeState::new();
        s.accept(&ResponseHead {
            content_length: Some("1000"),
            ..head(200)
        })
        .expect("first");
        s.on_data(400).expect("data");
        let good = ResponseHead {
            content_range: Some("bytes 400-999/1000"),
            content_length: Some("600"),
            ..head(206)
        };
        assert_eq!(
            s.clone().accept(&good),
            Ok(BodyPlan {
                skip: 0,
                body_len: Some(600)
            })
        );
        let wrong_start = ResponseHead {
            content_range: Some("bytes 300-999/1000"),
            ..head(206)
        };
        assert_eq!(
            s.clone().accept(&wrong_start),
            Err(RangeError::WrongStart {
                expected: 400,
                got: 300
            })
        );
        let changed = ResponseHead {
            content_range: Some("bytes 400-1999/2000"),
            ..head(206)
        };
        assert!(matches!(
            s.clone().accept(&changed),
            Err(RangeError::EntityChanged { .. })
        ));
        let mismatch = ResponseHead {
            content_range: Some("bytes 400-999/1000"),
            content_length: Some("5"),
            ..head(206)
        };
        assert!(matches!(
            s.clone().accept(&mismatch),
            Err(RangeError::LengthMismatch { .. })
        ));
        assert_eq!(
            s.clone().accept(&head(206)),
            Err(RangeError::MissingContentRange)
        );
    }

    #[test]
    fn server_ignoring_range_is_skipped_not_spliced() {
        let mut s = ResumeState::new();
        s.accept(&ResponseHead {
            content_length: Some("1000"),
            etag: Some("\"v1\""),
            ..head(200)
        })
        .expect("first");
        s.on_data(400).expect("data");
        let whole = ResponseHead {
            content_length: Some("1000"),
            etag: Some("\"v1\""),
            ..head(200)
        };
        assert_eq!(
            s.clone().accept(&whole),
            Ok(BodyPlan {
                skip: 400,
                body_len: Some(1000)
            })
        );
        let changed = ResponseHead {
            content_length: Some("1000"),
            etag: Some("\"v2\""),
            ..head(200)
        };
        assert!(matches!(
            s.accept(&changed),
            Err(RangeError::EntityChanged { .. })
        ));
    }

    #[test]
    fn over_long_body_and_statuses() {
        let mut s = ResumeState::new();
        s.accept(&ResponseHead {
            content_length: Some("10"),
            ..head(200)
        })
        .expect("first");
        assert_eq!(
            s.on_data(11),
            Err(RangeError::TooLong {
                total: 10,
                extra: 1
            })
        );
        assert!(RangeError::Status(503).is_retryable());
        assert!(!RangeError::Status(404).is_retryable());
        assert_eq!(
            ResumeState::new().accept(&head(416)),
            Err(RangeError::Status(416))
        );
        let weak = ResponseHead {
            etag: Some("W/\"x\""),
            ..head(200)
        };
        let mut s = ResumeState::new();
        s.accept(&weak).expect("weak etag accepted");
        s.on_data(1).expect("no total");
        assert_eq!(
            s.request_headers().len(),
            1,
            "weak ETag not used for If-Range"
        );
    }

    /// A server over `entity` answering the state's next request, honouring Range or not.
    fn serve(state: &ResumeState, entity: &[u8], honour: bool) -> (u16, Option<String>, usize) {
        let range_start = state
            .request_headers()
            .iter()
            .find(|(name, _)| *name == "range")
            .and_then(|(_, v)| {
                v.strip_prefix("bytes=")?
                    .strip_suffix('-')?
                    .parse::<usize>()
                    .ok()
            });
        match range_start {
            Some(start) if honour => (
                206,
                Some(format!(
                    "bytes {start}-{}/{}",
                    entity.len() - 1,
                    entity.len()
                )),
                start,
            ),
            _ => (200, None, 0),
        }
    }

    proptest! {
        #[test]
        fn resumed_downloads_reassemble_the_entity(
            len in 1usize..5000,
            cuts in prop::collection::vec((1usize..3000, any::<bool>()), 1..12),
        ) {
            let entity: Vec<u8> = (0..len).map(|i| (i * 31 % 256) as u8).collect();
            let mut state = ResumeState::new();
            let mut out = Vec::new();
            let mut connections = cuts.into_iter().chain(std::iter::repeat((usize::MAX, true)));
            while !state.is_complete() {
                let (cut, honour) = connections.next().expect("endless");
                let (status, content_range, start) = serve(&state, &entity, honour);
                let length = (entity.len() - start).to_string();
                let head = ResponseHead {
                    status,
                    content_length: Some(&length),
                    content_range: content_range.as_deref(),
                    etag: Some("\"v1\""),
                    last_modified: None,
                };
                let plan = state.accept(&head).expect("valid continuation");
                let body = &entity[start..];
                let delivered = &body[..cut.min(body.len())];
                let fresh = delivered.get(plan.skip as usize..).unwrap_or(&[]);
                state.on_data(fresh.len() as u64).expect("within total");
                out.extend_from_slice(fresh);
            }
            prop_assert_eq!(out, entity);
        }
    }

    proptest! {
        #[test]
        fn never_panics(cr in ".{0,40}", cl in ".{0,24}", status in 0u16..700, received in 0u64..u64::MAX) {
            let _ = parse_content_range(&cr);
            let _ = parse_content_length(&cl);
            let mut s = ResumeState::new();
            let _ = s.on_data(received);
            let _ = s.accept(&ResponseHead { status, content_length: Some(&cl), content_range: Some(&cr), etag: Some(&cr), last_modified: None });
            let _ = s.request_headers();
        }

        #[test]
        fn formatted_ranges_round_trip(first in 0u64..1 << 50, len in 1u64..1 << 20, extra in 0u64..1 << 20) {
            let last = first + len - 1;
            let total = last + 1 + extra;
            let parsed = parse_content_range(&format!("bytes {first}-{last}/{total}"));
            prop_assert_eq!(parsed, Ok(ContentRange { first, last, complete_length: Some(total) }));
        }
    }
}
