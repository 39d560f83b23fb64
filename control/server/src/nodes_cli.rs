//! The CLI of the nodes module's groups: `join-tokens`, `nodes` and `commands` (typed calls, printed as `-o`
//! asks). `nodes list` pages through the API's pages unless `--limit` asks for one.

use crate::client::ApiClient;
use crate::output::{self, Format, Table};
use anyhow::Context as _;
use bc_core::api::nodes::{self as api, CommandState};
use bc_mod_nodes::methods as nodes;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum JoinTokenCommand {
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
    /// Join tokens (never their secrets): uses left, expiry, whether they reclaim.
    List {
        /// Only this pool's.
        #[arg(long)]
        pool: Option<String>,
    },
    /// Revoke a join token: no node joins with it from now on (nodes that joined stay).
    Revoke {
        /// The token's id (`join-tokens list`), not its secret.
        id: String,
    },
}

/// `nodes list`'s filters and page.
#[derive(clap::Args)]
pub struct NodeFilter {
    /// Only this pool's nodes.
    #[arg(long)]
    pool: Option<String>,
    /// adopting, adopted, draining, failed or revoked.
    #[arg(long)]
    state: Option<String>,
    /// Nodes with a condition containing this text (e.g. DesiredStateFailed).
    #[arg(long)]
    condition: Option<String>,
    /// Nodes whose hostname matches (`*` matches any run of characters: 'gpu-*').
    #[arg(long)]
    hostname: Option<String>,
    /// One page of at most this many nodes (the API pages by node id; the next page's --after goes to stderr).
    /// Without it every page is read.
    #[arg(long)]
    limit: Option<u32>,
    /// The page after this node id.
    #[arg(long)]
    after: Option<String>,
}

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Nodes with state, online, GPUs and last seen, by id; filtered and paged by the API.
    List(NodeFilter),
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
    /// Forget a revoked node (its inventory, commands and devices go with it). Refused while the node is not
    /// revoked (revoke it first) or any of its GPUs is booked (release those reservations first).
    Delete { id: String },
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
pub enum CommandsCommand {
    /// A node's commands, newest first.
    List {
        /// The node whose commands to list.
        #[arg(long)]
        node: String,
        /// At most this many, newest first (default and cap 1000).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// A command's state, latest progress, result and error.
    Show {
        id: String,
        /// Wait until it finishes (done, failed or expired), printing progress as it changes.
        #[arg(long)]
        wait: bool,
    },
}

pub async fn join_tokens(
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

fn pool_id(s: &str) -> anyhow::Result<bc_core::ids::PoolId> {
    Ok(bc_core::ids::PoolId::parse(s)?)
}

fn node_ref(id: &str) -> anyhow::Result<api::NodeRef> {
    Ok(api::NodeRef {
        id: bc_core::ids::NodeId::parse(id)?,
    })
}

pub async fn nodes(client: &ApiClient, out: Format, command: NodeCommand) -> anyhow::Result<()> {
    match command {
        NodeCommand::List(f) => {
            let v = list_nodes(client, f).await?;
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
        NodeCommand::Delete { id } => {
            client
                .method::<nodes::DeleteNodeMethod>(&node_ref(&id)?)
                .await?;
            println!("deleted {id}");
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

pub async fn commands(
    client: &ApiClient,
    out: Format,
    command: CommandsCommand,
) -> anyhow::Result<()> {
    match command {
        CommandsCommand::List { node, limit } => {
            let v = client
                .method::<nodes::ListCommandsMethod>(&api::ListCommands {
                    node: bc_core::ids::NodeId::parse(&node)?,
                    limit,
                })
                .await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["ID", "KIND", "STATE", "AGE", "FINISHED"])
                    .wide(&["DELIVERIES", "ERROR"]);
                for c in &v.commands {
                    t.row(vec![
                        c.id.to_string(),
                        c.kind.clone(),
                        c.state.to_string(),
                        output::age(Some(c.created_ms), now),
                        output::age(c.finished_ms, now),
                        c.deliveries.to_string(),
                        c.error.clone().unwrap_or_default(),
                    ]);
                }
                t
            })?;
        }
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

/// `nodes list`: one page when `--limit` is given (the next page's cursor on stderr), else every page.
async fn list_nodes(client: &ApiClient, f: NodeFilter) -> anyhow::Result<api::Nodes> {
    let state = f
        .state
        .as_deref()
        .map(|s| {
            serde_json::from_value::<bc_core::node::NodeState>(serde_json::Value::String(s.into()))
                .map_err(|_| {
                    anyhow::anyhow!(
                        "--state {s:?}: use adopting, adopted, draining, failed or revoked"
                    )
                })
        })
        .transpose()?;
    let mut request = api::ListNodes {
        pool: f.pool.as_deref().map(pool_id).transpose()?,
        state,
        condition: f.condition,
        hostname: f.hostname,
        limit: f.limit,
        after: f
            .after
            .as_deref()
            .map(bc_core::ids::NodeId::parse)
            .transpose()?,
    };
    let mut all = client.method::<nodes::ListNodesMethod>(&request).await?;
    if f.limit.is_some() {
        if let Some(next) = &all.next {
            eprintln!("more nodes: --after {next}");
        }
        return Ok(all);
    }
    while let Some(next) = all.next.take() {
        request.after = Some(bc_core::ids::NodeId::parse(&next)?);
        let page = client.method::<nodes::ListNodesMethod>(&request).await?;
        all.nodes.extend(page.nodes);
        all.next = page.next;
    }
    Ok(all)
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
