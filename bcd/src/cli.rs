//! The `bcd` command line: argument types, the node commands (`join`, `status`, `run`, `telemetry`) and the
//! dispatch to the site's (`bcd site …`, in [`crate::site::cli`]). `main.rs` only calls [`main`]. The handlers are
//! the binary's, so they return `anyhow` errors like a `main` would; the library's own modules do not.

use crate::config::{ConfigWire, GpuBackendChoice};
use anyhow::Context as _;
use bc_error_chain::InlineErrorChain;
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "bcd", version, about = "Better Compute node daemon")]
pub struct Cli {
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
pub struct Overrides {
    #[arg(long)]
    pub gateway_url: Option<String>,
    #[arg(long)]
    pub ca_pin: Option<String>,
    /// JoinService's HPKE public key (base64url). It may begin with `-`, so a value is taken as given.
    #[arg(long, allow_hyphen_values = true)]
    pub join_public_key: Option<String>,
    /// nvml, none, or fixture:<path>.
    #[arg(long)]
    pub gpu_backend: Option<String>,
    /// Read /sys and /proc under this root instead of / (tests, containers).
    #[arg(long)]
    pub hardware_root: Option<PathBuf>,
    /// Where the CDI spec of this node's bookings goes (default /etc/cdi).
    #[arg(long)]
    pub cdi_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
pub enum Command {
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
        command: crate::site::cli::SiteCommand,
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
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell), e.g.
    /// `bcd completion bash > /etc/bash_completion.d/bcd`.
    Completion { shell: clap_complete::Shell },
    /// Print the man page (roff), e.g. `bcd man > /usr/share/man/man1/bcd.1`.
    Man,
    /// Print the systemd unit of a role to stdout (`bcd unit > /etc/systemd/system/bcd.service`): the node
    /// daemon's (`bcd run`) or the site agent's (`bcd site run`). scripts/install.sh installs the node's this way.
    Unit {
        #[arg(long, value_enum, default_value_t = UnitRole::Node)]
        role: UnitRole,
        /// The CDI directory the node's unit leaves writable (the daemon's --cdi-dir / cdi_dir; default /etc/cdi).
        #[arg(long)]
        cdi_dir: Option<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum UnitRole {
    Node,
    Site,
}

/// The systemd unit of `role`, from packaging/systemd (the same files the packages install).
pub fn unit(role: UnitRole, cdi_dir: Option<&str>) -> anyhow::Result<String> {
    match role {
        UnitRole::Site => {
            anyhow::ensure!(
                cdi_dir.is_none(),
                "--cdi-dir is the node's: the site agent writes no CDI spec"
            );
            Ok(include_str!("../../packaging/systemd/bcd-site.service").to_string())
        }
        UnitRole::Node => {
            let cdi = cdi_dir.unwrap_or("/etc/cdi");
            anyhow::ensure!(
                cdi.starts_with('/'),
                "--cdi-dir must be an absolute path (the systemd unit makes it writable by path), not {cdi:?}"
            );
            anyhow::ensure!(
                !cdi.chars().any(char::is_whitespace),
                "--cdi-dir must not contain whitespace (systemd's ReadWritePaths= splits on it): {cdi:?}"
            );
            Ok(include_str!("../../packaging/systemd/bcd.service").replace("@CDI_DIR@", cdi))
        }
    }
}

fn bcd_config(path: Option<PathBuf>) -> PathBuf {
    path.unwrap_or_else(|| PathBuf::from("/etc/bcd/bcd.toml"))
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

/// What `--version` prints (set by [`main`]; the package version alone in tests that call the library).
static VERSION: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

fn version() -> &'static str {
    VERSION.get().copied().unwrap_or(env!("CARGO_PKG_VERSION"))
}

pub(crate) fn load_config(
    path: &Path,
    state_dir: Option<PathBuf>,
    o: Overrides,
) -> anyhow::Result<crate::config::Config> {
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
            tunnels: None,
        })
        .validate(&origin)?)
}

/// The parser with `version` (what `--version` prints: the package version and the commit `main.rs` was stamped
/// with).
pub fn command(version: &'static str) -> clap::Command {
    use clap::CommandFactory as _;
    Cli::command().version(version)
}

