//! The `bcd site` subcommands: `serve` (the site services from site.toml alone), `enroll` (a site token makes this
//! host an agent of its site), `run` (the services fed by the control plane while this agent holds the boot lease)
//! and `redfish` (one BMC by hand). Argument types for [`crate::cli`]; the handlers are the binary's, so they
//! return `anyhow` errors like a `main` would.

use crate::cli::{Overrides, load_config};
use anyhow::Context as _;
use bc_error_chain::InlineErrorChain;
use clap::Subcommand;
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub enum SiteCommand {
    /// Serve proxy DHCP, TFTP and boot HTTP from the site config (--config, default /etc/bcd/site.toml) and its
    /// [[machine]] netboot table; SIGHUP reloads the table, SIGTERM stops.
    Serve,
    /// Enroll this host as an agent of a site with a site token (bcst_…). The key is persisted (0600) before any
    /// network call; safe to re-run after a crash. State defaults to /var/lib/bcd-site.
    Enroll {
        /// The token; prefer BCD_SITE_TOKEN or --token-file so it stays out of the process list.
        #[arg(env = "BCD_SITE_TOKEN", hide_env_values = true)]
        token: Option<String>,
        #[arg(long)]
        token_file: Option<PathBuf>,
        #[arg(long, default_value_t = 8)]
        attempts: u32,
        /// Connection settings (gateway_url, ca_pin, join_public_key) in bcd.toml form.
        #[arg(long, default_value = "/etc/bcd/bcd.toml")]
        agent_config: PathBuf,
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Serve like `site serve`, with the netboot table from the control plane, only while this agent holds the
    /// site's boot lease (a second agent of the site stands by and takes over when the lease expires).
    Run {
        #[arg(long, default_value = "/etc/bcd/bcd.toml")]
        agent_config: PathBuf,
        /// Boot lease length, e.g. 15s (renewed every third of it).
        #[arg(long, default_value = "15s", value_parser = bc_proto::duration::parse)]
        lease_ttl: std::time::Duration,
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Drive one BMC by hand: inspect, power, boot-once. Every change is read back. The BMC credentials come from
    /// the control plane's secret broker (--secret) or, for a BMC debugged without a control plane, from --user
    /// and the environment variable --password-env names.
    Redfish {
        /// The BMC, e.g. https://10.0.0.10 (https needs --pin).
        url: String,
        /// A secret of this agent's site holding the BMC credentials as {"username": "…", "password": "…"}
        /// (`better-compute secrets put <name> --site <site>`). Fetched with the site agent's identity
        /// (--state-dir, default /var/lib/bcd-site) as a JWE to a key made for this request; held in memory for
        /// this one operation only, never printed or logged.
        #[arg(long, conflicts_with_all = ["user", "password_env"])]
        secret: Option<String>,
        /// The BMC user, without --secret (default root).
        #[arg(long)]
        user: Option<String>,
        /// The environment variable that holds the password, without --secret (default BMC_PASSWORD; never a
        /// command-line argument).
        #[arg(long)]
        password_env: Option<String>,
        /// Pin the BMC's certificate: sha256:<hex SHA-256 of its DER certificate>.
        #[arg(long)]
        pin: Option<String>,
        /// The system to act on: its Id or its full @odata.id. Required when the BMC has several systems (the
        /// error lists them); without it, power and boot-once act only on a BMC with exactly one system.
        #[arg(long)]
        system: Option<String>,
        #[command(subcommand)]
        action: RedfishAction,
    },
}

#[derive(Subcommand)]
pub enum RedfishAction {
    /// Print the inventory: systems, processors and GPUs, memory, storage, NICs, PCIe devices.
    Inspect,
    /// on, off, graceful-off, reset, graceful-restart, cycle.
    Power { action: String },
    /// One-time boot override: pxe or http.
    BootOnce { target: String },
}

/// Where `bcd site redfish` takes the BMC credentials from.
enum BmcCredentialSource {
    /// A secret of the site, from the control plane's broker.
    Secret { state_dir: PathBuf, name: String },
    /// `--user` and the password in an environment variable.
    Env { user: String, password_env: String },
}

async fn redfish(
    url: &str,
    source: BmcCredentialSource,
    pin: Option<String>,
    system: Option<String>,
    action: RedfishAction,
) -> anyhow::Result<()> {
    use bcd_site::redfish;
    // Parsed before the credentials are fetched: a typo costs no secret delivery.
    let op = match action {
        RedfishAction::Inspect => redfish::Operation::Inspect,
        RedfishAction::Power { action } => {
            redfish::Operation::Power(action.parse().map_err(|e: String| anyhow::anyhow!(e))?)
        }
        RedfishAction::BootOnce { target } => {
            redfish::Operation::BootOnce(target.parse().map_err(|e: String| anyhow::anyhow!(e))?)
        }
    };
    let mut opts = redfish::BmcOptions::default();
    if let Some(pin) = pin {
        let hex_part = pin
            .strip_prefix("sha256:")
            .context("--pin must be sha256:<64 hex>")?;
        let bytes: [u8; 32] = hex::decode(hex_part)
            .ok()
            .and_then(|b| b.try_into().ok())
            .context("--pin must be sha256:<64 hex>")?;
        opts.trust = Some(redfish::TlsTrust::PinnedSha256(bytes));
    }
    let (creds, secret) = match source {
        BmcCredentialSource::Secret { state_dir, name } => {
            let creds = crate::site::fetch_bmc_credentials(&state_dir, &name).await?;
            let site = crate::state::StateDir::open(&state_dir)
                .ok()
                .and_then(|s| s.identity().ok().flatten())
                .map_or_else(|| "<site>".to_string(), |i| i.node_id);
            (creds, Some((name, site)))
        }
        BmcCredentialSource::Env { user, password_env } => {
            let password = std::env::var(&password_env).map_err(|_| {
                anyhow::anyhow!(
                    "the BMC password is read from the environment variable {password_env}, which is not set \
                     (or not UTF-8): set it, or take the credentials from the control plane with --secret <name>"
                )
            })?;
            (
                redfish::Credentials {
                    username: user,
                    password,
                },
                None,
            )
        }
    };
    // The credentials move into the one operation and are wiped when it ends. SIGINT or SIGTERM stops the
    // operation and logs the BMC session out before exiting (status 130, see crate::cli::main).
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = async {
                match term.as_mut() {
                    Some(t) => { t.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {}
        }
    };
    let result = redfish::run(url, creds, opts, system.as_deref(), op, shutdown)
        .await
        .map(|outcome| print!("{outcome}"));
    // An interrupted operation (RedfishError::Interrupted) exits 130: crate::cli::main maps it.
    match (result, secret) {
        (Ok(()), _) => Ok(()),
        (Err(e @ redfish::RedfishError::AuthRejected { .. }), Some((name, site))) => {
            Err(anyhow::Error::from(e).context(format!(
                "the BMC rejected the credentials of secret {name:?} of site {site}: store the right ones with \
                 `better-compute secrets put {name} --site {site}`"
            )))
        }
        (Err(e), _) => Err(e.into()),
    }
}

/// Where a site agent keeps its key, certificate and identity unless --state-dir says otherwise.
const SITE_STATE_DIR: &str = "/var/lib/bcd-site";

/// Runs one `bcd site` subcommand; `config` and `state_dir` are the global `--config` and `--state-dir`.
pub async fn run(
    command: SiteCommand,
    config: Option<PathBuf>,
    state_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    match command {
        SiteCommand::Serve => {
            let path = config.unwrap_or_else(|| PathBuf::from("/etc/bcd/site.toml"));
            let state_dir = state_dir.unwrap_or_else(|| PathBuf::from(SITE_STATE_DIR));
            site_serve(&path, &state_dir).await?
        }
        SiteCommand::Enroll {
            token,
            token_file,
            attempts,
            agent_config,
            overrides,
        } => {
            let token = match (token, token_file) {
                (Some(t), _) => t,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .with_context(|| format!("reading {}", f.display()))?,
                (None, None) => anyhow::bail!(
                    "give the site token as an argument, in BCD_SITE_TOKEN or with --token-file"
                ),
            };
            // A join token is refused (naming `bcd join`) before anything is written or sent.
            crate::join::check_token_kind(bc_proto::token::TokenKind::Site, &token)?;
            let state_dir = state_dir.or(Some(PathBuf::from(SITE_STATE_DIR)));
            let mut overrides = overrides;
            overrides.gpu_backend.get_or_insert_with(|| "none".into());
            let config = load_config(&agent_config, state_dir, overrides)?;
            let claims = crate::hardware::collect(&config.hardware_root, None, None);
            let outcome = crate::join::enroll_site(
                &config,
                &token,
                crate::join::JoinOptions { attempts, claims },
            )
            .await?;
            let how = if outcome.replayed {
                " (a retry of an earlier enrollment: no token use spent)"
            } else {
                ""
            };
            println!(
                "enrolled as an agent of site {}{how}",
                outcome.identity.node_id
            );
            println!(
                "identity {}; state in {}",
                outcome.identity.spiffe_id,
                config.state_dir.display()
            );
        }
        SiteCommand::Run {
            agent_config,
            lease_ttl,
            overrides,
        } => {
            let state_dir = state_dir.or(Some(PathBuf::from(SITE_STATE_DIR)));
            let mut overrides = overrides;
            overrides.gpu_backend.get_or_insert_with(|| "none".into());
            let agent = load_config(&agent_config, state_dir, overrides)?;
            let path = config.unwrap_or_else(|| PathBuf::from("/etc/bcd/site.toml"));
            site_run(&path, &agent_config, agent, lease_ttl).await?
        }
        SiteCommand::Redfish {
            url,
            secret,
            user,
            password_env,
            pin,
            system,
            action,
        } => {
            let source = match secret {
                Some(name) => BmcCredentialSource::Secret {
                    state_dir: state_dir.unwrap_or_else(|| PathBuf::from(SITE_STATE_DIR)),
                    name,
                },
                None => BmcCredentialSource::Env {
                    user: user.unwrap_or_else(|| "root".into()),
                    password_env: password_env.unwrap_or_else(|| "BMC_PASSWORD".into()),
                },
            };
            redfish(&url, source, pin, system, action).await?
        }
    }
    Ok(())
}

/// `bcd site serve`: the config file's [[machine]] list is the netboot table's source; SIGHUP re-reads it (an
/// invalid file is reported and the running table kept). The control-plane session will be another source
/// feeding the same channel. `/metrics` and the exporters follow the file's `[telemetry]` table (spooling under
/// `state_dir`).
async fn site_serve(path: &Path, state_dir: &Path) -> anyhow::Result<()> {
    use bcd_site::serve;
    let config = serve::SiteConfig::from_file(path)?;
    let counters = serve::SiteCounters::default();
    #[cfg(feature = "telemetry")]
    let telemetry = {
        let t = crate::telemetry::build_site_serve(path, state_dir, counters.clone()).await?;
        if let Some(addr) = t.metrics_addr() {
            tracing::info!(%addr, "serving /metrics");
        }
        t
    };
    #[cfg(not(feature = "telemetry"))]
    let _ = state_dir;
    let bound = serve::bind(&config)
        .await
        .with_context(|| format!("starting the services of {}", path.display()))?;
    let (table_tx, table_rx) = tokio::sync::watch::channel(config.netboot.clone());
    bc_proto::runtime::service::ready(&format!(
        "serving {} machine(s) from {}",
        config.netboot.len(),
        path.display()
    ));
    let _watchdog = bc_proto::runtime::service::spawn_watchdog();
    let reload_path = path.to_owned();
    let running = config.clone();
    let reload = tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            return;
        };
        while hup.recv().await.is_some() {
            match serve::SiteConfig::from_file(&reload_path) {
                Ok(c) => {
                    let settings_changed = serve::SiteConfig {
                        netboot: running.netboot.clone(),
                        ..c.clone()
                    } != running;
                    if settings_changed {
                        tracing::warn!(
                            path = %reload_path.display(),
                            "settings other than [[machine]] changed: they apply at the next start"
                        );
                    }
                    tracing::info!(path = %reload_path.display(), machines = c.netboot.len(), "reloaded the netboot table");
                    let _ = table_tx.send(c.netboot);
                }
                Err(e) => tracing::error!(
                    error = %InlineErrorChain::new(&e),
                    "reload refused; keeping the running table"
                ),
            }
        }
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    #[cfg(feature = "telemetry")]
    let telemetry = tokio::spawn(telemetry.run(async move {
        let mut rx = stop_rx;
        let _ = rx.wait_for(|s| *s).await;
    }));
    #[cfg(not(feature = "telemetry"))]
    drop(stop_rx);
    let result = serve::run(
        &config,
        bound,
        table_rx,
        counters,
        None,
        bc_proto::runtime::shutdown_signal(),
    )
    .await;
    bc_proto::runtime::service::stopping();
    reload.abort();
    let _ = stop_tx.send(true);
    #[cfg(feature = "telemetry")]
    let _ = telemetry.await;
    result.with_context(|| format!("serving {}", path.display()))
}

/// `bcd site run`: the site services, fed by the control plane while this agent holds the boot lease.
async fn site_run(
    path: &Path,
    agent_path: &Path,
    agent: crate::config::Config,
    lease_ttl: std::time::Duration,
) -> anyhow::Result<()> {
    use bcd_site::serve;
    let config = serve::SiteConfig::from_file(path)?;
    if !config.netboot.is_empty() {
        tracing::warn!(
            path = %path.display(),
            "[[machine]] entries are ignored by `bcd site run`: the control plane's table is served"
        );
    }
    let counters = serve::SiteCounters::default();
    #[cfg(feature = "telemetry")]
    let telemetry = crate::telemetry::build_site(agent_path, &agent, counters.clone()).await?;
    #[cfg(not(feature = "telemetry"))]
    let _ = agent_path;
    let bmc_worker = crate::site::bmc::BmcWorker::new(
        agent.state_dir.clone(),
        crate::site::bmc::BmcWorkerOptions::default(),
    );
    let reporter = crate::site::report::Reporter {
        state_dir: agent.state_dir.clone(),
        boot_url: format!("http://{}:{}", config.server_ip, config.http_port),
        dhcp: counters.dhcp.clone(),
        every: crate::site::report::EVERY,
        cache_dir: Some(config.artifacts.clone()),
    };
    let site_agent = crate::site::SiteAgent::new(
        agent,
        crate::site::SiteAgentOptions {
            lease_ttl: lease_ttl.max(std::time::Duration::from_secs(1)),
            artifacts: Some(config.artifacts.clone()),
            cache_max_bytes: config.cache_max_bytes,
            ..Default::default()
        },
    );
    let bound = serve::bind(&config)
        .await
        .with_context(|| format!("starting the services of {}", path.display()))?;
    let (table_tx, table_rx) = tokio::sync::watch::channel(serve::Netboot::default());
    bc_proto::runtime::service::ready("serving; the agent connects to the control plane");
    let _watchdog = bc_proto::runtime::service::spawn_watchdog();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let wait_stop = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    #[cfg(feature = "telemetry")]
    let telemetry = telemetry.map(|t| tokio::spawn(t.run(wait_stop(stop_rx.clone()))));
    let services = serve::run(
        &config,
        bound,
        table_rx,
        counters,
        None,
        wait_stop(stop_rx.clone()),
    );
    let agent_run = async {
        let r = site_agent.run(table_tx, wait_stop(stop_rx.clone())).await;
        let _ = stop_tx.send(true);
        r
    };
    let signal = async {
        bc_proto::runtime::shutdown_signal().await;
        let _ = stop_tx.send(true);
    };
    let bmc_run = bmc_worker.run(wait_stop(stop_rx.clone()));
    let report_run = reporter.run(wait_stop(stop_rx.clone()));
    let (served, agent_result, (), bmc_result, ()) = tokio::join!(
        services,
        agent_run,
        async {
            tokio::select! {
                _ = signal => {}
                _ = wait_stop(stop_rx.clone()) => {}
            }
        },
        bmc_run,
        report_run
    );
    bc_proto::runtime::service::stopping();
    if let Err(e) = bmc_result {
        tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "the BMC worker stopped");
    }
    #[cfg(feature = "telemetry")]
    if let Some(t) = telemetry {
        let _ = t.await;
    }
    agent_result?;
    served.with_context(|| format!("serving {}", path.display()))
}
