//! `better-compute`: the control plane binary. Parses arguments, builds the runtime, calls the library.

use anyhow::Context as _;
use bc_control::client::ApiClient;
use bc_control::output::{self, Format, Table};
use bc_core::api::nodes::{self as api, CommandState};
use bc_mod_nodes::methods as nodes;
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

/// The flags of every command that calls the API; they go anywhere after the group (`nodes list --api-key X`).
#[derive(clap::Args)]
struct ApiArgs {
    /// Control-plane API URL [default: the context's, else http://127.0.0.1:7080].
    #[arg(long, env = "BC_API_URL", global = true)]
    api_url: Option<String>,
    /// API key (bcak_…) [default: the context's].
    #[arg(long, env = "BC_API_KEY", hide_env_values = true, global = true)]
    api_key: Option<String>,
    /// A context of the CLI profile ($BC_CONFIG, else ~/.config/better-compute/config.toml) [default: its
    /// `current`].
    #[arg(long, env = "BC_CONTEXT", global = true)]
    context: Option<String>,
    /// How reads print: table, wide, json or yaml (JSON and YAML: the API's answer, times as RFC 3339).
    #[arg(short, long, value_enum, default_value_t, global = true)]
    output: bc_control::output::Format,
}

impl ApiArgs {
    fn resolved(&self) -> anyhow::Result<bc_control::profile::Resolved> {
        bc_control::profile::resolve(
            self.api_url.clone(),
            self.api_key.clone(),
            self.context.as_deref(),
            bc_control::profile::default_path().as_deref(),
        )
    }

    fn client(&self) -> anyhow::Result<ApiClient> {
        let r = self.resolved()?;
        Ok(ApiClient::new(&r.api_url, &r.api_key))
    }
}

