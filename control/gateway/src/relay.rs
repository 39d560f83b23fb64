//! The tunnel relay between control-plane processes (DESIGN.md, "Tunnels"): an API process opens a node's tunnel
//! through the gateway process that holds the node's session, over internal mTLS.
//!
//! - Server side ([`RelaySvc`], `TunnelRelay.Relay` on the gateway's listener): the caller must present a
//!   control-plane identity of the gateway's trust domain (`spiffe://<domain>/control/<id>`); nodes, sites and
//!   other gateways are refused. The request's metadata names the node (`bc-node-id`) and the port (`bc-port`); the
//!   gateway opens the tunnel as for its own API ([`Tunnels::open`]) and answers once the node opened its stream, or
//!   with a status whose `bc-refusal` metadata names the [`OpenError`]. Then frames pass through unchanged both
//!   ways, one HTTP/2 stream per tunnel with the gateway's explicit windows; each direction holds at most
//!   [`QUEUE`] frames here beyond HTTP/2's window.
//! - Client side ([`Peers`]): one HTTP/2 connection per gateway (cached; dropped when it fails), the caller's
//!   control-plane certificate, the gateways' server certificates verified against the CA. [`Peers::open`] returns
//!   the same [`Tunnel`] as a local open, so the API's relay does not know which it has.

use crate::tunnel::{Counters, OpenError, Tunnel, TunnelStats, Tunnels};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::v1;
use bc_proto::v1::tunnel_frame::Frame;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;
use tonic::codegen::BoxStream;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// Frames queued per direction per relayed tunnel (each at most 64 KiB).
pub const QUEUE: usize = 8;
/// Once one direction of a relayed tunnel ended, how long the other may take to end too.
pub const LINGER: Duration = Duration::from_secs(10);

const NODE: &str = "bc-node-id";
const PORT: &str = "bc-port";
const REFUSAL: &str = "bc-refusal";
const CAP: &str = "bc-cap";
const TUNNEL: &str = "bc-tunnel";
const WAITED_MS: &str = "bc-waited-ms";

/// `TunnelRelay` as the gateway serves it.
pub(crate) struct RelaySvc {
    pub tunnels: Tunnels,
    pub trust_domain: String,
}

/// The caller's control-plane identity, or why it is refused.
fn control_identity(
    certs: Option<&[rustls::pki_types::CertificateDer<'static>]>,
    trust_domain: &str,
) -> Result<SpiffeId, Status> {
    let leaf = certs.and_then(|c| c.first()).ok_or_else(|| {
        Status::unauthenticated("the tunnel relay needs a control-plane client certificate")
    })?;
    let id = SpiffeId::from_cert_der(leaf)
        .map_err(|e| Status::unauthenticated(format!("client certificate: {e}")))?;
    if id.trust_domain() != trust_domain || id.role() != Role::Control {
        return Err(Status::permission_denied(format!(
            "{id} may not use the tunnel relay: it takes control-plane identities of {trust_domain} only"
        )));
    }
    Ok(id)
}

fn metadata<'a>(request: &'a Request<Streaming<v1::TunnelFrame>>, key: &str) -> Option<&'a str> {
    request.metadata().get(key).and_then(|v| v.to_str().ok())
}

/// The status a refused open travels as, with its kind in metadata.
fn refusal(e: &OpenError) -> Status {
    let (mut status, kind) = match e {
        OpenError::NotConnected(_) => (Status::unavailable(e.to_string()), "NOT_CONNECTED"),
        OpenError::SessionBusy(_) => (Status::resource_exhausted(e.to_string()), "SESSION_BUSY"),
        OpenError::NodeFull { .. } => (Status::resource_exhausted(e.to_string()), "NODE_FULL"),
        OpenError::DialTimeout { .. } => (Status::deadline_exceeded(e.to_string()), "DIAL_TIMEOUT"),
        OpenError::Closed => (Status::unavailable(e.to_string()), "ABORTED"),
    };
    let m = status.metadata_mut();
    m.insert(REFUSAL, MetadataValue::from_static(kind));
    let mut put = |k: &'static str, v: String| {
        if let Ok(v) = MetadataValue::try_from(v) {
            m.insert(k, v);
        }
    };
    match e {
        OpenError::NodeFull { cap, .. } => put(CAP, cap.to_string()),
        OpenError::DialTimeout { tunnel, ms, .. } => {
            put(TUNNEL, tunnel.clone());
            put(WAITED_MS, ms.to_string());
        }
        _ => {}
    }
    status
}

/// The [`OpenError`] a refusal status carries, if it is one.
fn open_error(node: &str, status: &Status) -> Option<OpenError> {
    let m = status.metadata();
    let get = |k: &str| m.get(k).and_then(|v| v.to_str().ok());
    let node = node.to_string();
    Some(match get(REFUSAL)? {
        "NOT_CONNECTED" => OpenError::NotConnected(node),
        "SESSION_BUSY" => OpenError::SessionBusy(node),
        "NODE_FULL" => OpenError::NodeFull {
            node,
            cap: get(CAP).and_then(|c| c.parse().ok()).unwrap_or(0),
        },
        "DIAL_TIMEOUT" => OpenError::DialTimeout {
            node,
            tunnel: get(TUNNEL).unwrap_or_default().to_string(),
            ms: get(WAITED_MS).and_then(|c| c.parse().ok()).unwrap_or(0),
        },
        "ABORTED" => OpenError::Closed,
        _ => return None,
    })
}

