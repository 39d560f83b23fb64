//! Read-only TFTP for the iPXE loaders: [`codec`] (sans-I/O packets), [`negotiate`] (options against
//! [`Limits`]), [`root`] (what a request may open), [`cache`] (loader contents kept between transfers) and
//! [`server`] (one task per transfer).

pub mod cache;
pub mod codec;
pub mod root;
pub mod server;

use std::time::Duration;

use codec::RequestOptions;

/// Bounds on what clients may ask for and how long the server keeps trying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Transfers running at once; more requests are refused with a TFTP error until one ends.
    pub max_transfers: usize,
    /// Largest block size granted (RFC 2348 allows 8..=65464).
    pub max_blksize: u16,
    /// Largest window granted (RFC 7440).
    pub max_windowsize: u16,
    /// Largest window in bytes (window × block size): the memory one transfer holds for retransmission.
    pub max_window_bytes: usize,
    /// Retransmit timeout when the client does not ask for one (RFC 2349 allows 1..=255 s).
    pub timeout: Duration,
    /// Longest retransmit timeout a client may ask for; a longer `timeout` option is declined (left out of the
    /// OACK) and `timeout` used. RFC 2349 lets a client ask for 255 s, which with `max_retries` would let one
    /// silent request hold a transfer slot for about 25 minutes.
    pub max_client_timeout: Duration,
    /// Longest one transfer may run, however steadily its client acknowledges: a client that ACKs each block
    /// just before the timeout would otherwise hold its slot for ever. On expiry the client gets error 0.
    pub max_transfer_time: Duration,
    /// Transfers one client address may run at once; more get error 0 until one ends (64 slots are otherwise
    /// 64 requests from one machine).
    pub max_per_client: usize,
    /// Retransmissions of one window before the transfer is abandoned.
    pub max_retries: u32,
    /// Files up to this size are kept in memory between transfers (0: no cache).
    pub cache_max_file: u64,
    /// Memory all cached files may take together.
    pub cache_max_total: u64,
    /// How long a transfer waits for each ACK awake (yielding the CPU) before sleeping until it arrives: saves a
    /// wake-up per block in lockstep transfers, at the cost of at most this much CPU per block. Paused for clients
    /// slower than this and while the CPU is contended (see `server::Spin`). Zero: never.
    pub ack_spin: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_transfers: 64,
            max_blksize: 65464,
            max_windowsize: 64,
            max_window_bytes: 1 << 20,
            timeout: Duration::from_secs(1),
            max_client_timeout: Duration::from_secs(5),
            max_transfer_time: Duration::from_secs(600),
            max_per_client: 8,
            max_retries: 5,
            cache_max_file: 8 << 20,
            cache_max_total: 64 << 20,
            ack_spin: Duration::from_micros(100),
        }
    }
}

/// The block size when no option is negotiated (RFC 1350).
pub const DEFAULT_BLKSIZE: usize = 512;

/// What a transfer will use, and the OACK that tells the client so (empty: send DATA 1 directly).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub blksize: usize,
    pub timeout: Duration,
    pub windowsize: u16,
    pub oack: Vec<(String, String)>,
}

/// Accepts the options within RFC ranges, lowered to `limits`; out-of-range options are left out of the OACK,
/// which per RFC 2347 means "not accepted" (so is a `timeout` above `max_client_timeout`: RFC 2349 has the server
/// echo the value or decline it, not lower it). `tsize` is answered with `file_size`. Pure.
pub fn negotiate(req: &RequestOptions, file_size: u64, limits: &Limits) -> Negotiated {
    let mut n = Negotiated {
        blksize: DEFAULT_BLKSIZE,
        timeout: limits.timeout,
        windowsize: 1,
        oack: Vec::new(),
    };
    if let Some(b) = req.blksize.filter(|b| (8..=65464).contains(b)) {
        let b = b.min(u64::from(limits.max_blksize.max(8)));
        n.blksize = usize::try_from(b).unwrap_or(DEFAULT_BLKSIZE);
        n.oack.push(("blksize".into(), b.to_string()));
    }
    let longest = limits.max_client_timeout.as_secs().clamp(1, 255);
    if let Some(t) = req.timeout.filter(|t| (1..=longest).contains(t)) {
        n.timeout = Duration::from_secs(t);
        n.oack.push(("timeout".into(), t.to_string()));
    }
    if req.tsize.is_some() {
        n.oack.push(("tsize".into(), file_size.to_string()));
    }
    if let Some(w) = req.windowsize.filter(|w| (1..=65535).contains(w)) {
        let by_bytes = (limits.max_window_bytes / n.blksize).max(1) as u64;
        let w = w.min(u64::from(limits.max_windowsize.max(1))).min(by_bytes);
        n.windowsize = u16::try_from(w).unwrap_or(1);
        n.oack.push(("windowsize".into(), w.to_string()));
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_requests_get_rfc1350_defaults() {
        let n = negotiate(&RequestOptions::default(), 10, &Limits::default());
        assert_eq!((n.blksize, n.windowsize, n.oack.len()), (512, 1, 0));
    }

    #[test]
    fn a_timeout_beyond_the_limit_is_declined() {
        let limits = Limits::default();
        let ask = |t| RequestOptions {
            timeout: Some(t),
            ..RequestOptions::default()
        };
        let n = negotiate(&ask(255), 10, &limits);
        assert_eq!((n.timeout, n.oack.len()), (limits.timeout, 0));
        let n = negotiate(&ask(5), 10, &limits);
        assert_eq!(n.timeout, Duration::from_secs(5));
        assert_eq!(n.oack, vec![("timeout".to_string(), "5".to_string())]);
    }

    #[test]
    fn options_are_clamped_or_left_out() {
        let limits = Limits {
            max_blksize: 1468,
            max_windowsize: 8,
            ..Limits::default()
        };
        let req = RequestOptions {
            blksize: Some(9000),
            timeout: Some(0),
            tsize: Some(0),
            windowsize: Some(64),
        };
        let n = negotiate(&req, 123_456, &limits);
        assert_eq!(n.blksize, 1468);
        assert_eq!(n.windowsize, 8);
        assert_eq!(
            n.timeout, limits.timeout,
            "timeout 0 is out of range and refused"
        );
        assert_eq!(
            n.oack,
            vec![
                ("blksize".to_string(), "1468".to_string()),
                ("tsize".to_string(), "123456".to_string()),
                ("windowsize".to_string(), "8".to_string()),
            ]
        );
        // A huge block size shrinks the window so one transfer holds at most max_window_bytes.
        let big = RequestOptions {
            blksize: Some(65464),
            windowsize: Some(64),
            ..RequestOptions::default()
        };
        let n = negotiate(&big, 0, &Limits::default());
        assert_eq!((n.blksize, n.windowsize), (65464, 16));
        let tiny = RequestOptions {
            blksize: Some(7),
            ..RequestOptions::default()
        };
        assert!(negotiate(&tiny, 0, &limits).oack.is_empty());
    }
}