#[derive(Subcommand)]
enum Command {
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell), e.g.
    /// `better-compute completion bash > /etc/bash_completion.d/better-compute`.
    Completion { shell: clap_complete::Shell },
    /// Print the man page (roff), e.g. `better-compute man > /usr/share/man/man1/better-compute.1`.
    Man,
    /// Print the control plane's systemd unit (`better-compute unit > /etc/systemd/system/better-compute.service`).
    Unit,
    /// Apply the embedded database migrations (once per deploy).
    Migrate {
        #[arg(long, env = "BC_DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Serve the given roles.
    Serve(bc_control::serve_cli::ServeArgs),
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
    /// What nodes and operators need to trust and reach this control plane: CA pin, join key, gateway URL,
    /// trust domain, and the server's and this CLI's versions.
    Info {
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Instances (VMs on vps-host pools): create, show, list, stop, start, reboot, delete, set-pool.
    Instances {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::instances_cli::InstanceCommand,
    },
    /// Forward a local port to a port on a node, like `ssh -L`: one tunnel per local connection.
    Tunnel {
        #[command(flatten)]
        api: ApiArgs,
        node: String,
        port: u16,
        /// Local address to listen on (port 0 picks one).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
    },
    /// Tunnels: the audit (list) and pools' port allowlists (ports, set-ports).
    Tunnels {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::tunnel_cli::TunnelsCommand,
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
        #[arg(long, default_value = "1h", value_parser = bc_proto::duration::parse)]
        duration: std::time::Duration,
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
        #[arg(long, default_value = "24h", value_parser = bc_proto::duration::parse)]
        ttl: std::time::Duration,
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
    #[command(visible_alias = "cordon")]
    Drain { id: String },
    /// Hand out a drained node's GPUs again.
    #[command(visible_alias = "uncordon")]
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
        /// How long until the command expires unanswered: 90s, 10m, 1h.
        #[arg(long, default_value = "10m", value_parser = bc_proto::duration::parse)]
        timeout: std::time::Duration,
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

fn main() -> std::process::ExitCode {
    bc_proto::runtime::quiet_broken_pipe();
    bc_proto::install_crypto_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BC_LOG")
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(bc_proto::runtime::ansi())
        .init();
    let cli = Cli::parse();
    let result = bc_proto::runtime::build(None)
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(run(cli)));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // One line with the cause chain, no backtrace: these are the operator's errors to act on (exit 1; clap
        // exits 2 for a usage error before this).
        Err(e) => {
            eprintln!("better-compute: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { database_url } => {
            let store = bc_control::serve_cli::connect(&database_url).await?;
            let n = bc_control::migrate(&store).await?;
            println!("applied {n} migration(s)");
        }
        Command::BootstrapAdmin { database_url } => {
            let store = bc_control::serve_cli::connect(&database_url).await?;
            println!("{}", bc_control::bootstrap_admin(&store).await?);
        }
        Command::Completion { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "better-compute",
                &mut std::io::stdout(),
            );
        }
        Command::Man => {
            use clap::CommandFactory as _;
            clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout())?;
        }
        Command::Unit => print!(
            "{}",
            include_str!("../../../packaging/systemd/better-compute.service")
        ),
        Command::Serve(args) => bc_control::serve_cli::serve(args).await?,
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
                |r| bc_control::dev::print_ready(r, &data_dir),
                bc_proto::runtime::shutdown_signal(),
            )
            .await?;
        }
        Command::JoinTokens { api, command } => {
            let client = api.client()?;
            join_tokens(&client, api.output, command).await?;
        }
        Command::Instances { api, command } => {
            bc_control::instances_cli::instances(&api.client()?, command).await?
        }
        Command::Sites { api, command } => {
            let client = api.client()?;
            bc_control::site_cli::sites(&client, api.output, command).await?;
        }
        Command::SiteTokens { api, command } => {
            let client = api.client()?;
            bc_control::site_cli::site_tokens(&client, api.output, command).await?;
        }
        Command::Machines { api, command } => {
            let client = api.client()?;
            bc_control::site_cli::machines(&client, api.output, command).await?;
        }
        Command::Secrets { api, command } => {
            let client = api.client()?;
            bc_control::site_cli::secrets(&client, api.output, command).await?;
        }
        Command::Artifacts { api, command } => {
            let client = api.client()?;
            bc_control::site_cli::artifacts(&client, api.output, command).await?;
        }
        Command::Info { api } => {
            let client = api.client()?;
            let i = client
                .method::<bc_control::plane::InfoMethod>(&bc_core::api::system::Nothing {})
                .await?;
            output::print(api.output, &i, || {
                let mut t = Table::new(&["FIELD", "VALUE"]);
                for (k, v) in [
                    ("trust domain", i.trust_domain.as_str()),
                    ("CA pin", i.ca_pin.as_str()),
                    ("join key", i.join_public_key.as_str()),
                    ("gateway URL", i.gateway_url.as_str()),
                    ("server version", i.version.as_str()),
                    ("CLI version", env!("CARGO_PKG_VERSION")),
                ] {
                    t.row(vec![k.to_string(), v.to_string()]);
                }
                t
            })?;
        }
        Command::Tunnel {
            api,
            node,
            port,
            listen,
        } => {
            let r = api.resolved()?;
            let api = bc_control::tunnel_cli::Api {
                url: r.api_url,
                key: r.api_key,
            };
            bc_control::tunnel_cli::tunnel(api, node, port, listen).await?;
        }
        Command::Tunnels { api, command } => {
            let client = api.client()?;
            bc_control::tunnel_cli::tunnels(&client, command).await?;
        }
        Command::Reservations { api, command } => {
            let client = api.client()?;
            reservations(&client, api.output, command).await?;
        }
        Command::Nodes { api, command } => {
            let client = api.client()?;
            nodes(&client, api.output, command).await?;
        }
        Command::Commands { api, command } => {
            let client = api.client()?;
            commands(&client, api.output, command).await?;
        }
    }
    Ok(())
}

async fn join_tokens(
    client: &ApiClient,
    out: Format,
    command: JoinTokenCommand,
) -> anyhow::Result<()> {
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
                    ttl_seconds: i64::try_from(ttl.as_secs())
                        .map_err(|_| anyhow::anyhow!("--ttl is too long"))?,
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
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["ID", "POOL", "LEFT", "TOTAL", "REVOKED", "EXPIRES"])
                    .wide(&["RECLAIM", "AGE"]);
                for k in &v.tokens {
                    t.row(vec![
                        k.id.clone(),
                        k.pool_id.to_string(),
                        k.uses_left.to_string(),
                        k.uses_total.to_string(),
                        k.revoked.to_string(),
                        output::age(Some(k.expires_at_ms), now),
                        k.reclaim.to_string(),
                        output::age(Some(k.created_at_ms), now),
                    ]);
                }
                t
            })?;
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

/// The reservations table: one row each.
fn reservation_table<'a>(
    rows: impl IntoIterator<Item = &'a bc_core::api::capacity::Reservation>,
) -> Table {
    let now = output::now_ms();
    let mut t = Table::new(&["ID", "TENANT", "STATE", "GPUS", "AGE", "EXPIRES"])
        .wide(&["POOL", "NODE:GPU"]);
    for r in rows {
        let gpus: Vec<String> = r
            .gpus
            .iter()
            .map(|g| format!("{}:{}", g.node, g.uuid))
            .collect();
        t.row(vec![
            r.id.to_string(),
            r.tenant.to_string(),
            r.state.to_string(),
            r.gpus.len().to_string(),
            output::age(Some(r.created_at_ms), now),
            output::age(r.expires_at_ms, now),
            r.request
                .pool
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            gpus.join(","),
        ]);
    }
    t
}

