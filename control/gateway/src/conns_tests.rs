//! The shedding policy's decisions, table by table (no I/O, time as input).

use super::*;

fn limits() -> ConnLimits {
    ConnLimits {
        max_connections: 100,
        max_unauthenticated: 20,
        max_stalled_per_source: 8,
        ..ConnLimits::for_descriptors(1024)
    }
}

fn peer(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

fn admitted(a: Admission) -> (ConnId, Vec<ConnId>) {
    match a {
        Admission::Admitted { id, shed } => (id, shed),
        Admission::Refused => panic!("refused"),
    }
}

/// A real node from `ip`: handshake with a client certificate, then its Session.
fn real_node(t: &mut ConnTable, ip: &str, port: u16, now: Instant, l: &ConnLimits) -> ConnId {
    let (id, _) = admitted(t.admit(peer(ip, port), now, l));
    t.handshake_done(id, true, now);
    assert_eq!(t.request_started(peer(ip, port)), Some(id));
    id
}

#[test]
fn deadlines_shrink_from_their_base_to_their_floor_as_pressure_rises() {
    let d = Deadline::new(Duration::from_secs(10), Duration::from_secs(1));
    assert_eq!(d.at(0.0, 0.5), Duration::from_secs(10));
    assert_eq!(d.at(0.5, 0.5), Duration::from_secs(10));
    assert_eq!(d.at(0.75, 0.5), Duration::from_millis(5500));
    assert_eq!(d.at(1.0, 0.5), Duration::from_secs(1));
    assert_eq!(d.at(7.0, 0.5), Duration::from_secs(1));
}

#[test]
fn limits_follow_the_descriptor_limit() {
    let l = ConnLimits::for_descriptors(1024);
    assert_eq!((l.max_connections, l.max_unauthenticated), (896, 448));
    let l = ConnLimits::for_descriptors(524_288);
    assert_eq!((l.max_connections, l.max_unauthenticated), (520_192, 4096));
    let l = ConnLimits::for_descriptors(64);
    assert!(l.max_connections >= 16 && l.max_unauthenticated >= 8);
    assert!(l.max_stalled_per_source <= l.max_unauthenticated);
}

#[test]
fn a_flood_sharing_a_real_nodes_address_sheds_its_own_oldest_connections() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    // Silent connections: the gateway read nothing and waits.
    let mut flood = Vec::new();
    for port in 0..8 {
        let id = admitted(t.admit(peer("10.0.0.1", port), t0, &l)).0;
        t.waiting_on_peer(id, t0);
        flood.push(id);
    }
    // The real node's connection from the same address sheds the flood connection silent longest.
    let later = t0 + Duration::from_secs(2);
    let (node, shed) = admitted(t.admit(peer("10.0.0.1", 100), later, &l));
    assert_eq!(shed, vec![flood[0]]);
    // While it finishes its handshake, more flood connections shed older flood connections.
    for (i, port) in (200..205).enumerate() {
        let (id, shed) = admitted(t.admit(peer("10.0.0.1", port), later, &l));
        assert_eq!(shed, vec![flood[i + 1]]);
        t.waiting_on_peer(id, later);
    }
    t.handshake_done(node, true, later);
    assert_eq!(t.request_started(peer("10.0.0.1", 100)), Some(node));
    // Now trusted: never chosen, however long the flood goes on (one connection every 100 ms, each silent).
    for port in 300..400 {
        let now = later + Duration::from_millis(100 * u64::from(port - 300));
        let (id, shed) = admitted(t.admit(peer("10.0.0.1", port), now, &l));
        assert!(!shed.contains(&node));
        t.waiting_on_peer(id, now);
    }
    // At most the cap and what arrives within the 1 s grace.
    assert!(t.stats(&l).stalled <= 8 + 10 + 1, "{:?}", t.stats(&l));
    assert!(
        t.expire(later + Duration::from_secs(3600), &l)
            .iter()
            .all(|(id, _)| *id != node)
    );
}

#[test]
fn a_handshake_in_progress_outlasts_a_churning_flood_from_its_own_address() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let (node, _) = admitted(t.admit(peer("10.0.9.1", 1), t0, &l));
    // Connections that never send a byte, arriving faster than the node's handshake ends: they shed each other.
    for port in 2..1000 {
        let now = t0 + Duration::from_micros(u64::from(port));
        let (id, shed) = admitted(t.admit(peer("10.0.9.1", port), now, &l));
        assert!(!shed.contains(&node), "port {port}");
        t.waiting_on_peer(id, now);
    }
    // The node's handshake waits for its peer a moment (a round trip): those silent longer go first.
    let now = t0 + Duration::from_millis(5);
    t.waiting_on_peer(node, now);
    for port in 1000..1005 {
        let (id, shed) = admitted(t.admit(peer("10.0.9.1", port), now, &l));
        assert!(!shed.contains(&node), "port {port}");
        t.waiting_on_peer(id, now);
    }
    t.peer_ready(node);
    // A busy gateway that has served none of the newcomers yet: the newest go first, the node stays.
    let mut newest = Vec::new();
    for port in 1100..1200 {
        let now = now + Duration::from_micros(u64::from(port));
        let (id, shed) = admitted(t.admit(peer("10.0.9.1", port), now, &l));
        assert!(!shed.contains(&node), "port {port}");
        if let Some(&prev) = newest.last()
            && port >= 1119
        {
            assert_eq!(shed, vec![prev], "the newest not yet served goes");
        }
        newest.push(id);
    }
    assert_eq!(t.stats(&l).stalled, 20, "the unauthenticated cap");
}

