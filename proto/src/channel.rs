//! The client side of the gateway connection: rustls configs (CA pin for the first contact, the stored trust bundle
//! afterwards, the node certificate as client identity), a tonic [`Channel`] over them, and the reconnect policy
//! [`RECONNECT`] (bc-backoff's one [`ExponentialBackoff`]: exponential, full jitter, capped).
//!
//! The CA pin is `sha256:<hex>` of the CA certificate's SubjectPublicKeyInfo, the same form kubeadm uses for its
//! discovery hash: a node that has never talked to the control plane trusts exactly the chain whose CA key matches.

pub use bc_backoff::{Backoff, ExponentialBackoff, InvalidBackoff, Jitter};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Uri};

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("CA pin must be sha256:<64 hex characters>")]
    BadPin,
    #[error("gateway URL {url:?} must be https://host:port")]
    BadUrl { url: String },
    #[error("building TLS configuration")]
    Tls(#[source] rustls::Error),
    #[error("connecting to the gateway at {url}")]
    Connect {
        url: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// `sha256:<hex>` of the SubjectPublicKeyInfo of a certificate.
pub fn ca_pin_of(cert_der: &[u8]) -> Option<String> {
    spki_of(cert_der).map(|spki| format!("sha256:{}", hex::encode(crate::sha256(&spki))))
}

/// SHA-256 of a certificate's SubjectPublicKeyInfo: names the key it certifies (a node's `join_key_hash`, hex).
pub fn key_hash_of(cert_der: &[u8]) -> Option<[u8; 32]> {
    spki_of(cert_der).map(|spki| crate::sha256(&spki))
}

/// (NotBefore, NotAfter) of a certificate in Unix milliseconds.
pub fn cert_validity_ms(cert_der: &[u8]) -> Option<(i64, i64)> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(cert_der).ok()?;
    let v = cert.validity();
    Some((
        v.not_before.timestamp() * 1000,
        v.not_after.timestamp() * 1000,
    ))
}

/// When to renew a certificate valid from `not_before_ms` to `not_after_ms`: at 50% ±10% of its life (`unit` is
/// uniform in [0, 1)), or now if that point has passed. Spreading renewals keeps a fleet that joined together
/// from renewing together.
pub fn renewal_delay(not_before_ms: i64, not_after_ms: i64, now_ms: i64, unit: f64) -> Duration {
    let life = (not_after_ms - not_before_ms).max(0) as f64;
    let at = not_before_ms as f64 + life * (0.4 + 0.2 * unit.clamp(0.0, 1.0));
    Duration::from_millis((at - now_ms as f64).max(0.0) as u64)
}

fn spki_of(cert_der: &[u8]) -> Option<Vec<u8>> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(cert_der).ok()?;
    Some(cert.public_key().raw.to_vec())
}

fn parse_pin(pin: &str) -> Result<[u8; 32], ChannelError> {
    let hex_part = pin
        .trim()
        .strip_prefix("sha256:")
        .ok_or(ChannelError::BadPin)?;
    let bytes = hex::decode(hex_part).map_err(|_| ChannelError::BadPin)?;
    bytes.try_into().map_err(|_| ChannelError::BadPin)
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(crate::tls_provider())
}

