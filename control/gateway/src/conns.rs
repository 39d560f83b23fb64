//! Connection accounting and the shedding policy of the gateway's accept path: which connections it closes, and
//! when. Pure: the accept path ([`crate::accept`]) reports what happens to each connection and applies the answers;
//! time is an argument.
//!
//! Bounded the way careful proxies bound what unauthenticated peers can hold (nginx's per-address `limit_conn` and
//! handshake timeouts, Envoy's overload manager with its scaled timeouts, linkerd's protocol-detection timeout):
//! - Accepting never waits on the peers already connected: there are no handshake slots to fill, every connection
//!   is accepted and accounted here at once.
//! - A connection is *stalled* while it is in the TLS handshake, has not started a request yet, or has no client
//!   certificate and no request in flight. Until its first request the accept path reports whether the gateway is
//!   waiting for the peer's bytes (it has read all there was) or the peer is waiting for the gateway (bytes arrived
//!   and are not read yet: a busy gateway is not the peer's fault).
//! - Stalled connections have deadlines (handshake, first request, idle) and a connection without a client
//!   certificate a lifetime. The deadlines shrink as the pressure (unauthenticated connections against their cap,
//!   all connections against the descriptor budget) rises from `shrink_from` to 1, down to their floors, and apply
//!   to connections already open; a shrunk handshake or first-request deadline closes only a connection that is
//!   waiting for its peer (the base deadline closes any).
//! - Per source (an IPv4 address or an IPv6 /64), at most `max_stalled_per_source` stalled connections: one more
//!   sheds the source's connection that has kept the gateway waiting longest, once that is `peer_grace` or more (a
//!   burst of real handshakes from one address, waiting a round trip for their peers, is not shed). Fresh over
//!   first-come-first-served: a flood sharing a real node's address sheds its own silent connections, not the
//!   node's handshake.
//! - At the cap of unauthenticated connections, or at the descriptor budget, a new connection sheds a stalled
//!   connection of the source holding the most (longest-queue drop): the one keeping the gateway waiting longest,
//!   else (all waiting for the gateway) the newest, which would be served last; else the oldest connection without
//!   a client certificate that has a request in flight (a Join). Connections with a verified client
//!   certificate that have started a request (Sessions, site calls) are never shed; when nothing else can be, the
//!   new connection is refused.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::time::Instant;

/// A connection's number in the table.
pub type ConnId = u64;

/// Where connections are counted together: an IPv4 address, or an IPv6 /64 (what one host is usually given).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source(IpAddr);

impl Source {
    pub fn of(ip: IpAddr) -> Source {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Source(IpAddr::V4(v4)),
            IpAddr::V6(v6) => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                Source(IpAddr::V6(bits.into()))
            }
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V4(v4) => write!(f, "{v4}"),
            IpAddr::V6(v6) => write!(f, "{v6}/64"),
        }
    }
}

/// A deadline that shrinks under pressure: `base` up to `shrink_from`, then linearly down to `floor` at 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    pub base: Duration,
    pub floor: Duration,
}

impl Deadline {
    pub const fn new(base: Duration, floor: Duration) -> Deadline {
        Deadline { base, floor }
    }

    pub fn at(&self, pressure: f64, shrink_from: f64) -> Duration {
        if pressure <= shrink_from || self.base <= self.floor {
            return self.base;
        }
        let span = (1.0 - shrink_from).max(f64::EPSILON);
        let shrink = ((pressure - shrink_from) / span).clamp(0.0, 1.0);
        self.base - (self.base - self.floor).mul_f64(shrink)
    }
}

