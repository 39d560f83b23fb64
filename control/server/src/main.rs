//! `better-compute`: the control plane binary. Parses arguments, builds the runtime, calls the library.

use anyhow::Context as _;
use bc_control::client::ApiClient;
use bc_control::config::ServeConfigWire;
use bc_core::api::nodes::{self as api, CommandState};
use bc_mod_nodes::methods as nodes;
use bc_store::Store;
use clap::{Parser, Subcommand};
use serde_json::json;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "better-compute",
    version,
    about = "Better Compute control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ApiArgs {
    /// Control-plane API URL.
    #[arg(long, env = "BC_API_URL", default_value = "http://127.0.0.1:7080")]
    api_url: String,
    /// API key (bcak_…).
    #[arg(long, env = "BC_API_KEY", hide_env_values = true)]
    api_key: String,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the embedded database migrations (once per deploy).
    Migrate {
        #[arg(long, env = "BC_DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Serve the given roles.
    Serve {
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
    },
    /// Everything in one process on a private PostgreSQL under --data-dir. No other setup.
    Dev {
        #[arg(long, default_value = ".bc-dev")]
        data_dir: PathBuf,
        #[arg(long, default_value = "127.0.0.1:7080")]
        api_listen: SocketAddr,
        #[arg(long, default_value = "127.0.0.1:7443")]
        gateway_listen: SocketAddr,
        #[arg(long, default_value = "dev.bettercompute.local")]
        trust_domain: String,
    },
    /// Create the administrator principal (or give it a new key) and print its API key.
    BootstrapAdmin {
        #[arg(long, env = "BC_DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Join tokens: create, list, revoke.
    JoinTokens {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: JoinTokenCommand,
    },
    /// Commands queued for nodes: show (state, progress, signed result).
    Commands {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: CommandsCommand,
    },
    /// Nodes: list, show, drain, undrain, revoke, command.
    Nodes {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: NodeCommand,
    },
    /// Sites (rack agents enrolled with site tokens): revoke.
    Sites {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::site_cli::SiteCommand,
    },
    /// Site tokens (bcst_… for `bcd site enroll`): create, list, revoke.
    SiteTokens {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::site_cli::SiteTokenCommand,
    },
    /// Machines a site netboots: create, list, set-boot.
    Machines {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::site_cli::MachineCommand,
    },
    /// Secrets brokered to sites (BMC credentials): put.
    Secrets {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::site_cli::SecretCommand,
    },
    /// Artifacts sites boot (kernels, initramfs, images), content-addressed: put, list.
    Artifacts {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::site_cli::ArtifactCommand,
    },
    /// Bare-metal machines through the metal flow: enroll, inspect, provide, deploy, release, abort, retry, show, list.
    Metal {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::metal_cli::MetalCommand,
    },
    /// Reservations: create, list, show, release.
    Reservations {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: ReservationCommand,
    },
}

#[derive(Subcommand)]
enum ReservationCommand {
    /// Reserve GPUs; waits for the placer and prints the reservation (id, node, GPU UUIDs).
    Create {
        #[arg(long, default_value = "root")]
        tenant: String,
        #[arg(long)]
        gpus: u32,
        /// GPU model as nodes report it (any when absent).
        #[arg(long)]
        model: Option<String>,
        /// node (all on one node), nvlink (one NVLink clique) or any.
        #[arg(long, default_value = "node")]
        topology: String,
        /// How long: 90s, 30m, 24h, 7d.
        #[arg(long, default_value = "1h")]
        duration: String,
        /// The pool to book in (required when the control plane places by pool).
        #[arg(long)]
        pool: Option<String>,
        /// Retrying with the same key and request returns the same reservation.
        #[arg(long)]
        idempotency_key: Option<String>,
    },
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    Show {
        id: String,
    },
    Release {
        id: String,
    },
}

#[derive(Subcommand)]
enum JoinTokenCommand {
    /// Create a token; prints the token (shown once) on stdout.
    Create {
        #[arg(long, default_value = "default")]
        pool: String,
        #[arg(long, default_value_t = 1)]
        uses: i32,
        /// Lifetime: 90s, 30m, 24h, 7d.
        #[arg(long, default_value = "24h")]
        ttl: String,
        /// Hardware the joining node must match, e.g. --expect gpu.count=8 (repeatable).
        #[arg(long = "expect", value_name = "CLAIM=VALUE")]
        expect: Vec<String>,
        /// Allow re-adopting an existing node whose hardware key matches.
        #[arg(long)]
        reclaim: bool,
    },
    List {
        #[arg(long)]
        pool: Option<String>,
    },
    Revoke {
        id: String,
    },
}

#[derive(Subcommand)]
enum NodeCommand {
    /// Nodes with state, online, GPUs and last seen.
    List,
    /// One node: state, conditions, GPUs, inventory, last seen.
    Show { id: String },
    /// Stop handing out this node's GPUs: once this returns no new booking lands on it (existing ones stay).
    Drain { id: String },
    /// Hand out a drained node's GPUs again.
    Undrain { id: String },
    /// Refuse this node's identity from now on (its session is closed within a liveness interval).
    Revoke { id: String },
    /// Queue a command for the node's daemon (e.g. ramdisk.wipe, ramdisk.stream, ramdisk.diagnose); prints its id.
    Command {
        node: String,
        kind: String,
        /// Arguments: a JSON object (at most 64 KiB), e.g. '{"disks": ["vda"]}'.
        #[arg(long, default_value = "{}")]
        args: String,
        /// Seconds until the command expires unanswered.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
}

#[derive(Subcommand)]
enum CommandsCommand {
    /// A command's state, latest progress, result and error.
    Show {
        id: String,
        /// Wait until it finishes (done, failed or expired), printing progress as it changes.
        #[arg(long)]
        wait: bool,
    },
}

fn parse_ttl(s: &str) -> anyhow::Result<i64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1),
        Some((i, 'm')) => (&s[..i], 60),
        Some((i, 'h')) => (&s[..i], 3600),
        Some((i, 'd')) => (&s[..i], 86_400),
        _ => (s, 1),
    };
    let n: i64 = num
        .parse()
        .with_context(|| format!("--ttl {s:?}: expected a number with s, m, h or d"))?;
    Ok(n * mult)
}