/// How the client decides to trust the gateway.
pub enum ServerTrust {
    /// First contact: trust the chain whose CA key matches the pin.
    Pin(String),
    /// Afterwards: the CA certificates received at join (the trust bundle).
    Bundle(Vec<CertificateDer<'static>>),
}

/// A client TLS config for the gateway (ALPN h2), optionally presenting a client certificate.
pub fn client_config(
    trust: ServerTrust,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<Arc<rustls::ClientConfig>, ChannelError> {
    let provider = provider();
    let verifier: Arc<dyn ServerCertVerifier> = match trust {
        ServerTrust::Pin(pin) => Arc::new(PinnedCaVerifier {
            pin: parse_pin(&pin)?,
            provider: provider.clone(),
        }),
        ServerTrust::Bundle(cas) => {
            let mut roots = RootCertStore::empty();
            for ca in cas {
                roots.add(ca).map_err(ChannelError::Tls)?;
            }
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| ChannelError::Tls(rustls::Error::General(e.to_string())))?
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(ChannelError::Tls)?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match identity {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(ChannelError::Tls)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// How a pinned connection to a gateway whose chain holds no CA with the pinned key fails (the start of the TLS
/// error's text, then the pin and the CA pins it presented): a caller names it to the operator, and never retries.
pub const PIN_MISMATCH: &str = "no certificate in the gateway's chain matches the CA pin";

/// Trusts a server chain only if one of the presented certificates is a CA whose SPKI hash equals the pin, and the
/// end entity verifies (name, dates, signature) against that CA.
#[derive(Debug)]
struct PinnedCaVerifier {
    pin: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| spki_of(c).is_some_and(|spki| crate::sha256(&spki) == self.pin))
            .ok_or_else(|| {
                let presented: Vec<String> =
                    intermediates.iter().filter_map(|c| ca_pin_of(c)).collect();
                rustls::Error::General(format!(
                    "{PIN_MISMATCH} sha256:{} (it presents {})",
                    hex::encode(self.pin),
                    if presented.is_empty() {
                        "no CA certificate".to_string()
                    } else {
                        presented.join(", ")
                    }
                ))
            })?;
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let inner =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
        inner.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Host and port of an `https://host:port` gateway URL.
pub fn parse_gateway_url(url: &str) -> Result<(String, u16), ChannelError> {
    let bad = || ChannelError::BadUrl {
        url: url.to_string(),
    };
    let uri: Uri = url.parse().map_err(|_| bad())?;
    if uri.scheme_str() != Some("https") {
        return Err(bad());
    }
    let host = uri
        .host()
        .ok_or_else(bad)?
        .trim_matches(|c| c == '[' || c == ']')
        .to_string();
    Ok((host, uri.port_u16().unwrap_or(443)))
}

/// Opens one HTTP/2 connection to the gateway over `tls`. The returned channel does not reconnect by itself beyond
/// what tonic does; long-lived callers wrap it in their own loop with a [`Backoff`] (e.g. of [`RECONNECT`]).
pub async fn connect(url: &str, tls: Arc<rustls::ClientConfig>) -> Result<Channel, ChannelError> {
    connect_from(url, tls, None).await
}

/// [`connect`] from the local address `local` (None: the one the kernel picks). Load tools give each simulated
/// node its own loopback address, as real nodes have their own.
pub async fn connect_from(
    url: &str,
    tls: Arc<rustls::ClientConfig>,
    local: Option<std::net::IpAddr>,
) -> Result<Channel, ChannelError> {
    connect_observed(url, tls, local, None).await
}

/// [`connect_from`], setting `resumed` after each handshake of the channel to whether it resumed a session (`bcd
/// run` probes a resumed connection that fails; load tools count them).
pub async fn connect_observed(
    url: &str,
    tls: Arc<rustls::ClientConfig>,
    local: Option<std::net::IpAddr>,
    resumed: Option<Arc<std::sync::atomic::AtomicBool>>,
) -> Result<Channel, ChannelError> {
    let (host, port) = parse_gateway_url(url)?;
    let server_name = ServerName::try_from(host.clone()).map_err(|_| ChannelError::BadUrl {
        url: url.to_string(),
    })?;
    let connector = tower::service_fn(move |_: Uri| {
        let tls = tls.clone();
        let host = host.clone();
        let server_name = server_name.clone();
        let resumed = resumed.clone();
        async move {
            let tcp = match local {
                None => tokio::net::TcpStream::connect((host.as_str(), port)).await?,
                Some(ip) => {
                    let to = tokio::net::lookup_host((host.as_str(), port))
                        .await?
                        .find(|a| a.is_ipv4() == ip.is_ipv4())
                        .ok_or_else(|| {
                            std::io::Error::new(
                                std::io::ErrorKind::AddrNotAvailable,
                                format!("{host} has no address of the family of {ip}"),
                            )
                        })?;
                    tcp_from(ip, to).await?
                }
            };
            tcp.set_nodelay(true)?;
            let stream = tokio_rustls::TlsConnector::from(tls)
                .connect(server_name, tcp)
                .await?;
            if let Some(resumed) = &resumed {
                let kind = stream.get_ref().1.handshake_kind();
                resumed.store(
                    kind == Some(rustls::HandshakeKind::Resumed),
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    // The scheme here only tells tonic to speak HTTP/2 over what the connector returns; TLS is ours.
    Endpoint::from_shared(format!("http://gateway:{port}"))
        .map_err(|source| ChannelError::Connect {
            url: url.to_string(),
            source,
        })?
        .connect_timeout(Duration::from_secs(10))
        // Tunnels share this connection, one HTTP/2 stream each: windows for bandwidth × delay per stream, and a
        // connection window that holds every tunnel's at once so a stalled one never starves the Session.
        .initial_stream_window_size(crate::tunnel::STREAM_WINDOW)
        .initial_connection_window_size(crate::tunnel::CONNECTION_WINDOW)
        .max_frame_size(crate::tunnel::H2_MAX_FRAME)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20))
        .connect_with_connector(connector)
        .await
        .map_err(|source| ChannelError::Connect {
            url: url.to_string(),
            source,
        })
}

/// How long a call to the gateway may wait for its answer (a unary call's, or a stream's opening).
pub const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// `call` (a unary call, or the opening of a stream) given up after `deadline` with DEADLINE_EXCEEDED naming
/// `what`. HTTP/2 keep-alive ends a connection whose peer is gone, not one whose gateway answers pings while the
/// handler of this call is stuck (on its database, say): without this the caller waits for ever. tonic's
/// `Request::set_timeout` only tells the server.
pub async fn answered_within<T>(
    what: &str,
    deadline: Duration,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    tokio::time::timeout(deadline, call)
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "{what}: the gateway did not answer within {} s; retry",
                deadline.as_secs()
            )))
        })
}

/// A TCP connection to `to` from the local address `local` (its port the kernel's pick).
pub async fn tcp_from(
    local: std::net::IpAddr,
    to: std::net::SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = if local.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.bind(std::net::SocketAddr::new(local, 0))?;
    socket.connect(to).await
}

/// How a daemon reconnects to the gateway (bcd's session, the site agent, `bcd join`'s retries use their own
/// policies of the same kind): 0.5 s doubling to 30 s, full jitter, so a fleet that lost the gateway together does
/// not come back together.
pub const RECONNECT: ExponentialBackoff = ExponentialBackoff::new(
    Duration::from_millis(500),
    Duration::from_secs(30),
    Jitter::Fraction(1.0),
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnects_back_off_with_full_jitter_to_half_a_minute() {
        let mut b = RECONNECT.start();
        assert_eq!(b.next_delay(0.999_999).as_millis(), 499);
        assert_eq!(b.next_delay(0.5).as_millis(), 500);
        for _ in 0..40 {
            assert!(b.next_delay(0.999_999) <= Duration::from_secs(30));
        }
        assert_eq!(b.next_delay(0.0), Duration::ZERO);
    }

    #[test]
    fn renewal_is_at_half_life_plus_minus_ten_percent() {
        let day = 86_400_000;
        assert_eq!(
            renewal_delay(0, day, 0, 0.5),
            Duration::from_millis(day as u64 / 2)
        );
        assert_eq!(
            renewal_delay(0, day, 0, 0.0),
            Duration::from_millis(day as u64 * 4 / 10)
        );
        assert!(renewal_delay(0, day, 0, 0.999_999) <= Duration::from_millis(day as u64 * 6 / 10));
        assert_eq!(
            renewal_delay(0, day, day, 0.5),
            Duration::ZERO,
            "overdue renews now"
        );
    }

    #[test]
    fn urls_and_pins() {
        assert_eq!(
            parse_gateway_url("https://127.0.0.1:7443").ok(),
            Some(("127.0.0.1".into(), 7443))
        );
        assert!(parse_gateway_url("http://127.0.0.1:7443").is_err());
        assert!(parse_pin("sha256:00").is_err());
        assert!(parse_pin(&format!("sha256:{}", "ab".repeat(32))).is_ok());
    }
}
