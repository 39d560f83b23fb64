//! The `better-compute` command line: its parser ([`Cli`], walked by the `--help` golden test and by the
//! completion and man page generators) and the dispatch of each group to its `*_cli` module. `main.rs` only calls
//! [`main`] with the version it was stamped with.

use crate::client::ApiClient;
use crate::output::{self, Table};
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "better-compute",
    version,
    about = "Better Compute control plane"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The flags of every command that calls the API; they go anywhere after the group (`nodes list --api-key X`),
/// and before it too ([`hoist_api_flags`]).
#[derive(clap::Args)]
#[command(next_help_heading = "API and output")]
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
    output: crate::output::Format,
    /// Repeat a read (list, show, info) every --interval, printing it again when it changed (a terminal's screen
    /// is redrawn); Ctrl-C ends it.
    #[arg(short, long, global = true)]
    watch: bool,
    /// How often --watch reads: 2s, 30s, 1m.
    #[arg(long, default_value = "2s", value_parser = bc_proto::duration::parse, global = true)]
    interval: std::time::Duration,
    /// How long a call waits for its answer (uploads excepted): 30s, 2m.
    #[arg(long, default_value = "60s", value_parser = bc_proto::duration::parse, global = true)]
    timeout: std::time::Duration,
}

impl ApiArgs {
    fn resolved(&self) -> anyhow::Result<crate::profile::Resolved> {
        crate::profile::resolve(
            self.api_url.clone(),
            self.api_key.clone(),
            self.context.as_deref(),
            crate::profile::default_path().as_deref(),
        )
    }

    fn client(&self) -> anyhow::Result<ApiClient> {
        let r = self.resolved()?;
        Ok(ApiClient::with_timeout(
            &r.api_url,
            &r.api_key,
            self.timeout,
        ))
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
    Serve(crate::serve_cli::ServeArgs),
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
        command: crate::nodes_cli::JoinTokenCommand,
    },
    /// Commands queued for nodes: list (a node's), show (state, progress, signed result).
    Commands {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::nodes_cli::CommandsCommand,
    },
    /// Nodes: list, show, drain (cordon), undrain (uncordon), revoke, delete, command.
    Nodes {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::nodes_cli::NodeCommand,
    },
    /// Sites (rack agents enrolled with site tokens): list, revoke.
    Sites {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::site_cli::SiteCommand,
    },
    /// Site tokens (bcst_… for `bcd site enroll`): create, list, revoke.
    SiteTokens {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::site_cli::SiteTokenCommand,
    },
    /// Machines a site netboots: create, list, set-boot, delete.
    Machines {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::site_cli::MachineCommand,
    },
    /// Secrets brokered to sites (BMC credentials): put, list (names only), delete.
    Secrets {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::site_cli::SecretCommand,
    },
    /// Artifacts sites boot (kernels, initramfs, images), content-addressed: put, list, delete.
    Artifacts {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::site_cli::ArtifactCommand,
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
        command: crate::instances_cli::InstanceCommand,
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
        command: crate::tunnel_cli::TunnelsCommand,
    },
    /// Bare-metal machines through the metal flow: enroll, inspect, provide, deploy, release, abort, retry, show, list.
    Metal {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::metal_cli::MetalCommand,
    },
    /// Reservations: create, list, show, release.
    Reservations {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::reservations_cli::ReservationCommand,
    },
    /// Tenants: create, list.
    Tenants {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::iam_cli::TenantCommand,
    },
    /// Principals (API callers) and their grants: create, list.
    Principals {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::iam_cli::PrincipalCommand,
    },
    /// The audit log: list (by actor, action, subject, time).
    Audit {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::iam_cli::AuditCommand,
    },
}

/// The parser with `version` (the package version and the commit `main.rs` was stamped with).
pub fn command(version: &'static str) -> clap::Command {
    use clap::CommandFactory as _;
    Cli::command().version(version)
}

