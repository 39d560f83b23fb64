//! bc-backoff: the one retry delay schedule of the workspace, after linkerd's `exp-backoff`. Every retry loop (the
//! gateway channel's reconnects, the site's artifact downloads, the Redfish client's busy answers, the ramdisk's
//! image stream and DHCP retransmissions, telemetry exports) takes its delays from an [`ExponentialBackoff`].
//!
//! A policy is a base delay doubling per attempt up to a cap (the attempt's *ceiling*), randomised by a [`Jitter`].
//! It is validated when built ([`ExponentialBackoff::try_new`]; [`ExponentialBackoff::new`] checks a constant at
//! compile time) and pure: it reads no clock and no random number generator, the caller passes a uniform number
//! in `[0, 1]` (`unit`) to every [`ExponentialBackoff::delay`], so tests pin the randomness and decisions that use
//! it stay pure. [`Backoff`] counts the attempts of one retry loop.
//!
//! It depends on nothing (std only) and must stay that way: `scripts/check-deps` keeps it a leaf.

#![deny(clippy::disallowed_methods)]

use std::fmt;
use std::time::Duration;

/// How a delay is randomised around its attempt's ceiling `c` (`unit` is the caller's uniform number in `[0, 1]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Jitter {
    /// Uniform in `[c × (1 − f), c]`, `f` in `[0, 1]`: `Fraction(1.0)` is "full jitter" (uniform in `[0, c]`, the
    /// spread that best de-synchronises a fleet reconnecting together), `Fraction(0.5)` is "equal jitter" (at least
    /// half the ceiling), `Fraction(0.0)` no jitter. Never above the cap.
    Fraction(f64),
    /// Uniform in `[c − s, c + s]`, `s` at most the base delay: RFC 2131 §4.1's retransmission delay "randomized by
    /// a uniform number chosen from the range −1 to +1" seconds. May exceed the cap by `s`.
    Spread(Duration),
}

/// Why a backoff policy was refused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InvalidBackoff {
    /// A zero base delay retries in a busy loop.
    ZeroBase,
    /// The cap is below the base delay.
    CapBelowBase { base: Duration, cap: Duration },
    /// A jitter fraction outside `[0, 1]` (or not a number).
    Fraction(f64),
    /// A spread larger than the base delay (the first delays could be zero).
    SpreadAboveBase { spread: Duration, base: Duration },
}

impl fmt::Display for InvalidBackoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidBackoff::ZeroBase => f.write_str(
                "backoff base delay is zero: every retry would follow at once; give at least 1 ms",
            ),
            InvalidBackoff::CapBelowBase { base, cap } => {
                write!(
                    f,
                    "backoff cap {cap:?} is below its base delay {base:?}: raise the cap or lower the base"
                )
            }
            InvalidBackoff::Fraction(x) => {
                write!(
                    f,
                    "backoff jitter fraction {x} is not in [0, 1] (1 is full jitter, 0 none)"
                )
            }
            InvalidBackoff::SpreadAboveBase { spread, base } => write!(
                f,
                "backoff jitter spread {spread:?} exceeds the base delay {base:?}: the first delays could be zero"
            ),
        }
    }
}

impl std::error::Error for InvalidBackoff {}

/// A retry delay policy: attempt `n` (from 0) has the ceiling `min(cap, base × 2ⁿ)`, randomised by the jitter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExponentialBackoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
}

impl ExponentialBackoff {
    /// Validates a policy: a base delay above zero, a cap at least the base, a jitter fraction in `[0, 1]` or a
    /// spread at most the base.
    pub const fn try_new(
        base: Duration,
        cap: Duration,
        jitter: Jitter,
    ) -> Result<ExponentialBackoff, InvalidBackoff> {
        if base.is_zero() {
            return Err(InvalidBackoff::ZeroBase);
        }
        if cap.as_nanos() < base.as_nanos() {
            return Err(InvalidBackoff::CapBelowBase { base, cap });
        }
        match jitter {
            // NaN fails both comparisons.
            Jitter::Fraction(x) if !(x >= 0.0 && x <= 1.0) => {
                return Err(InvalidBackoff::Fraction(x));
            }
            Jitter::Spread(spread) if spread.as_nanos() > base.as_nanos() => {
                return Err(InvalidBackoff::SpreadAboveBase { spread, base });
            }
            _ => {}
        }
        Ok(ExponentialBackoff { base, cap, jitter })
    }

