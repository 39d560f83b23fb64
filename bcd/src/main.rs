//! `bcd`: the node daemon binary. Parses arguments, builds the runtime, calls the library.

use anyhow::Context as _;
use bcd::config::{ConfigWire, GpuBackendChoice};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "bcd", version, about = "Better Compute node daemon")]
struct Cli {
    /// Configuration file: /etc/bcd/bcd.toml (written by the install script) for join and run,
    /// /etc/bcd/site.toml for `site serve`.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// State directory (node key, certificate, identity).
    #[arg(long, global = true, env = "BCD_STATE_DIR")]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct Overrides {
    #[arg(long)]
    gateway_url: Option<String>,
    #[arg(long)]
    ca_pin: Option<String>,
    /// JoinService's HPKE public key (base64url). It may begin with `-`, so a value is taken as given.
    #[arg(long, allow_hyphen_values = true)]
    join_public_key: Option<String>,
    /// nvml, none, or fixture:<path>.
    #[arg(long)]
    gpu_backend: Option<String>,
    /// Read /sys and /proc under this root instead of / (tests, containers).
    #[arg(long)]
    hardware_root: Option<PathBuf>,
    /// Where the CDI spec of this node's bookings goes (default /etc/cdi).
    #[arg(long)]
    cdi_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Join the control plane with a join token (bcjt_…). Safe to re-run after a crash.
    Join {
        /// The token; prefer BCD_JOIN_TOKEN or --token-file so it stays out of the process list.
        #[arg(env = "BCD_JOIN_TOKEN", hide_env_values = true)]
        token: Option<String>,
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Attempts while the gateway is unreachable.
        #[arg(long, default_value_t = 8)]
        attempts: u32,
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Show this node's identity and certificate lifetime.
    Status,
    /// Rack agent commands (`bcd site`).
    #[cfg(feature = "site")]
    Site {
        #[command(subcommand)]
        command: SiteCommand,
    },
    /// Sample and export telemetry only, as configured in bcd.toml's [telemetry] table (no session): to check the
    /// configuration, or on a host that runs bcd only as its exporter. `bcd run` does the same beside the session.
    #[cfg(feature = "telemetry")]
    Telemetry {
        /// Print one sample in the Prometheus text format to stdout and exit (nothing is sent).
        #[arg(long)]
        once: bool,
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Run the daemon: the session with the gateway (reconnects by itself), and telemetry when bcd.toml has a
    /// [telemetry] table.
    ///
    /// Exits 3 when the node needs a join token (its certificate expired while it was offline and no token was
    /// given), 4 when the control plane refuses it (revoked).
    Run {
        /// A join token to rejoin with (by reclaim) should the certificate have expired while the node was offline.
        #[arg(long = "join-token", env = "BCD_JOIN_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// A file holding that token.
        #[arg(long, env = "BCD_JOIN_TOKEN_FILE")]
        token_file: Option<PathBuf>,
        #[command(flatten)]
        overrides: Overrides,
    },
}

#[cfg(feature = "site")]
#[derive(Subcommand)]
enum SiteCommand {
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
        /// Boot lease length in seconds (renewed every third of it).
        #[arg(long, default_value_t = 15)]
        lease_ttl: u64,
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

#[cfg(feature = "site")]
#[derive(Subcommand)]
enum RedfishAction {
    /// Print the inventory: systems, processors and GPUs, memory, storage, NICs, PCIe devices.
    Inspect,
    /// on, off, graceful-off, reset, graceful-restart, cycle.
    Power { action: String },
    /// One-time boot override: pxe or http.
    BootOnce { target: String },
}

/// Where `bcd site redfish` takes the BMC credentials from.
#[cfg(feature = "site")]
enum BmcCredentialSource {
    /// A secret of the site, from the control plane's broker.
    Secret { state_dir: PathBuf, name: String },
    /// `--user` and the password in an environment variable.
    Env { user: String, password_env: String },
}

#[cfg(feature = "site")]
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
            let creds = bcd::site::fetch_bmc_credentials(&state_dir, &name).await?;
            let site = bcd::state::StateDir::open(&state_dir)
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
    // operation and logs the BMC session out before exiting (status 130).
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
    if let Err(e @ redfish::RedfishError::Interrupted { .. }) = &result {
        eprintln!("bcd site redfish: {e}");
        std::process::exit(130);
    }
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
#[cfg(feature = "site")]
const SITE_STATE_DIR: &str = "/var/lib/bcd-site";

fn bcd_config(path: Option<PathBuf>) -> PathBuf {
    path.unwrap_or_else(|| PathBuf::from("/etc/bcd/bcd.toml"))
}

/// `bcd site serve`: the config file's [[machine]] list is the netboot table's source; SIGHUP re-reads it (an
/// invalid file is reported and the running table kept). The control-plane session will be another source
/// feeding the same channel.
#[cfg(feature = "site")]
async fn site_serve(path: &Path) -> anyhow::Result<()> {
    use bcd_site::serve;
    let config = serve::SiteConfig::from_file(path)?;
    let bound = serve::bind(&config)
        .await
        .with_context(|| format!("starting the services of {}", path.display()))?;
    let (table_tx, table_rx) = tokio::sync::watch::channel(config.netboot.clone());
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
                    error = %format!("{:#}", anyhow::Error::from(e)),
                    "reload refused; keeping the running table"
                ),
            }
        }
    });
    let result = serve::run(
        &config,
        bound,
        table_rx,
        serve::SiteCounters::default(),
        None,
        bc_proto::runtime::shutdown_signal(),
    )
    .await;
    reload.abort();
    result.with_context(|| format!("serving {}", path.display()))
}