fn main() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BC_LOG")
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = bc_proto::runtime::build(None)?;
    rt.block_on(run(cli))
}

async fn connect(url: &str) -> anyhow::Result<Store> {
    let pool = bc_store::sqlx::postgres::PgPoolOptions::new()
        .max_connections(64)
        .connect(url)
        .await
        .context("connecting to PostgreSQL")?;
    Ok(Store::new(pool))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { database_url } => {
            let store = connect(&database_url).await?;
            let n = bc_store::migrate::migrate_with(store.pool(), &bc_control::module_migrations())
                .await?;
            println!("applied {n} migration(s)");
        }
        Command::BootstrapAdmin { database_url } => {
            let store = connect(&database_url).await?;
            println!("{}", bc_control::bootstrap_admin(&store).await?);
        }
        command @ Command::Serve { .. } => serve(command).await?,
        Command::Dev {
            data_dir,
            api_listen,
            gateway_listen,
            trust_domain,
        } => {
            let opts = bc_control::dev::DevOptions {
                data_dir: data_dir.clone(),
                api_listen,
                gateway_listen,
                trust_domain,
            };
            bc_control::dev::run(
                opts,
                |r| {
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
                },
                bc_proto::runtime::shutdown_signal(),
            )
            .await?;
        }
        Command::JoinTokens { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            join_tokens(&client, command).await?;
        }
        Command::Sites { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            bc_control::site_cli::sites(&client, command).await?;
        }
        Command::SiteTokens { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            bc_control::site_cli::site_tokens(&client, command).await?;
        }
        Command::Machines { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            bc_control::site_cli::machines(&client, command).await?;
        }
        Command::Secrets { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            bc_control::site_cli::secrets(&client, command).await?;
        }
        Command::Artifacts { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            bc_control::site_cli::artifacts(&client, command).await?;
        }
        Command::Metal { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            bc_control::metal_cli::metal(&client, command).await?;
        }
        Command::Reservations { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            reservations(&client, command).await?;
        }
        Command::Nodes { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            nodes(&client, command).await?;
        }
        Command::Commands { api, command } => {
            let client = ApiClient::new(&api.api_url, &api.api_key);
            commands(&client, command).await?;
        }
    }
    Ok(())
}

