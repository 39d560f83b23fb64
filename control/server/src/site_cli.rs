//! Operator commands of sites: `better-compute sites|site-tokens|machines|secrets|artifacts …`, thin calls of the API.

use crate::client::ApiClient;
use crate::output::{self, Format, Table};
use anyhow::Context as _;
use bc_core::api::sites::{
    BootSpec, BySite, CreateMachineRequest, CreateSiteTokenRequest, DeleteArtifactRequest,
    DeleteMachineRequest, DeleteSecretRequest, ListArtifactsRequest, ListSitesRequest,
    PutSecretRequest, RevokeSiteRequest, RevokeSiteTokenRequest, SetMachineBootRequest,
};
use bc_core::ids::SiteId;
use bc_mod_sites::methods::{
    CreateMachine, CreateSiteToken, DeleteArtifact, DeleteMachine, DeleteSecret, ListArtifacts,
    ListMachines, ListSecrets, ListSiteTokens, ListSites, PutSecret, RevokeSite, RevokeSiteToken,
    SetMachineBoot,
};
use clap::Subcommand;

/// A site id from the command line (checked here, with the API's rule, before anything is sent).
fn site_arg(site: &str) -> anyhow::Result<SiteId> {
    if let Some(why) = bc_core::api::sites::site_name_error(site) {
        anyhow::bail!(why);
    }
    Ok(SiteId::parse(site)?)
}

/// Several site ids, for a list (any id the API accepts).
fn site_filter(site: Option<String>) -> anyhow::Result<BySite> {
    let site = site
        .map(|s| SiteId::parse(&s).context("--site"))
        .transpose()?;
    Ok(BySite { site })
}

/// A typed answer as the JSON the CLI printed before the answers were typed (unchanged for scripts).
fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

#[derive(Subcommand)]
pub enum SiteCommand {
    /// Sites with their agents, machines, secrets and boot-lease holder.
    List,
    /// Revoke a site: every agent of it is refused at the gateways' TLS handshake (within their refresh interval,
    /// 10 s) and by the site services at once; its unspent tokens are revoked and its boot lease released. Revoking
    /// again changes nothing.
    Revoke { site: String },
}

pub async fn sites(client: &ApiClient, out: Format, command: SiteCommand) -> anyhow::Result<()> {
    match command {
        SiteCommand::List => {
            let v = client.method::<ListSites>(&ListSitesRequest {}).await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t =
                    Table::new(&["SITE", "AGENTS", "MACHINES", "SECRETS", "REVOKED", "AGE"])
                        .wide(&["BOOT HOLDER", "CREATED BY"]);
                for s in &v.sites {
                    t.row(vec![
                        s.id.to_string(),
                        s.agents.to_string(),
                        s.machines.to_string(),
                        s.secrets.to_string(),
                        s.revoked_at_ms
                            .map_or_else(|| "no".to_string(), |r| output::age(Some(r), now)),
                        output::age(Some(s.created_at_ms), now),
                        s.boot_holder.clone().unwrap_or_default(),
                        s.created_by.clone(),
                    ]);
                }
                t
            })?;
        }
        SiteCommand::Revoke { site } => {
            let v = client
                .method::<RevokeSite>(&RevokeSiteRequest {
                    site: site_arg(&site)?,
                })
                .await?;
            if v.already_revoked {
                println!("site {site} was already revoked");
            } else {
                println!(
                    "revoked site {site} ({} unspent token(s) revoked, boot lease {})",
                    v.tokens_revoked,
                    if v.lease_released {
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
        /// Lifetime: 90s, 30m, 24h, 7d.
        #[arg(long, default_value = "24h", value_parser = bc_proto::duration::parse)]
        ttl: std::time::Duration,
    },
    /// Site tokens (never their secrets): uses left, expiry.
    List {
        /// Only this site's.
        #[arg(long)]
        site: Option<String>,
    },
    /// Revoke a site token: no agent enrolls with it from now on (enrolled agents stay).
    Revoke {
        /// The token's id (`site-tokens list`), not its secret.
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
    /// Machines with what they netboot.
    List {
        /// Only this site's.
        #[arg(long)]
        site: Option<String>,
    },
    /// Set what a machine netboots; without --kernel it stops netbooting.
    SetBoot {
        mac: String,
        #[command(flatten)]
        boot: BootArgs,
    },
    /// Forget a machine. Refused while the metal flow holds it (`metal release` or `metal abort` it first).
    Delete { mac: String },
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
    fn to_spec(&self) -> Option<BootSpec> {
        self.kernel.as_ref().map(|kernel| BootSpec {
            kernel: kernel.clone(),
            initrd: self.initrd.clone(),
            cmdline: self.cmdline.clone(),
        })
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
    /// Stored artifacts: hash, size, name.
    List,
    /// Delete an artifact (its row and its file). Refused, naming them, while a machine's boot or a metal
    /// machine's record references it.
    Delete {
        /// Its hash: 64 hex digits or sha256:<hex>.
        sha256: String,
    },
}

pub async fn artifacts(
    client: &ApiClient,
    out: Format,
    command: ArtifactCommand,
) -> anyhow::Result<()> {
    match command {
        ArtifactCommand::Put { file, name } => {
            let name = name.or_else(|| file.file_name().map(|n| n.to_string_lossy().into_owned()));
            let v = client.upload_artifact(&file, name.as_deref()).await?;
            println!("{}", v.reference);
            eprintln!(
                "artifact {} ({} bytes) stored",
                v.artifact.name, v.artifact.size
            );
        }
        ArtifactCommand::List => {
            let v = client
                .method::<ListArtifacts>(&ListArtifactsRequest {})
                .await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["SHA256", "SIZE", "NAME", "AGE"]).wide(&["CREATED BY"]);
                for a in &v.artifacts {
                    t.row(vec![
                        a.sha256.clone(),
                        a.size.to_string(),
                        a.name.clone(),
                        output::age(Some(a.created_at_ms), now),
                        a.created_by.clone(),
                    ]);
                }
                t
            })?;
        }
        ArtifactCommand::Delete { sha256 } => {
            let v = client
                .method::<DeleteArtifact>(&DeleteArtifactRequest { sha256 })
                .await?;
            println!("deleted artifact sha256:{}", v.sha256);
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
    /// Secrets' names, sites and when they were last put (never their values).
    List {
        /// Only this site's.
        #[arg(long)]
        site: Option<String>,
    },
    /// Delete a secret of a site. Refused, naming them, while a metal machine's BMC uses it.
    Delete {
        name: String,
        #[arg(long)]
        site: String,
    },
}

pub async fn site_tokens(
    client: &ApiClient,
    out: Format,
    command: SiteTokenCommand,
) -> anyhow::Result<()> {
    match command {
        SiteTokenCommand::Create { site, uses, ttl } => {
            let v = client
                .method::<CreateSiteToken>(&CreateSiteTokenRequest {
                    site: site_arg(&site)?,
                    uses,
                    ttl_seconds: i64::try_from(ttl.as_secs())
                        .map_err(|_| anyhow::anyhow!("--ttl is too long"))?,
                })
                .await?;
            println!("{}", v.token);
            eprintln!(
                "site token {} for site {}: {} use(s); the secret is shown only once",
                v.id, v.site, v.uses
            );
        }
        SiteTokenCommand::List { site } => {
            let v = client.method::<ListSiteTokens>(&site_filter(site)?).await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["ID", "SITE", "LEFT", "TOTAL", "REVOKED", "EXPIRES"])
                    .wide(&["AGE", "CREATED BY"]);
                for k in &v.tokens {
                    t.row(vec![
                        k.id.clone(),
                        k.site_id.to_string(),
                        k.uses_left.to_string(),
                        k.uses_total.to_string(),
                        k.revoked.to_string(),
                        output::age(Some(k.expires_at_ms), now),
                        output::age(Some(k.created_at_ms), now),
                        k.created_by.clone(),
                    ]);
                }
                t
            })?;
        }
        SiteTokenCommand::Revoke { id } => {
            client
                .method::<RevokeSiteToken>(&RevokeSiteTokenRequest { id: id.clone() })
                .await?;
            println!("revoked {id}");
        }
    }
    Ok(())
}

