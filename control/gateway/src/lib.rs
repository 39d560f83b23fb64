//! bc-gateway: the daemon-facing gRPC server.
//!
//! It terminates TLS ([`tls`]: server certificate from the control-plane CA, optional client certificates verified
//! against the same CA) and serves the `bettercompute.v1` services over HTTP/2. It holds no CA and no signing key:
//! Join, the site services ([`site`]: boot lease, netboot table, SecretRequest) are handed to services it receives as traits ([`JoinHandler`]). It must
//! not import bc-store or bc-control. Start with [`serve`]; what a peer may hold before it authenticates, and for
//! how long, is [`conns`] (the policy) and `accept` (the accept loop applying it). Tunnels are [`tunnel`] (to the
//! nodes this gateway holds) and [`relay`] (between control-plane processes: the API's side and the gateway's).

mod accept;
pub mod conns;
pub mod relay;
pub mod session;
pub mod site;
pub mod tls;
pub mod tunnel;

use bc_proto::v1;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_stream::wrappers::ReceiverStream;

/// A boxed future, so handlers can be trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long one call into the store may take. The pool's connections have no deadline of their own, and a primary
/// that vanishes without a reset (power lost, packets dropped) leaves a query waiting for ever: a session's task,
/// the one housekeeping task of every session here, or a site agent's call must not wait with it.
pub const STORE_DEADLINE: Duration = Duration::from_secs(30);

/// `call` into the store within [`STORE_DEADLINE`]; past it UNAVAILABLE naming `what` (a message that must land
/// then ends its session, and the node sends it again in the next; a site agent retries its call).
pub(crate) async fn stored<T>(
    what: &str,
    call: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    tokio::time::timeout(STORE_DEADLINE, call)
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::unavailable(format!(
                "{what}: the database did not answer within {} s",
                STORE_DEADLINE.as_secs()
            )))
        })
}

/// JoinService as the gateway sees it: a request in, a response or a status with a clear message out.
pub trait JoinHandler: Send + Sync + 'static {
    fn join(
        &self,
        request: v1::JoinRequest,
        peer: Option<SocketAddr>,
    ) -> BoxFuture<'_, Result<v1::JoinResponse, tonic::Status>>;
}

/// What the gateway serves.
#[derive(Clone)]
pub struct Services {
    pub join: Arc<dyn JoinHandler>,
    /// Sessions (with the registry that holds them), when the control plane provides a backend.
    pub session: Option<(
        Arc<dyn session::SessionBackend>,
        session::SessionConfig,
        session::Registry,
    )>,
    /// Site agents' boot lease, netboot table and secrets (with the trust domain their identities must carry).
    pub site: Option<(Arc<dyn site::SiteHandler>, String)>,
    /// Tunnels to nodes' ports (`TunnelService`, node identities of the sessions' trust domain, and the relay for
    /// other control-plane processes, `TunnelRelay`, control-plane identities only), when sessions are served too;
    /// its HTTP/2 windows apply to every connection.
    pub tunnels: Option<tunnel::Tunnels>,
}

/// Limits on what a peer may make the gateway do.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections: how many, how many unauthenticated, per source, and the deadlines of each stage.
    pub connections: conns::ConnLimits,
    /// Largest gRPC message accepted (Join requests are a few KiB).
    pub max_message_bytes: usize,
    /// How long a shutdown waits for in-flight calls after closing sessions.
    pub shutdown_grace: Duration,
    /// The TCP balancers in front of the gateway that send a PROXY protocol v2 header
    /// ([`bc_proto::proxy_protocol`]): their connections must begin with one, and are accounted (per-source
    /// limits, logs, the address a Join records) as the client it names. Empty: no header is read from anyone.
    pub proxy_protocol_from: bc_proto::proxy_protocol::Trusted,
}

impl Limits {
    /// Limits for a process that may open `descriptors` files.
    pub fn for_descriptors(descriptors: u64) -> Limits {
        Limits {
            connections: conns::ConnLimits::for_descriptors(descriptors),
            max_message_bytes: 64 * 1024,
            shutdown_grace: Duration::from_secs(5),
            proxy_protocol_from: Default::default(),
        }
    }
}

impl Default for Limits {
    /// Limits for the descriptor limit (RLIMIT_NOFILE) in force.
    fn default() -> Limits {
        Limits::for_descriptors(bc_proto::runtime::nofile_limit())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("gateway server failed")]
    Serve(#[source] tonic::transport::Error),
    #[error(
        "the gateway's accept loop ended ({0}): it would accept no connection; restart the process"
    )]
    AcceptLoop(String),
}

struct JoinSvc(Arc<dyn JoinHandler>);

