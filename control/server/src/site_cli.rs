//! Operator commands of sites: `better-compute sites|site-tokens|machines|secrets|artifacts …`, thin calls of the API.

use crate::client::ApiClient;
use clap::Subcommand;
use serde_json::{Value, json};

#[derive(Subcommand)]
pub enum SiteCommand {
    /// Revoke a site: every agent of it is refused at the gateways' TLS handshake (within their refresh interval,
    /// 10 s) and by the site services at once; its unspent tokens are revoked and its boot lease released. Revoking
    /// again changes nothing.
    Revoke { site: String },
}

pub async fn sites(client: &ApiClient, command: SiteCommand) -> anyhow::Result<()> {
    match command {
        SiteCommand::Revoke { site } => {
            let v = client
                .call("sites", "revoke", json!({"site": site}))
                .await?;
            if v["already_revoked"].as_bool().unwrap_or(false) {
                println!("site {site} was already revoked");
            } else {
                println!(
                    "revoked site {site} ({} unspent token(s) revoked, boot lease {})",
                    v["tokens_revoked"],
                    if v["lease_released"].as_bool().unwrap_or(false) {
                        "released"
                    } else {
                        "not held"
                    }
                );
            }
        }
    }
    Ok(())
}

#[derive(Subcommand)]
pub enum SiteTokenCommand {
    /// Create a site token (bcst_…) for `bcd site enroll`; prints it (shown once) on stdout. Creates the site when
    /// it does not exist yet.
    Create {
        #[arg(long)]
        site: String,
        /// One per site agent (an active one and a standby: 2).
        #[arg(long, default_value_t = 2)]
        uses: i32,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 86_400)]
        ttl_seconds: i64,
    },
    List {
        #[arg(long)]
        site: Option<String>,
    },
    Revoke {
        id: String,
    },
}

#[derive(Subcommand)]
pub enum MachineCommand {
    /// Register a machine of a site by MAC, optionally with what it netboots.
    Create {
        mac: String,
        #[arg(long)]
        site: String,
        #[command(flatten)]
        boot: BootArgs,
    },
    List {
        #[arg(long)]
        site: Option<String>,
    },
    /// Set what a machine netboots; without --kernel it stops netbooting.
    SetBoot {
        mac: String,
        #[command(flatten)]
        boot: BootArgs,
    },
}

#[derive(clap::Args)]
pub struct BootArgs {
    /// http(s) URL, a path under the site's artifact cache (ramdisk/vmlinuz), or `sha256:<hex>` of an artifact
    /// stored with `artifacts put` (the site agent fetches it into its cache).
    #[arg(long)]
    kernel: Option<String>,
    #[arg(long)]
    initrd: Option<String>,
    #[arg(long, default_value = "")]
    cmdline: String,
}

impl BootArgs {
    fn to_json(&self) -> Value {
        match &self.kernel {
            None => Value::Null,
            Some(k) => json!({"kernel": k, "initrd": self.initrd, "cmdline": self.cmdline}),
        }
    }
}

#[derive(Subcommand)]
pub enum ArtifactCommand {
    /// Upload a kernel, initramfs or image; prints the `sha256:<hex>` reference to give `machines create --kernel`.
    /// The file is streamed from disk (never read into memory whole).
    Put {
        file: std::path::PathBuf,
        /// Name for listings and logs (default: the file name).
        #[arg(long)]
        name: Option<String>,
    },
    List,
}

