//! A gateway that shuts down stops accepting at once, returns only once its sessions recorded their close, and one
//! dropped (aborted) lets its port go.
//!
//! Both were seen in CI on stop 46 (`bcd/tests/session.rs::gateway_restart_daemons_reconnect_by_themselves`): the
//! draining gateway went on accepting, a daemon reconnected to it and opened a session there, so the drain ran out
//! its bounds and the control plane's stop aborted the gateway. The accept loop, a task of its own, survived the
//! abort holding the listener, and the gateway started again on the same address failed: "Address already in use".

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bc_gateway::session::SessionRef;
use bc_gateway::{BoxFuture, JoinHandler, Limits, Services};
use bc_proto::v1;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A Join that says it started, then never ends: a call in flight through the whole drain.
struct Stuck(tokio::sync::mpsc::UnboundedSender<()>);

impl JoinHandler for Stuck {
    fn join(
        &self,
        _request: v1::JoinRequest,
        _peer: Option<SocketAddr>,
    ) -> BoxFuture<'_, Result<v1::JoinResponse, tonic::Status>> {
        let started = self.0.clone();
        Box::pin(async move {
            let _ = started.send(());
            std::future::pending().await
        })
    }
}

/// A CA and a server certificate for 127.0.0.1 it issued; the server takes client certificates of the CA (node
/// identities) and connections without one (Join).
struct Pki {
    ca: rustls::pki_types::CertificateDer<'static>,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    server: bc_gateway::tls::ServerTls,
}

fn pki() -> Result<Pki, Error> {
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate()?;
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &issuer)?;
    let server = bc_gateway::tls::server_config(
        bc_gateway::tls::Renewable::new(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )?,
        &[ca.der().clone()],
        bc_gateway::tls::Revocations::default(),
        None,
    )?;
    Ok(Pki {
        ca: ca.der().clone(),
        issuer,
        server,
    })
}

/// A gateway serving only Join (the stuck one) on a free loopback port, until `shutdown` fires.
async fn gateway(
    pki: &Pki,
    shutdown: tokio::sync::oneshot::Receiver<()>,
) -> Result<
    (
        SocketAddr,
        tokio::task::JoinHandle<Result<(), bc_gateway::GatewayError>>,
        tokio::sync::mpsc::UnboundedReceiver<()>,
    ),
    Error,
> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (started_tx, started) = tokio::sync::mpsc::unbounded_channel();
    let services = Services {
        join: Arc::new(Stuck(started_tx)),
        session: None,
        site: None,
        tunnels: None,
    };
    let served = tokio::spawn(bc_gateway::serve(
        listener,
        pki.server.clone(),
        services,
        Limits::default(),
        async move {
            let _ = shutdown.await;
        },
    ));
    Ok((addr, served, started))
}

/// Starts a Join that will stay in flight, and waits until the gateway's handler has it.
async fn join_in_flight(
    pki: &Pki,
    addr: SocketAddr,
    started: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(vec![pki.ca.clone()]),
        None,
    )?;
    let channel = bc_proto::channel::connect(&format!("https://{addr}"), tls).await?;
    let call = tokio::spawn(async move {
        let mut client = v1::join_service_client::JoinServiceClient::new(channel);
        let _ = client.join(v1::JoinRequest::default()).await;
    });
    tokio::time::timeout(Duration::from_secs(10), started.recv())
        .await
        .map_err(|_| "the Join did not reach the gateway's handler within 10 s")?;
    Ok(call)
}

/// A gateway serving, with a Join in flight through it: the setup of both tests.
struct Serving {
    addr: SocketAddr,
    served: tokio::task::JoinHandle<Result<(), bc_gateway::GatewayError>>,
    /// Begins the shutdown.
    stop: tokio::sync::oneshot::Sender<()>,
    _call: tokio::task::JoinHandle<()>,
}

async fn serving_with_a_stuck_join() -> Result<Serving, Error> {
    bc_proto::install_crypto_provider();
    let pki = pki()?;
    let (stop, shutdown) = tokio::sync::oneshot::channel();
    let (addr, served, mut started) = gateway(&pki, shutdown).await?;
    let _call = join_in_flight(&pki, addr, &mut started).await?;
    Ok(Serving {
        addr,
        served,
        stop,
        _call,
    })
}

