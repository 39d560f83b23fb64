//! The site's boot lease as a state machine: what the agent knows (connected or not, serving until when on its own
//! clock, when its certificate is due) and what it does next. [`BootLease::on`] takes what just happened
//! ([`Event`]), the time and a random number and returns a [`Plan`]: effects on the services ([`Effect`]) and the
//! next I/O step ([`Step`]). The agent ([`super::agent`]) performs the step and feeds back its outcome as the next
//! event; nothing here touches the network, the clock or the RNG (clippy's `disallowed-methods` enforces it), so
//! the tests below drive whole timelines (a lease held, lost, running out while the control plane is unreachable)
//! in microseconds on made-up instants.
//!
//! The rules:
//! - Ask every third of the TTL; after a failure retry sooner with backoff (200 ms doubling, full jitter), never
//!   later than the next regular round.
//! - Serve only while holding the lease, and only until `sent + min(expires_in, ttl)` on the agent's own clock:
//!   the moment the request was sent, so an answer that took long does not stretch the lease, and never longer
//!   than the lease asked for. Past that without a renewal (control plane unreachable) serve nothing: the wait
//!   before the next step never sleeps past the deadline, and a request still in flight then does not hold it up
//!   ([`BootLease::expire`]).
//! - Lost (another holder) or refused (PermissionDenied: the site was revoked before the gateway's revocation set
//!   caught up): stand by at once and, when refused, reconnect so the next handshake says whether it is revoked.
//! - Renew the site certificate when due (checked before each ask); a new certificate means a new connection.

#![deny(clippy::disallowed_methods)]

use bc_backoff::{Backoff, ExponentialBackoff, Jitter};
use std::time::Duration;
use tokio::time::Instant;

/// First retry delay after a failed ask or connection.
pub const RETRY_BASE: Duration = Duration::from_millis(200);
/// Shortest deadline for one request.
pub const MIN_RPC_TIMEOUT: Duration = Duration::from_millis(200);

/// The lease's timing, from the TTL asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseTimes {
    /// Lease length asked for.
    pub ttl: Duration,
    /// Between asks while all is well: a third of the TTL.
    pub interval: Duration,
    /// Deadline of each request: the interval, at least [`MIN_RPC_TIMEOUT`].
    pub rpc_timeout: Duration,
    /// Retries after failures: [`RETRY_BASE`] doubling up to the TTL, full jitter (each wait also at most the
    /// interval).
    pub retry: ExponentialBackoff,
}

impl LeaseTimes {
    pub fn new(ttl: Duration) -> LeaseTimes {
        let interval = ttl / 3;
        LeaseTimes {
            ttl,
            interval,
            rpc_timeout: interval.max(MIN_RPC_TIMEOUT),
            // Valid for every TTL: the cap is at least the base.
            retry: ExponentialBackoff::new(RETRY_BASE, ttl.max(RETRY_BASE), Jitter::Fraction(1.0)),
        }
    }

    /// The TTL in the request's milliseconds.
    pub fn ttl_ms(&self) -> u32 {
        u32::try_from(self.ttl.as_millis()).unwrap_or(u32::MAX)
    }
}

/// The control plane's answer to a lease request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseAnswer {
    pub held: bool,
    pub fence: i64,
    pub holder: String,
    /// What the control plane says is left of the lease.
    pub expires_in: Duration,
    /// When the request was sent, on the agent's clock.
    pub sent: Instant,
}

/// How a refused lease request is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// PermissionDenied: the control plane no longer accepts this agent. Stand by and reconnect.
    Denied,
    /// Unavailable or Unknown: the connection is suspect. Reconnect.
    Reconnect,
    /// Anything else: retry on the same connection.
    Other,
}

impl Refusal {
    pub fn of(code: tonic::Code) -> Refusal {
        match code {
            tonic::Code::PermissionDenied => Refusal::Denied,
            tonic::Code::Unavailable | tonic::Code::Unknown => Refusal::Reconnect,
            _ => Refusal::Other,
        }
    }
}

/// What happened since the last plan: the outcome of its step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The wait ended (its time came, or a poke: an artifact finished downloading).
    Woke,
    Connected,
    /// The gateway could not be reached, or the connection timed out.
    ConnectFailed,
    /// The gateway refused this agent's certificate as revoked (at the handshake or as a status).
    Revoked,
    /// The certificate was renewed; the next renewal is due in `next_in`.
    Renewed {
        next_in: Duration,
    },
    RenewFailed,
    Answer(LeaseAnswer),
    Refused(Refusal),
    /// The lease request got no answer within its deadline.
    TimedOut,
    /// The netboot table was fetched (`true`) or not.
    Table {
        fetched: bool,
    },
    /// The agent is asked to stop.
    Shutdown,
}