pub async fn artifacts(client: &ApiClient, command: ArtifactCommand) -> anyhow::Result<()> {
    match command {
        ArtifactCommand::Put { file, name } => {
            let name = name.or_else(|| file.file_name().map(|n| n.to_string_lossy().into_owned()));
            let v = client.put_artifact_file(&file, name.as_deref()).await?;
            println!("{}", v["reference"].as_str().unwrap_or_default());
            eprintln!(
                "artifact {} ({} bytes) stored",
                v["artifact"]["name"].as_str().unwrap_or_default(),
                v["artifact"]["size"]
            );
        }
        ArtifactCommand::List => {
            let v = client.call("artifacts", "list", json!({})).await?;
            println!("{:<64} {:>12} NAME", "SHA256", "SIZE");
            for a in v["artifacts"].as_array().into_iter().flatten() {
                println!(
                    "{:<64} {:>12} {}",
                    a["sha256"].as_str().unwrap_or_default(),
                    a["size"].to_string(),
                    a["name"].as_str().unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

#[derive(Subcommand)]
pub enum SecretCommand {
    /// Store a secret for a site (sealed at rest; delivered to the site's agents as JWE). The value is read from
    /// the environment variable named by --value-env, never from the command line.
    Put {
        name: String,
        #[arg(long)]
        site: String,
        #[arg(long, default_value = "BC_SECRET_VALUE")]
        value_env: String,
    },
}

pub async fn site_tokens(client: &ApiClient, command: SiteTokenCommand) -> anyhow::Result<()> {
    match command {
        SiteTokenCommand::Create {
            site,
            uses,
            ttl_seconds,
        } => {
            let v = client
                .call(
                    "site-tokens",
                    "create",
                    json!({"site": site, "uses": uses, "ttl_seconds": ttl_seconds}),
                )
                .await?;
            println!("{}", v["token"].as_str().unwrap_or_default());
            eprintln!(
                "site token {} for site {}: {} use(s); the secret is shown only once",
                v["id"].as_str().unwrap_or_default(),
                v["site"].as_str().unwrap_or_default(),
                v["uses"]
            );
        }
        SiteTokenCommand::List { site } => {
            let v = client
                .call("site-tokens", "list", json!({"site": site}))
                .await?;
            println!(
                "{:<18} {:<16} {:>6} {:>6} {:<8}",
                "ID", "SITE", "LEFT", "TOTAL", "REVOKED"
            );
            for t in v["tokens"].as_array().into_iter().flatten() {
                println!(
                    "{:<18} {:<16} {:>6} {:>6} {:<8}",
                    t["id"].as_str().unwrap_or_default(),
                    t["site_id"].as_str().unwrap_or_default(),
                    t["uses_left"].to_string(),
                    t["uses_total"].to_string(),
                    t["revoked"].to_string()
                );
            }
        }
        SiteTokenCommand::Revoke { id } => {
            client
                .call("site-tokens", "revoke", json!({"id": id}))
                .await?;
            println!("revoked {id}");
        }
    }
    Ok(())
}

pub async fn machines(client: &ApiClient, command: MachineCommand) -> anyhow::Result<()> {
    match command {
        MachineCommand::Create { mac, site, boot } => {
            let v = client
                .call(
                    "machines",
                    "create",
                    json!({"mac": mac, "site": site, "boot": boot.to_json()}),
                )
                .await?;
            println!("{}", v["machine"]);
        }
        MachineCommand::List { site } => {
            let v = client
                .call("machines", "list", json!({"site": site}))
                .await?;
            println!("{:<18} {:<16} BOOT", "MAC", "SITE");
            for m in v["machines"].as_array().into_iter().flatten() {
                println!(
                    "{:<18} {:<16} {}",
                    m["mac"].as_str().unwrap_or_default(),
                    m["site_id"].as_str().unwrap_or_default(),
                    m["boot"]
                );
            }
        }
        MachineCommand::SetBoot { mac, boot } => {
            let v = client
                .call(
                    "machines",
                    "set-boot",
                    json!({"mac": mac, "boot": boot.to_json()}),
                )
                .await?;
            println!("{v}");
        }
    }
    Ok(())
}

pub async fn secrets(client: &ApiClient, command: SecretCommand) -> anyhow::Result<()> {
    match command {
        SecretCommand::Put {
            name,
            site,
            value_env,
        } => {
            let value = std::env::var(&value_env).map_err(|_| {
                anyhow::anyhow!("set the secret's value in the environment variable {value_env}")
            })?;
            client
                .call(
                    "secrets",
                    "put",
                    json!({"site": site, "name": name, "value": value}),
                )
                .await?;
            println!("stored secret {name} for site {site}");
        }
    }
    Ok(())
}
