//! bc-control: the `better-compute` control plane.
//!
//! It owns the HTTP API and IAM ([`api`]), the CA ([`ca`]), composes the nodes module (JoinService, sessions, the
//! node verbs and controllers: [`bc_mod_nodes`]), site enrollment and services ([`site`]), the secret broker ([`secrets`]), role wiring ([`start`]),
//! configuration ([`config`]), `dev` mode on an embedded PostgreSQL ([`dev`]), and the operator CLI: its parser and
//! dispatch ([`cli`]), its API client ([`client`]) and its output ([`output`]). Decisions live in bc-core, state in bc-store, the daemon-facing server in bc-gateway; this crate
//! wires them. Start with [`start`].

pub mod api;
pub mod backend;
pub use bc_ca as ca;
pub mod cli;
pub mod client;
pub mod config;
pub mod dev;
pub mod fleet;
mod gateway_row;
pub mod iam_api;
pub mod iam_cli;
pub mod instances_cli;
pub use bc_mod_nodes::{join, lifecycle, methods as node_methods, session};
pub mod metal_cli;
pub mod metal_config;
pub mod nodes_cli;
pub mod notify;
pub mod output;
pub mod plane;
pub mod profile;
pub mod progress;
pub mod provider_secrets;
pub mod renew;
pub mod reservations_cli;
pub mod serve_cli;
pub mod site_cli;
pub mod statistics;
pub mod telemetry;
pub mod tunnel_cli;
pub mod watch;

use crate::ca::Ca;
use crate::config::ServeConfig;
use bc_core::iam::Grant;
use bc_mod_sites::{ArtifactDir, SecretBox, SiteBackend};
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use std::net::SocketAddr;
use std::sync::Arc;

/// What `--version` and `system.info` say: set once by the binary ([`cli::main`]) with its commit; the package
/// version alone where the library runs without it (tests).
static VERSION: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// Records the binary's version (the first call wins).
pub fn set_version(version: &'static str) {
    VERSION.get_or_init(|| version);
}