/// Why the agent stopped serving (for its log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StandByReason {
    /// The lease ran out on the agent's clock without a renewal.
    RanOut,
    /// Another agent holds it.
    Lost { holder: String },
    /// The control plane refused this agent.
    Refused,
}

/// An effect on what the services serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Serve the table just fetched (its machines answer DHCP). `first` when this starts a holding.
    Serve {
        fence: i64,
        holder: String,
        first: bool,
    },
    /// Serve nothing. `why` is set when this ends a holding; `fence` and `holder` name the current holder when known.
    StandBy {
        fence: i64,
        holder: String,
        why: Option<StandByReason>,
    },
    /// Drop the connection; the next round connects again.
    Disconnect,
}

/// The next I/O step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do before `until` (a poke may end the wait sooner).
    Wait {
        until: Instant,
    },
    Connect,
    /// Renew the site certificate.
    Renew,
    /// Ask for (or renew) the lease.
    Ask,
    /// Fetch the netboot table (the lease is held).
    FetchTable,
    /// Release the lease, then stop.
    Release,
    /// Stop (nothing to release).
    Stop,
    /// Stop with an error: the site is revoked.
    ExitRevoked,
}

/// What to do now: apply the effects in order, then perform the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub effects: Vec<Effect>,
    pub step: Step,
}

impl Plan {
    fn step(step: Step) -> Plan {
        Plan {
            effects: Vec::new(),
            step,
        }
    }
}

/// The agent's knowledge of the lease.
#[derive(Debug, Clone)]
pub struct BootLease {
    times: LeaseTimes,
    connected: bool,
    /// While serving: when the lease ends on the agent's clock unless renewed first.
    serving_until: Option<Instant>,
    /// A holding that has not yet served a table (the next [`Effect::Serve`] is its first).
    starting: bool,
    /// Fence and holder of the last answer that said the lease is held.
    held: (i64, String),
    renew_at: Instant,
    /// The next regular round (after a failure: sooner, by backoff).
    next_round: Instant,
    backoff: Backoff,
}

impl BootLease {
    /// An agent starting at `now`, its certificate due for renewal in `renew_in`.
    pub fn new(times: LeaseTimes, now: Instant, renew_in: Duration) -> BootLease {
        BootLease {
            times,
            connected: false,
            serving_until: None,
            starting: false,
            held: (0, String::new()),
            renew_at: now + renew_in,
            next_round: now,
            backoff: times.retry.start(),
        }
    }

    pub fn times(&self) -> &LeaseTimes {
        &self.times
    }

    /// True while the agent serves (holds the lease and it has not run out).
    pub fn serving(&self) -> bool {
        self.serving_until.is_some()
    }

    /// Until when the agent may serve, on its own clock.
    pub fn serving_until(&self) -> Option<Instant> {
        self.serving_until
    }

    /// The first plan.
    pub fn start(&mut self, now: Instant) -> Plan {
        self.round(now)
    }

    /// The plan after `event`, at `now`; `unit` is a uniform random number in [0, 1] for the backoff's jitter.
    pub fn on(&mut self, event: Event, now: Instant, unit: f64) -> Plan {
        match event {
            Event::Woke => self.round(now),
            Event::Connected => {
                self.connected = true;
                Plan::step(self.ask_or_renew(now))
            }
            Event::ConnectFailed => self.retry_later(Vec::new(), now, unit),
            Event::Revoked => {
                self.connected = false;
                Plan {
                    effects: vec![self.stand_by(false)],
                    step: Step::ExitRevoked,
                }
            }
            Event::Renewed { next_in } => {
                self.renew_at = now + next_in;
                // The new certificate is used from a new connection; lease and table stay as they are.
                self.connected = false;
                let mut plan = self.round(now);
                plan.effects.insert(0, Effect::Disconnect);
                plan
            }
            Event::RenewFailed => Plan::step(Step::Ask),
            Event::Answer(a) => self.answered(a, now),
            Event::Refused(r) => {
                let mut effects = Vec::new();
                match r {
                    Refusal::Other => {}
                    Refusal::Reconnect => {
                        self.connected = false;
                        effects.push(Effect::Disconnect);
                    }
                    Refusal::Denied => {
                        effects.push(self.stand_by(true));
                        self.connected = false;
                        effects.push(Effect::Disconnect);
                    }
                }
                self.retry_later(effects, now, unit)
            }
            Event::TimedOut => {
                self.connected = false;
                self.next_round = now + self.times.interval;
                Plan {
                    effects: vec![Effect::Disconnect],
                    step: self.wait(),
                }
            }
            Event::Table { fetched } => {
                self.next_round = now + self.times.interval;
                let mut effects = Vec::new();
                // A table that came in after the lease ran out is not served.
                if fetched && self.serving_until.is_some_and(|d| now < d) {
                    effects.push(Effect::Serve {
                        fence: self.held.0,
                        holder: self.held.1.clone(),
                        first: std::mem::take(&mut self.starting),
                    });
                }
                Plan {
                    effects,
                    step: self.wait(),
                }
            }
            Event::Shutdown => {
                let effects = vec![self.stand_by(false)];
                let step = if self.connected {
                    Step::Release
                } else {
                    Step::Stop
                };
                self.connected = false;
                Plan { effects, step }
            }
        }
    }

