//! bc-error-chain: the one way an error is shown in a log line, a gRPC status or an API message, after omicron's
//! `InlineErrorChain`: the error and every cause below it on one line, `a: b: c`.
//!
//! Library errors carry their cause as `#[source]` and their message does not repeat it (STYLE.md), so
//! `error = %e` shows only the top (`StoreError::Db` logged "database error" and no more). Log
//! `error = %InlineErrorChain::new(&e)` instead, and build statuses from [`chain`]. A message that does repeat its
//! source's text is shown once: a cause whose text the message above already ends with is skipped.
//!
//! It depends on nothing (std only) and must stay that way: `scripts/check-deps` keeps it a leaf.

#![deny(clippy::disallowed_methods)]

use std::error::Error;
use std::fmt;

/// Displays an error and its causes on one line: `top: cause: root cause`.
#[derive(Clone, Copy)]
pub struct InlineErrorChain<'a>(&'a (dyn Error + 'static));

impl<'a> InlineErrorChain<'a> {
    pub fn new(error: &'a (dyn Error + 'static)) -> InlineErrorChain<'a> {
        InlineErrorChain(error)
    }
}

impl fmt::Display for InlineErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = self.0.to_string();
        f.write_str(&shown)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            let text = e.to_string();
            // `#[error("...: {0}")]` over a `#[source]`: the cause is in the message already.
            if !text.is_empty() && !shown.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            shown = text;
            cause = e.source();
        }
        Ok(())
    }
}

impl fmt::Debug for InlineErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The chain as a `String` (for a `tonic::Status` message or an API error).
pub fn chain(error: &(dyn Error + 'static)) -> String {
    InlineErrorChain::new(error).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Store {
        #[error("database error")]
        Db(#[source] std::io::Error),
        #[error("reading config {path}")]
        Read {
            path: String,
            #[source]
            source: Box<Store>,
        },
        #[error("opening the pool: {0}")]
        Repeats(#[source] std::io::Error),
    }

    fn refused() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused")
    }

    #[test]
    fn every_cause_is_shown_on_one_line() {
        let e = Store::Db(refused());
        assert_eq!(
            e.to_string(),
            "database error",
            "the top alone drops the cause"
        );
        assert_eq!(
            InlineErrorChain::new(&e).to_string(),
            "database error: connection refused"
        );
        let nested = Store::Read {
            path: "/etc/bcd/site.toml".into(),
            source: Box::new(e),
        };
        assert_eq!(
            chain(&nested),
            "reading config /etc/bcd/site.toml: database error: connection refused"
        );
        assert_eq!(
            format!("{:?}", InlineErrorChain::new(&nested)),
            chain(&nested)
        );
    }

    #[test]
    fn a_message_that_repeats_its_cause_shows_it_once() {
        let e = Store::Repeats(refused());
        assert_eq!(chain(&e), "opening the pool: connection refused");
    }

    #[test]
    fn an_error_without_causes_is_its_message() {
        assert_eq!(chain(&refused()), "connection refused");
    }
}