async fn join_tokens(client: &ApiClient, command: JoinTokenCommand) -> anyhow::Result<()> {
    match command {
        JoinTokenCommand::Create {
            pool,
            uses,
            ttl,
            expect,
            reclaim,
        } => {
            let mut exp = std::collections::BTreeMap::new();
            for e in expect {
                let (k, v) = e.split_once('=').context("--expect must be CLAIM=VALUE")?;
                exp.insert(k.to_string(), v.to_string());
            }
            let t = client
                .method::<nodes::CreateJoinTokenMethod>(&api::CreateJoinToken {
                    pool: pool_id(&pool)?,
                    uses,
                    ttl_seconds: parse_ttl(&ttl)?,
                    expect: bc_core::join::Expectations(exp),
                    reclaim,
                })
                .await?;
            println!("{}", t.token);
            eprintln!(
                "join token {} for pool {}: {} use(s), reclaim {}; the secret is shown only once",
                t.id, t.pool, t.uses, t.reclaim
            );
        }
        JoinTokenCommand::List { pool } => {
            let pool = pool.as_deref().map(pool_id).transpose()?;
            let v = client
                .method::<nodes::ListJoinTokensMethod>(&api::ListJoinTokens { pool })
                .await?;
            println!(
                "{:<18} {:<12} {:>6} {:>6} {:<8} {:<8}",
                "ID", "POOL", "LEFT", "TOTAL", "REVOKED", "RECLAIM"
            );
            for t in v.tokens {
                println!(
                    "{:<18} {:<12} {:>6} {:>6} {:<8} {:<8}",
                    t.id, t.pool_id, t.uses_left, t.uses_total, t.revoked, t.reclaim
                );
            }
        }
        JoinTokenCommand::Revoke { id } => {
            client
                .method::<nodes::RevokeJoinTokenMethod>(&api::JoinTokenRef { id: id.clone() })
                .await?;
            println!("revoked {id}");
        }
    }
    Ok(())
}

/// Calls `M` with its typed request and reads its typed answer.
async fn call_typed<M: bc_kernel::ApiMethod>(
    client: &ApiClient,
    request: &M::Request,
) -> anyhow::Result<M::Response> {
    let v = client
        .call(M::GROUP, M::METHOD, serde_json::to_value(request)?)
        .await?;
    serde_json::from_value(v).map_err(|e| {
        anyhow::anyhow!(
            "{}.{}: the control plane's answer is not what this CLI reads ({e}); use a CLI of the server's version",
            M::GROUP,
            M::METHOD
        )
    })
}

fn print_reservation(r: &bc_core::api::capacity::Reservation) {
    let gpus: Vec<String> = r
        .gpus
        .iter()
        .map(|g| format!("{}:{}", g.node, g.uuid))
        .collect();
    println!(
        "{:<40} {:<10} {:<9} {}",
        r.id,
        r.tenant,
        r.state,
        gpus.join(" ")
    );
}

fn pool_id(s: &str) -> anyhow::Result<bc_core::ids::PoolId> {
    Ok(bc_core::ids::PoolId::parse(s)?)
}

fn node_ref(id: &str) -> anyhow::Result<api::NodeRef> {
    Ok(api::NodeRef {
        id: bc_core::ids::NodeId::parse(id)?,
    })
}