/// The version this process reports.
pub fn version() -> &'static str {
    VERSION.get().copied().unwrap_or(env!("CARGO_PKG_VERSION"))
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("loading the CA and JoinService key")]
    Ca(#[from] ca::CaError),
    #[error("binding {what} on {addr}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("gateway TLS")]
    Tls(#[from] bc_gateway::tls::TlsError),
    #[error("store")]
    Store(#[from] bc_store::StoreError),
    #[error("telemetry")]
    Telemetry(#[from] bc_telemetry::TelemetryError),
    #[error(transparent)]
    Config(#[from] bc_kernel::InvalidConfig),
    #[error("initializing the control plane: {0}")]
    Initialize(#[from] bc_kernel::ApiError),
    #[error("applying the modules' migrations")]
    Migrate(#[from] bc_store::migrate::MigrateError),
    #[error("the tunnel relay's client TLS: {0}")]
    Relay(String),
}

/// A started control plane: where it listens and what nodes need to trust it.
pub struct Running {
    pub api_addr: Option<SocketAddr>,
    pub gateway_addr: Option<SocketAddr>,
    /// Where `/metrics` is served (loopback), when it is.
    pub metrics_addr: Option<SocketAddr>,
    pub gateway_url: String,
    /// The sessions the gateway role holds (for status and benchmarks).
    pub sessions: Option<bc_gateway::session::Registry>,
    /// The gateway role's tunnels (for status and tests).
    pub tunnels: Option<bc_gateway::tunnel::Tunnels>,
    /// The gateway role's TLS handshakes since start, full and resumed (for metrics and tests).
    pub handshakes: Option<Arc<bc_gateway::tls::HandshakeCounts>>,
    pub ca_pin: String,
    pub join_public_key: String,
    pub trust_domain: String,
    /// What the modules said while the control plane initialized (a configuration that cannot work as it stands).
    pub notes: Vec<String>,
    plane: bc_kernel::Running,
}

impl Running {
    /// Stops every role and waits for them.
    pub async fn shutdown(mut self) {
        self.stop().await;
    }

    /// Stops every role and waits for them, in place.
    pub async fn stop(&mut self) {
        self.plane.stop().await;
    }

    /// Waits until a role task ends on its own (which is an error in a server), then stops the rest.
    pub async fn wait_any(&mut self) {
        self.plane.wait_any().await;
    }
}

/// The kernel's role set for `roles`.
fn role_set(roles: &config::Roles) -> Result<bc_kernel::RoleSet, StartError> {
    let on = [
        (roles.api, "api"),
        (roles.gateway, "gateway"),
        (roles.controllers, "controllers"),
        (roles.scheduler, "scheduler"),
        (roles.sinks, "sinks"),
        (roles.iam, "iam"),
    ];
    let list: Vec<&str> = on.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect();
    Ok(bc_kernel::RoleSet::parse(&list.join(","))?)
}

/// The listen backlog asked for: connections the kernel completes and holds until they are accepted. The kernel
/// caps it at `net.core.somaxconn` (4,096 by default since Linux 5.4). tokio's `bind` asks for 1,024: a reconnect
/// storm of thousands of daemons overflowed it while the accept loop shared two cores with the handshakes, and each
/// dropped SYN cost its daemon a retransmission (1 s, then 3 s) and the balancer's health check its deadline.
const LISTEN_BACKLOG: u32 = 4096;

async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(tokio::net::TcpListener, SocketAddr), StartError> {
    let bind_error = |source| StartError::Bind { what, addr, source };
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(bind_error)?;
    // As tokio's bind: a restarted process may take its address while old connections linger in TIME_WAIT.
    socket.set_reuseaddr(true).map_err(bind_error)?;
    socket.bind(addr).map_err(bind_error)?;
    let listener = socket.listen(LISTEN_BACKLOG).map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local))
}

/// The gateway role, bound and ready to serve: its listener, TLS and services.
struct Gateway {
    /// Its name in certificates, session rows and metrics (`gw-<hostname>-<port>` unless configured).
    id: String,
    /// Where the other control-plane processes reach it (published in the store).
    relay_url: String,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    url: String,
    registry: bc_gateway::session::Registry,
    /// Tunnels to the nodes of `registry` (the tunnels module's relay reaches them).
    tunnels: bc_gateway::tunnel::Tunnels,
    tls: bc_gateway::tls::ServerTls,
    /// Its serving certificate, re-issued while it runs.
    renewal: renew::Renewal,
    services: bc_gateway::Services,
    /// The balancers whose connections begin with a PROXY protocol header.
    proxy_protocol_from: bc_proto::proxy_protocol::Trusted,
}

async fn gateway(
    config: &ServeConfig,
    store: &Store,
    ca: &Arc<Ca>,
    join_key: bc_proto::seal::JoinPrivateKey,
    secrets: &Arc<SecretBox>,
) -> Result<Gateway, StartError> {
    let (listener, addr) = bind("gateway", config.gateway_listen).await?;
    let url = match &config.gateway_url {
        Some(url) if !url.is_empty() => url.clone(),
        _ => {
            let host = config
                .gateway_hosts
                .first()
                .cloned()
                .unwrap_or_else(|| addr.ip().to_string());
            format!("https://{host}:{}", addr.port())
        }
    };
    let gateway_id = config
        .gateway_id
        .clone()
        .unwrap_or_else(|| format!("gw-{}-{}", host_name(), addr.port()));
    let relay_url = match &config.gateway_relay_url {
        Some(url) => url.clone(),
        None => {
            let host = config
                .gateway_hosts
                .first()
                .cloned()
                .unwrap_or_else(|| addr.ip().to_string());
            format!("https://{host}:{}", addr.port())
        }
    };
    let renewal = renew::issue(
        ca,
        renew::Identity::Gateway {
            id: gateway_id.clone(),
            hosts: config.gateway_hosts.clone(),
        },
    )?;
    let registry = bc_gateway::session::Registry::default();
    let tunnels = bc_gateway::tunnel::Tunnels::new(registry.clone(), Default::default());
    // Every gateway of the plane holds the CA, so each opens the others' session tickets: a node whose gateway
    // restarted, or whose balancer sent it elsewhere, resumes instead of a full mTLS handshake.
    let tickets = ca.session_tickets();
    let tls = bc_gateway::tls::server_config(
        renewal.current.clone(),
        std::slice::from_ref(ca.cert_der()),
        registry.revocations(),
        Some(Arc::new(tickets)),
    )?;
    let sites: join::SiteEnroller = {
        let (store, ca) = (store.clone(), ca.clone());
        Arc::new(move |token, csr| {
            let (store, ca) = (store.clone(), ca.clone());
            Box::pin(async move { bc_mod_sites::enroll(&store, &ca, &token, &csr).await })
        })
    };
    let join = join::JoinService::start(store.clone(), ca.clone(), join_key, Some(sites));
    let mut session_config = bc_gateway::session::SessionConfig::new(&config.trust_domain);
    if let Some(t) = config.session_timing {
        session_config.heartbeat = t.heartbeat;
        session_config.liveness_interval = t.liveness_interval;
        session_config.pending_interval = t.pending_interval;
        session_config.idle_timeout = t.idle_timeout;
        session_config.revocation_interval = t.revocation_interval;
    }
    let inventory = Arc::new(bc_mod_inventory::Inventory::new(store.clone()));
    let backend = Arc::new(
        session::ControlSessions::new(store.clone(), ca.clone(), inventory).on_gateway(&gateway_id),
    );
    let site = SiteBackend::new(
        store.clone(),
        ca.clone(),
        secrets.clone(),
        ArtifactDir::new(&config.state_dir),
    );
    let services = bc_gateway::Services {
        join,
        session: Some((backend, session_config, registry.clone())),
        site: Some((
            Arc::new(bc_mod_metal::gateway::WithBmc::new(
                Arc::new(site),
                store.clone(),
                &config.trust_domain,
            )),
            config.trust_domain.clone(),
        )),
        tunnels: Some(tunnels.clone()),
    };
    Ok(Gateway {
        id: gateway_id,
        relay_url,
        listener,
        addr,
        url,
        registry,
        tunnels,
        tls,
        renewal,
        services,
        proxy_protocol_from: config.gateway_proxy_protocol_from.clone(),
    })
}

/// Builds the control plane of `config` through the kernel (`build` → `initialize` → `start(roles)`) and serves
/// its listeners. Nothing blocks: the listeners are bound before this returns, so callers can print addresses and
/// tests can connect at once. `store` must be migrated (`initialize` verifies it).
pub async fn start(config: &ServeConfig, store: Store) -> Result<Running, StartError> {
    start_with(config, store, true).await
}

/// The migrations of the modules this binary composes (numbered from 1000: metal's 1100–1199, tunnels'
/// 1200–1299, instances' 1300–1399), as bc-store's runner takes them beside the base schema's.
pub fn module_migrations() -> Vec<bc_store::migrate::Migration> {
    bc_mod_metal::MIGRATIONS
        .iter()
        .chain(bc_mod_tunnels::MIGRATIONS)
        .chain(bc_mod_instances::MIGRATIONS)
        .map(|m| bc_store::migrate::Migration {
            version: m.version,
            name: m.name,
            sql: m.sql,
        })
        .collect()
}

/// Applies the pending migrations of the base schema and of the composed modules; returns how many ran.
pub async fn migrate(store: &Store) -> Result<usize, bc_store::migrate::MigrateError> {
    bc_store::migrate::migrate_with(store.pool(), &module_migrations()).await
}

/// Like [`start`]; with `migrate` false it only verifies that no migration is pending (`serve --no-migrate`: the
/// deploy ran `better-compute migrate`), and refuses to start otherwise.
pub async fn start_with(
    config: &ServeConfig,
    store: Store,
    migrate: bool,
) -> Result<Running, StartError> {
    let roles = role_set(&config.roles)?;
    let ca = load_ca(config)?;
    let join_key = ca::load_or_create_join_key(&config.state_dir)?;
    let join_public_key = join_key.public_key().encode();
    let secrets = Arc::new(SecretBox::load_or_create(&config.state_dir)?);
    let backend = backend::StoreBackend::new(store.clone());
    let gateway = match config.roles.gateway {
        true => Some(gateway(config, &store, &ca, join_key, &secrets).await?),
        false => None,
    };
    let api = match config.roles.api {
        true => Some(bind("api", config.api_listen).await?),
        false => None,
    };
    let gateway_url = gateway
        .as_ref()
        .map(|g| g.url.clone())
        .unwrap_or_else(|| config.gateway_url.clone().unwrap_or_default());
    let sessions = gateway.as_ref().map(|g| g.registry.clone());
    let gateway_addr = gateway.as_ref().map(|g| g.addr);
    let gateway_id = gateway.as_ref().map(|g| g.id.clone());
    let handshakes = gateway.as_ref().map(|g| g.tls.counts());
    let metrics = telemetry::ControlMetrics::default();
    let worker = bc_mod_nodes::controllers::worker_id();
    let lease = config.shard_lease.unwrap_or(config::DEFAULT_SHARD_LEASE);
    let mut options = bc_kernel::Options::new(worker.clone());
    options.shard_lease = lease;
    // Pending migrations (the base schema's and the modules', numbered from 1000) are applied in `initialize`,
    // once, under the migration lock; `serve --no-migrate` only verifies that none is pending.
    options.migrate = migrate;
    let nodes = bc_mod_nodes::Config {
        ca: ca.clone(),
        sessions: sessions.clone(),
        lifecycle: config.lifecycle_timing.unwrap_or_default(),
    };
    let mut builder = bc_kernel::ControlPlane::builder(options)
        .module(plane::module(store.clone()))
        .module(bc_mod_nodes::module(nodes))
        .module(capacity_module(config, &metrics))
        .module(bc_mod_sites::module())
        .module(bc_mod_instances::module(
            config.instances.clone().unwrap_or_default(),
        ))
        .module(bc_mod_metal::module(metal_config(
            &config.metal,
            &gateway_url,
            &ca.pin(),
            &join_public_key,
        )));
    if api.is_some() {
        builder = builder.resource(sites_state(config, &store, &ca, &sessions, &secrets));
        builder = builder.resource(api_state(
            &store,
            &ca,
            &join_public_key,
            &gateway_url,
            &sessions,
        ));
    }
    builder = builder.resource(provider_secrets::resource(&store, &secrets));
    let tunnels = gateway.as_ref().map(|g| g.tunnels.clone());
    let mut renewals: Vec<renew::Renewal> = gateway.iter().map(|g| g.renewal.clone()).collect();
    let relay;
    (builder, relay) = with_tunnels(builder, config, &store, &ca, &worker, gateway.as_ref())?;
    renewals.extend(relay);
    for (path, item) in [fleet::api_path(), telemetry::api_path()] {
        builder = builder.api_path(path, item);
    }
    let initialized = builder.build()?.initialize(backend).await?;
    store.ensure_root_tenant().await?;
    let mut plane = initialized.start(&roles);
    let every = config.cert_renewal.unwrap_or(renew::RENEW_EVERY);
    plane.spawn(renew::run(ca.clone(), renewals, every, plane.stop_signal()));
    if let Some(g) = gateway {
        start_gateway(g, &store, &mut plane, gateway_row::GatewayLease::of(lease)).await?;
    }
    let mut api_addr = None;
    if let Some((listener, addr)) = api {
        api_addr = Some(addr);
        let router = initialized.router().merge(fleet::routes()).layer(
            axum::middleware::from_fn_with_state(metrics.clone(), telemetry::count_api),
        );
        let mut stop = plane.stop_signal();
        plane.spawn(bc_kernel::serve::serve(listener, router, async move {
            stop.stopped().await
        }));
        tracing::info!(%addr, "api role listening");
    }
    let sources = telemetry::Sources {
        store: store.clone(),
        worker: worker.clone(),
        gateway: gateway_id.zip(sessions.clone()),
        handshakes: handshakes.clone(),
        lease_roles: Vec::new(),
        queues: config.roles.controllers,
    };
    let metrics_addr = export_metrics(config, &metrics, sources, &mut plane).await?;
    note_roles_without_loops(config);
    Ok(Running {
        api_addr,
        gateway_addr,
        metrics_addr,
        gateway_url,
        sessions,
        tunnels,
        handshakes,
        ca_pin: ca.pin(),
        join_public_key,
        trust_domain: config.trust_domain.clone(),
        notes: initialized.notes().to_vec(),
        plane,
    })
}

/// The tunnels module and its state: this process's gateway role (when it runs one) and, for the API role, the
/// relay's client to the other gateways.
fn with_tunnels(
    builder: bc_kernel::ControlPlaneBuilder,
    config: &ServeConfig,
    store: &Store,
    ca: &Ca,
    worker: &str,
    gateway: Option<&Gateway>,
) -> Result<(bc_kernel::ControlPlaneBuilder, Option<renew::Renewal>), StartError> {
    let local = gateway.map(|g| bc_mod_tunnels::LocalGateway {
        id: g.id.clone(),
        tunnels: g.tunnels.clone(),
    });
    let (peers, renewal) = match config.roles.api {
        true => {
            let (peers, renewal) = relay_peers(ca, worker)?;
            (Some(peers), Some(renewal))
        }
        false => (None, None),
    };
    let state = bc_mod_tunnels::TunnelsState::new(
        store.clone(),
        local,
        peers,
        config.tunnels.clone(),
        worker.to_string(),
    );
    Ok((
        builder.module(bc_mod_tunnels::module()).resource(state),
        renewal,
    ))
}

/// Publishes the gateway role's relay URL and lease and keeps them fresh (closing, a lease later, the sessions its
/// previous run left open whose node has not reconnected), then serves it until the plane stops.
async fn start_gateway(
    g: Gateway,
    store: &Store,
    plane: &mut bc_kernel::Running,
    lease: gateway_row::GatewayLease,
) -> Result<(), StartError> {
    let (addr, stop) = (g.addr, plane.stop_signal());
    store
        .publish_gateway(&g.id, &g.relay_url, lease.ms())
        .await?;
    plane.spawn(gateway_row::end_previous_run(
        store.clone(),
        (g.id.clone(), g.registry.clone()),
        lease,
        plane.stop_signal(),
    ));
    let publish = plane.stop_signal();
    plane.spawn(gateway_row::publish_gateway(
        store.clone(),
        (g.id.clone(), g.relay_url.clone()),
        lease,
        publish,
    ));
    tracing::info!(%addr, gateway_id = g.id, relay_url = g.relay_url, "gateway role listening");
    plane.spawn(serve_gateway(g, stop));
    Ok(())
}

/// This host's name as an id part (letters, digits, '.', '-', '_'; "host" when unknown).
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let clean: String = name
        .trim()
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                true => c,
                false => '-',
            },
        )
        .take(64)
        .collect();
    match clean.is_empty() {
        true => "host".into(),
        false => clean,
    }
}

/// The API role's client of the tunnel relay: a control-plane certificate for this process (`worker`), issued by
/// the CA (and re-issued while it runs: the returned renewal), and the CA to verify the gateways.
fn relay_peers(
    ca: &Ca,
    worker: &str,
) -> Result<(bc_gateway::relay::Peers, renew::Renewal), StartError> {
    let id: String = worker
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                true => c,
                false => '-',
            },
        )
        .take(128)
        .collect();
    let renewal = renew::issue(ca, renew::Identity::Control { id })?;
    let tls = bc_proto::channel::client_config(
        bc_proto::channel::ServerTrust::Bundle(vec![ca.cert_der().clone()]),
        None,
    )
    .map_err(|e| StartError::Relay(bc_error_chain::chain(&e)))?;
    let mut tls = (*tls).clone();
    tls.client_auth_cert_resolver = renewal.current.clone();
    Ok((bc_gateway::relay::Peers::new(Arc::new(tls)), renewal))
}