/// What the accept path may hold, and for how long.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnLimits {
    /// Connections (descriptors) the gateway holds at most; past it a new connection sheds one or is refused.
    pub max_connections: usize,
    /// Connections without a client certificate or not past their first request, all sources together.
    pub max_unauthenticated: usize,
    /// Stalled connections of one source.
    pub max_stalled_per_source: usize,
    /// How long a connection must have kept the gateway waiting before a newer one from its source sheds it.
    pub peer_grace: Duration,
    /// From accept to the end of the TLS handshake.
    pub handshake: Deadline,
    /// From the end of the handshake to the first request (the HTTP/2 preface and a Join, a Session or a site call).
    pub first_request: Deadline,
    /// A connection without a client certificate, with no request in flight.
    pub idle: Deadline,
    /// A connection without a client certificate, from accept, whatever it does (Join is one call).
    pub lifetime: Deadline,
    /// Pressure from which the deadlines shrink.
    pub shrink_from: f64,
}

impl ConnLimits {
    /// Limits for a process that may open `descriptors` files (its RLIMIT_NOFILE): an eighth of them (at least 128,
    /// at most 4,096) is left to the rest of the process (database pool, API connections, files), half of the rest
    /// may be unauthenticated (at most 4,096), and a source may hold 128 stalled connections. Deadlines: 10 s for
    /// the handshake and for the first request, shrinking to 3 s; 10 s idle without a client certificate, shrinking
    /// to 1 s; 60 s in all without one, shrinking to 10 s.
    pub fn for_descriptors(descriptors: u64) -> ConnLimits {
        let descriptors = usize::try_from(descriptors).unwrap_or(usize::MAX);
        let reserve = (descriptors / 8).clamp(128, 4096).min(descriptors / 2);
        let max_connections = descriptors.saturating_sub(reserve).max(16);
        let max_unauthenticated = (max_connections / 2).clamp(8, 4096);
        ConnLimits {
            max_connections,
            max_unauthenticated,
            max_stalled_per_source: 128.min(max_unauthenticated),
            peer_grace: Duration::from_secs(1),
            // Floors a real peer still meets when the gateway is busy: a TCP retransmission (1 s) and a round trip
            // or two on a slow link, with the CPU shared among many handshakes.
            handshake: Deadline::new(Duration::from_secs(10), Duration::from_secs(3)),
            first_request: Deadline::new(Duration::from_secs(10), Duration::from_secs(3)),
            idle: Deadline::new(Duration::from_secs(10), Duration::from_secs(1)),
            lifetime: Deadline::new(Duration::from_secs(60), Duration::from_secs(10)),
            shrink_from: 0.5,
        }
    }
}

/// Where a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Accepted; the TLS handshake has not finished.
    Handshake,
    /// TLS done; no request started yet.
    FirstRequest,
    /// A request has started.
    Open,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Handshake, no request yet, or without a client certificate and idle: shed first.
    Stalled,
    /// Without a client certificate, a request in flight (a Join).
    Busy,
    /// A verified client certificate and a request started: never shed.
    Trusted,
}

#[derive(Debug)]
struct Conn {
    peer: SocketAddr,
    source: Source,
    accepted: Instant,
    stage: Stage,
    /// Start of the stage, or of the idle time once open.
    since: Instant,
    authenticated: bool,
    /// Since when the gateway has been waiting for the peer's bytes (it read all there was); None while bytes may
    /// be waiting for the gateway (before its first read, or since new bytes arrived). Reported until the first
    /// request.
    waiting_on_peer: Option<Instant>,
    in_flight: u32,
    /// Closed by the policy; the entry goes when the connection is dropped.
    shed: bool,
}

impl Conn {
    /// Since when the peer has kept the gateway waiting, if it has.
    fn peer_stalled_since(&self) -> Option<Instant> {
        match self.stage {
            Stage::Handshake | Stage::FirstRequest => self.waiting_on_peer,
            Stage::Open => (self.in_flight == 0).then_some(self.since),
        }
    }

    fn class(&self) -> Class {
        match self.stage {
            Stage::Handshake | Stage::FirstRequest => Class::Stalled,
            Stage::Open if self.authenticated => Class::Trusted,
            Stage::Open if self.in_flight > 0 => Class::Busy,
            Stage::Open => Class::Stalled,
        }
    }
}

/// Where a connection sorts among its source's, first shed first.
type ShedKey = (u8, u64, ConnId);