/// The binary's `main`: parses the arguments, runs the command, returns the exit status.
pub fn main(version: &'static str) -> i32 {
    VERSION.get_or_init(|| version);
    bc_proto::runtime::quiet_broken_pipe();
    bc_proto::install_crypto_provider();
    bc_proto::runtime::logs::init("BCD_LOG", "info");
    let cli = match command(version)
        .try_get_matches()
        .and_then(|m| <Cli as clap::FromArgMatches>::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // Two workers are plenty for one connection; they keep the idle daemon small.
    let result = bc_proto::runtime::build(Some(2))
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(run(cli)));
    let Err(e) = result else { return 0 };
    #[cfg(feature = "site")]
    if let Some(e @ bcd_site::redfish::RedfishError::Interrupted { .. }) =
        e.downcast_ref::<bcd_site::redfish::RedfishError>()
    {
        eprintln!("bcd site redfish: {e}");
        return 130;
    }
    eprintln!("bcd: error: {e:#}");
    if let Some(e) = e.downcast_ref::<crate::session::RunError>() {
        return e.exit_code();
    }
    #[cfg(feature = "site")]
    if let Some(e) = e.downcast_ref::<crate::site::SiteError>() {
        return e.exit_code();
    }
    1
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
            crate::join::check_token_kind(bc_proto::token::TokenKind::Join, &token)?;
            let config = load_config(&bcd_config(cli.config), cli.state_dir, overrides)?;
            let (backend, gpu_error) = match crate::gpu::open(&config.gpu_backend) {
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
                crate::hardware::collect(&config.hardware_root, backend.as_deref(), gpu_error);
            let gpus = claims.gpus.len();
            let outcome = crate::join::join(
                &config,
                &token,
                crate::join::JoinOptions { attempts, claims },
            )
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
        Command::Site { command } => {
            crate::site::cli::run(command, cli.config, cli.state_dir).await?
        }
        Command::Completion { shell } => {
            clap_complete::generate(
                shell,
                &mut command(version()),
                "bcd",
                &mut std::io::stdout(),
            );
        }
        Command::Man => {
            clap_mangen::Man::new(command(version())).render(&mut std::io::stdout())?;
        }
        Command::Unit { role, cdi_dir } => print!("{}", unit(role, cdi_dir.as_deref())?),
        Command::Status => {
            let dir = cli
                .state_dir
                .unwrap_or_else(|| PathBuf::from("/var/lib/bcd"));
            let state = crate::state::StateDir::open(&dir)?;
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
            let gpu: Option<std::sync::Arc<dyn crate::gpu::GpuBackend>> = match crate::gpu::open(
                &config.gpu_backend,
            ) {
                Ok(b) => Some(std::sync::Arc::from(b)),
                Err(e) => {
                    tracing::warn!(error = %InlineErrorChain::new(&e), "no GPU backend: GPUs will be reported missing");
                    None
                }
            };
            // Telemetry runs beside the session and outlives its reconnects; it stops with the daemon.
            let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            #[cfg(feature = "telemetry")]
            let telemetry = crate::telemetry::build(
                &config_path,
                &config,
                gpu.clone(),
                crate::telemetry::WithoutTable::MetricsOnly,
            )
            .await?
            .inspect(|t| {
                if let Some(addr) = t.metrics_addr() {
                    tracing::info!(%addr, "serving /metrics");
                }
            })
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
                crate::vmm::host::start(&config_path, &config.state_dir, stopped(stop_rx.clone()))
                    .await?;
            let mut daemon = crate::session::Daemon::new(config, gpu);
            daemon.rejoin_token = rejoin_token;
            #[cfg(feature = "vmm")]
            if let Some(v) = &vmm {
                daemon.instances = Some(v.host.clone());
                daemon.hook = Some(v.hook.clone());
            }
            // Ready for the service manager once the local work is running; the session comes up (and goes down)
            // by itself and is reported as status: a node whose gateway is unreachable is running, not failing.
            bc_proto::runtime::service::ready("connecting to the gateway");
            let watchdog = bc_proto::runtime::service::spawn_watchdog();
            let result = daemon.run(stopped(stop_rx.clone())).await;
            bc_proto::runtime::service::stopping();
            drop(watchdog);
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
            let gpu: Option<std::sync::Arc<dyn crate::gpu::GpuBackend>> = match crate::gpu::open(
                &config.gpu_backend,
            ) {
                Ok(b) => Some(std::sync::Arc::from(b)),
                Err(e) => {
                    tracing::warn!(error = %InlineErrorChain::new(&e), "no GPU backend: no GPU metrics");
                    None
                }
            };
            if once {
                let registry = bc_telemetry::Registry::new();
                let sampler = crate::telemetry::NodeSampler::new(
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
            let without = crate::telemetry::WithoutTable::Nothing;
            let Some(t) = crate::telemetry::build(&config_path, &config, gpu, without).await?
            else {
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
