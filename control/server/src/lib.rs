//! bc-control: the `better-compute` control plane.
//!
//! It owns the HTTP API and IAM ([`api`]), JoinService and the CA ([`join`], [`ca`]), site enrollment and services ([`site`]), the secret broker ([`secrets`]), role wiring ([`start`]),
//! configuration ([`config`]), `dev` mode on an embedded PostgreSQL ([`dev`]) and the operator CLI's API client
//! ([`client`]). Decisions live in bc-core, state in bc-store, the daemon-facing server in bc-gateway; this crate
//! wires them. Start with [`start`].

pub mod admission;
pub mod api;
pub mod artifacts;
pub mod backend;
pub mod ca;
pub mod client;
pub mod commands_api;
pub mod config;
pub mod controllers;
pub mod dev;
pub mod join;
pub mod lifecycle;
pub mod notify;
pub mod pokes;
pub mod scheduler;
pub mod secrets;
pub mod session;
pub mod site;
pub mod site_api;
pub mod site_cli;
pub mod statistics;

use crate::ca::Ca;
use crate::config::ServeConfig;
use bc_core::iam::Grant;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinSet;

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
}

/// A started control plane: where it listens and what nodes need to trust it.
pub struct Running {
    pub api_addr: Option<SocketAddr>,
    pub gateway_addr: Option<SocketAddr>,
    pub gateway_url: String,
    /// The sessions the gateway role holds (for status and benchmarks).
    pub sessions: Option<bc_gateway::session::Registry>,
    pub ca_pin: String,
    pub join_public_key: String,
    pub trust_domain: String,
    tasks: JoinSet<()>,
    stop: watch::Sender<bool>,
}

impl Running {
    /// Stops every role and waits for them.
    pub async fn shutdown(mut self) {
        self.stop().await;
    }

    /// Stops every role and waits for them, in place.
    pub async fn stop(&mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
    }

    /// Waits until a role task ends on its own (which is an error in a server), then stops the rest.
    pub async fn wait_any(&mut self) {
        let _ = self.tasks.join_next().await;
    }
}

