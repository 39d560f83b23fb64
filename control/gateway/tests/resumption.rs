//! TLS session resumption at the gateway, in memory (no sockets): every gateway sealing with the same key resumes
//! the others' sessions, and a resumed session's certificate is checked after the handshake as a full handshake
//! checks it (dates, revoked identities and keys).

use bc_gateway::tls::{Handshake, Revocations, ServerTls};
use bc_proto::spiffe::SpiffeId;
use bc_proto::tickets::SessionTickets;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Pki {
    ca: CertificateDer<'static>,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

fn pki() -> Result<Pki, Error> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = params.self_signed(&key)?;
    Ok(Pki {
        ca: ca.der().clone(),
        issuer: rcgen::Issuer::new(params, key),
    })
}

/// A leaf of `pki` for `names`/`uri`, valid from `not_before` for `life`.
fn leaf(
    pki: &Pki,
    names: &[&str],
    uri: Option<&str>,
    not_before: time::OffsetDateTime,
    life: time::Duration,
) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), Error> {
    let key = rcgen::KeyPair::generate()?;
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
    if let Some(uri) = uri {
        params
            .subject_alt_names
            .push(rcgen::SanType::URI(rcgen::string::Ia5String::try_from(
                uri.to_string(),
            )?));
    }
    params.not_before = not_before;
    params.not_after = not_before + life;
    let cert = params.signed_by(&key, &pki.issuer)?;
    Ok((
        cert.der().clone(),
        PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    ))
}

fn gateway(
    pki: &Pki,
    revoked: &Revocations,
    tickets: Option<Arc<SessionTickets>>,
) -> Result<ServerTls, Error> {
    let (cert, key) = leaf(
        pki,
        &["localhost"],
        None,
        time::OffsetDateTime::now_utc() - time::Duration::hours(1),
        time::Duration::days(1),
    )?;
    Ok(bc_gateway::tls::server_config(
        bc_gateway::tls::Renewable::new(vec![cert, pki.ca.clone()], key)?,
        std::slice::from_ref(&pki.ca),
        revoked.clone(),
        tickets,
    )?)
}

fn connect(
    client: &Arc<rustls::ClientConfig>,
    server: &ServerTls,
) -> Result<rustls::ServerConnection, Error> {
    Ok(bc_gateway::tls::handshake_in_memory(
        client,
        &server.config,
    )?)
}

fn node_client(
    pki: &Pki,
    id: &str,
    not_before: time::OffsetDateTime,
    life: time::Duration,
) -> Result<(Arc<rustls::ClientConfig>, CertificateDer<'static>), Error> {
    let (cert, key) = leaf(
        pki,
        &[],
        Some(&format!("spiffe://bc.test/node/{id}")),
        not_before,
        life,
    )?;
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(vec![pki.ca.clone()]),
        Some((vec![cert.clone()], key)),
    )?;
    Ok((tls, cert))
}

fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

#[test]
fn a_session_resumes_at_every_gateway_sharing_the_key_and_a_full_handshake_elsewhere()
-> Result<(), Error> {
    let pki = pki()?;
    let revoked = Revocations::default();
    let tickets = Arc::new(SessionTickets::new(b"ca key", &pki.ca));
    let a = gateway(&pki, &revoked, Some(tickets.clone()))?;
    // Another gateway process of the same plane: its own serving certificate, the same key.
    let b = gateway(
        &pki,
        &revoked,
        Some(Arc::new(SessionTickets::new(b"ca key", &pki.ca))),
    )?;
    let other = gateway(
        &pki,
        &revoked,
        Some(Arc::new(SessionTickets::new(b"another ca key", &pki.ca))),
    )?;
    let without = gateway(&pki, &revoked, None)?;
    let (client, _) = node_client(
        &pki,
        "n1",
        time::OffsetDateTime::now_utc() - time::Duration::hours(1),
        time::Duration::days(1),
    )?;

    let first = connect(&client, &a)?;
    assert_eq!(first.handshake_kind(), Some(rustls::HandshakeKind::Full));
    assert_eq!(a.admit(&first, now_ms()), Ok(Handshake::Full));
    let again = connect(&client, &a)?;
    assert_eq!(again.handshake_kind(), Some(rustls::HandshakeKind::Resumed));
    // The certificate the ticket holds is the peer's, as after a full handshake.
    assert!(again.peer_certificates().is_some_and(|c| c.len() == 1));
    assert_eq!(a.admit(&again, now_ms()), Ok(Handshake::Resumed));
    let elsewhere = connect(&client, &b)?;
    assert_eq!(
        elsewhere.handshake_kind(),
        Some(rustls::HandshakeKind::Resumed),
        "a gateway with the same key resumes the other's session"
    );
    assert_eq!(b.admit(&elsewhere, now_ms()), Ok(Handshake::Resumed));
    // A gateway whose key differs cannot open the ticket: a full handshake, the certificate verified.
    let foreign = connect(&client, &other)?;
    assert_eq!(foreign.handshake_kind(), Some(rustls::HandshakeKind::Full));
    // A gateway without tickets never resumes (and sends none).
    let never = connect(&client, &without)?;
    assert_eq!(never.handshake_kind(), Some(rustls::HandshakeKind::Full));
    assert_eq!(a.counts().full.load(Relaxed), 1);
    assert_eq!(a.counts().resumed.load(Relaxed), 1);
    assert_eq!(b.counts().resumed.load(Relaxed), 1);
    Ok(())
}

