#![no_main]
//! A TLS session ticket as a client presents it to the gateway (`bc_proto::tickets`): no input may panic; bytes that
//! open are a ticket the gateways sealed, so anything else (altered, another key's, out of its lifetime) opens to
//! nothing; and a session sealed at any time opens to itself within its lifetime and never after it.
use bc_proto::tickets::{CLOCK_SKEW, MIN_TICKET, SessionTickets, TICKET_LIFETIME};
use libfuzzer_sys::fuzz_target;
use std::sync::LazyLock;

static OURS: LazyLock<SessionTickets> =
    LazyLock::new(|| SessionTickets::new(b"fuzz ca key", b"fuzz ca"));
static THEIRS: LazyLock<SessionTickets> =
    LazyLock::new(|| SessionTickets::new(b"another ca key", b"fuzz ca"));

fuzz_target!(|data: &[u8]| {
    let (now, rest) = match data.split_first_chunk::<8>() {
        Some((n, rest)) => (u64::from_le_bytes(*n), rest),
        None => (0, data),
    };
    // Arbitrary bytes as a presented ticket: only ours open, and only what we sealed (the tag says so).
    if let Ok(session) = OURS.open(rest, now) {
        assert!(rest.len() >= MIN_TICKET);
        assert_eq!(session.len(), rest.len() - MIN_TICKET);
        assert!(THEIRS.open(rest, now).is_err());
    }
    // The input as a session: sealed now, it opens to itself for its lifetime, at no other gateway, and not after.
    let mut nonce = [0u8; 12];
    let n = rest.len().min(12);
    nonce[..n].copy_from_slice(&rest[..n]);
    let now = now % (u64::MAX / 2);
    let ticket = OURS.seal(rest, now, nonce).expect("sealing never fails");
    assert_eq!(OURS.open(&ticket, now).as_deref(), Ok(rest));
    let life = TICKET_LIFETIME.as_secs();
    assert_eq!(OURS.open(&ticket, now + life).as_deref(), Ok(rest));
    assert!(OURS.open(&ticket, now + life + 1).is_err());
    if now > CLOCK_SKEW.as_secs() {
        assert!(OURS.open(&ticket, now - CLOCK_SKEW.as_secs() - 1).is_err());
    }
    assert!(THEIRS.open(&ticket, now).is_err());
    // One bit flipped anywhere: it does not open.
    if let Some(i) = (!ticket.is_empty()).then(|| rest.len() % ticket.len()) {
        let mut bad = ticket.clone();
        bad[i] ^= 0x80;
        assert!(OURS.open(&bad, now).is_err());
    }
});