    /// The lease's own deadline, checked whatever the agent is doing (a request in flight included): at
    /// [`BootLease::serving_until`] or later, stop serving. The agent calls it when that instant comes during a
    /// step; rounds call it first.
    pub fn expire(&mut self, now: Instant) -> Option<Effect> {
        if self.serving_until.is_none_or(|d| now < d) {
            return None;
        }
        let served = self.end_holding();
        Some(Effect::StandBy {
            fence: 0,
            holder: String::new(),
            why: served.then_some(StandByReason::RanOut),
        })
    }

    /// A round: stop serving if the lease ran out, then connect, renew or ask.
    fn round(&mut self, now: Instant) -> Plan {
        let effects = self.expire(now).into_iter().collect();
        let step = if self.connected {
            self.ask_or_renew(now)
        } else {
            Step::Connect
        };
        Plan { effects, step }
    }

    fn ask_or_renew(&mut self, now: Instant) -> Step {
        if now >= self.renew_at {
            // Should the renewal fail, try again a round later, not at once.
            self.renew_at = now + self.times.interval;
            Step::Renew
        } else {
            Step::Ask
        }
    }

    fn answered(&mut self, a: LeaseAnswer, now: Instant) -> Plan {
        self.backoff.reset();
        if !a.held {
            let lost = self.end_holding();
            self.next_round = now + self.times.interval;
            return Plan {
                effects: vec![Effect::StandBy {
                    why: lost.then(|| StandByReason::Lost {
                        holder: a.holder.clone(),
                    }),
                    fence: a.fence,
                    holder: a.holder,
                }],
                step: self.wait(),
            };
        }
        if self.serving_until.is_none() {
            self.starting = true;
        }
        self.held = (a.fence, a.holder);
        // Never trust a lease longer than the one asked for: this deadline is what stops DHCP when the control
        // plane cannot be reached.
        self.serving_until = Some(a.sent + a.expires_in.min(self.times.ttl));
        self.next_round = now + self.times.interval;
        // An answer that came after the lease it grants had run out (a slow control plane, a short grant) serves
        // nothing: stand by now instead of fetching a table for a lease already over.
        if let Some(ran_out) = self.expire(now) {
            return Plan {
                effects: vec![ran_out],
                step: self.wait(),
            };
        }
        Plan::step(Step::FetchTable)
    }

    /// After a failure: wait a backoff step, at most the interval.
    fn retry_later(&mut self, effects: Vec<Effect>, now: Instant, unit: f64) -> Plan {
        let wait = self.backoff.next_delay(unit).min(self.times.interval);
        self.next_round = now + wait;
        Plan {
            effects,
            step: self.wait(),
        }
    }

    /// Until the next round, but never past the end of the lease being served.
    fn wait(&self) -> Step {
        let until = match self.serving_until {
            Some(d) => self.next_round.min(d),
            None => self.next_round,
        };
        Step::Wait { until }
    }

    /// Stops serving; `refused` says the control plane refused this agent (reported when it ends a holding).
    fn stand_by(&mut self, refused: bool) -> Effect {
        let served = self.end_holding();
        Effect::StandBy {
            fence: 0,
            holder: String::new(),
            why: (refused && served).then_some(StandByReason::Refused),
        }
    }

    /// Ends the holding, if any; true when it had served a table (so its end is worth a log line).
    fn end_holding(&mut self) -> bool {
        let served = self.serving_until.take().is_some() && !self.starting;
        self.starting = false;
        served
    }
}

#[cfg(test)]
mod tests;