fn pool_id(s: &str) -> anyhow::Result<bc_core::ids::PoolId> {
    Ok(bc_core::ids::PoolId::parse(s)?)
}

fn node_ref(id: &str) -> anyhow::Result<api::NodeRef> {
    Ok(api::NodeRef {
        id: bc_core::ids::NodeId::parse(id)?,
    })
}

async fn reservations(
    client: &ApiClient,
    out: Format,
    command: ReservationCommand,
) -> anyhow::Result<()> {
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
                duration_s: u32::try_from(duration.as_secs())
                    .map_err(|_| anyhow::anyhow!("--duration {duration:?} is too long"))?,
                pool,
                idempotency_key,
            };
            let answer = call_typed::<CreateReservationMethod>(client, &request).await?;
            output::print(out, &answer, || {
                reservation_table([&answer.reservation.reservation])
            })?;
        }
        ReservationCommand::List { tenant } => {
            let request = ListReservations {
                tenant,
                limit: None,
            };
            let list = call_typed::<ListReservationsMethod>(client, &request).await?;
            output::print(out, &list, || {
                reservation_table(list.reservations.iter().map(|r| &r.reservation))
            })?;
        }
        ReservationCommand::Show { id } => {
            let answer = call_typed::<GetReservationMethod>(client, &by_id(&id)?).await?;
            if out != Format::Table && out != Format::Wide {
                return output::print(out, &answer, Table::default);
            }
            let shown = &answer.reservation;
            let r = &shown.reservation;
            print!("{}", reservation_table([r]).render(out == Format::Wide));
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
        }
        ReservationCommand::Release { id } => {
            let answer = call_typed::<ReleaseReservationMethod>(client, &by_id(&id)?).await?;
            output::print(out, &answer, || {
                reservation_table([&answer.reservation.reservation])
            })?;
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

async fn nodes(client: &ApiClient, out: Format, command: NodeCommand) -> anyhow::Result<()> {
    match command {
        NodeCommand::List => {
            let v = client
                .method::<nodes::ListNodesMethod>(&api::ListNodes {})
                .await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&[
                    "NODE", "POOL", "STATE", "ONLINE", "GPUS", "SEEN", "HOSTNAME",
                ])
                .wide(&["EPOCH", "GENERATION", "CONDITIONS"]);
                for n in &v.nodes {
                    t.row(vec![
                        n.id.to_string(),
                        n.pool_id.to_string(),
                        n.state.as_str().to_string(),
                        if n.online { "yes" } else { "no" }.to_string(),
                        n.gpu_count().to_string(),
                        n.last_seen_ms
                            .map_or_else(|| "never".to_string(), |t| output::age(Some(t), now)),
                        n.hostname().to_string(),
                        n.session_epoch.to_string(),
                        format!("{}/{}", n.acked_generation, n.desired_generation),
                        n.conditions.len().to_string(),
                    ]);
                }
                t
            })?;
        }
        NodeCommand::Show { id } => {
            let v = client
                .method::<nodes::GetNodeMethod>(&node_ref(&id)?)
                .await?;
            if out != Format::Table && out != Format::Wide {
                return output::print(out, &v, Table::default);
            }
            let n = &v.node;
            println!("node {}  pool {}  state {}", n.id, n.pool_id, n.state);
            let seen = n.last_seen_ms.map_or("never".into(), |t| {
                format!(
                    "{} ago ({})",
                    output::age(Some(t), output::now_ms()),
                    output::rfc3339(t)
                )
            });
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
                    timeout_s: timeout.as_secs(),
                })
                .await?;
            println!("{}", queued.id);
        }
    }
    Ok(())
}

async fn commands(client: &ApiClient, out: Format, command: CommandsCommand) -> anyhow::Result<()> {
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
                    print_command(out, &c)?;
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

/// A command as `commands show` prints it: its fields (table), or the API's answer (json, yaml).
fn print_command(out: Format, c: &api::Command) -> anyhow::Result<()> {
    if out != Format::Table && out != Format::Wide {
        return output::print(out, c, Table::default);
    }
    let now = output::now_ms();
    println!(
        "command {}  node {}  kind {}  state {}",
        c.id, c.node_id, c.kind, c.state
    );
    println!(
        "created {} ago  deadline {}",
        output::age(Some(c.created_ms), now),
        output::age(Some(c.deadline_ms), now)
    );
    if let Some(p) = &c.progress {
        println!("progress: {p}");
    }
    if let Some(e) = &c.error {
        println!("error: {e}");
    }
    if let Some(r) = &c.result {
        println!("result:\n{}", serde_json::to_string_pretty(r)?);
    }
    Ok(())
}