/// `bcd site run`: the site services, fed by the control plane while this agent holds the boot lease.
#[cfg(feature = "site")]
async fn site_run(
    path: &Path,
    agent_path: &Path,
    agent: bcd::config::Config,
    lease_ttl: u64,
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
    let telemetry = bcd::telemetry::build_site(agent_path, &agent, counters.clone()).await?;
    #[cfg(not(feature = "telemetry"))]
    let _ = agent_path;
    let site_agent = bcd::site::SiteAgent::new(
        agent,
        bcd::site::SiteAgentOptions {
            lease_ttl: std::time::Duration::from_secs(lease_ttl.max(1)),
            artifacts: Some(config.artifacts.clone()),
            cache_max_bytes: config.cache_max_bytes,
            ..Default::default()
        },
    );
    let bound = serve::bind(&config)
        .await
        .with_context(|| format!("starting the services of {}", path.display()))?;
    let (table_tx, table_rx) = tokio::sync::watch::channel(serve::Netboot::default());
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
    let (served, agent_result, ()) = tokio::join!(services, agent_run, async {
        tokio::select! {
            _ = signal => {}
            _ = wait_stop(stop_rx.clone()) => {}
        }
    });
    #[cfg(feature = "telemetry")]
    if let Some(t) = telemetry {
        let _ = t.await;
    }
    agent_result?;
    served.with_context(|| format!("serving {}", path.display()))
}

/// `bcd telemetry` needs no gateway: fill the connection settings with inert values where neither the file nor the
/// command line gives them, so a telemetry-only bcd.toml validates.
#[cfg(feature = "telemetry")]
fn telemetry_placeholders(path: &Path, o: &mut Overrides) -> anyhow::Result<()> {
    let base = if path.exists() {
        ConfigWire::from_file(path)?
    } else {
        ConfigWire::default()
    };
    if base.gateway_url.is_none() && o.gateway_url.is_none() {
        o.gateway_url = Some("https://127.0.0.1:1".into());
    }
    if base.ca_pin.is_none() && o.ca_pin.is_none() {
        o.ca_pin = Some(format!("sha256:{}", "0".repeat(64)));
    }
    if base.join_public_key.is_none() && o.join_public_key.is_none() {
        o.join_public_key = Some(bc_proto::seal::generate_join_keypair().1.encode());
    }
    Ok(())
}

fn load_config(
    path: &Path,
    state_dir: Option<PathBuf>,
    o: Overrides,
) -> anyhow::Result<bcd::config::Config> {
    let (base, origin) = if path.exists() {
        (ConfigWire::from_file(path)?, path.display().to_string())
    } else {
        (ConfigWire::default(), "command line".to_string())
    };
    Ok(base
        .overlay(ConfigWire {
            gateway_url: o.gateway_url,
            ca_pin: o.ca_pin,
            join_public_key: o.join_public_key,
            state_dir,
            gpu_backend: o.gpu_backend,
            hardware_root: o.hardware_root,
            cdi_dir: o.cdi_dir,
        })
        .validate(&origin)?)
}

