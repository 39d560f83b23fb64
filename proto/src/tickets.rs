//! TLS 1.3 session tickets every gateway of a control plane can open: sealed with a key derived from a secret the
//! gateways already share (the CA's private key: `bc_ca::Ca::session_tickets`) and the CA certificate they verify
//! clients against, so a node whose gateway restarted, or whose balancer sent it to another gateway, resumes its
//! session instead of repeating the whole mTLS handshake. Whoever can seal a ticket can resume as any node whose
//! certificate they have; whoever holds the CA key can already issue one.
//!
//! A resumed session skips the certificates and their signatures (on both sides: the largest part of a reconnect's
//! CPU, see BENCHMARKS.md), so the gateway checks the client certificate the ticket carries after the handshake
//! (its dates and the revocation sets: `bc_gateway::tls::ServerTls::admit`). The chain is not verified again: a
//! ticket opens only under a key derived from this CA's certificate, and the gateway seals one only after a full
//! handshake verified the chain, or after a resumption whose certificate it admitted.
//!
//! A ticket is `version (1) ‖ issued at (8, Unix seconds, big-endian) ‖ nonce (12) ‖ AES-256-GCM(session) ‖ tag
//! (16)`, the first 9 bytes authenticated as associated data. It opens for [`TICKET_LIFETIME`] after it was issued,
//! and not when it claims to be issued more than [`CLOCK_SKEW`] in the future (gateways' clocks differ). The
//! version, the age and the tag are checked before anything is decrypted; anything else is no ticket (the handshake
//! goes on as a full one).

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a ticket opens after it was issued (and what the gateway tells clients its tickets live).
pub const TICKET_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// How far in the future a ticket's issue time may be (another gateway's clock ahead of this one's).
pub const CLOCK_SKEW: Duration = Duration::from_secs(300);

const VERSION: u8 = 1;
const HEADER: usize = 1 + 8;
const TAG: usize = 16;
/// Shortest sealed ticket: the header, the nonce and the tag of an empty session.
pub const MIN_TICKET: usize = HEADER + NONCE_LEN + TAG;

const SALT: &[u8] = b"better-compute gateway session tickets v1";

/// Seals and opens the gateways' session tickets. Two values made from the same secret and CA open each other's
/// tickets; any other pair does not.
pub struct SessionTickets {
    key: LessSafeKey,
}

impl std::fmt::Debug for SessionTickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTickets").finish_non_exhaustive()
    }
}

/// Why a ticket did not open (for tests and the fuzz target; the TLS handshake only learns that it did not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TicketRefused {
    #[error("shorter than a sealed ticket ({MIN_TICKET} bytes)")]
    Short,
    #[error("not a version {VERSION} ticket")]
    Version,
    #[error("issued more than the ticket lifetime ago")]
    Expired,
    #[error("issued in the future, beyond the clock skew allowed")]
    Future,
    #[error("not sealed by this control plane's gateways, or altered")]
    Forged,
}

struct Len32;

impl hkdf::KeyType for Len32 {
    fn len(&self) -> usize {
        32
    }
}

impl SessionTickets {
    /// The sealing key for gateways holding `secret` (the CA's private key) and verifying clients against the CA
    /// certificate `ca_der`.
    pub fn new(secret: &[u8], ca_der: &[u8]) -> SessionTickets {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(secret);
        let ca = crate::sha256(ca_der);
        let info = [&ca[..]];
        let mut bytes = [0u8; 32];
        // Expanding 32 bytes from SHA-256 is within HKDF's bounds, so neither step can fail.
        if let Ok(okm) = prk.expand(&info, Len32) {
            let _ = okm.fill(&mut bytes);
        }
        let key = UnboundKey::new(&AES_256_GCM, &bytes)
            .unwrap_or_else(|_| unreachable!("32-byte AES-256 key"));
        SessionTickets {
            key: LessSafeKey::new(key),
        }
    }

