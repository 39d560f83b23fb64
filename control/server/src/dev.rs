//! `better-compute dev`: a private PostgreSQL under a data directory, migrated, every role in one process on
//! localhost, an administrator key, a fresh join token. A second `dev` on the same directory reuses the database,
//! the CA, the JoinService key and the admin key.

use crate::config::{Roles, ServeConfig};
use bc_core::join::Expectations;
use bc_proto::token::{Token, TokenKind};
use bc_store::Store;
use bc_store::embedded::{Durability, EmbeddedPostgres};
use bc_store::join_tokens::NewJoinToken;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub const DATABASE: &str = "bettercompute";
pub const DEFAULT_POOL: &str = "default";

pub struct DevOptions {
    pub data_dir: PathBuf,
    pub api_listen: SocketAddr,
    pub gateway_listen: SocketAddr,
    pub trust_domain: String,
    /// More names or addresses for the gateway's certificate, the first of them in the gateway URL nodes get (a
    /// lab whose machines reach the gateway on a segment address).
    pub gateway_hosts: Vec<String>,
    /// The metal module's configuration (`[metal]` of a configuration file).
    pub metal: bc_mod_metal::Config,
}

/// What `dev` prints when it is ready (and writes to `<data>/dev.env`).
pub struct DevReady {
    pub api_url: String,
    pub gateway_url: String,
    pub admin_key: String,
    pub ca_pin: String,
    pub join_public_key: String,
    pub join_token: String,
    pub database_url: String,
    pub ready_ms: u128,
}

/// How long `dev` waits for its database pool to close once the roles have stopped.
const POOL_CLOSE: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs dev mode until `shutdown` resolves; `on_ready` is called once everything listens.
pub async fn run(
    opts: DevOptions,
    on_ready: impl FnOnce(&DevReady),
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    std::fs::create_dir_all(&opts.data_dir)?;
    let data_dir = std::fs::canonicalize(&opts.data_dir)?;
    // The postgres user (when we are root) must be able to reach its directory.
    let mut perms = std::fs::metadata(&data_dir)?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o711);
    std::fs::set_permissions(&data_dir, perms)?;
    let pg_dir = data_dir.join("pg");
    let pg =
        tokio::task::spawn_blocking(move || EmbeddedPostgres::start(&pg_dir, Durability::Durable))
            .await??;
    let admin_pool = pg.pool("postgres", 2).await?;
    let exists: Option<i32> =
        bc_store::sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
            .bind(DATABASE)
            .fetch_optional(&admin_pool)
            .await?;
    if exists.is_none() {
        bc_store::sqlx::raw_sql("CREATE DATABASE bettercompute")
            .execute(&admin_pool)
            .await?;
    }
    admin_pool.close().await;
    let pool = pg.pool(DATABASE, 64).await?;
    let store = Store::new(pool);
    crate::migrate(&store).await?;
    store.ensure_root_tenant().await?;
    store
        .ensure_pool(
            DEFAULT_POOL,
            bc_store::iam::ROOT_TENANT,
            "default pool",
            true,
        )
        .await?;

    let key_path = data_dir.join("admin.key");
    let admin_key = match std::fs::read_to_string(&key_path) {
        Ok(k) if crate::restore_admin(&store, k.trim()).await? => k.trim().to_string(),
        _ => {
            let k = crate::bootstrap_admin(&store).await?;
            crate::ca::write_private(&key_path, k.as_bytes())?;
            k
        }
    };

    let mut gateway_hosts = opts.gateway_hosts.clone();
    for h in ["localhost", "127.0.0.1"] {
        if !gateway_hosts.iter().any(|g| g == h) {
            gateway_hosts.push(h.into());
        }
    }
    let config = ServeConfig {
        api_listen: opts.api_listen,
        gateway_listen: opts.gateway_listen,
        gateway_hosts,
        metal: opts.metal.clone(),
        telemetry: Some(dev_metrics(&data_dir.join("state"))?),
        ..ServeConfig::loopback(data_dir.join("state"), &opts.trust_domain, Roles::all())
    };
    let running = crate::start(&config, store.clone()).await?;

    let token = Token::generate(TokenKind::Join)?;
    let expires_at_ms = (time::OffsetDateTime::now_utc().unix_timestamp() + 86_400) * 1000;
    store
        .create_join_token(NewJoinToken {
            id: token.id(),
            pool_id: DEFAULT_POOL,
            secret_hash: &token.secret().hash(),
            uses: 16,
            expires_at_ms,
            expect: &Expectations::default(),
            reclaim: true,
            created_by: "dev",
        })
        .await?;

    let ready = DevReady {
        api_url: running
            .api_addr
            .map(|a| format!("http://{a}"))
            .unwrap_or_default(),
        gateway_url: running.gateway_url.clone(),
        admin_key,
        ca_pin: running.ca_pin.clone(),
        join_public_key: running.join_public_key.clone(),
        join_token: token.reveal(),
        database_url: pg.url(DATABASE),
        ready_ms: t0.elapsed().as_millis(),
    };
    crate::ca::write_private(
        &data_dir.join("dev.env"),
        format!(
            "BC_API_URL={}\nBC_API_KEY={}\nBC_GATEWAY_URL={}\nBC_CA_PIN={}\nBC_JOIN_KEY={}\nBC_JOIN_TOKEN={}\nBC_DATABASE_URL={}\n",
            ready.api_url,
            ready.admin_key,
            ready.gateway_url,
            ready.ca_pin,
            ready.join_public_key,
            ready.join_token,
            ready.database_url
        )
        .as_bytes(),
    )?;
    on_ready(&ready);
    shutdown.await;
    stop(running, &store, pg).await
}