/// Starts the roles of `config` against `store` (already migrated). Nothing blocks: the listeners are bound before
/// this returns, so callers can print addresses and tests can connect at once.
pub async fn start(config: &ServeConfig, store: Store) -> Result<Running, StartError> {
    let mut ca = Ca::load_or_create(&config.state_dir, &config.trust_domain)?;
    if let Some(l) = config.leaf_lifetime {
        ca = ca.with_leaf_lifetime(time::Duration::try_from(l).unwrap_or(ca::LEAF_LIFETIME));
    }
    let ca = Arc::new(ca);
    let join_key = ca::load_or_create_join_key(&config.state_dir)?;
    let join_public_key = join_key.public_key().encode();
    let secrets = Arc::new(secrets::SecretBox::load_or_create(&config.state_dir)?);
    store.ensure_root_tenant().await?;
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let bind = |what: &'static str, addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { what, addr, source })
    };
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut gateway_addr = None;
    let mut gateway_registry = None;
    let mut gateway_url = config.gateway_url.clone().unwrap_or_default();
    if config.roles.gateway {
        let listener = bind("gateway", config.gateway_listen).await?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            what: "gateway",
            addr: config.gateway_listen,
            source,
        })?;
        gateway_addr = Some(addr);
        if gateway_url.is_empty() {
            let host = config
                .gateway_hosts
                .first()
                .cloned()
                .unwrap_or_else(|| addr.ip().to_string());
            gateway_url = format!("https://{host}:{}", addr.port());
        }
        let gateway_id = format!("gw-{}", addr.port());
        let (chain, key) = ca.issue_gateway(&gateway_id, &config.gateway_hosts)?;
        let registry = bc_gateway::session::Registry::default();
        let tls = bc_gateway::tls::server_config(
            chain,
            key,
            std::slice::from_ref(ca.cert_der()),
            registry.revocations(),
        )?;
        let join = join::JoinService::start(store.clone(), ca.clone(), join_key);
        let mut session_config = bc_gateway::session::SessionConfig::new(&config.trust_domain);
        if let Some(t) = config.session_timing {
            session_config.heartbeat = t.heartbeat;
            session_config.liveness_interval = t.liveness_interval;
            session_config.pending_interval = t.pending_interval;
            session_config.idle_timeout = t.idle_timeout;
            session_config.revocation_interval = t.revocation_interval;
        }
        let backend = Arc::new(session::ControlSessions::new(store.clone(), ca.clone()));
        let services = bc_gateway::Services {
            join,
            session: Some((backend, session_config, registry.clone())),
            site: Some((
                Arc::new(site::SiteBackend::new(
                    store.clone(),
                    ca.clone(),
                    secrets.clone(),
                    artifacts::ArtifactDir::new(&config.state_dir),
                )),
                config.trust_domain.clone(),
            )),
        };
        gateway_registry = Some(registry);
        let rx = stop_rx.clone();
        tasks.spawn(async move {
            if let Err(e) = bc_gateway::serve(
                listener,
                tls,
                services,
                bc_gateway::Limits::default(),
                stopped(rx),
            )
            .await
            {
                tracing::error!(error = %e, "gateway stopped");
            }
        });
        tracing::info!(%addr, "gateway role listening");
    }

    let mut api_addr = None;
    if config.roles.api {
        let listener = bind("api", config.api_listen).await?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            what: "api",
            addr: config.api_listen,
            source,
        })?;
        api_addr = Some(addr);
        let decisions = Arc::new(admission::Decisions::default());
        let mut decided = notify::listen(
            &store,
            &[bc_store::reservations::DECIDED_CHANNEL],
            stop_rx.clone(),
        );
        let (d, st) = (decisions.clone(), store.clone());
        tasks.spawn(async move {
            while let Some(n) = decided.recv().await {
                if let notify::Notice::Message { payload, .. } = n {
                    d.decided(&st, &payload).await;
                }
            }
        });
        let state = api::ApiState {
            store: store.clone(),
            ca: ca.clone(),
            join_public_key: join_public_key.clone(),
            gateway_url: gateway_url.clone(),
            sessions: gateway_registry.clone(),
            decisions: Some(decisions),
            admitter: Some(admission::Admitter::start(store.clone())),
            principals: Arc::new(api::PrincipalCache::default()),
            secrets: secrets.clone(),
            artifacts: artifacts::ArtifactDir::new(&config.state_dir),
        };
        let rx = stop_rx.clone();
        tasks.spawn(async move {
            if let Err(e) = axum::serve(listener, api::router(state))
                .with_graceful_shutdown(stopped(rx))
                .await
            {
                tracing::error!(error = %e, "api stopped");
            }
        });
        tracing::info!(%addr, "api role listening");
    }
    let lease = config.shard_lease.unwrap_or(config::DEFAULT_SHARD_LEASE);
    let worker = controllers::worker_id();
    let mut lifecycle_poke = None;
    if config.roles.controllers {
        let timing = config.lifecycle_timing.unwrap_or_default();
        let (shards_tx, shards_rx) = watch::channel(Vec::new());
        tasks.spawn(controllers::run(
            store.clone(),
            worker.clone(),
            lease,
            shards_tx,
            stop_rx.clone(),
        ));
        let poke = Arc::new(tokio::sync::Notify::new());
        lifecycle_poke = Some(poke.clone());
        tasks.spawn(lifecycle::run(
            store.clone(),
            timing,
            shards_rx,
            poke,
            stop_rx.clone(),
        ));
        tracing::info!(
            worker,
            "controllers role: lifecycle, expiry and outbox sink running"
        );
    }
    tasks.spawn(pokes::run(
        store.clone(),
        gateway_registry.clone(),
        lifecycle_poke,
        stop_rx.clone(),
    ));
    if config.roles.scheduler {
        tasks.spawn(scheduler::run(
            store.clone(),
            worker.clone(),
            lease,
            config.capacity_reload.unwrap_or(scheduler::FULL_RELOAD),
            stop_rx.clone(),
        ));
        tracing::info!(worker, "scheduler role: placer running");
    }
    if config.roles.controllers || config.roles.scheduler {
        tasks.spawn(statistics::run(store.clone(), stop_rx.clone()));
    }
    if config.roles.sinks {
        tracing::info!(
            "sinks role: the outbox sink runs inside the controllers role in this version"
        );
    }
    for (on, name) in [(config.roles.iam, "iam")] {
        if on {
            tracing::info!(
                role = name,
                "role enabled; no loops of this role exist in this version yet"
            );
        }
    }
    Ok(Running {
        api_addr,
        gateway_addr,
        gateway_url,
        sessions: gateway_registry,
        ca_pin: ca.pin(),
        join_public_key,
        trust_domain: config.trust_domain.clone(),
        tasks,
        stop,
    })
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