#[tonic::async_trait]
impl v1::tunnel_relay_server::TunnelRelay for RelaySvc {
    async fn relay(
        &self,
        request: Request<Streaming<v1::TunnelFrame>>,
    ) -> Result<Response<BoxStream<v1::TunnelFrame>>, Status> {
        let certs = request.peer_certs();
        let caller = control_identity(certs.as_deref().map(|v| v.as_slice()), &self.trust_domain)?;
        let node = metadata(&request, NODE)
            .filter(|n| SpiffeId::new(&self.trust_domain, Role::Node, n).is_ok())
            .ok_or_else(|| Status::invalid_argument(format!("{NODE}: a node id is required")))?
            .to_string();
        let port: u16 = metadata(&request, PORT)
            .and_then(|p| p.parse().ok())
            .filter(|&p| p != 0)
            .ok_or_else(|| Status::invalid_argument(format!("{PORT}: a TCP port (1 to 65535)")))?;
        let tunnel = match self.tunnels.open(&node, port).await {
            Ok(t) => t,
            Err(e) => {
                tracing::info!(caller = %caller, node_id = node, port, error = %e, "relayed tunnel refused");
                return Err(refusal(&e));
            }
        };
        tracing::debug!(caller = %caller, node_id = node, port, tunnel = tunnel.id, "relayed tunnel open");
        let (out, rx) = mpsc::channel(QUEUE);
        tokio::spawn(pump(tunnel, request.into_inner(), out));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Passes frames between the API process's stream and the node's until one of them ends, then gives the other
/// [`LINGER`] to end too. The API's end ending drops the node's sending half, so the node sees its stream end
/// after what was queued.
async fn pump(
    tunnel: Tunnel,
    mut inbound: Streaming<v1::TunnelFrame>,
    out: mpsc::Sender<Result<v1::TunnelFrame, Status>>,
) {
    let Tunnel { tx, mut rx, .. } = tunnel;
    let up = async move {
        while let Ok(Some(f)) = inbound.message().await {
            if matches!(f.frame, None | Some(Frame::Open(_))) {
                let why = "the API process sent a frame other than data, half_close or close";
                let _ = tx
                    .send(bc_proto::tunnel::close(v1::TunnelCloseCode::Protocol, why))
                    .await;
                break;
            }
            if tx.send(f).await.is_err() {
                break;
            }
        }
    };
    let down = async move {
        while let Some(f) = rx.recv().await {
            let failed = f.is_err();
            if out.send(f).await.is_err() || failed {
                break;
            }
        }
        rx
    };
    tokio::pin!(up, down);
    tokio::select! {
        _ = &mut up => {
            let _ = tokio::time::timeout(LINGER, down).await;
        }
        rx = &mut down => {
            let _ = tokio::time::timeout(LINGER, up).await;
            drop(rx);
        }
    }
}

/// Why a relayed open failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The gateway refused it as it would its own API's open.
    #[error(transparent)]
    Refused(OpenError),
    #[error("gateway {url} is unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("gateway {url} answered {code:?}: {message}")]
    Status {
        url: String,
        code: tonic::Code,
        message: String,
    },
}

/// The client side of the relay: an API process's connections to the gateways. Cloning shares them.
#[derive(Clone)]
pub struct Peers {
    tls: Arc<rustls::ClientConfig>,
    channels: Arc<tokio::sync::Mutex<HashMap<String, Channel>>>,
    counters: Arc<Counters>,
}

impl Peers {
    /// Peers reached with `tls`: the caller's control-plane certificate, gateways verified against the CA
    /// (`bc_proto::channel::client_config` with the CA bundle).
    pub fn new(tls: Arc<rustls::ClientConfig>) -> Peers {
        Peers {
            tls,
            channels: Arc::default(),
            counters: Arc::default(),
        }
    }

    /// Counters of the tunnels relayed through other gateways (`opened`, `open_now`, bytes each way).
    pub fn stats(&self) -> TunnelStats {
        crate::tunnel::snapshot(&self.counters)
    }

    /// The cached connection to `url`, or a new one. The cache's lock is not held while connecting (up to 10 s to
    /// a gateway that accepts and says nothing): before, one such gateway held up relays to every other gateway.
    /// Two callers that connect at once keep the first connection cached.
    async fn channel(&self, url: &str) -> Result<Channel, RelayError> {
        if let Some(c) = self.channels.lock().await.get(url) {
            return Ok(c.clone());
        }
        let c = bc_proto::channel::connect(url, self.tls.clone())
            .await
            .map_err(|e| RelayError::Unreachable {
                url: url.to_string(),
                reason: bc_error_chain::chain(&e),
            })?;
        Ok(self
            .channels
            .lock()
            .await
            .entry(url.to_string())
            .or_insert(c)
            .clone())
    }