/// The metal module's configuration: the ramdisk's command line names this control plane (gateway URL, CA pin,
/// JoinService key), so the ramdisk joins it with the attempt's boot token.
fn metal_config(
    base: &bc_mod_metal::Config,
    gateway_url: &str,
    ca_pin: &str,
    join_key: &str,
) -> bc_mod_metal::Config {
    let mut c = base.clone();
    c.ramdisk.cmdline = format!(
        "{} bc.url={gateway_url} bc.ca_pin={ca_pin} bc.join_key={join_key}",
        c.ramdisk.cmdline
    );
    c
}

/// The capacity module as `config` sets it up, recording placement latency into `metrics`.
fn capacity_module(config: &ServeConfig, metrics: &telemetry::ControlMetrics) -> bc_kernel::Module {
    let observer = metrics.clone();
    bc_mod_capacity::module(bc_mod_capacity::CapacityOptions {
        placer: config.placer,
        full_reload: config.capacity_reload,
        runs_scheduler: config.roles.scheduler,
        observer: bc_mod_capacity::PlacementObserver(Arc::new(move |d| {
            observer.observe_placement(d)
        })),
    })
}

/// The CA of the state directory (created on first start), with the configured leaf lifetime.
fn load_ca(config: &ServeConfig) -> Result<Arc<Ca>, StartError> {
    let mut ca = Ca::load_or_create(&config.state_dir, &config.trust_domain)?;
    if let Some(l) = config.leaf_lifetime {
        ca = ca.with_leaf_lifetime(time::Duration::try_from(l).unwrap_or(ca::LEAF_LIFETIME));
    }
    Ok(Arc::new(ca))
}

