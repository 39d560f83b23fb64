//! `better-compute serve` (the configured roles until a shutdown signal, telling the service manager when they are
//! ready) and the database connection every command of the binary that needs one opens.

use crate::config::ServeConfigWire;
use anyhow::Context as _;
use bc_store::Store;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    /// Comma-separated: api,gateway,controllers,scheduler,sinks,iam (or all).
    #[arg(long)]
    roles: Option<String>,
    #[arg(long, env = "BC_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    #[arg(long)]
    state_dir: Option<PathBuf>,
    #[arg(long)]
    trust_domain: Option<String>,
    #[arg(long)]
    api_listen: Option<String>,
    #[arg(long)]
    gateway_listen: Option<String>,
    /// A DNS name or IP address for the gateway certificate (repeatable).
    #[arg(long = "gateway-host")]
    gateway_hosts: Vec<String>,
    #[arg(long)]
    gateway_url: Option<String>,
    /// Do not run migrations at start (they are run by `migrate` in the deploy).
    #[arg(long)]
    no_migrate: bool,
}

/// `better-compute serve`: the configured roles until a shutdown signal.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let ServeArgs {
        config,
        roles,
        database_url,
        state_dir,
        trust_domain,
        api_listen,
        gateway_listen,
        gateway_hosts,
        gateway_url,
        no_migrate,
    } = args;
    let (base, origin) = match &config {
        Some(p) => (ServeConfigWire::from_file(p)?, p.display().to_string()),
        None => (ServeConfigWire::default(), "command line".to_string()),
    };
    let cfg = base
        .overlay(ServeConfigWire {
            state_dir,
            database_url,
            trust_domain,
            roles,
            api_listen,
            gateway_listen,
            gateway_hosts: (!gateway_hosts.is_empty()).then_some(gateway_hosts),
            gateway_url,
            shard_lease_ms: None,
            telemetry: None,
            capacity: None,
            ..ServeConfigWire::default()
        })
        .validate(&origin)?;
    let url = cfg.database_url.clone().context(
        "INVALID_CONFIG: database_url is required (flag --database-url or BC_DATABASE_URL)",
    )?;
    let store = connect(&url).await?;
    if !no_migrate {
        crate::migrate(&store).await?;
    }
    let mut running = crate::start_with(&cfg, store, false).await?;
    let stop = bc_proto::runtime::shutdown_signal();
    if let Some(addr) = running.metrics_addr {
        tracing::info!(%addr, "serving /metrics");
    }
    println!(
        "serving: api={} gateway={} ca_pin={} join_key={}",
        running
            .api_addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into()),
        running
            .gateway_addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into()),
        running.ca_pin,
        running.join_public_key
    );
    bc_proto::runtime::service::ready(&format!(
        "serving: api={} gateway={}",
        running
            .api_addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into()),
        running
            .gateway_addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into()),
    ));
    let watchdog = bc_proto::runtime::service::spawn_watchdog();
    tokio::select! {
        _ = stop => {}
        _ = running.wait_any() => tracing::error!("a role stopped on its own"),
    }
    bc_proto::runtime::service::stopping();
    drop(watchdog);
    running.shutdown().await;
    Ok(())
}

/// A pool on the database at `url`, or an error that names why not at once. The URL may list several hosts
/// (libpq's `host1:port1,host2:port2` with `target_session_attrs=read-write`): the pool follows the primary among
/// them ([`bc_store::multihost`]).
pub async fn connect(url: &str) -> anyhow::Result<Store> {
    // Each host is given 10 s to answer, so a database that refuses or does not answer is named at once: a pool
    // would retry in silence for 30 s and then say only "pool timed out".
    const PROBE: std::time::Duration = std::time::Duration::from_secs(10);
    bc_store::multihost::connect(url, 64, PROBE)
        .await
        .map_err(|e| match e {
            bc_store::multihost::TargetsError::NoHost { .. } => anyhow::anyhow!(
                "connecting to PostgreSQL: {e} (check the database URL's hosts and ports, that the server runs, and \
                 that nothing drops the traffic)"
            ),
            e => anyhow::Error::new(e).context("connecting to PostgreSQL"),
        })
}