/// Whether a listener can be bound on `addr` as the gateway binds it (SO_REUSEADDR: a listener still open is in
/// the way, connections in TIME_WAIT are not).
fn bindable(addr: SocketAddr) -> bool {
    let Ok(socket) = tokio::net::TcpSocket::new_v4() else {
        return false;
    };
    socket.set_reuseaddr(true).is_ok() && socket.bind(addr).is_ok() && socket.listen(16).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_gateway_accepts_no_new_connection() -> Result<(), Error> {
    let Serving {
        addr,
        served,
        stop,
        _call,
    } = serving_with_a_stuck_join().await?;
    let t0 = Instant::now();
    let _ = stop.send(());
    // The call in flight holds the drain open for the grace period (5 s); new connections must be refused well
    // before it ends.
    let refused = loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break t0.elapsed(),
            _ if t0.elapsed() > Duration::from_secs(2) => {
                return Err(format!(
                    "the gateway still accepts connections {:?} into its drain",
                    t0.elapsed()
                )
                .into());
            }
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    println!("new connections refused {refused:?} after the shutdown began");
    let ended = tokio::time::timeout(
        Limits::default().shutdown_grace + Duration::from_secs(5),
        served,
    )
    .await
    .map_err(|_| "the gateway did not end within its grace period and 5 s")?;
    ended??;
    println!(
        "the gateway ended {:?} after the shutdown began",
        t0.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_aborted_while_serving_lets_its_port_go() -> Result<(), Error> {
    let Serving {
        addr,
        served,
        stop: _stop,
        _call,
    } = serving_with_a_stuck_join().await?;
    assert!(!bindable(addr), "the serving gateway holds its port");
    // As the control plane's stop aborts a gateway still running after its grace period.
    served.abort();
    let _ = served.await;
    let t0 = Instant::now();
    while !bindable(addr) {
        if t0.elapsed() > Duration::from_secs(2) {
            return Err(format!(
                "the port of the aborted gateway is still held after {:?}",
                t0.elapsed()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "the port was free {:?} after the gateway was aborted",
        t0.elapsed()
    );
    Ok(())
}

/// How long the backend takes to record a session's close (a database write, slowed so that a gateway returning
/// before the writes were done is seen).
const CLOSE_TAKES: Duration = Duration::from_millis(300);

/// A session backend that opens every node at epoch 1 and takes [`CLOSE_TAKES`] to record a close.
struct SlowClose {
    closed: Arc<std::sync::atomic::AtomicUsize>,
}

/// An answer at once.
fn ready<'a, T: Send + 'a>(
    value: Result<T, tonic::Status>,
) -> BoxFuture<'a, Result<T, tonic::Status>> {
    Box::pin(async move { value })
}

impl bc_gateway::session::SessionBackend for SlowClose {
    fn open(
        &self,
        _node_id: &str,
        _public_key: &[u8],
        _hello: &v1::Hello,
    ) -> BoxFuture<'_, Result<bc_gateway::session::SessionGrant, tonic::Status>> {
        ready(Ok(bc_gateway::session::SessionGrant {
            epoch: 1,
            want_sections: Vec::new(),
        }))
    }
    fn inventory(
        &self,
        _: &SessionRef,
        _: v1::InventorySection,
    ) -> BoxFuture<'_, Result<(), tonic::Status>> {
        ready(Ok(()))
    }
    fn ack(
        &self,
        _: &SessionRef,
        _: v1::DesiredStateAck,
    ) -> BoxFuture<'_, Result<(), tonic::Status>> {
        ready(Ok(()))
    }
    fn result(
        &self,
        _: &SessionRef,
        _: v1::CommandResult,
    ) -> BoxFuture<'_, Result<(), tonic::Status>> {
        ready(Ok(()))
    }
    fn progress(
        &self,
        _: &SessionRef,
        _: v1::CommandProgress,
    ) -> BoxFuture<'_, Result<(), tonic::Status>> {
        ready(Ok(()))
    }
    fn renew(
        &self,
        _: &SessionRef,
        _: Vec<u8>,
        _: Vec<u8>,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, tonic::Status>> {
        ready(Err(tonic::Status::unimplemented("not in this test")))
    }
    fn closed(&self, _s: &bc_gateway::session::Seen) -> BoxFuture<'_, ()> {
        let closed = self.closed.clone();
        Box::pin(async move {
            tokio::time::sleep(CLOSE_TAKES).await;
            closed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        })
    }
    fn liveness(
        &self,
        _: &[bc_gateway::session::Seen],
    ) -> BoxFuture<'_, Result<Vec<String>, tonic::Status>> {
        ready(Ok(Vec::new()))
    }
    fn pending(
        &self,
        _: &[SessionRef],
    ) -> BoxFuture<'_, Result<Vec<(String, v1::GatewayMessage)>, tonic::Status>> {
        ready(Ok(Vec::new()))
    }
    fn revoked_since(
        &self,
        _: Option<i64>,
    ) -> BoxFuture<'_, Result<bc_gateway::session::RevokedSince, tonic::Status>> {
        ready(Ok(bc_gateway::session::RevokedSince::default()))
    }
}