pub async fn machines(
    client: &ApiClient,
    out: Format,
    command: MachineCommand,
) -> anyhow::Result<()> {
    match command {
        MachineCommand::Create { mac, site, boot } => {
            let v = client
                .method::<CreateMachine>(&CreateMachineRequest {
                    mac,
                    site: site_arg(&site)?,
                    boot: boot.to_spec(),
                })
                .await?;
            println!("{}", json(&v.machine));
        }
        MachineCommand::List { site } => {
            let v = client.method::<ListMachines>(&site_filter(site)?).await?;
            output::print(out, &v, || {
                let mut t = Table::new(&["MAC", "SITE", "KERNEL"]).wide(&["INITRD", "CMDLINE"]);
                for m in &v.machines {
                    let boot = m.boot.as_ref();
                    t.row(vec![
                        m.mac.to_string(),
                        m.site_id.to_string(),
                        boot.map(|b| b.kernel.clone()).unwrap_or_default(),
                        boot.and_then(|b| b.initrd.clone()).unwrap_or_default(),
                        boot.map(|b| b.cmdline.clone()).unwrap_or_default(),
                    ]);
                }
                t
            })?;
        }
        MachineCommand::SetBoot { mac, boot } => {
            let v = client
                .method::<SetMachineBoot>(&SetMachineBootRequest {
                    mac,
                    boot: boot.to_spec(),
                })
                .await?;
            println!("{}", json(&v));
        }
        MachineCommand::Delete { mac } => {
            let v = client
                .method::<DeleteMachine>(&DeleteMachineRequest { mac })
                .await?;
            println!("deleted machine {} of site {}", v.mac, v.site);
        }
    }
    Ok(())
}

pub async fn secrets(
    client: &ApiClient,
    out: Format,
    command: SecretCommand,
) -> anyhow::Result<()> {
    match command {
        SecretCommand::List { site } => {
            let v = client.method::<ListSecrets>(&site_filter(site)?).await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["SITE", "NAME", "UPDATED"]).wide(&["BY"]);
                for x in &v.secrets {
                    t.row(vec![
                        x.site_id.to_string(),
                        x.name.clone(),
                        output::age(Some(x.updated_at_ms), now),
                        x.created_by.clone(),
                    ]);
                }
                t
            })?;
        }
        SecretCommand::Delete { name, site } => {
            client
                .method::<DeleteSecret>(&DeleteSecretRequest {
                    site: site_arg(&site)?,
                    name: name.clone(),
                })
                .await?;
            println!("deleted secret {name} of site {site}");
        }
        SecretCommand::Put {
            name,
            site,
            value_env,
        } => {
            let value = std::env::var(&value_env).map_err(|_| {
                anyhow::anyhow!("set the secret's value in the environment variable {value_env}")
            })?;
            client
                .method::<PutSecret>(&PutSecretRequest {
                    site: site_arg(&site)?,
                    name: name.clone(),
                    value,
                })
                .await?;
            println!("stored secret {name} for site {site}");
        }
    }
    Ok(())
}