    /// Opens a tunnel to `port` on `node_id` through the gateway at `relay_url`.
    pub async fn open(
        &self,
        relay_url: &str,
        node_id: &str,
        port: u16,
    ) -> Result<Tunnel, RelayError> {
        let channel = self.channel(relay_url).await?;
        let (to_node, queued) = mpsc::channel::<Result<v1::TunnelFrame, Status>>(QUEUE);
        let frames = tokio_stream::wrappers::ReceiverStream::new(queued).filter_map(Result::ok);
        let mut request = Request::new(frames);
        let m = request.metadata_mut();
        let bad = |what: &str| RelayError::Status {
            url: relay_url.to_string(),
            code: tonic::Code::InvalidArgument,
            message: format!("{what} is not a metadata value"),
        };
        m.insert(
            NODE,
            MetadataValue::try_from(node_id).map_err(|_| bad("the node id"))?,
        );
        m.insert(PORT, MetadataValue::from(u32::from(port)));
        let mut client = v1::tunnel_relay_client::TunnelRelayClient::new(channel)
            .max_decoding_message_size(bc_proto::tunnel::MAX_ENCODED);
        match client.relay(request).await {
            Ok(response) => Ok(Tunnel::relayed(
                format!("relay:{relay_url}"),
                node_id.to_string(),
                port,
                to_node,
                response.into_inner(),
                self.counters.clone(),
            )),
            Err(status) => {
                if let Some(e) = open_error(node_id, &status) {
                    return Err(RelayError::Refused(e));
                }
                if status.code() == tonic::Code::Unavailable
                    || status.code() == tonic::Code::Unknown
                {
                    // A transport failure: connect afresh next time.
                    self.channels.lock().await.remove(relay_url);
                    return Err(RelayError::Unreachable {
                        url: relay_url.to_string(),
                        reason: status.message().to_string(),
                    });
                }
                Err(RelayError::Status {
                    url: relay_url.to_string(),
                    code: status.code(),
                    message: status.message().to_string(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway that accepts and never answers the TLS handshake does not hold up a relay to another gateway
    /// while the first connect waits out its 10 s. Before, the cache's lock was held across the connect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_gateway_does_not_hold_up_the_others() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let silent_url = format!("https://{}", silent.local_addr().expect("addr"));
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let closed_url = format!("https://{}", closed.local_addr().expect("addr"));
        drop(closed);
        let tls = bc_proto::channel::client_config(
            bc_proto::channel::ServerTrust::Pin(format!("sha256:{}", "00".repeat(32))),
            None,
        )
        .expect("tls");
        let peers = Peers::new(tls);
        let stuck = tokio::spawn({
            let peers = peers.clone();
            async move { peers.channel(&silent_url).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let began = std::time::Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(5), peers.channel(&closed_url))
            .await
            .expect("answered while the other connect waits")
            .expect_err("nothing listens there");
        assert!(matches!(e, RelayError::Unreachable { .. }), "{e}");
        assert!(
            began.elapsed() < Duration::from_secs(2),
            "{:?}",
            began.elapsed()
        );
        assert!(
            !stuck.is_finished(),
            "the silent gateway's connect still waits"
        );
        stuck.abort();
        drop(silent);
    }

    #[test]
    fn every_refusal_travels_and_comes_back_as_itself() {
        for e in [
            OpenError::NotConnected("n1".into()),
            OpenError::SessionBusy("n1".into()),
            OpenError::NodeFull {
                node: "n1".into(),
                cap: 128,
            },
            OpenError::DialTimeout {
                node: "n1".into(),
                tunnel: "ab-3".into(),
                ms: 10_000,
            },
            OpenError::Closed,
        ] {
            let status = refusal(&e);
            assert_eq!(open_error("n1", &status), Some(e.clone()), "{status:?}");
            assert_eq!(status.message(), e.to_string());
        }
        assert_eq!(
            open_error("n1", &Status::unavailable("connection refused")),
            None
        );
    }

    #[test]
    fn only_control_plane_identities_of_the_trust_domain_may_relay()
    -> Result<(), Box<dyn std::error::Error>> {
        let cert = |uri: &str| -> Result<rustls::pki_types::CertificateDer<'static>, rcgen::Error> {
            let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
            let mut p = rcgen::CertificateParams::default();
            p.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into()?)];
            Ok(p.self_signed(&key)?.der().clone())
        };
        let ok = [cert("spiffe://test.bc/control/api-1")?];
        assert_eq!(control_identity(Some(&ok), "test.bc")?.id(), "api-1");
        for uri in [
            "spiffe://test.bc/node/n1",
            "spiffe://test.bc/site/s1",
            "spiffe://test.bc/gateway/gw-1",
            "spiffe://other.bc/control/api-1",
        ] {
            let refused = control_identity(Some(&[cert(uri)?]), "test.bc").err();
            assert_eq!(
                refused.as_ref().map(|s| s.code()),
                Some(tonic::Code::PermissionDenied),
                "{uri}: {refused:?}"
            );
        }
        let none = control_identity(None, "test.bc").err().map(|s| s.code());
        assert_eq!(none, Some(tonic::Code::Unauthenticated));
        Ok(())
    }
}
