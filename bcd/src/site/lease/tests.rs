//! Whole lease timelines on made-up instants: no sleeping, no control plane.

// The tests pick one real instant as their origin; everything after it is arithmetic.
#![allow(clippy::disallowed_methods)]

use super::*;
use proptest::prelude::*;

/// TTL 1.5 s: asks every 500 ms, requests time out after 500 ms.
const TTL: Duration = Duration::from_millis(1500);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A lease and what the services would serve, driven by hand.
struct Sim {
    lease: BootLease,
    t0: Instant,
    now: Instant,
    serving: bool,
}

impl Sim {
    fn new(renew_in: Duration) -> Sim {
        let t0 = Instant::now();
        Sim {
            lease: BootLease::new(LeaseTimes::new(TTL), t0, renew_in),
            t0,
            now: t0,
            serving: false,
        }
    }

    fn at(&mut self, t: u64) -> &mut Sim {
        self.now = self.t0 + ms(t);
        self
    }

    fn t(&self, t: u64) -> Instant {
        self.t0 + ms(t)
    }

    fn apply(&mut self, plan: &Plan) {
        for e in &plan.effects {
            match e {
                Effect::Serve { .. } => self.serving = true,
                Effect::StandBy { .. } => self.serving = false,
                Effect::Disconnect => {}
            }
        }
    }

    fn on(&mut self, e: Event) -> Plan {
        let plan = self.lease.on(e, self.now, 1.0);
        self.apply(&plan);
        plan
    }

    fn held(&self, sent: u64, fence: i64) -> Event {
        Event::Answer(LeaseAnswer {
            held: true,
            fence,
            holder: "site/a".into(),
            expires_in: TTL,
            sent: self.t(sent),
        })
    }

    /// Connects at 0 and holds the lease from an ask sent at 0; the table is served at 10 ms.
    fn serving_from_zero() -> Sim {
        let mut s = Sim::new(Duration::from_secs(3600));
        assert_eq!(s.lease.start(s.now).step, Step::Connect);
        assert_eq!(s.on(Event::Connected).step, Step::Ask);
        let held = s.held(0, 7);
        assert_eq!(s.at(5).on(held).step, Step::FetchTable);
        let p = s.at(10).on(Event::Table { fetched: true });
        assert_eq!(
            p.effects,
            vec![Effect::Serve {
                fence: 7,
                holder: "site/a".into(),
                first: true
            }]
        );
        assert_eq!(p.step, Step::Wait { until: s.t(510) });
        assert!(s.serving);
        s
    }
}

#[test]
fn a_holder_asks_every_third_of_the_ttl_and_keeps_serving() {
    let mut s = Sim::serving_from_zero();
    assert_eq!(s.at(510).on(Event::Woke).step, Step::Ask);
    let held = s.held(510, 7);
    assert_eq!(s.at(515).on(held).step, Step::FetchTable);
    let p = s.at(520).on(Event::Table { fetched: true });
    assert!(
        matches!(&p.effects[..], [Effect::Serve { first: false, .. }]),
        "{p:?}"
    );
    assert_eq!(p.step, Step::Wait { until: s.t(1020) });
    assert_eq!(s.lease.serving_until(), Some(s.t(2010)));
}

#[test]
fn an_unreachable_control_plane_stops_dhcp_when_the_lease_runs_out_on_the_agents_clock() {
    let mut s = Sim::serving_from_zero();
    // The next ask gets no answer: the connection is dropped and the wait ends at the lease's deadline, not later.
    assert_eq!(s.at(510).on(Event::Woke).step, Step::Ask);
    let p = s.at(1010).on(Event::TimedOut);
    assert_eq!(p.effects, vec![Effect::Disconnect]);
    assert_eq!(p.step, Step::Wait { until: s.t(1500) });
    assert!(s.serving, "still within the lease");
    let p = s.at(1500).on(Event::Woke);
    assert_eq!(
        p.effects,
        vec![Effect::StandBy {
            fence: 0,
            holder: String::new(),
            why: Some(StandByReason::RanOut)
        }]
    );
    assert_eq!(p.step, Step::Connect);
    assert!(!s.serving);
    // Reconnecting keeps failing: it never serves again on its own.
    for t in [1600, 1900, 2400, 2900] {
        let p = s.at(t).on(Event::ConnectFailed);
        assert!(p.effects.is_empty());
        assert!(matches!(p.step, Step::Wait { until } if until <= s.t(t) + TTL / 3));
        assert!(!s.serving);
    }
}