#[tonic::async_trait]
impl v1::join_service_server::JoinService for JoinSvc {
    async fn join(
        &self,
        request: tonic::Request<v1::JoinRequest>,
    ) -> Result<tonic::Response<v1::JoinResponse>, tonic::Status> {
        let peer = request.remote_addr();
        let response = self.0.join(request.into_inner(), peer).await?;
        Ok(tonic::Response::new(response))
    }
}

/// Sessions are long-lived streams: a graceful shutdown first stops accepting (`accepting`: the accept loop) and
/// closes them (daemons reconnect elsewhere or later), then gives in-flight calls a bounded grace period (whose
/// start the receiver says).
///
/// A draining gateway takes no new connection. It did until stop 46: a daemon whose session was closed reconnected
/// to it within milliseconds and opened a session there, so the wait for the sessions to leave ran its whole 5 s and
/// the grace period its 5 s more, and the control plane's stop ran out of its 10 s (`bc_kernel::STOP_GRACE`).
fn graceful<T: Send + 'static>(
    shutdown: impl Future<Output = ()> + Send + 'static,
    registry: Option<session::Registry>,
    accepting: tokio::task::AbortHandle,
    incoming_open: tokio::sync::mpsc::Sender<T>,
) -> (
    impl Future<Output = ()> + Send + 'static,
    tokio::sync::watch::Receiver<bool>,
) {
    let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        // The accept loop ends here, and with it its end of the connection stream; tonic takes the end of that
        // stream for the end of serving and returns once its connections close, without waiting for this future.
        // The sessions' closes were still being written (a gateway of `better-compute serve` holding 1,500
        // sessions exited 0.55 s after SIGTERM with 315 of them recorded offline). This sender keeps the stream
        // open until the drain is over.
        let _incoming_open = incoming_open;
        accepting.abort();
        if let Some(r) = registry {
            // Let the sessions record that they went offline (bounded: the grace period below still applies).
            // Closed again each round: a handshake under way when the listener closed may still open one.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                r.close_all("gateway shutting down");
                if r.is_empty() || tokio::time::Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let _ = stopping_tx.send(true);
    };
    (shutdown, stopping_rx)
}

/// Aborts the gateway's own tasks (the accept loop, which holds the listener, the sweeper, the housekeeping) when
/// [`serve`] ends or is dropped. Dropped: the control plane's stop aborts a gateway still draining after its
/// grace period, and a `JoinHandle` dropped does not abort its task; the accept loop went on holding the port, and
/// a gateway started again on it failed with "Address already in use" (seen in CI, stop 46).
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// The gateway's accept side, running: its TLS connections as tonic takes them, and what its stop needs.
struct Accepting {
    incoming: ReceiverStream<std::io::Result<accept::TlsConn>>,
    /// Holds `incoming` open while the stop drains the sessions ([`graceful`]).
    incoming_open: tokio::sync::mpsc::Sender<std::io::Result<accept::TlsConn>>,
    gate: accept::Gate,
    accept_loop: tokio::task::JoinHandle<()>,
    /// The accept loop and the sweeper of stalled connections, aborted when `serve` ends or is dropped.
    own_tasks: AbortOnDrop,
}

/// Starts the accept loop (the connection policy, PROXY headers, TLS handshakes) and its sweeper on `listener`.
fn start_accepting(listener: TcpListener, tls: tls::ServerTls, limits: &Limits) -> Accepting {
    let c = &limits.connections;
    tracing::info!(
        max_connections = c.max_connections,
        max_unauthenticated = c.max_unauthenticated,
        max_stalled_per_source = c.max_stalled_per_source,
        proxy_protocol_from = %limits.proxy_protocol_from,
        "gateway connection limits"
    );
    let gate = accept::Gate::new(c.clone());
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    let incoming_open = tx.clone();
    let accept_loop = tokio::spawn(accept::accept(
        listener,
        gate.clone(),
        accept::AcceptConfig {
            acceptor: tokio_rustls::TlsAcceptor::from(tls.config.clone()),
            tls,
            tx,
            handshake_ceiling: c.handshake.base,
            proxies: Arc::new(limits.proxy_protocol_from.clone()),
        },
    ));
    let sweeper = tokio::spawn(accept::sweep(gate.clone()));
    let own_tasks = AbortOnDrop(vec![accept_loop.abort_handle(), sweeper.abort_handle()]);
    Accepting {
        incoming: ReceiverStream::new(rx),
        incoming_open,
        gate,
        accept_loop,
        own_tasks,
    }
}

