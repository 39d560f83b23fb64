use super::*;
use proptest::prelude::*;

const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
const XID: u32 = 0xdead_beef;

fn reply(kind: MessageType, xid: u32, yiaddr: Ipv4Addr) -> Vec<u8> {
    let mut msg = Message::new_with_id(
        xid,
        Ipv4Addr::UNSPECIFIED,
        yiaddr,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &MAC,
    );
    msg.set_opcode(Opcode::BootReply);
    let o = msg.opts_mut();
    o.insert(DhcpOption::MessageType(kind));
    o.insert(DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 9, 0, 1)));
    o.insert(DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)));
    o.insert(DhcpOption::Router(vec![Ipv4Addr::new(10, 9, 0, 1)]));
    o.insert(DhcpOption::AddressLeaseTime(3600));
    let mut out = Vec::new();
    msg.encode(&mut Encoder::new(&mut out)).expect("encode");
    out
}

fn sent(step: Step) -> Message {
    match step {
        Step::Send(bytes) => wire::decode(&bytes).expect("our own packet decodes"),
        other => panic!("expected a packet, got {other:?}"),
    }
}

#[test]
fn discover_offer_request_ack() {
    let t0 = Instant::now();
    let mut c = DhcpClient::new(MAC, XID, Duration::from_secs(30));
    let d = sent(c.start(t0));
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    assert_eq!(d.xid(), XID);
    assert!(d.flags().broadcast());
    let addr = Ipv4Addr::new(10, 9, 0, 50);
    let r = sent(c.on_packet(&reply(MessageType::Offer, XID, addr), t0));
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
    assert_eq!(
        r.opts().get(OptionCode::RequestedIpAddress),
        Some(&DhcpOption::RequestedIpAddress(addr))
    );
    match c.on_packet(&reply(MessageType::Ack, XID, addr), t0) {
        Step::Bound(lease) => {
            assert_eq!(lease.address, addr);
            assert_eq!(lease.prefix_len, 24);
            assert_eq!(lease.router, Some(Ipv4Addr::new(10, 9, 0, 1)));
            assert_eq!(lease.lease_secs, Some(3600));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.deadline(), None);
}

#[test]
fn ignores_other_transactions_and_garbage() {
    let t0 = Instant::now();
    let mut c = DhcpClient::new(MAC, XID, Duration::from_secs(30));
    let _ = c.start(t0);
    let addr = Ipv4Addr::new(10, 9, 0, 50);
    assert_eq!(
        c.on_packet(&reply(MessageType::Offer, XID + 1, addr), t0),
        Step::Wait
    );
    assert_eq!(c.on_packet(&[1, 2, 3], t0), Step::Wait);
    assert_eq!(
        c.on_packet(&reply(MessageType::Ack, XID, addr), t0),
        Step::Wait
    );
    assert_eq!(c.ignored, 3);
}

#[test]
fn nak_restarts_and_timeouts_retransmit_then_give_up() {
    let t0 = Instant::now();
    let mut c = DhcpClient::new(MAC, XID, Duration::from_secs(10));
    let _ = c.start(t0);
    assert_eq!(c.on_timer(t0 + Duration::from_millis(499)), Step::Wait);
    let again = sent(c.on_timer(t0 + Duration::from_millis(1500)));
    assert_eq!(again.opts().msg_type(), Some(MessageType::Discover));
    let addr = Ipv4Addr::new(10, 9, 0, 50);
    let _ = c.on_packet(
        &reply(MessageType::Offer, XID, addr),
        t0 + Duration::from_secs(2),
    );
    let d = sent(c.on_packet(
        &reply(MessageType::Nak, XID, addr),
        t0 + Duration::from_secs(2),
    ));
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    match c.on_timer(t0 + Duration::from_secs(11)) {
        Step::Failed(why) => assert!(why.contains("no OFFER"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn resolv_conf_lists_at_most_three_servers() {
    let lease = Lease {
        address: Ipv4Addr::new(10, 0, 0, 5),
        prefix_len: 24,
        router: None,
        dns: (1..=4).map(|i| Ipv4Addr::new(10, 0, 0, i)).collect(),
        server: Ipv4Addr::new(10, 0, 0, 1),
        lease_secs: None,
        renewal_secs: None,
        rebinding_secs: None,
    };
    assert_eq!(
        resolv_conf(&lease),
        "nameserver 10.0.0.1\nnameserver 10.0.0.2\nnameserver 10.0.0.3\n"
    );
}

#[test]
fn retransmissions_back_off_with_bounded_jitter() {
    let t0 = Instant::now();
    for xid in [0u32, 1, 0xdead_beef, u32::MAX, 12345] {
        let mut c = DhcpClient::new(MAC, xid, Duration::from_secs(600));
        let _ = c.start(t0);
        let mut now = t0;
        for n in 0..8u32 {
            let due = c.deadline().expect("a retransmission is due");
            let gap = due - now;
            let base = Duration::from_secs(1 << n.min(3));
            assert!(
                gap + Duration::from_millis(500) >= base
                    && gap <= base + Duration::from_millis(500),
                "retry {n} of xid {xid:#x} after {gap:?}"
            );
            now = due;
            assert!(matches!(c.on_timer(now), Step::Send(_)));
        }
    }
}

proptest! {
    #[test]
    fn never_panics_on_input(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let t0 = Instant::now();
        let mut c = DhcpClient::new(MAC, XID, Duration::from_secs(10));
        let _ = c.start(t0);
        let _ = c.on_packet(&bytes, t0);
    }

    #[test]
    fn never_panics_on_valid_headers_with_random_options(opts in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut p = reply(MessageType::Offer, XID, Ipv4Addr::new(10, 0, 0, 2));
        p.truncate(wire::HEADER_LEN);
        p.extend_from_slice(&opts);
        let t0 = Instant::now();
        let mut c = DhcpClient::new(MAC, XID, Duration::from_secs(10));
        let _ = c.start(t0);
        let _ = c.on_packet(&p, t0);
    }
}
