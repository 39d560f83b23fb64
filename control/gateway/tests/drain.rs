//! A gateway that shuts down stops accepting at once, and one dropped (aborted) lets its port go.
//!
//! Both were seen in CI on stop 46 (`bcd/tests/session.rs::gateway_restart_daemons_reconnect_by_themselves`): the
//! draining gateway went on accepting, a daemon reconnected to it and opened a session there, so the drain ran out
//! its bounds and the control plane's stop aborted the gateway. The accept loop, a task of its own, survived the
//! abort holding the listener, and the gateway started again on the same address failed: "Address already in use".

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// A CA and a server certificate for 127.0.0.1 it issued.
struct Pki {
    ca: rustls::pki_types::CertificateDer<'static>,
    server: Arc<rustls::ServerConfig>,
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
    let mut server =
        rustls::ServerConfig::builder_with_provider(Arc::new(bc_proto::tls_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Pki {
        ca: ca.der().clone(),
        server: Arc::new(server),
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