#[test]
fn a_burst_from_one_address_is_not_shed_before_its_peers_had_a_round_trip() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    // Twelve handshakes from one address (its cap is 8), each waiting for its peer's next flight.
    for port in 0..12 {
        let (id, shed) = admitted(t.admit(peer("10.0.10.1", port), t0, &l));
        assert!(shed.is_empty(), "port {port}");
        t.waiting_on_peer(id, t0);
    }
    // A second later those still waiting are fair game.
    let (_, shed) = admitted(t.admit(peer("10.0.10.1", 100), t0 + Duration::from_secs(1), &l));
    assert_eq!(shed.len(), 1);
}

#[test]
fn at_the_cap_the_source_holding_the_most_loses_its_oldest() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    // 20 unauthenticated: 8 from each of two flood addresses, 4 from a third.
    let mut first_of = HashMap::new();
    for (ip, n) in [("10.0.0.2", 8), ("10.0.0.3", 8), ("10.0.0.4", 4)] {
        for port in 0..n {
            let now = t0 + Duration::from_millis(u64::from(port));
            let (id, shed) = admitted(t.admit(peer(ip, port), now, &l));
            assert!(shed.is_empty());
            t.waiting_on_peer(id, now);
            first_of.entry(ip).or_insert(id);
        }
    }
    // A real node from elsewhere gets in; one of the two heaviest sources loses its oldest.
    let (node, shed) = admitted(t.admit(peer("192.0.2.9", 1), t0 + Duration::from_secs(1), &l));
    assert_eq!(shed.len(), 1);
    assert!(shed[0] == first_of["10.0.0.2"] || shed[0] == first_of["10.0.0.3"]);
    assert_ne!(shed[0], node);
    assert_eq!(t.stats(&l).stalled, 20, "still at the cap, not over it");
}

#[test]
fn joins_in_flight_are_shed_only_when_nothing_is_stalled() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let mut joins = Vec::new();
    for port in 0..20 {
        let (id, _) = admitted(t.admit(peer("10.0.1.1", port), t0, &l));
        t.handshake_done(id, false, t0);
        t.request_started(peer("10.0.1.1", port));
        joins.push(id);
    }
    assert_eq!(t.stats(&l).busy, 20);
    let (fresh, shed) = admitted(t.admit(peer("10.0.1.2", 1), t0, &l));
    assert_eq!(
        shed,
        vec![joins[0]],
        "nothing stalled: the oldest join goes"
    );
    // Now a stalled connection exists: it goes before any join.
    let (_, shed) = admitted(t.admit(peer("10.0.1.2", 2), t0, &l));
    assert_eq!(shed, vec![fresh]);
    assert_eq!(t.stats(&l).busy, 19);
}

#[test]
fn a_table_full_of_sessions_refuses_new_connections_and_sheds_no_session() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let sessions: Vec<ConnId> = (0..100)
        .map(|p| real_node(&mut t, "10.0.2.1", p, t0, &l))
        .collect();
    assert_eq!(t.admit(peer("10.0.2.2", 1), t0, &l), Admission::Refused);
    assert_eq!(t.open(), 100);
    t.remove(sessions[0]);
    let (_, shed) = admitted(t.admit(peer("10.0.2.2", 2), t0, &l));
    assert!(shed.is_empty());
    assert_eq!(t.stats(&l).counters.refused, 1);
}