/// A source's stalled and busy connections, in the order they are shed.
#[derive(Debug, Default)]
struct SourceConns {
    stalled: BTreeSet<ShedKey>,
    busy: BTreeSet<ShedKey>,
}

/// Why a connection was closed by the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// Its source already held its share of stalled connections; a newer one came.
    SourceFull,
    /// The unauthenticated cap or the descriptor budget was reached; a newer connection came.
    Full,
    /// Its deadline (as shrunk by the pressure) passed.
    Expired(Stage),
    /// accept(2) failed for want of descriptors.
    Descriptors,
}

/// The answer to a new connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Admitted as `id`; close the connections in `shed` (oldest first: they made room for it).
    Admitted { id: ConnId, shed: Vec<ConnId> },
    /// Nothing could make room: close the new connection.
    Refused,
}

/// Counts since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnCounters {
    pub accepted: u64,
    pub refused: u64,
    pub shed_source_full: u64,
    pub shed_full: u64,
    pub expired: u64,
    pub shed_descriptors: u64,
}

/// The table's state, for logs and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnStats {
    pub open: usize,
    pub stalled: usize,
    pub busy: usize,
    pub pressure: f64,
    pub counters: ConnCounters,
}

/// Every connection of the gateway from accept to close.
#[derive(Debug)]
pub struct ConnTable {
    /// Times in shed keys count from here.
    epoch: Instant,
    conns: HashMap<ConnId, Conn>,
    by_peer: HashMap<SocketAddr, ConnId>,
    sources: HashMap<Source, SourceConns>,
    stalled: usize,
    busy: usize,
    shed_pending: usize,
    next: ConnId,
    counters: ConnCounters,
}

impl Default for ConnTable {
    fn default() -> ConnTable {
        ConnTable::new(Instant::now())
    }
}

impl ConnTable {
    pub fn new(epoch: Instant) -> ConnTable {
        ConnTable {
            epoch,
            conns: HashMap::new(),
            by_peer: HashMap::new(),
            sources: HashMap::new(),
            stalled: 0,
            busy: 0,
            shed_pending: 0,
            next: 0,
            counters: ConnCounters::default(),
        }
    }

    /// Connections open and not shed.
    pub fn open(&self) -> usize {
        self.conns.len() - self.shed_pending
    }

    /// How close the gateway is to its limits: the larger of unauthenticated connections over their cap and all
    /// connections over the descriptor budget.
    pub fn pressure(&self, limits: &ConnLimits) -> f64 {
        let unauthenticated =
            (self.stalled + self.busy) as f64 / limits.max_unauthenticated.max(1) as f64;
        let descriptors = self.open() as f64 / limits.max_connections.max(1) as f64;
        unauthenticated.max(descriptors)
    }

    pub fn stats(&self, limits: &ConnLimits) -> ConnStats {
        ConnStats {
            open: self.open(),
            stalled: self.stalled,
            busy: self.busy,
            pressure: self.pressure(limits),
            counters: self.counters,
        }
    }

    /// A new connection from `peer`.
    pub fn admit(&mut self, peer: SocketAddr, now: Instant, limits: &ConnLimits) -> Admission {
        let source = Source::of(peer.ip());
        let mut shed = Vec::new();
        let source_stalled = self.sources.get(&source).map_or(0, |s| s.stalled.len());
        if source_stalled >= limits.max_stalled_per_source.max(1)
            && let Some(victim) = self.oldest_of(source, Class::Stalled)
            && self
                .conns
                .get(&victim)
                .and_then(Conn::peer_stalled_since)
                .is_some_and(|since| now.saturating_duration_since(since) >= limits.peer_grace)
        {
            self.shed(victim, Shed::SourceFull);
            shed.push(victim);
        }
        while self.stalled + self.busy >= limits.max_unauthenticated.max(1)
            || self.open() >= limits.max_connections.max(1)
        {
            let Some(victim) = self.longest_queue_victim() else {
                break;
            };
            self.shed(victim, Shed::Full);
            shed.push(victim);
        }
        if self.open() >= limits.max_connections.max(1) {
            self.counters.refused += 1;
            return Admission::Refused;
        }
        let id = self.next;
        self.next += 1;
        self.counters.accepted += 1;
        if let Some(old) = self.by_peer.insert(peer, id) {
            // The peer's previous connection is closed as far as the kernel is concerned; forget its request key.
            tracing::debug!(%peer, old, "peer address reused before its connection was dropped");
        }
        self.conns.insert(
            id,
            Conn {
                peer,
                source,
                accepted: now,
                stage: Stage::Handshake,
                since: now,
                authenticated: false,
                waiting_on_peer: None,
                in_flight: 0,
                shed: false,
            },
        );
        self.link(id);
        Admission::Admitted { id, shed }
    }