/// A node's session through the gateway at `addr`, as node `id` of trust domain `bc.test` (a certificate of the
/// lab's CA): returns once the Welcome came, with a task that reads the session until it ends and then lets the
/// connection go, as a daemon does before it reconnects.
async fn session(
    pki: &Pki,
    addr: SocketAddr,
    id: &str,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.subject_alt_names = vec![rcgen::SanType::URI(rcgen::string::Ia5String::try_from(
        format!("spiffe://bc.test/node/{id}"),
    )?)];
    let cert = params.signed_by(&key, &pki.issuer)?;
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(vec![pki.ca.clone()]),
        Some((
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )),
    )?;
    let channel = bc_proto::channel::connect(&format!("https://{addr}"), tls).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(v1::NodeMessage {
        msg: Some(v1::node_message::Msg::Hello(v1::Hello {
            node_id: id.to_string(),
            ..Default::default()
        })),
    })
    .await?;
    let mut client = v1::session_service_client::SessionServiceClient::new(channel);
    let mut inbound = client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    match tokio::time::timeout(Duration::from_secs(10), inbound.message()).await {
        Ok(Ok(Some(v1::GatewayMessage {
            msg: Some(v1::gateway_message::Msg::Welcome(_)),
        }))) => {}
        other => return Err(format!("node {id}: no Welcome: {other:?}").into()),
    }
    Ok(tokio::spawn(async move {
        while let Ok(Some(_)) = inbound.message().await {}
        drop((tx, client));
    }))
}

/// Before the fix, a stopping gateway returned as soon as its connections closed: its accept loop ended with the
/// stop, tonic took the end of the connections it accepted for the end of serving and returned without waiting for
/// the drain, and the sessions' closes were still being written. In `better-compute serve` the process then exited:
/// in `scripts/bench sessions`' rolling restart a gateway holding 1,500 sessions exited 0.55 s after SIGTERM with
/// 315 of them recorded offline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_gateway_returns_once_its_sessions_recorded_their_close() -> Result<(), Error> {
    bc_proto::install_crypto_provider();
    let pki = pki()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let closed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let registry = bc_gateway::session::Registry::default();
    let services = Services {
        join: Arc::new(Stuck(tokio::sync::mpsc::unbounded_channel().0)),
        session: Some((
            Arc::new(SlowClose {
                closed: closed.clone(),
            }),
            bc_gateway::session::SessionConfig::new("bc.test"),
            registry.clone(),
        )),
        site: None,
        tunnels: None,
    };
    let (stop, shutdown) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(bc_gateway::serve(
        listener,
        pki.server.clone(),
        services,
        Limits::default(),
        async move {
            let _ = shutdown.await;
        },
    ));
    const NODES: usize = 6;
    let mut nodes = Vec::new();
    for i in 0..NODES {
        nodes.push(session(&pki, addr, &format!("n{i}")).await?);
    }
    assert_eq!(registry.len(), NODES, "every session is open");
    let t0 = Instant::now();
    let _ = stop.send(());
    let ended = tokio::time::timeout(Duration::from_secs(15), served)
        .await
        .map_err(|_| "the gateway did not end within 15 s of its stop")?;
    let took = t0.elapsed();
    ended??;
    let recorded = closed.load(std::sync::atomic::Ordering::SeqCst);
    println!("the gateway returned {took:?} after its stop, {recorded} of {NODES} closes recorded");
    assert_eq!(
        recorded, NODES,
        "the gateway returned {took:?} after its stop with {recorded} of {NODES} sessions' closes recorded \
         (each takes {CLOSE_TAKES:?})"
    );
    for n in nodes {
        let _ = tokio::time::timeout(Duration::from_secs(5), n).await;
    }
    Ok(())
}