fn main() {
    bc_proto::install_crypto_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BCD_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: logs written to files and journals stay greppable.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    // Two workers are plenty for one connection; they keep the idle daemon small.
    let result = bc_proto::runtime::build(Some(2))
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(run(cli)));
    if let Err(e) = result {
        eprintln!("bcd: error: {e:#}");
        let code = e
            .downcast_ref::<bcd::session::RunError>()
            .map(bcd::session::RunError::exit_code)
            .or_else(|| {
                #[cfg(feature = "site")]
                {
                    e.downcast_ref::<bcd::site::SiteError>()
                        .map(bcd::site::SiteError::exit_code)
                }
                #[cfg(not(feature = "site"))]
                {
                    None
                }
            })
            .unwrap_or(1);
        std::process::exit(code);
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Join {
            token,
            token_file,
            attempts,
            overrides,
        } => {
            let token = match (token, token_file) {
                (Some(t), _) => t,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .with_context(|| format!("reading {}", f.display()))?,
                (None, None) => anyhow::bail!(
                    "give the join token as an argument, in BCD_JOIN_TOKEN or with --token-file"
                ),
            };
            // A site token is refused (naming `bcd site enroll`) before anything is written or sent.
            bcd::join::check_token_kind(bc_proto::token::TokenKind::Join, &token)?;
            let config = load_config(&bcd_config(cli.config), cli.state_dir, overrides)?;
            let (backend, gpu_error) = match bcd::gpu::open(&config.gpu_backend) {
                Ok(b) => (Some(b), None),
                Err(e) if config.gpu_backend == GpuBackendChoice::Nvml => {
                    (None, Some(e.to_string()))
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(e) = &gpu_error {
                tracing::warn!(error = %e, "no GPUs reported");
            }
            let claims =
                bcd::hardware::collect(&config.hardware_root, backend.as_deref(), gpu_error);
            let gpus = claims.gpus.len();
            let outcome =
                bcd::join::join(&config, &token, bcd::join::JoinOptions { attempts, claims })
                    .await?;
            let how = if outcome.replayed {
                " (a retry of an earlier join: same node, no token use spent)"
            } else if outcome.reclaimed {
                " (reclaimed: same node as before)"
            } else {
                ""
            };
            println!(
                "joined as node {} in pool {} with {gpus} GPU(s){how}",
                outcome.identity.node_id, outcome.identity.pool
            );
            println!(
                "identity {}; state in {}",
                outcome.identity.spiffe_id,
                config.state_dir.display()
            );
        }
        #[cfg(feature = "site")]
        Command::Site {
            command: SiteCommand::Serve,
        } => {
            let path = cli
                .config
                .unwrap_or_else(|| PathBuf::from("/etc/bcd/site.toml"));
            site_serve(&path).await?
        }
        #[cfg(feature = "site")]
        Command::Site {
            command:
                SiteCommand::Enroll {
                    token,
                    token_file,
                    attempts,
                    agent_config,
                    overrides,
                },
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
            bcd::join::check_token_kind(bc_proto::token::TokenKind::Site, &token)?;
            let state_dir = cli.state_dir.or(Some(PathBuf::from(SITE_STATE_DIR)));
            let mut overrides = overrides;
            overrides.gpu_backend.get_or_insert_with(|| "none".into());
            let config = load_config(&agent_config, state_dir, overrides)?;
            let claims = bcd::hardware::collect(&config.hardware_root, None, None);
            let outcome = bcd::join::enroll_site(
                &config,
                &token,
                bcd::join::JoinOptions { attempts, claims },
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
        #[cfg(feature = "site")]
        Command::Site {
            command:
                SiteCommand::Run {
                    agent_config,
                    lease_ttl,
                    overrides,
                },
        } => {
            let state_dir = cli.state_dir.or(Some(PathBuf::from(SITE_STATE_DIR)));
            let mut overrides = overrides;
            overrides.gpu_backend.get_or_insert_with(|| "none".into());
            let agent = load_config(&agent_config, state_dir, overrides)?;
            let path = cli
                .config
                .unwrap_or_else(|| PathBuf::from("/etc/bcd/site.toml"));
            site_run(&path, &agent_config, agent, lease_ttl).await?
        }
        #[cfg(feature = "site")]
        Command::Site {
            command:
                SiteCommand::Redfish {
                    url,
                    secret,
                    user,
                    password_env,
                    pin,
                    system,
                    action,
                },
        } => {
            let source = match secret {
                Some(name) => BmcCredentialSource::Secret {
                    state_dir: cli
                        .state_dir
                        .unwrap_or_else(|| PathBuf::from(SITE_STATE_DIR)),
                    name,
                },
                None => BmcCredentialSource::Env {
                    user: user.unwrap_or_else(|| "root".into()),
                    password_env: password_env.unwrap_or_else(|| "BMC_PASSWORD".into()),
                },
            };
            redfish(&url, source, pin, system, action).await?
        }
        Command::Status => {
            let dir = cli
                .state_dir
                .unwrap_or_else(|| PathBuf::from("/var/lib/bcd"));
            let state = bcd::state::StateDir::open(&dir)?;
            match state.identity()? {
                None => println!("not joined (state in {})", dir.display()),
                Some(id) => {
                    let now = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
                    println!("node {} ({})", id.node_id, id.spiffe_id);
                    println!("pool {}; gateway {}", id.pool, id.gateway_url);
                    println!(
                        "certificate expires in {} min",
                        (id.not_after_ms - now) / 60_000
                    );
                }
            }
        }
        Command::Run {
            token,
            token_file,
            overrides,
        } => {
            let rejoin_token = match (token, token_file) {
                (Some(t), _) => Some(t.trim().to_string()),
                (None, Some(f)) => Some(
                    std::fs::read_to_string(&f)
                        .with_context(|| format!("reading the join token file {}", f.display()))?
                        .trim()
                        .to_string(),
                ),
                (None, None) => None,
            };
            let config_path = bcd_config(cli.config);
            let config = load_config(&config_path, cli.state_dir, overrides)?;
            let gpu: Option<std::sync::Arc<dyn bcd::gpu::GpuBackend>> =
                match bcd::gpu::open(&config.gpu_backend) {
                    Ok(b) => Some(std::sync::Arc::from(b)),
                    Err(e) => {
                        tracing::warn!(error = %e, "no GPU backend: GPUs will be reported missing");
                        None
                    }
                };
            // Telemetry runs beside the session and outlives its reconnects; it stops with the daemon.
            let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            #[cfg(feature = "telemetry")]
            let telemetry = bcd::telemetry::build(&config_path, &config, gpu.clone())
                .await?
                .map(|t| tokio::spawn(t.run(stopped(stop_rx.clone()))));
            let signal = bc_proto::runtime::shutdown_signal();
            let signal_tx = stop_tx.clone();
            let watcher = tokio::spawn(async move {
                signal.await;
                let _ = signal_tx.send(true);
            });
            // VPS instances ([vmm] in bcd.toml): the supervisor stops with the daemon; its VMs keep running.
            #[cfg(feature = "vmm")]
            let vmm =
                bcd::vmm::host::start(&config_path, &config.state_dir, stopped(stop_rx.clone()))
                    .await?;
            let mut daemon = bcd::session::Daemon::new(config, gpu);
            daemon.rejoin_token = rejoin_token;
            #[cfg(feature = "vmm")]
            if let Some(v) = &vmm {
                daemon.instances = Some(v.host.clone());
                daemon.hook = Some(v.hook.clone());
            }
            let result = daemon.run(stopped(stop_rx.clone())).await;
            let _ = stop_tx.send(true);
            watcher.abort();
            #[cfg(feature = "telemetry")]
            if let Some(t) = telemetry {
                let _ = t.await;
            }
            #[cfg(feature = "vmm")]
            if let Some(v) = vmm {
                let _ = v.task.await;
            }
            result?;
        }
        #[cfg(feature = "telemetry")]
        Command::Telemetry { once, overrides } => {
            let config_path = bcd_config(cli.config);
            let mut overrides = overrides;
            // The gateway settings are not needed to export; placeholders keep validation happy when absent.
            telemetry_placeholders(&config_path, &mut overrides)?;
            let config = load_config(&config_path, cli.state_dir, overrides)?;
            let gpu: Option<std::sync::Arc<dyn bcd::gpu::GpuBackend>> =
                match bcd::gpu::open(&config.gpu_backend) {
                    Ok(b) => Some(std::sync::Arc::from(b)),
                    Err(e) => {
                        tracing::warn!(error = %e, "no GPU backend: no GPU metrics");
                        None
                    }
                };
            if once {
                let registry = bc_telemetry::Registry::new();
                let sampler = bcd::telemetry::NodeSampler::new(
                    &registry,
                    gpu,
                    &config.hardware_root,
                    &config.state_dir,
                );
                registry.register(std::sync::Arc::new(sampler));
                let at_ms = time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
                let mut out = String::new();
                bc_telemetry::exposition::render(&registry.collect(at_ms as i64), &mut out);
                print!("{out}");
                return Ok(());
            }
            let Some(t) = bcd::telemetry::build(&config_path, &config, gpu).await? else {
                anyhow::bail!(
                    "{} has no [telemetry] table: add one (docs/telemetry.md) or use --once to print a sample",
                    config_path.display()
                );
            };
            if let Some(addr) = t.metrics_addr() {
                tracing::info!(%addr, "serving /metrics");
            }
            t.run(bc_proto::runtime::shutdown_signal()).await;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_join_key_that_begins_with_a_hyphen_is_taken_as_the_value() {
        // base64url keys begin with '-' one time in 64; clap took them for a flag (a CI run failed on one).
        for argv in [
            vec!["bcd", "run", "--join-public-key", "-Tk0x"],
            vec!["bcd", "join", "--join-public-key", "-Tk0x", "bcjt_x.y"],
        ] {
            let cli = Cli::try_parse_from(&argv);
            assert!(
                cli.is_ok(),
                "{argv:?}: {:?}",
                cli.err().map(|e| e.to_string())
            );
        }
    }
}