    /// `session` sealed as issued at `now_secs`, with `nonce` (unique per ticket: [`Self::encrypt`] draws it).
    pub fn seal(&self, session: &[u8], now_secs: u64, nonce: [u8; NONCE_LEN]) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(MIN_TICKET + session.len());
        out.push(VERSION);
        out.extend_from_slice(&now_secs.to_be_bytes());
        out.extend_from_slice(&nonce);
        let mut body = session.to_vec();
        let aad = Aad::from(&out[..HEADER]);
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), aad, &mut body)
            .ok()?;
        out.extend_from_slice(&body);
        Some(out)
    }

    /// The session a ticket holds, when it was sealed by these gateways at most [`TICKET_LIFETIME`] before
    /// `now_secs`.
    pub fn open(&self, ticket: &[u8], now_secs: u64) -> Result<Vec<u8>, TicketRefused> {
        if ticket.len() < MIN_TICKET {
            return Err(TicketRefused::Short);
        }
        if ticket[0] != VERSION {
            return Err(TicketRefused::Version);
        }
        let mut issued = [0u8; 8];
        issued.copy_from_slice(&ticket[1..HEADER]);
        let issued = u64::from_be_bytes(issued);
        if issued > now_secs.saturating_add(CLOCK_SKEW.as_secs()) {
            return Err(TicketRefused::Future);
        }
        if now_secs.saturating_sub(issued) > TICKET_LIFETIME.as_secs() {
            return Err(TicketRefused::Expired);
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&ticket[HEADER..HEADER + NONCE_LEN]);
        let mut body = ticket[HEADER + NONCE_LEN..].to_vec();
        let plain = self
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&ticket[..HEADER]),
                &mut body,
            )
            .map_err(|_| TicketRefused::Forged)?;
        Ok(plain.to_vec())
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl rustls::server::ProducesTickets for SessionTickets {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        TICKET_LIFETIME.as_secs() as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).ok()?;
        self.seal(plain, unix_now(), nonce)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open(cipher, unix_now()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000;

    fn tickets(secret: &[u8], ca: &[u8]) -> SessionTickets {
        SessionTickets::new(secret, ca)
    }

    #[test]
    fn a_ticket_opens_at_every_gateway_with_the_same_secret_and_ca_and_nowhere_else() {
        let a = tickets(b"ca key", b"ca");
        let t = a.seal(b"session", NOW, [7; 12]).expect("sealed");
        assert_eq!(a.open(&t, NOW).expect("opens"), b"session");
        assert_eq!(
            tickets(b"ca key", b"ca").open(&t, NOW + 1).expect("opens"),
            b"session"
        );
        assert_eq!(
            tickets(b"other key", b"ca").open(&t, NOW),
            Err(TicketRefused::Forged)
        );
        assert_eq!(
            tickets(b"ca key", b"another ca").open(&t, NOW),
            Err(TicketRefused::Forged)
        );
    }

    #[test]
    fn a_ticket_opens_for_its_lifetime_and_not_from_the_future() {
        let a = tickets(b"k", b"ca");
        let t = a.seal(b"s", NOW, [1; 12]).expect("sealed");
        let life = TICKET_LIFETIME.as_secs();
        assert!(a.open(&t, NOW + life).is_ok());
        assert_eq!(a.open(&t, NOW + life + 1), Err(TicketRefused::Expired));
        let skew = CLOCK_SKEW.as_secs();
        assert!(a.open(&t, NOW - skew).is_ok());
        assert_eq!(a.open(&t, NOW - skew - 1), Err(TicketRefused::Future));
    }

    #[test]
    fn an_altered_ticket_does_not_open() {
        let a = tickets(b"k", b"ca");
        let t = a.seal(b"session bytes", NOW, [2; 12]).expect("sealed");
        for i in 0..t.len() {
            let mut bad = t.clone();
            bad[i] ^= 0x01;
            assert!(a.open(&bad, NOW).is_err(), "byte {i} altered still opened");
        }
        // The issue time is authenticated: moving it back (to stretch a ticket's life) breaks the tag.
        let mut older = t.clone();
        older[1..9].copy_from_slice(&(NOW - 10).to_be_bytes());
        assert_eq!(a.open(&older, NOW), Err(TicketRefused::Forged));
        assert_eq!(a.open(&t[..MIN_TICKET - 1], NOW), Err(TicketRefused::Short));
        let mut v2 = t.clone();
        v2[0] = 2;
        assert_eq!(a.open(&v2, NOW), Err(TicketRefused::Version));
    }
}