/// Stops the roles, then the pool (within [`POOL_CLOSE`]), then PostgreSQL, and logs each step's time.
async fn stop(running: crate::Running, store: &Store, pg: EmbeddedPostgres) -> anyhow::Result<()> {
    let stopping = Instant::now();
    running.shutdown().await;
    let roles = stopping.elapsed();
    // Closing the pool waits for every connection, and a task the roles left behind (a join's commit loop, a
    // session's open batches) may still wait on the pool for a database that is gone: 30 s, its acquire timeout.
    // Stopping PostgreSQL next ends every connection anyway.
    if tokio::time::timeout(POOL_CLOSE, store.pool().close())
        .await
        .is_err()
    {
        tracing::warn!(
            waited_s = POOL_CLOSE.as_secs(),
            "the database pool did not close in time; stopping PostgreSQL"
        );
    }
    let pool = stopping.elapsed();
    tokio::task::spawn_blocking(move || pg.stop()).await?;
    tracing::info!(
        roles_ms = roles.as_millis(),
        pool_ms = pool.as_millis(),
        postgres_ms = stopping.elapsed().as_millis(),
        "dev stopped"
    );
    Ok(())
}

/// What `better-compute dev` prints once it is ready: the addresses, keys and token to use, and the environment
/// file that holds them.
pub fn print_ready(r: &DevReady, data_dir: &Path) {
    println!(
        "better-compute dev is ready in {} ms (data in {})",
        r.ready_ms,
        data_dir.display()
    );
    println!("  api:           {}", r.api_url);
    println!("  gateway:       {}", r.gateway_url);
    println!("  admin key:     {}", r.admin_key);
    println!("  CA pin:        {}", r.ca_pin);
    println!("  join key:      {}", r.join_public_key);
    println!(
        "  join token:    {}  (pool default, 16 uses, 24h, reclaim)",
        r.join_token
    );
    println!("  environment:   {}/dev.env", data_dir.display());
}

/// `dev` serves `/metrics` like `serve` ([`crate::telemetry::DEFAULT_METRICS_LISTEN`], off with a warning when
/// another process holds it) and exports nowhere.
fn dev_metrics(
    state_dir: &std::path::Path,
) -> Result<bc_telemetry::TelemetryConfig, bc_telemetry::config::TelemetryConfigError> {
    bc_telemetry::TelemetryWire::default().validate_with(
        "better-compute dev",
        state_dir.join("telemetry"),
        Some(crate::telemetry::DEFAULT_METRICS_LISTEN),
    )
}