    /// The TLS handshake finished; `authenticated`: the peer presented a certificate the verifier accepted.
    pub fn handshake_done(&mut self, id: ConnId, authenticated: bool, now: Instant) {
        self.update(id, |c| {
            c.stage = Stage::FirstRequest;
            c.since = now;
            c.authenticated = authenticated;
        });
    }

    /// The gateway read all the peer had sent and waits for more.
    pub fn waiting_on_peer(&mut self, id: ConnId, now: Instant) {
        self.update(id, |c| {
            c.waiting_on_peer.get_or_insert(now);
        });
    }

    /// Bytes from the peer arrived (the gateway has not read them yet).
    pub fn peer_ready(&mut self, id: ConnId) {
        self.update(id, |c| c.waiting_on_peer = None);
    }

    /// A request started on the connection from `peer`; returns its id for [`ConnTable::request_ended`].
    pub fn request_started(&mut self, peer: SocketAddr) -> Option<ConnId> {
        let id = *self.by_peer.get(&peer)?;
        self.update(id, |c| {
            c.stage = Stage::Open;
            c.in_flight = c.in_flight.saturating_add(1);
        });
        Some(id)
    }

    /// A request ended (its response finished or was dropped).
    pub fn request_ended(&mut self, id: ConnId, now: Instant) {
        self.update(id, |c| {
            c.in_flight = c.in_flight.saturating_sub(1);
            if c.in_flight == 0 {
                c.since = now;
            }
        });
    }

    /// The connection is gone (its descriptor closed).
    pub fn remove(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        if c.shed {
            self.shed_pending -= 1;
        } else {
            self.unlink(id);
        }
        if let Some(c) = self.conns.remove(&id)
            && self.by_peer.get(&c.peer) == Some(&id)
        {
            self.by_peer.remove(&c.peer);
        }
    }