#[test]
fn the_deadline_holds_while_a_request_is_in_flight() {
    let mut s = Sim::serving_from_zero();
    // Quick refusals, then an ask at 1110 that hangs: at 1500 the agent stops serving without waiting for it.
    assert_eq!(s.at(510).on(Event::Woke).step, Step::Ask);
    let p = s.at(510).on(Event::Refused(Refusal::Other));
    assert_eq!(p.step, Step::Wait { until: s.t(710) });
    assert_eq!(s.at(710).on(Event::Woke).step, Step::Ask);
    let p = s.at(710).on(Event::Refused(Refusal::Other));
    assert_eq!(p.step, Step::Wait { until: s.t(1110) });
    assert_eq!(s.at(1110).on(Event::Woke).step, Step::Ask);
    assert_eq!(s.lease.serving_until(), Some(s.t(1500)));
    assert_eq!(s.lease.expire(s.t(1499)), None);
    let e = s.lease.expire(s.t(1500));
    assert!(
        matches!(
            e,
            Some(Effect::StandBy {
                why: Some(StandByReason::RanOut),
                ..
            })
        ),
        "{e:?}"
    );
    assert!(!s.lease.serving());
    // The hung ask times out later; nothing is served again.
    let p = s.at(1610).on(Event::TimedOut);
    assert_eq!(p.effects, vec![Effect::Disconnect]);
}

#[test]
fn the_holder_stands_by_when_another_agent_holds_the_lease() {
    let mut s = Sim::serving_from_zero();
    s.at(510).on(Event::Woke);
    let sent = s.t(510);
    let p = s.at(515).on(Event::Answer(LeaseAnswer {
        held: false,
        fence: 8,
        holder: "site/b".into(),
        expires_in: TTL,
        sent,
    }));
    assert_eq!(
        p.effects,
        vec![Effect::StandBy {
            fence: 8,
            holder: "site/b".into(),
            why: Some(StandByReason::Lost {
                holder: "site/b".into()
            })
        }]
    );
    assert_eq!(p.step, Step::Wait { until: s.t(1015) });
    assert!(!s.serving);
}

#[test]
fn a_standby_takes_over_once_the_lease_is_free() {
    let mut s = Sim::new(Duration::from_secs(3600));
    s.lease.start(s.now);
    s.on(Event::Connected);
    let taken = Event::Answer(LeaseAnswer {
        held: false,
        fence: 3,
        holder: "site/a".into(),
        expires_in: ms(900),
        sent: s.t(0),
    });
    let p = s.on(taken);
    // Standing by from the start is no loss: no reason to log.
    assert!(
        matches!(
            &p.effects[..],
            [Effect::StandBy {
                why: None,
                fence: 3,
                ..
            }]
        ),
        "{p:?}"
    );
    s.at(500).on(Event::Woke);
    let held = s.held(500, 4);
    assert_eq!(s.on(held).step, Step::FetchTable);
    let p = s.at(505).on(Event::Table { fetched: true });
    assert!(
        matches!(
            &p.effects[..],
            [Effect::Serve {
                fence: 4,
                first: true,
                ..
            }]
        ),
        "{p:?}"
    );
}

#[test]
fn a_lease_longer_than_asked_for_is_not_trusted() {
    let mut s = Sim::new(Duration::from_secs(3600));
    s.lease.start(s.now);
    s.on(Event::Connected);
    let sent = s.t(0);
    s.at(20).on(Event::Answer(LeaseAnswer {
        held: true,
        fence: 1,
        holder: "site/a".into(),
        expires_in: Duration::from_secs(60),
        sent,
    }));
    // From when the request was sent, not when the answer came, and no longer than the TTL.
    assert_eq!(s.lease.serving_until(), Some(s.t(1500)));
}

#[test]
fn a_table_that_arrives_after_the_lease_ran_out_is_not_served() {
    let mut s = Sim::new(Duration::from_secs(3600));
    s.lease.start(s.now);
    s.on(Event::Connected);
    let held = s.held(0, 1);
    s.on(held);
    let p = s.at(1600).on(Event::Table { fetched: true });
    assert!(p.effects.is_empty(), "{p:?}");
    assert!(!s.serving);
    // The round that follows ends the holding; it never served, so there is nothing to report.
    let p = s.on(Event::Woke);
    assert!(
        matches!(&p.effects[..], [Effect::StandBy { why: None, .. }]),
        "{p:?}"
    );
}