#[test]
fn a_resumed_session_of_a_revoked_identity_or_key_is_refused_after_its_handshake()
-> Result<(), Error> {
    let pki = pki()?;
    let revoked = Revocations::default();
    let tickets = Arc::new(SessionTickets::new(b"ca key", &pki.ca));
    let gw = gateway(&pki, &revoked, Some(tickets))?;
    let from = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
    let (client, _) = node_client(&pki, "revokee", from, time::Duration::days(1))?;
    let (keyed, keyed_cert) = node_client(&pki, "rekeyed", from, time::Duration::days(1))?;
    let (bystander, _) = node_client(&pki, "bystander", from, time::Duration::days(1))?;
    for c in [&client, &keyed, &bystander] {
        connect(c, &gw)?;
    }
    // Revoked after the tickets were sealed: the ticket still opens (the handshake resumes), the gateway refuses.
    revoked.extend([SpiffeId::new(
        "bc.test",
        bc_proto::spiffe::Role::Node,
        "revokee",
    )?]);
    let conn = connect(&client, &gw)?;
    assert_eq!(conn.handshake_kind(), Some(rustls::HandshakeKind::Resumed));
    let why = gw
        .admit(&conn, now_ms())
        .expect_err("a revoked identity resumed");
    assert!(why.contains("revoked"), "{why}");
    // A key a reclaim superseded, likewise.
    let hash = bc_proto::channel::key_hash_of(&keyed_cert).ok_or("key hash")?;
    assert_eq!(revoked.extend_keys([hash]), 1);
    let conn = connect(&keyed, &gw)?;
    assert_eq!(conn.handshake_kind(), Some(rustls::HandshakeKind::Resumed));
    let why = gw
        .admit(&conn, now_ms())
        .expect_err("a revoked key resumed");
    assert!(why.contains("key"), "{why}");
    // Everyone else resumes.
    let conn = connect(&bystander, &gw)?;
    assert_eq!(gw.admit(&conn, now_ms()), Ok(Handshake::Resumed));
    assert_eq!(gw.counts().resumed_refused.load(Relaxed), 2);
    // Without the ticket, the revoked identity's full handshake is refused in the handshake itself.
    let mut fresh = (*client).clone();
    fresh.resumption = rustls::client::Resumption::disabled();
    let e = connect(&Arc::new(fresh), &gw).expect_err("a revoked identity's full handshake");
    assert!(e.to_string().contains("Revoked"), "{e}");
    Ok(())
}

#[test]
fn a_resumed_session_whose_certificate_expired_is_refused() -> Result<(), Error> {
    let pki = pki()?;
    let revoked = Revocations::default();
    let gw = gateway(
        &pki,
        &revoked,
        Some(Arc::new(SessionTickets::new(b"k", &pki.ca))),
    )?;
    // A certificate that expires in a minute; the ticket lives for hours.
    let (client, cert) = node_client(
        &pki,
        "short",
        time::OffsetDateTime::now_utc() - time::Duration::hours(1),
        time::Duration::minutes(61),
    )?;
    connect(&client, &gw)?;
    let conn = connect(&client, &gw)?;
    assert_eq!(conn.handshake_kind(), Some(rustls::HandshakeKind::Resumed));
    let (_, not_after) = bc_proto::channel::cert_validity_ms(&cert).ok_or("validity")?;
    assert_eq!(gw.admit(&conn, not_after), Ok(Handshake::Resumed));
    let conn = connect(&client, &gw)?;
    let why = gw
        .admit(&conn, not_after + 1)
        .expect_err("an expired certificate resumed");
    assert!(why.contains("expired"), "{why}");
    Ok(())
}
