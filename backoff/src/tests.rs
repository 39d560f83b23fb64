use super::*;
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

fn full(base: Duration, cap: Duration) -> ExponentialBackoff {
    ExponentialBackoff::new(base, cap, Jitter::Fraction(1.0))
}

#[test]
fn full_jitter_grows_to_the_cap() {
    let b = full(100 * MS, Duration::from_secs(5));
    assert_eq!(b.delay(0, 0.999_999).as_millis(), 99);
    assert_eq!(b.delay(1, 0.5), 100 * MS);
    assert_eq!(b.delay(0, 0.0), Duration::ZERO);
    assert_eq!(b.ceiling(5), Duration::from_millis(3200));
    assert_eq!(b.ceiling(6), Duration::from_secs(5));
    assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(5));
}

#[test]
fn equal_jitter_keeps_at_least_half() {
    let b = ExponentialBackoff::new(100 * MS, Duration::from_secs(2), Jitter::Fraction(0.5));
    assert_eq!(b.delay(0, 0.0), 50 * MS);
    assert_eq!(b.delay(0, 1.0), 100 * MS);
    assert_eq!(b.delay(3, 0.0), 400 * MS);
    assert_eq!(b.delay(10, 1.0), Duration::from_secs(2));
    assert_eq!(b.delay(u32::MAX, 0.5), 1500 * MS);
}

#[test]
fn spread_is_rfc_2131_plus_minus() {
    let b = ExponentialBackoff::new(
        Duration::from_secs(1),
        Duration::from_secs(8),
        Jitter::Spread(500 * MS),
    );
    assert_eq!(b.delay(0, 0.0), 500 * MS);
    assert_eq!(b.delay(0, 1.0), 1500 * MS);
    assert_eq!(b.delay(3, 0.5), Duration::from_secs(8));
    assert_eq!(b.delay(9, 1.0), Duration::from_millis(8500));
}

#[test]
fn a_counter_walks_the_attempts_and_resets() {
    let policy = full(100 * MS, Duration::from_secs(5));
    let mut b = policy.start();
    assert_eq!(b.next_delay(1.0), 100 * MS);
    assert_eq!(b.next_delay(1.0), 200 * MS);
    assert_eq!(b.attempts(), 2);
    for _ in 0..100 {
        assert!(b.next_delay(1.0) <= Duration::from_secs(5));
    }
    b.reset();
    assert_eq!(b.attempts(), 0);
    assert_eq!(b.next_delay(1.0), 100 * MS);
}

#[test]
fn invalid_policies_are_refused_with_the_reason() {
    let s = Duration::from_secs(1);
    let cases = [
        (
            ExponentialBackoff::try_new(Duration::ZERO, s, Jitter::Fraction(1.0)),
            InvalidBackoff::ZeroBase,
            "base delay is zero",
        ),
        (
            ExponentialBackoff::try_new(s, 10 * MS, Jitter::Fraction(1.0)),
            InvalidBackoff::CapBelowBase {
                base: s,
                cap: 10 * MS,
            },
            "cap 10ms is below its base delay 1s",
        ),
        (
            ExponentialBackoff::try_new(MS, s, Jitter::Fraction(1.5)),
            InvalidBackoff::Fraction(1.5),
            "fraction 1.5 is not in [0, 1]",
        ),
        (
            ExponentialBackoff::try_new(MS, s, Jitter::Fraction(-0.1)),
            InvalidBackoff::Fraction(-0.1),
            "fraction -0.1",
        ),
        (
            ExponentialBackoff::try_new(MS, s, Jitter::Spread(2 * MS)),
            InvalidBackoff::SpreadAboveBase {
                spread: 2 * MS,
                base: MS,
            },
            "spread 2ms exceeds the base delay 1ms",
        ),
    ];
    for (got, want, says) in cases {
        assert_eq!(got, Err(want));
        let message = want.to_string();
        assert!(message.contains(says), "{message}");
    }
    // NaN is no fraction (and compares unequal to itself, so it is matched by shape).
    let nan = ExponentialBackoff::try_new(MS, s, Jitter::Fraction(f64::NAN));
    assert!(
        matches!(nan, Err(InvalidBackoff::Fraction(x)) if x.is_nan()),
        "{nan:?}"
    );
    // The boundaries are valid.
    assert!(ExponentialBackoff::try_new(MS, MS, Jitter::Fraction(0.0)).is_ok());
    assert!(ExponentialBackoff::try_new(MS, MS, Jitter::Spread(MS)).is_ok());
}