/// The binary's `main`: parses the arguments (`version` is what `--version` prints), runs the command, prints an
/// error as one line and returns the exit status.
pub fn main(version: &'static str) -> std::process::ExitCode {
    crate::set_version(version);
    bc_proto::runtime::quiet_broken_pipe();
    bc_proto::install_crypto_provider();
    bc_proto::runtime::logs::init("BC_LOG", "info,sqlx=warn");
    let matches = command(version).get_matches_from(hoist_api_flags(std::env::args_os().collect()));
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Some(api) = cli.command.api().filter(|a| a.watch)
        && std::env::var_os(WATCHED).is_none()
    {
        return crate::watch::run(&matches, api.interval, WATCHED);
    }
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

/// The API and output flags ([`ApiArgs`]) given before the group (`better-compute --context lab nodes list`, as
/// kubectl takes them) moved to just after it, where the parser takes them; the rest is left as it was, so a flag
/// before a command that does not call the API (`serve`, `dev`) is still refused by the parser.
fn hoist_api_flags(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    // (long, short, takes a value)
    const FLAGS: [(&str, Option<&str>, bool); 7] = [
        ("--api-url", None, true),
        ("--api-key", None, true),
        ("--context", None, true),
        ("--output", Some("-o"), true),
        ("--watch", Some("-w"), false),
        ("--interval", None, true),
        ("--timeout", None, true),
    ];
    let mut end = 1;
    while let Some(arg) = args.get(end).and_then(|a| a.to_str()) {
        let Some(&(_, _, value)) = FLAGS.iter().find(|(long, short, _)| {
            arg == *long
                || arg.starts_with(&format!("{long}="))
                || short.is_some_and(|s| arg == s || (arg.starts_with(s) && arg.len() > 2))
        }) else {
            break;
        };
        let attached = arg.contains('=') || (arg.len() > 2 && !arg.starts_with("--"));
        end += if value && !attached { 2 } else { 1 };
    }
    if end == 1 || end >= args.len() {
        return args;
    }
    let flags: Vec<_> = args.drain(1..end).collect();
    args.splice(2..2, flags);
    args
}

/// Set in the environment of the reads `--watch` repeats, so they run once.
const WATCHED: &str = "BC_WATCHED";

impl Command {
    /// The API flags of a command that calls the API.
    fn api(&self) -> Option<&ApiArgs> {
        use Command as C;
        match self {
            C::JoinTokens { api, .. }
            | C::Commands { api, .. }
            | C::Nodes { api, .. }
            | C::Sites { api, .. }
            | C::SiteTokens { api, .. }
            | C::Machines { api, .. }
            | C::Secrets { api, .. }
            | C::Artifacts { api, .. }
            | C::Info { api }
            | C::Instances { api, .. }
            | C::Tunnel { api, .. }
            | C::Tunnels { api, .. }
            | C::Metal { api, .. }
            | C::Reservations { api, .. }
            | C::Tenants { api, .. }
            | C::Principals { api, .. }
            | C::Audit { api, .. } => Some(api),
            C::Completion { .. }
            | C::Man
            | C::Unit
            | C::Migrate { .. }
            | C::Serve(_)
            | C::Dev { .. }
            | C::BootstrapAdmin { .. } => None,
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { database_url } => {
            let store = crate::serve_cli::connect(&database_url).await?;
            let n = crate::migrate(&store).await?;
            println!("applied {n} migration(s)");
        }
        Command::BootstrapAdmin { database_url } => {
            let store = crate::serve_cli::connect(&database_url).await?;
            println!("{}", crate::bootstrap_admin(&store).await?);
        }
        Command::Completion { shell } => {
            clap_complete::generate(
                shell,
                &mut command(crate::version()),
                "better-compute",
                &mut std::io::stdout(),
            );
        }
        Command::Man => {
            clap_mangen::Man::new(command(crate::version())).render(&mut std::io::stdout())?;
        }
        Command::Unit => print!(
            "{}",
            include_str!("../../../packaging/systemd/better-compute.service")
        ),
        Command::Serve(args) => crate::serve_cli::serve(args).await?,
        Command::Dev {
            data_dir,
            api_listen,
            gateway_listen,
            trust_domain,
            gateway_hosts,
            config,
        } => {
            let opts = crate::dev::DevOptions {
                data_dir: data_dir.clone(),
                api_listen,
                gateway_listen,
                trust_domain,
                gateway_hosts,
                metal: dev_metal(config.as_deref())?,
            };
            crate::dev::run(
                opts,
                |r| crate::dev::print_ready(r, &data_dir),
                bc_proto::runtime::shutdown_signal(),
            )
            .await?;
        }
        Command::JoinTokens { api, command } => {
            let client = api.client()?;
            crate::nodes_cli::join_tokens(&client, api.output, command).await?;
        }
        Command::Instances { api, command } => {
            crate::instances_cli::instances(&api.client()?, api.output, command).await?
        }
        Command::Sites { api, command } => {
            let client = api.client()?;
            crate::site_cli::sites(&client, api.output, command).await?;
        }
        Command::SiteTokens { api, command } => {
            let client = api.client()?;
            crate::site_cli::site_tokens(&client, api.output, command).await?;
        }
        Command::Machines { api, command } => {
            let client = api.client()?;
            crate::site_cli::machines(&client, api.output, command).await?;
        }
        Command::Secrets { api, command } => {
            let client = api.client()?;
            crate::site_cli::secrets(&client, api.output, command).await?;
        }
        Command::Artifacts { api, command } => {
            let client = api.client()?;
            crate::site_cli::artifacts(&client, api.output, command).await?;
        }
        Command::Info { api } => info(&api).await?,
        Command::Tunnel {
            api,
            node,
            port,
            listen,
        } => tunnel(&api, node, port, listen).await?,
        Command::Tunnels { api, command } => {
            let client = api.client()?;
            crate::tunnel_cli::tunnels(&client, api.output, command).await?;
        }
        Command::Metal { api, command } => {
            crate::metal_cli::metal(&api.client()?, api.output, command).await?
        }
        Command::Reservations { api, command } => {
            let client = api.client()?;
            crate::reservations_cli::reservations(&client, api.output, command).await?;
        }
        Command::Nodes { api, command } => {
            let client = api.client()?;
            crate::nodes_cli::nodes(&client, api.output, command).await?;
        }
        Command::Commands { api, command } => {
            let client = api.client()?;
            crate::nodes_cli::commands(&client, api.output, command).await?;
        }
        Command::Tenants { api, command } => {
            crate::iam_cli::tenants(&api.client()?, api.output, command).await?
        }
        Command::Principals { api, command } => {
            crate::iam_cli::principals(&api.client()?, api.output, command).await?
        }
        Command::Audit { api, command } => {
            crate::iam_cli::audit(&api.client()?, api.output, command).await?
        }
    }
    Ok(())
}

/// `dev --config`: the file's `[metal]` table (its other settings are ignored), else the metal defaults.
fn dev_metal(config: Option<&std::path::Path>) -> anyhow::Result<bc_mod_metal::Config> {
    Ok(match config {
        Some(path) => crate::config::ServeConfigWire::from_file(path)?
            .metal
            .unwrap_or_default()
            .validate(&path.display().to_string())?,
        None => bc_mod_metal::Config::default(),
    })
}

/// `better-compute tunnel`: like `ssh -L`, through the API named by the flags or the context.
async fn tunnel(
    api: &ApiArgs,
    node: String,
    port: u16,
    listen: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let r = api.resolved()?;
    let api = crate::tunnel_cli::Api {
        url: r.api_url,
        key: r.api_key,
    };
    crate::tunnel_cli::tunnel(api, node, port, listen).await
}

/// `better-compute info`: what nodes and operators need to trust and reach the control plane, and the versions.
async fn info(api: &ApiArgs) -> anyhow::Result<()> {
    let client = api.client()?;
    let i = client
        .method::<crate::plane::InfoMethod>(&bc_core::api::system::Nothing {})
        .await?;
    output::print(api.output, &i, || {
        let mut t = Table::new(&["FIELD", "VALUE"]);
        for (k, v) in [
            ("trust domain", i.trust_domain.as_str()),
            ("CA pin", i.ca_pin.as_str()),
            ("join key", i.join_public_key.as_str()),
            ("gateway URL", i.gateway_url.as_str()),
            ("server version", i.version.as_str()),
            ("CLI version", crate::version()),
        ] {
            t.row(vec![k.to_string(), v.to_string()]);
        }
        t
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::hoist_api_flags;

    fn hoisted(args: &str) -> String {
        let args = args.split(' ').map(Into::into).collect();
        hoist_api_flags(args)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn api_flags_before_the_group_move_after_it() {
        assert_eq!(
            hoisted("bc --api-key K -ojson --context=lab -w nodes list --pool p"),
            "bc nodes --api-key K -ojson --context=lab -w list --pool p"
        );
        assert_eq!(
            hoisted("bc -o yaml info"),
            "bc info -o yaml",
            "a group without a subcommand"
        );
        // Nothing to move, a flag of another command, or a flag without its value: left for the parser to judge.
        for same in [
            "bc nodes list --api-key K",
            "bc --data-dir d dev",
            "bc --api-key",
            "bc --api-key K",
            "bc --version",
        ] {
            assert_eq!(hoisted(same), same);
        }
    }
}