async fn reservations(client: &ApiClient, command: ReservationCommand) -> anyhow::Result<()> {
    use bc_core::api::capacity::{CreateReservation, ListReservations, ReservationById};
    use bc_mod_capacity::admission::{
        CreateReservationMethod, GetReservationMethod, ListReservationsMethod,
        ReleaseReservationMethod,
    };
    let by_id = |id: &str| -> anyhow::Result<ReservationById> {
        Ok(ReservationById {
            id: bc_core::ids::ReservationId::parse(id)?,
        })
    };
    match command {
        ReservationCommand::Create {
            tenant,
            gpus,
            model,
            topology,
            duration,
            pool,
            idempotency_key,
        } => {
            let topology = serde_json::from_value(json!(topology))
                .map_err(|_| anyhow::anyhow!("--topology {topology:?}: use node, nvlink or any"))?;
            let pool = pool.map(|p| bc_core::ids::PoolId::parse(&p)).transpose()?;
            let request = CreateReservation {
                tenant,
                gpus,
                model,
                topology,
                duration_s: u32::try_from(parse_ttl(&duration)?)
                    .map_err(|_| anyhow::anyhow!("--duration {duration:?} is too long"))?,
                pool,
                idempotency_key,
            };
            let answer = call_typed::<CreateReservationMethod>(client, &request).await?;
            print_reservation(&answer.reservation.reservation);
        }
        ReservationCommand::List { tenant } => {
            let request = ListReservations {
                tenant,
                limit: None,
            };
            let list = call_typed::<ListReservationsMethod>(client, &request).await?;
            for r in &list.reservations {
                print_reservation(&r.reservation);
            }
        }
        ReservationCommand::Show { id } => {
            let answer = call_typed::<GetReservationMethod>(client, &by_id(&id)?).await?;
            let shown = &answer.reservation;
            let r = &shown.reservation;
            print_reservation(r);
            if let Some(e) = &r.error {
                println!("error: {e}");
            }
            if let Some(d) = &shown.delivery {
                println!("delivery: {}", delivery_name(d.state));
                for n in &d.nodes {
                    println!(
                        "  node {} generation {}: {}{}",
                        n.node,
                        n.generation,
                        delivery_name(n.state),
                        n.message
                            .as_deref()
                            .map(|m| format!(": {m}"))
                            .unwrap_or_default()
                    );
                }
            }
            println!("{}", serde_json::to_string_pretty(shown)?);
        }
        ReservationCommand::Release { id } => {
            let answer = call_typed::<ReleaseReservationMethod>(client, &by_id(&id)?).await?;
            print_reservation(&answer.reservation.reservation);
        }
    }
    Ok(())
}

fn delivery_name(d: bc_core::reservation::Delivery) -> &'static str {
    match d {
        bc_core::reservation::Delivery::Pending => "pending",
        bc_core::reservation::Delivery::Applied => "applied",
        bc_core::reservation::Delivery::Failed => "failed",
    }
}

