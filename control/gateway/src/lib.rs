//! bc-gateway: the daemon-facing gRPC server.
//!
//! It terminates TLS ([`tls`]: server certificate from the control-plane CA, optional client certificates verified
//! against the same CA) and serves the `bettercompute.v1` services over HTTP/2. It holds no CA and no signing key:
//! Join, the site services ([`site`]: boot lease, netboot table, SecretRequest) are handed to services it receives as traits ([`JoinHandler`]). It must
//! not import bc-store or bc-control. Start with [`serve`].

pub mod session;
pub mod site;
pub mod tls;

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
}

/// Limits on what a peer may make the gateway do.
#[derive(Debug, Clone)]
pub struct Limits {
    /// TLS handshakes in progress at once; further connections wait in the kernel's accept queue.
    pub concurrent_handshakes: usize,
    pub handshake_timeout: Duration,
    /// Largest gRPC message accepted (Join requests are a few KiB).
    pub max_message_bytes: usize,
    /// How long a shutdown waits for in-flight calls after closing sessions.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            concurrent_handshakes: 512,
            handshake_timeout: Duration::from_secs(10),
            max_message_bytes: 64 * 1024,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("gateway server failed")]
    Serve(#[source] tonic::transport::Error),
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

/// Serves the gateway on an already-bound listener until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    services: Services,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    // Revoked identities are refused from the first handshake on (Hello refuses them too, should this read fail).
    let mut revocation_watermark = None;
    if let Some((backend, _, registry)) = &services.session {
        revocation_watermark = session::refresh_revocations(backend.as_ref(), registry, None).await;
    }
    let (tx, rx) = tokio::sync::mpsc::channel(limits.concurrent_handshakes);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(limits.concurrent_handshakes));
    let accept_loop = tokio::spawn(async move {
        loop {
            let Ok(permit) = handshakes.clone().acquire_owned().await else {
                return;
            };
            let (tcp, addr) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off briefly rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let timeout = limits.handshake_timeout;
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok::<_, std::io::Error>(stream)).await;
                    }
                    Ok(Err(e)) => tracing::info!(%addr, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::info!(%addr, "TLS handshake timed out"),
                }
            });
        }
    });
    let join = v1::join_service_server::JoinServiceServer::new(JoinSvc(services.join))
        .max_decoding_message_size(limits.max_message_bytes);
    let mut router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(join);
    let mut housekeeping = None;
    let mut registry_for_shutdown = None;
    if let Some((backend, config, registry)) = services.session {
        registry_for_shutdown = Some(registry.clone());
        housekeeping = Some(tokio::spawn(session::housekeeping(
            backend.clone(),
            registry.clone(),
            config.clone(),
            revocation_watermark,
        )));
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
    // Sessions are long-lived streams: a graceful shutdown first closes them (daemons reconnect elsewhere or
    // later), then gives in-flight calls a bounded grace period.
    let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        if let Some(r) = registry_for_shutdown {
            r.close_all("gateway shutting down");
            // Let the sessions record that they went offline (bounded: the grace period below still applies).
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while !r.is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let _ = stopping_tx.send(true);
    };
    let serve = router.serve_with_incoming_shutdown(ReceiverStream::new(rx), shutdown);
    let result = tokio::select! {
        r = serve => r.map_err(GatewayError::Serve),
        _ = async {
            let _ = stopping_rx.wait_for(|s| *s).await;
            tokio::time::sleep(limits.shutdown_grace).await;
        } => {
            tracing::warn!("gateway shutdown grace period over; dropping remaining connections");
            Ok(())
        }
    };
    accept_loop.abort();
    if let Some(h) = housekeeping {
        h.abort();
    }
    result
}