/// Found by `the_agent_never_serves_past_its_lease`: a renewal whose answer came after the lease it granted had
/// already run out (sent at 510, 0 ms left, answered at 757) kept the old table served past the new deadline.
#[test]
fn a_renewal_answered_after_its_own_lease_ran_out_stands_by() {
    let mut s = Sim::serving_from_zero();
    assert_eq!(s.at(510).on(Event::Woke).step, Step::Ask);
    let sent = s.t(510);
    let p = s.at(757).on(Event::Answer(LeaseAnswer {
        held: true,
        fence: 7,
        holder: "site/a".into(),
        expires_in: Duration::ZERO,
        sent,
    }));
    assert_eq!(
        p.effects,
        vec![Effect::StandBy {
            fence: 0,
            holder: String::new(),
            why: Some(StandByReason::RanOut),
        }]
    );
    assert_eq!(p.step, Step::Wait { until: s.t(1257) });
    assert!(!s.serving);
    assert_eq!(s.lease.serving_until(), None);
}

#[test]
fn a_failed_table_fetch_keeps_the_table_served() {
    let mut s = Sim::serving_from_zero();
    s.at(510).on(Event::Woke);
    let held = s.held(510, 7);
    s.on(held);
    let p = s.at(520).on(Event::Table { fetched: false });
    assert!(p.effects.is_empty());
    assert!(s.serving);
    assert_eq!(s.lease.serving_until(), Some(s.t(2010)));
}

#[test]
fn a_refusal_stands_by_and_reconnects() {
    let mut s = Sim::serving_from_zero();
    s.at(510).on(Event::Woke);
    let p = s.on(Event::Refused(Refusal::Denied));
    assert_eq!(
        p.effects,
        vec![
            Effect::StandBy {
                fence: 0,
                holder: String::new(),
                why: Some(StandByReason::Refused)
            },
            Effect::Disconnect
        ]
    );
    assert_eq!(p.step, Step::Wait { until: s.t(710) });
    assert!(!s.serving);
    assert_eq!(s.at(710).on(Event::Woke).step, Step::Connect);
    // Unavailable: reconnect, keep serving while the lease lasts.
    let mut s = Sim::serving_from_zero();
    s.at(510).on(Event::Woke);
    let p = s.on(Event::Refused(Refusal::Reconnect));
    assert_eq!(p.effects, vec![Effect::Disconnect]);
    assert!(s.serving);
    assert_eq!(Refusal::of(tonic::Code::PermissionDenied), Refusal::Denied);
    assert_eq!(Refusal::of(tonic::Code::Unknown), Refusal::Reconnect);
    assert_eq!(Refusal::of(tonic::Code::Internal), Refusal::Other);
}

#[test]
fn a_revoked_site_stops_serving_and_exits() {
    let mut s = Sim::serving_from_zero();
    s.at(510).on(Event::Woke);
    let p = s.on(Event::Revoked);
    assert!(matches!(&p.effects[..], [Effect::StandBy { .. }]), "{p:?}");
    assert_eq!(p.step, Step::ExitRevoked);
    assert!(!s.serving);
}

#[test]
fn a_due_renewal_comes_before_the_ask_and_a_new_certificate_reconnects() {
    let mut s = Sim::new(ms(1000));
    s.lease.start(s.now);
    assert_eq!(s.on(Event::Connected).step, Step::Ask);
    assert_eq!(s.at(1000).on(Event::Woke).step, Step::Renew);
    // A failed renewal asks anyway and is tried again a round later, not at every wake.
    assert_eq!(s.on(Event::RenewFailed).step, Step::Ask);
    assert_eq!(s.at(1100).on(Event::Woke).step, Step::Ask);
    assert_eq!(s.at(1500).on(Event::Woke).step, Step::Renew);
    let p = s.on(Event::Renewed {
        next_in: Duration::from_secs(43_200),
    });
    assert_eq!(p.effects, vec![Effect::Disconnect]);
    assert_eq!(p.step, Step::Connect);
    assert_eq!(s.on(Event::Connected).step, Step::Ask);
}

