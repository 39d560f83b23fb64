//! `better-compute`: the control plane binary. Parses arguments, builds the runtime, calls the library.

use bc_control::client::ApiClient;
use bc_control::output::{self, Table};
use clap::{Parser, Subcommand};
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
        /// A name or address the gateway's certificate also covers, used in the gateway URL given to nodes
        /// (repeatable; the first wins): e.g. the address machines on a boot segment reach it at.
        #[arg(long = "gateway-host")]
        gateway_hosts: Vec<String>,
        /// A configuration file whose `[metal]` table configures the metal module (its other settings are
        /// ignored: dev chooses its own).
        #[arg(long)]
        config: Option<PathBuf>,
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
        command: bc_control::nodes_cli::JoinTokenCommand,
    },
    /// Commands queued for nodes: show (state, progress, signed result).
    Commands {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::nodes_cli::CommandsCommand,
    },
    /// Nodes: list, show, drain, undrain, revoke, command.
    Nodes {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: bc_control::nodes_cli::NodeCommand,
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
        command: bc_control::reservations_cli::ReservationCommand,
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
            gateway_hosts,
            config,
        } => {
            let metal = match &config {
                Some(path) => bc_control::config::ServeConfigWire::from_file(path)?
                    .metal
                    .unwrap_or_default()
                    .validate(&path.display().to_string())?,
                None => bc_mod_metal::Config::default(),
            };
            let opts = bc_control::dev::DevOptions {
                data_dir: data_dir.clone(),
                api_listen,
                gateway_listen,
                trust_domain,
                gateway_hosts,
                metal,
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
            bc_control::nodes_cli::join_tokens(&client, api.output, command).await?;
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
        Command::Info { api } => info(&api).await?,
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
        Command::Metal { api, command } => {
            bc_control::metal_cli::metal(&api.client()?, command).await?
        }
        Command::Reservations { api, command } => {
            let client = api.client()?;
            bc_control::reservations_cli::reservations(&client, api.output, command).await?;
        }
        Command::Nodes { api, command } => {
            let client = api.client()?;
            bc_control::nodes_cli::nodes(&client, api.output, command).await?;
        }
        Command::Commands { api, command } => {
            let client = api.client()?;
            bc_control::nodes_cli::commands(&client, api.output, command).await?;
        }
    }
    Ok(())
}

/// `better-compute info`: what nodes and operators need to trust and reach the control plane, and the versions.
async fn info(api: &ApiArgs) -> anyhow::Result<()> {
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
    Ok(())
}