    /// Connections whose deadline, shrunk by the pressure now, has passed: marked shed, to be closed.
    pub fn expire(&mut self, now: Instant, limits: &ConnLimits) -> Vec<(ConnId, Stage)> {
        let p = self.pressure(limits);
        let at = |d: &Deadline| d.at(p, limits.shrink_from);
        let (handshake, first, idle, lifetime) = (
            at(&limits.handshake),
            at(&limits.first_request),
            at(&limits.idle),
            at(&limits.lifetime),
        );
        let expired: Vec<(ConnId, Stage)> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.shed)
            .filter(|(_, c)| {
                let waited = now.saturating_duration_since(c.since);
                let on_peer = c.waiting_on_peer.is_some();
                match c.stage {
                    Stage::Handshake => {
                        (on_peer && waited >= handshake) || waited >= limits.handshake.base
                    }
                    Stage::FirstRequest => {
                        (on_peer && waited >= first) || waited >= limits.first_request.base
                    }
                    Stage::Open if c.authenticated => false,
                    Stage::Open => {
                        (c.in_flight == 0 && waited >= idle)
                            || now.saturating_duration_since(c.accepted) >= lifetime
                    }
                }
            })
            .map(|(&id, c)| (id, c.stage))
            .collect();
        for &(id, stage) in &expired {
            self.shed(id, Shed::Expired(stage));
        }
        expired
    }

    /// accept(2) failed for want of descriptors: up to `n` connections to close, chosen as for a full table.
    pub fn shed_for_descriptors(&mut self, n: usize) -> Vec<ConnId> {
        let mut out = Vec::new();
        while out.len() < n {
            let Some(victim) = self.longest_queue_victim() else {
                break;
            };
            self.shed(victim, Shed::Descriptors);
            out.push(victim);
        }
        out
    }

    // === internals ===

    /// The first stalled connection (see [`ConnTable::shed_key`]) of the source holding the most; else the oldest
    /// busy one of the source holding the most busy ones.
    fn longest_queue_victim(&self) -> Option<ConnId> {
        for class in [Class::Stalled, Class::Busy] {
            let heaviest = self
                .sources
                .iter()
                .map(|(s, c)| (s, Self::set(c, class).len()))
                .filter(|(_, n)| *n > 0)
                .max_by_key(|(_, n)| *n);
            if let Some((&source, _)) = heaviest {
                return self.oldest_of(source, class);
            }
        }
        None
    }

    fn oldest_of(&self, source: Source, class: Class) -> Option<ConnId> {
        let s = self.sources.get(&source)?;
        Self::set(s, class).first().map(|&(_, _, id)| id)
    }

    fn set(s: &SourceConns, class: Class) -> &BTreeSet<ShedKey> {
        match class {
            Class::Busy => &s.busy,
            _ => &s.stalled,
        }
    }

    fn shed(&mut self, id: ConnId, why: Shed) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        if c.shed {
            return;
        }
        self.unlink(id);
        if let Some(c) = self.conns.get_mut(&id) {
            c.shed = true;
        }
        self.shed_pending += 1;
        let counter = match why {
            Shed::SourceFull => &mut self.counters.shed_source_full,
            Shed::Full => &mut self.counters.shed_full,
            Shed::Expired(_) => &mut self.counters.expired,
            Shed::Descriptors => &mut self.counters.shed_descriptors,
        };
        *counter += 1;
    }

    fn update(&mut self, id: ConnId, f: impl FnOnce(&mut Conn)) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let shed = c.shed;
        if !shed {
            self.unlink(id);
        }
        if let Some(c) = self.conns.get_mut(&id) {
            f(c);
        }
        if !shed {
            self.link(id);
        }
    }

    /// Busy connections: oldest first. Stalled ones: those keeping the gateway waiting, longest first; then those
    /// the gateway has not served yet, newest first (served in order, the newest would be served last).
    fn shed_key(&self, id: ConnId, c: &Conn) -> ShedKey {
        let at = |t: Instant| t.saturating_duration_since(self.epoch).as_nanos() as u64;
        match (c.class(), c.peer_stalled_since()) {
            (Class::Stalled, Some(since)) => (0, at(since), id),
            (Class::Stalled, None) => (1, u64::MAX - at(c.accepted), id),
            _ => (0, at(c.accepted), id),
        }
    }

    fn link(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let (class, source, key) = (c.class(), c.source, self.shed_key(id, c));
        let s = self.sources.entry(source).or_default();
        match class {
            Class::Stalled => {
                s.stalled.insert(key);
                self.stalled += 1;
            }
            Class::Busy => {
                s.busy.insert(key);
                self.busy += 1;
            }
            Class::Trusted => {}
        }
    }

    fn unlink(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let (class, source, key) = (c.class(), c.source, self.shed_key(id, c));
        let Some(s) = self.sources.get_mut(&source) else {
            return;
        };
        match class {
            Class::Stalled => {
                if s.stalled.remove(&key) {
                    self.stalled -= 1;
                }
            }
            Class::Busy => {
                if s.busy.remove(&key) {
                    self.busy -= 1;
                }
            }
            Class::Trusted => {}
        }
        if s.stalled.is_empty() && s.busy.is_empty() {
            self.sources.remove(&source);
        }
    }
}

#[cfg(test)]
#[path = "conns_tests.rs"]
mod tests;