#[test]
fn failures_back_off_but_never_wait_past_a_round() {
    let mut s = Sim::new(Duration::from_secs(3600));
    s.lease.start(s.now);
    let mut waits = Vec::new();
    for _ in 0..5 {
        let p = s.on(Event::ConnectFailed);
        let Step::Wait { until } = p.step else {
            panic!("{p:?}")
        };
        waits.push((until - s.now).as_millis());
        s.now = until;
        assert_eq!(s.on(Event::Woke).step, Step::Connect);
    }
    assert_eq!(waits, vec![200, 400, 500, 500, 500]);
    // An answer starts the backoff again.
    s.on(Event::Connected);
    let held = s.held(0, 1);
    s.on(held);
    s.on(Event::Table { fetched: true });
    s.on(Event::Woke);
    let p = s.on(Event::Refused(Refusal::Other));
    assert_eq!(
        p.step,
        Step::Wait {
            until: s.now + ms(200)
        }
    );
}

#[test]
fn shutdown_stands_by_and_releases_a_connection() {
    let mut s = Sim::serving_from_zero();
    let p = s.on(Event::Shutdown);
    assert!(matches!(&p.effects[..], [Effect::StandBy { .. }]), "{p:?}");
    assert_eq!(p.step, Step::Release);
    assert!(!s.serving);
    let mut s = Sim::new(Duration::from_secs(3600));
    s.lease.start(s.now);
    assert_eq!(s.on(Event::Shutdown).step, Step::Stop);
}

/// Any outcome of the step in progress, after some time: what the network could do to the agent.
fn outcomes() -> impl Strategy<Value = (u64, u8, bool, u8, u64)> {
    (0u64..700, 0u8..10, any::<bool>(), 0u8..3, 0u64..3000)
}

proptest! {
    /// Whatever the control plane answers and however long it takes, the services never serve at or past
    /// `sent + ttl` of the last answer that granted the lease, nor while no answer granted it.
    #[test]
    fn the_agent_never_serves_past_its_lease(events in proptest::collection::vec(outcomes(), 1..120), unit in 0.0f64..=1.0) {
        let mut s = Sim::new(ms(2000));
        let mut plan = s.lease.start(s.now);
        let mut granted_until: Option<Instant> = None;
        for (elapsed, pick, held, refusal, expires) in events {
            // The step takes `elapsed` (a wait ends at its time or earlier, on a poke); the lease's own deadline
            // is applied as the agent does, during the step.
            let end = match plan.step {
                Step::Wait { until } => (s.now + ms(elapsed)).min(until),
                Step::Release | Step::Stop | Step::ExitRevoked => break,
                _ => s.now + ms(elapsed),
            };
            if let Some(d) = s.lease.serving_until().filter(|d| *d <= end) {
                let e = s.lease.expire(d);
                s.apply(&Plan { effects: e.into_iter().collect(), step: plan.step });
            }
            s.now = end;
            if s.serving {
                prop_assert!(granted_until.is_some_and(|g| s.now < g), "served at {:?} past {:?}", s.now - s.t0, granted_until.map(|g| g - s.t0));
            }
            let event = match (plan.step, pick) {
                (Step::Wait { .. }, _) => Event::Woke,
                (Step::Connect, 0..=6) => Event::Connected,
                (Step::Connect, 7..=8) => Event::ConnectFailed,
                (Step::Renew, 0..=5) => Event::Renewed { next_in: ms(expires) },
                (Step::Renew, _) => Event::RenewFailed,
                (Step::Ask, 0..=5) => {
                    let sent = s.now - ms(elapsed);
                    if held {
                        granted_until = Some(sent + ms(expires).min(TTL));
                    }
                    Event::Answer(LeaseAnswer { held, fence: 1, holder: "h".into(), expires_in: ms(expires), sent })
                }
                (Step::Ask, 6..=7) => Event::Refused([Refusal::Denied, Refusal::Reconnect, Refusal::Other][refusal as usize]),
                (Step::Ask, 8) => Event::TimedOut,
                (Step::FetchTable, 0..=7) => Event::Table { fetched: true },
                (Step::FetchTable, 8) => Event::Table { fetched: false },
                (_, 9) => Event::Shutdown,
                _ => Event::Revoked,
            };
            if matches!(event, Event::Answer(LeaseAnswer { held: false, .. })) {
                granted_until = None;
            }
            plan = s.lease.on(event, s.now, unit);
            s.apply(&plan);
            if s.serving {
                prop_assert!(granted_until.is_some_and(|g| s.now < g));
            }
            if let (Some(d), Step::Wait { until }) = (s.lease.serving_until(), plan.step) {
                prop_assert!(until <= d, "a wait sleeps past the lease");
            }
        }
    }
}