/// The API role's own handlers' state.
fn api_state(
    store: &Store,
    ca: &Arc<Ca>,
    join_public_key: &str,
    gateway_url: &str,
    sessions: &Option<bc_gateway::session::Registry>,
) -> api::ApiState {
    api::ApiState {
        store: store.clone(),
        ca: ca.clone(),
        join_public_key: join_public_key.to_string(),
        gateway_url: gateway_url.to_string(),
        sessions: sessions.clone(),
    }
}

/// The sites module's state (its handlers' kernel resource).
fn sites_state(
    config: &ServeConfig,
    store: &Store,
    ca: &Arc<Ca>,
    sessions: &Option<bc_gateway::session::Registry>,
    secrets: &Arc<SecretBox>,
) -> bc_mod_sites::Sites {
    bc_mod_sites::Sites {
        store: store.clone(),
        ca: ca.clone(),
        sessions: sessions.clone(),
        secrets: secrets.clone(),
        artifacts: ArtifactDir::new(&config.state_dir),
    }
}

/// With telemetry configured (`serve` always is): samples the control plane's own metrics, serves them on
/// `/metrics` and exports them until the plane stops. Returns where `/metrics` is served.
async fn export_metrics(
    config: &ServeConfig,
    metrics: &telemetry::ControlMetrics,
    mut sources: telemetry::Sources,
    plane: &mut bc_kernel::Running,
) -> Result<Option<SocketAddr>, StartError> {
    let Some(table) = &config.telemetry else {
        return Ok(None);
    };
    let pipeline = telemetry::pipeline(table, metrics, &sources.worker).await?;
    let metrics_addr = pipeline.metrics_addr();
    let interval = table.interval;
    if config.roles.controllers {
        sources.lease_roles.push(bc_mod_nodes::controllers::ROLE);
    }
    if config.roles.scheduler {
        sources.lease_roles.push(bc_mod_capacity::ROLE);
    }
    let stop = plane::stop_watch(plane.stop_signal());
    plane.spawn(telemetry::sample(metrics.clone(), sources, interval, stop));
    let mut stop = plane.stop_signal();
    plane.spawn(pipeline.run(async move { stop.stopped().await }));
    tracing::info!(metrics = ?metrics_addr, "telemetry: the control plane's own metrics are sampled");
    Ok(metrics_addr)
}