async fn nodes(client: &ApiClient, command: NodeCommand) -> anyhow::Result<()> {
    match command {
        NodeCommand::List => {
            let v = client
                .method::<nodes::ListNodesMethod>(&api::ListNodes {})
                .await?;
            let now = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
            println!(
                "{:<38} {:<10} {:<10} {:<7} {:>5} {:>9} {:<20}",
                "NODE", "POOL", "STATE", "ONLINE", "GPUS", "SEEN", "HOSTNAME"
            );
            for n in &v.nodes {
                let seen = n
                    .last_seen_ms
                    .map(|t| format!("{}s ago", (now - t).max(0) / 1000))
                    .unwrap_or_else(|| "never".into());
                println!(
                    "{:<38} {:<10} {:<10} {:<7} {:>5} {:>9} {:<20}",
                    n.id.as_str(),
                    n.pool_id.as_str(),
                    n.state.as_str(),
                    if n.online { "yes" } else { "no" },
                    n.gpu_count(),
                    seen,
                    n.hostname()
                );
            }
        }
        NodeCommand::Show { id } => {
            let v = client
                .method::<nodes::GetNodeMethod>(&node_ref(&id)?)
                .await?;
            let n = &v.node;
            println!("node {}  pool {}  state {}", n.id, n.pool_id, n.state);
            let seen = n.last_seen_ms.map_or("never".into(), |t| t.to_string());
            println!(
                "online {}  last seen {seen}  epoch {}",
                n.online, n.session_epoch
            );
            let failing = match &n.desired_state {
                Some(d) if d.failing => format!(
                    "  generation {} FAILED to apply (see the condition)",
                    d.failed_generation
                ),
                _ => String::new(),
            };
            println!(
                "desired generation {}  applied {}{failing}",
                n.desired_generation, n.acked_generation
            );
            for c in &n.conditions {
                println!("condition: {c}");
            }
            // The gpus section as bcd writes it (bc-proto's type); a section this CLI cannot read is skipped.
            let gpus = v.inventory.get("gpus").and_then(|g| {
                serde_json::from_value::<bc_proto::payloads::GpusSection>(g.clone()).ok()
            });
            for g in gpus.iter().flat_map(|s| &s.gpus) {
                println!("gpu {} {} {}", g.index, g.uuid, g.model);
            }
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        NodeCommand::Drain { id } => {
            client
                .method::<nodes::DrainNodeMethod>(&node_ref(&id)?)
                .await?;
            println!("draining {id}: no new bookings; existing ones stay until released");
        }
        NodeCommand::Undrain { id } => {
            client
                .method::<nodes::UndrainNodeMethod>(&node_ref(&id)?)
                .await?;
            println!("undrained {id}: its free GPUs are bookable again");
        }
        NodeCommand::Revoke { id } => {
            client
                .method::<nodes::RevokeNodeMethod>(&node_ref(&id)?)
                .await?;
            println!("revoked {id}");
        }
        NodeCommand::Command {
            node,
            kind,
            args,
            timeout,
        } => {
            let args: serde_json::Value = serde_json::from_str(&args)
                .with_context(|| format!("--args {args:?} is not JSON"))?;
            let queued = client
                .method::<nodes::QueueCommandMethod>(&api::QueueCommand {
                    node_id: bc_core::ids::NodeId::parse(&node)?,
                    kind,
                    args,
                    timeout_s: timeout,
                })
                .await?;
            println!("{}", queued.id);
        }
    }
    Ok(())
}

async fn commands(client: &ApiClient, command: CommandsCommand) -> anyhow::Result<()> {
    match command {
        CommandsCommand::Show { id, wait } => {
            let request = api::CommandRef {
                id: bc_core::ids::CommandId::parse(&id)?,
            };
            let mut last_progress = None;
            loop {
                let c = client
                    .method::<nodes::GetCommandMethod>(&request)
                    .await?
                    .command;
                if !wait || c.state.is_finished() {
                    println!("{}", serde_json::to_string_pretty(&c)?);
                    if matches!(c.state, CommandState::Failed | CommandState::Expired) {
                        anyhow::bail!(
                            "command {id} {}: {}",
                            c.state,
                            c.error.as_deref().unwrap_or("no error recorded")
                        );
                    }
                    break;
                }
                if c.progress != last_progress {
                    last_progress = c.progress.clone();
                    let shown = last_progress.clone().unwrap_or_default();
                    println!("{}: {shown}", c.state);
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
    Ok(())
}

/// `better-compute serve`: the configured roles until a shutdown signal.
async fn serve(command: Command) -> anyhow::Result<()> {
    let Command::Serve {
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
    } = command
    else {
        anyhow::bail!("serve: not a serve command");
    };
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
        })
        .validate(&origin)?;
    let url = cfg.database_url.clone().context(
        "INVALID_CONFIG: database_url is required (flag --database-url or BC_DATABASE_URL)",
    )?;
    let store = connect(&url).await?;
    if !no_migrate {
        bc_store::migrate::migrate_with(store.pool(), &bc_control::module_migrations()).await?;
    }
    let mut running = bc_control::start(&cfg, store).await?;
    let stop = bc_proto::runtime::shutdown_signal();
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
    tokio::select! {
        _ = stop => {}
        _ = running.wait_any() => tracing::error!("a role stopped on its own"),
    }
    running.shutdown().await;
    Ok(())
}