#[test]
fn stalled_connections_expire_sooner_under_pressure_and_sessions_never() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let session = real_node(&mut t, "10.0.3.1", 1, t0, &l);
    let (idle, _) = admitted(t.admit(peer("10.0.3.2", 1), t0, &l));
    t.waiting_on_peer(idle, t0);
    // Low pressure: 2 s into a handshake is within the 10 s deadline.
    assert!(t.expire(t0 + Duration::from_secs(2), &l).is_empty());
    // Full pressure (the unauthenticated cap reached): the deadline is down to its floor.
    let at = t0 + Duration::from_secs(2);
    let flood: Vec<ConnId> = (0..19)
        .map(|p| {
            let id = admitted(t.admit(peer(&format!("10.0.4.{p}"), 1), at, &l)).0;
            t.waiting_on_peer(id, at);
            id
        })
        .collect();
    assert!((t.pressure(&l) - 1.0).abs() < 1e-9);
    let expired = t.expire(t0 + Duration::from_millis(3500), &l);
    assert_eq!(
        expired,
        vec![(idle, Stage::Handshake)],
        "the 3.5 s old handshake, past the 3 s floor"
    );
    // 19 of 20 now: the deadline is 3.7 s.
    assert!(t.expire(t0 + Duration::from_millis(5600), &l).is_empty());
    let mut later: Vec<ConnId> = t
        .expire(t0 + Duration::from_millis(5700), &l)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    later.sort();
    let mut flood = flood;
    flood.sort();
    assert_eq!(later, flood);
    assert!(
        t.expire(t0 + Duration::from_secs(86_400), &l).is_empty(),
        "the session stays"
    );
    assert_eq!(t.open(), 1, "shed entries stay until dropped, not counted");
    let _ = session;
}

#[test]
fn a_shrunk_deadline_spares_a_handshake_the_gateway_has_not_served() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let (node, _) = admitted(t.admit(peer("10.0.7.1", 1), t0, &l));
    for p in 0..19 {
        let id = admitted(t.admit(peer(&format!("10.0.8.{p}"), 1), t0, &l)).0;
        t.waiting_on_peer(id, t0);
    }
    // Full pressure, 5 s on: past the 3 s floor, but the node's bytes wait for the gateway.
    let expired = t.expire(t0 + Duration::from_secs(5), &l);
    assert_eq!(expired.len(), 19);
    assert!(expired.iter().all(|(id, _)| *id != node));
    // The base deadline closes it whatever the reason.
    assert_eq!(
        t.expire(t0 + Duration::from_secs(10), &l),
        vec![(node, Stage::Handshake)]
    );
}

#[test]
fn a_connection_without_certificate_is_closed_when_idle_or_too_old() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let p = peer("10.0.5.1", 1);
    let (id, _) = admitted(t.admit(p, t0, &l));
    t.handshake_done(id, false, t0);
    // No request within the first-request deadline: closed (the HTTP/2 preface never came).
    assert_eq!(
        t.expire(t0 + Duration::from_secs(10), &l),
        vec![(id, Stage::FirstRequest)]
    );
    t.remove(id);
    let (id, _) = admitted(t.admit(p, t0, &l));
    t.handshake_done(id, false, t0);
    t.request_started(p);
    assert!(
        t.expire(t0 + Duration::from_secs(30), &l).is_empty(),
        "a Join in flight"
    );
    t.request_ended(id, t0 + Duration::from_secs(30));
    assert!(t.expire(t0 + Duration::from_secs(35), &l).is_empty());
    assert_eq!(
        t.expire(t0 + Duration::from_secs(40), &l),
        vec![(id, Stage::Open)],
        "idle 10 s"
    );
    t.remove(id);
    let (id, _) = admitted(t.admit(p, t0, &l));
    t.handshake_done(id, false, t0);
    t.request_started(p);
    assert_eq!(
        t.expire(t0 + Duration::from_secs(60), &l),
        vec![(id, Stage::Open)],
        "lifetime"
    );
    t.remove(id);
    assert_eq!(t.open(), 0);
    assert!(t.sources.is_empty() && t.by_peer.is_empty());
}

#[test]
fn ipv6_peers_are_counted_by_their_64_and_mapped_ipv4_as_ipv4() {
    let a = Source::of("2001:db8:1:2:aaaa::1".parse().expect("ip"));
    let b = Source::of("2001:db8:1:2:bbbb::2".parse().expect("ip"));
    let c = Source::of("2001:db8:1:3::1".parse().expect("ip"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.to_string(), "2001:db8:1:2::/64");
    assert_eq!(
        Source::of("::ffff:192.0.2.1".parse().expect("ip")),
        Source::of("192.0.2.1".parse().expect("ip"))
    );
}

#[test]
fn accept_failing_for_descriptors_sheds_stalled_connections_first() {
    let l = limits();
    let mut t = ConnTable::default();
    let t0 = Instant::now();
    let session = real_node(&mut t, "10.0.6.1", 1, t0, &l);
    let stalled: Vec<ConnId> = (0..3)
        .map(|p| {
            let id = admitted(t.admit(peer("10.0.6.2", p), t0, &l)).0;
            t.waiting_on_peer(id, t0);
            id
        })
        .collect();
    assert_eq!(t.shed_for_descriptors(16), stalled);
    assert!(
        t.shed_for_descriptors(16).is_empty(),
        "the session is never shed"
    );
    let _ = session;
}