async fn serve_gateway(g: Gateway, mut stop: bc_kernel::Stop) {
    let stopped = async move { stop.stopped().await };
    if let Err(e) = bc_gateway::serve(
        g.listener,
        g.tls,
        g.services,
        bc_gateway::Limits {
            proxy_protocol_from: g.proxy_protocol_from,
            ..Default::default()
        },
        stopped,
    )
    .await
    {
        tracing::error!(error = %e, "gateway stopped");
    }
}

/// Creates (or re-keys) the administrator principal of the root tenant with every permission; returns its API key.
pub async fn bootstrap_admin(store: &Store) -> Result<String, bc_store::StoreError> {
    let key = Token::generate(TokenKind::ApiKey)
        .map_err(|e| bc_store::StoreError::Corrupt(format!("no randomness: {e}")))?;
    install_admin_key(store, &key).await?;
    Ok(key.reveal())
}

/// Re-installs a known admin key (dev mode keeps its key in its data directory); false when it is malformed.
pub async fn restore_admin(store: &Store, key: &str) -> Result<bool, bc_store::StoreError> {
    let Ok(key) = Token::parse(TokenKind::ApiKey, key) else {
        return Ok(false);
    };
    install_admin_key(store, &key).await?;
    Ok(true)
}

async fn install_admin_key(store: &Store, key: &Token) -> Result<(), bc_store::StoreError> {
    store.ensure_root_tenant().await?;
    let all = Grant {
        permission: "*".into(),
        scope: "*".into(),
    };
    store
        .upsert_principal(
            "admin",
            bc_store::iam::ROOT_TENANT,
            "administrator",
            key.id(),
            &key.secret().hash(),
            &[all],
        )
        .await
}