    /// [`ExponentialBackoff::try_new`] for `const` items: an invalid constant policy fails the build. Not for
    /// policies from configuration (it panics there); use `try_new`.
    pub const fn new(base: Duration, cap: Duration, jitter: Jitter) -> ExponentialBackoff {
        match ExponentialBackoff::try_new(base, cap, jitter) {
            Ok(b) => b,
            Err(InvalidBackoff::ZeroBase) => panic!("backoff base delay is zero"),
            Err(InvalidBackoff::CapBelowBase { .. }) => {
                panic!("backoff cap is below its base delay")
            }
            Err(InvalidBackoff::Fraction(_)) => panic!("backoff jitter fraction is not in [0, 1]"),
            Err(InvalidBackoff::SpreadAboveBase { .. }) => {
                panic!("backoff jitter spread exceeds the base delay")
            }
        }
    }

    pub const fn base(&self) -> Duration {
        self.base
    }

    pub const fn cap(&self) -> Duration {
        self.cap
    }

    pub const fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The ceiling of attempt `attempt` (from 0): `min(cap, base × 2^attempt)`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let cap = self.cap.as_nanos();
        let grown = 1u128
            .checked_shl(attempt)
            .and_then(|factor| self.base.as_nanos().checked_mul(factor))
            .unwrap_or(cap);
        from_nanos(grown.min(cap))
    }

    /// The delay before retry `attempt` (from 0). `unit` is a uniform random number in `[0, 1]` from the caller;
    /// values outside are clamped (NaN counts as 0), so no input panics.
    pub fn delay(&self, attempt: u32, unit: f64) -> Duration {
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        let c = self.ceiling(attempt).as_nanos();
        let (lo, hi) = match self.jitter {
            Jitter::Fraction(f) => (c - scale(c, f), c),
            Jitter::Spread(s) => {
                let s = s.as_nanos();
                (c.saturating_sub(s), c.saturating_add(s))
            }
        };
        from_nanos(lo + scale(hi - lo, unit))
    }

    /// A counter of attempts for one retry loop, starting at attempt 0.
    pub const fn start(&self) -> Backoff {
        Backoff {
            policy: *self,
            attempt: 0,
        }
    }
}

/// `n × x` rounded down, for `x` in `[0, 1]`: never more than `n`.
fn scale(n: u128, x: f64) -> u128 {
    ((n as f64 * x) as u128).min(n)
}

fn from_nanos(n: u128) -> Duration {
    const NANOS: u128 = 1_000_000_000;
    match u64::try_from(n / NANOS) {
        Ok(secs) => Duration::new(secs, (n % NANOS) as u32),
        Err(_) => Duration::MAX,
    }
}

/// The attempts of one retry loop under a policy: each [`Backoff::next_delay`] is the next attempt's delay;
/// [`Backoff::reset`] after a success starts again from the base.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    policy: ExponentialBackoff,
    attempt: u32,
}

impl Backoff {
    /// The delay before the next retry (then counts the attempt); `unit` as in [`ExponentialBackoff::delay`].
    pub fn next_delay(&mut self, unit: f64) -> Duration {
        let d = self.policy.delay(self.attempt, unit);
        self.attempt = self.attempt.saturating_add(1);
        d
    }

    /// After a success: the next delay is the first attempt's again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Retries counted since the start or the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    pub fn policy(&self) -> &ExponentialBackoff {
        &self.policy
    }
}

#[cfg(test)]
mod tests;