/// A valid policy of either jitter kind, over the whole range of durations.
fn policies() -> impl Strategy<Value = ExponentialBackoff> {
    let nanos = 1u64..=u64::MAX;
    (
        nanos.clone(),
        nanos,
        0.0f64..=1.0,
        any::<bool>(),
        0.0f64..=1.0,
    )
        .prop_map(|(a, b, f, spread, s)| {
            let (base, cap) = (
                Duration::from_nanos(a.min(b)),
                Duration::from_nanos(a.max(b)),
            );
            let jitter = if spread {
                Jitter::Spread(Duration::from_nanos((a.min(b) as f64 * s) as u64))
            } else {
                Jitter::Fraction(f)
            };
            ExponentialBackoff::new(base, cap, jitter)
        })
}

proptest! {
    #[test]
    fn ceilings_start_at_the_base_grow_and_stop_at_the_cap(p in policies(), n in any::<u32>()) {
        let c = p.ceiling(n);
        prop_assert!(c >= p.base() && c <= p.cap());
        prop_assert!(p.ceiling(n.saturating_add(1)) >= c);
        prop_assert_eq!(p.ceiling(0), p.base());
        prop_assert_eq!(p.ceiling(200), p.cap());
    }

    #[test]
    fn delays_stay_in_the_jitter_range(p in policies(), n in 0u32..100, unit in 0.0f64..=1.0) {
        let c = p.ceiling(n);
        let d = p.delay(n, unit);
        match p.jitter() {
            Jitter::Fraction(f) => {
                prop_assert!(d <= c && d <= p.cap(), "{d:?} above ceiling {c:?}");
                let floor = c.as_nanos() - ((c.as_nanos() as f64 * f) as u128).min(c.as_nanos());
                prop_assert!(d.as_nanos() >= floor, "{d:?} below {floor} ns");
            }
            Jitter::Spread(s) => {
                prop_assert!(d >= c.saturating_sub(s) && d <= c.saturating_add(s), "{d:?} outside {c:?} ± {s:?}");
            }
        }
    }

    #[test]
    fn more_unit_never_means_less_delay(p in policies(), n in 0u32..100, a in 0.0f64..=1.0, b in 0.0f64..=1.0) {
        let (lo, hi) = (a.min(b), a.max(b));
        prop_assert!(p.delay(n, lo) <= p.delay(n, hi));
    }

    #[test]
    fn any_unit_is_clamped_never_a_panic(p in policies(), n in any::<u32>(), unit in any::<f64>()) {
        let d = p.delay(n, unit);
        let clamped = if unit.is_nan() { 0.0 } else { unit.clamp(0.0, 1.0) };
        prop_assert_eq!(d, p.delay(n, clamped));
    }

    #[test]
    fn a_counter_gives_the_policys_delays_in_order(p in policies(), units in proptest::collection::vec(0.0f64..=1.0, 1..40)) {
        let mut b = p.start();
        for (n, u) in units.iter().enumerate() {
            prop_assert_eq!(b.next_delay(*u), p.delay(n as u32, *u));
        }
    }

    #[test]
    fn try_new_accepts_exactly_the_valid_policies(base in any::<u64>(), cap in any::<u64>(), f in any::<f64>()) {
        let (base, cap) = (Duration::from_nanos(base), Duration::from_nanos(cap));
        let valid = !base.is_zero() && cap >= base && (0.0..=1.0).contains(&f);
        prop_assert_eq!(ExponentialBackoff::try_new(base, cap, Jitter::Fraction(f)).is_ok(), valid);
    }
}