/// Says which asked-for roles run nothing of their own in this version.
fn note_roles_without_loops(config: &ServeConfig) {
    if config.roles.sinks {
        tracing::info!(
            "sinks role: the outbox sink runs inside the controllers role in this version"
        );
    }
    if config.roles.iam {
        tracing::info!(
            role = "iam",
            "role enabled; no loops of this role exist in this version yet"
        );
    }
}

#[cfg(test)]
mod tests {
    /// `ss -ltn` shows a listening socket's backlog as its Send-Q.
    #[tokio::test]
    async fn listeners_ask_for_a_backlog_a_reconnect_storm_fits() {
        let (listener, addr) = super::bind("gateway", ([127, 0, 0, 1], 0).into())
            .await
            .expect("bind");
        let Ok(out) = std::process::Command::new("ss")
            .args(["-ltnH", &format!("sport = :{}", addr.port())])
            .output()
        else {
            bc_testkit::skip!("ss (iproute2) is not installed");
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let backlog: u32 = text
            .split_whitespace()
            .nth(2)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no listening socket in ss's answer: {text:?}"));
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .expect("net.core.somaxconn");
        // tokio's bind asked for 1,024.
        assert_eq!(backlog, super::LISTEN_BACKLOG.min(somaxconn));
        assert!(backlog > 1024 || somaxconn <= 1024, "{backlog}");
        drop(listener);
    }
}