/// Resolves only if the accept loop ends by itself, which it does only by panicking (it loops until it is aborted).
/// The connection stream is held open for the drain ([`graceful`]) and no longer ends with the loop, so without this
/// a gateway whose accept loop died would go on serving the connections it has and accept none; with it, `serve`
/// fails and the control plane's process stops (a role that ends on its own ends the process, and its service
/// manager starts it again).
async fn ended_by_itself(accept_loop: tokio::task::JoinHandle<()>) -> String {
    match accept_loop.await {
        Err(e) if e.is_cancelled() => std::future::pending().await,
        Err(e) => e.to_string(),
        Ok(()) => "it returned".to_string(),
    }
}

/// Serves the gateway on an already-bound listener until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    tls: tls::ServerTls,
    services: Services,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    // Revoked identities are refused from the first handshake on (Hello refuses them too, should this read fail).
    let mut revocation_watermark = None;
    if let Some((backend, _, registry)) = &services.session {
        revocation_watermark = session::refresh_revocations(backend.as_ref(), registry, None).await;
    }
    let Accepting {
        incoming,
        incoming_open,
        gate,
        accept_loop,
        mut own_tasks,
    } = start_accepting(listener, tls, &limits);
    let join = v1::join_service_server::JoinServiceServer::new(JoinSvc(services.join))
        .max_decoding_message_size(limits.max_message_bytes);
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = &services.tunnels {
        let w = t.limits().windows;
        builder = builder
            .initial_stream_window_size(Some(w.stream))
            .initial_connection_window_size(Some(w.connection))
            .max_frame_size(Some(bc_proto::tunnel::H2_MAX_FRAME));
    }
    let mut router = builder
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .layer(accept::CountRequests { gate })
        .add_service(join);
    let mut registry_for_shutdown = None;
    if let Some((backend, config, registry)) = services.session {
        registry_for_shutdown = Some(registry.clone());
        let housekeeping = tokio::spawn(session::housekeeping(
            backend.clone(),
            registry.clone(),
            config.clone(),
            revocation_watermark,
        ));
        own_tasks.0.push(housekeeping.abort_handle());
        if let Some(tunnels) = services.tunnels {
            let relay = relay::RelaySvc {
                tunnels: tunnels.clone(),
                trust_domain: config.trust_domain.clone(),
            };
            let svc = tunnel::TunnelSvc {
                tunnels,
                trust_domain: config.trust_domain.clone(),
            };
            router = router
                .add_service(
                    v1::tunnel_service_server::TunnelServiceServer::new(svc)
                        .max_decoding_message_size(bc_proto::tunnel::MAX_ENCODED),
                )
                .add_service(
                    v1::tunnel_relay_server::TunnelRelayServer::new(relay)
                        .max_decoding_message_size(bc_proto::tunnel::MAX_ENCODED),
                );
        }
        let svc = session::SessionSvc {
            backend,
            registry,
            config,
        };
        router = router.add_service(
            v1::session_service_server::SessionServiceServer::new(svc)
                .max_decoding_message_size(limits.max_message_bytes),
        );
    }
    if let Some((handler, trust_domain)) = services.site {
        let handler: Arc<dyn site::SiteHandler> = Arc::new(site::Bounded(handler));
        let svc = || site::SiteSvc {
            handler: handler.clone(),
            trust_domain: trust_domain.clone(),
        };
        router = router
            .add_service(
                v1::site_service_server::SiteServiceServer::new(svc())
                    .max_decoding_message_size(limits.max_message_bytes),
            )
            .add_service(
                v1::secret_service_server::SecretServiceServer::new(svc())
                    .max_decoding_message_size(limits.max_message_bytes),
            );
    }
    let (shutdown, mut stopping_rx) = graceful(
        shutdown,
        registry_for_shutdown,
        accept_loop.abort_handle(),
        incoming_open,
    );
    let serve = router.serve_with_incoming_shutdown(incoming, shutdown);
    let result = tokio::select! {
        r = serve => r.map_err(GatewayError::Serve),
        why = ended_by_itself(accept_loop) => Err(GatewayError::AcceptLoop(why)),
        _ = async {
            let _ = stopping_rx.wait_for(|s| *s).await;
            tokio::time::sleep(limits.shutdown_grace).await;
        } => {
            tracing::warn!("gateway shutdown grace period over; dropping remaining connections");
            Ok(())
        }
    };
    drop(own_tasks);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An accept loop that panics fails the gateway; one aborted by the stop does not.
    #[tokio::test]
    async fn only_an_accept_loop_that_ends_by_itself_fails_the_gateway() {
        let panicked = tokio::spawn(async { panic!("accept loop bug") });
        let why = ended_by_itself(panicked).await;
        assert!(why.contains("panicked"), "{why}");
        let aborted = tokio::spawn(std::future::pending::<()>());
        aborted.abort();
        let waited =
            tokio::time::timeout(Duration::from_millis(200), ended_by_itself(aborted)).await;
        assert!(
            waited.is_err(),
            "an aborted accept loop failed the gateway: {waited:?}"
        );
    }
}
