//! The CLI of the server's own groups: `tenants create|list`, `principals create|list` (grants and key ids, never
//! a key but the one `create` prints once) and `audit list` (filtered by actor, action, subject and time).

use crate::client::ApiClient;
use crate::output::{self, Format, Table};
use crate::plane::{
    CreatePrincipalMethod, CreateTenantMethod, ListAuditMethod, ListPrincipalsMethod,
    ListTenantsMethod,
};
use anyhow::Context as _;
use bc_core::api::audit::ListAudit;
use bc_core::api::iam::{CreatePrincipal, CreateTenant, ListPrincipals, ListTenants};
use bc_core::iam::Grant;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum TenantCommand {
    /// Create a tenant (root callers only); creating one that exists changes nothing.
    Create {
        id: String,
        #[arg(long)]
        name: Option<String>,
    },
    /// Tenants (all for a root caller, else its own).
    List,
}

#[derive(Subcommand)]
pub enum PrincipalCommand {
    /// Create a principal holding the grants given (each covered by one of yours); prints its API key (shown
    /// once) on stdout.
    Create {
        id: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        name: Option<String>,
        /// A grant, PERMISSION@SCOPE (e.g. compute:nodes:get@pool/gpu-a), repeatable.
        #[arg(long = "grant", value_name = "PERMISSION@SCOPE")]
        grants: Vec<String>,
    },
    /// The principals of a tenant (yours by default) with their grants and API key ids.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum AuditCommand {
    /// Audit events, newest first.
    List {
        /// The actor exactly (principal/admin, node/<id>, site/<id>/agent/<key>).
        #[arg(long)]
        actor: Option<String>,
        /// The action exactly, or a prefix ending in `.` or `*` (machine.*, secret.).
        #[arg(long)]
        action: Option<String>,
        /// The subject exactly, or a prefix ending in `/` or `*` (machine/aa:bb:cc:dd:ee:ff, site/rack-1/).
        #[arg(long)]
        subject: Option<String>,
        /// Events at or after: a duration ago (1h, 7d) or an RFC 3339 time (2026-12-01T18:00:00Z).
        #[arg(long, value_parser = instant_arg)]
        since: Option<i64>,
        /// Events before: a duration ago or an RFC 3339 time.
        #[arg(long, value_parser = instant_arg)]
        until: Option<i64>,
        /// At most this many (one page; the next page's --before goes to stderr).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Events older than this event id (a page's continuation).
        #[arg(long)]
        before: Option<i64>,
    },
}

/// `1h` (that long ago) or `2026-12-01T18:00:00Z`, as Unix milliseconds.
fn instant_arg(s: &str) -> Result<i64, String> {
    if let Ok(t) = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339) {
        return Ok((t.unix_timestamp_nanos() / 1_000_000) as i64);
    }
    match bc_proto::duration::parse(s) {
        Ok(d) => Ok(output::now_ms() - d.as_millis() as i64),
        Err(e) => Err(format!(
            "{e}; or give an RFC 3339 time such as 2026-12-01T18:00:00Z"
        )),
    }
}

pub async fn tenants(
    client: &ApiClient,
    out: Format,
    command: TenantCommand,
) -> anyhow::Result<()> {
    match command {
        TenantCommand::Create { id, name } => {
            let t = client
                .method::<CreateTenantMethod>(&CreateTenant { id, name })
                .await?;
            println!("tenant {} ({})", t.id, t.name);
        }
        TenantCommand::List => {
            let v = client.method::<ListTenantsMethod>(&ListTenants {}).await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["TENANT", "NAME", "ROOT", "AGE"]);
                for x in &v.tenants {
                    t.row(vec![
                        x.id.clone(),
                        x.name.clone(),
                        x.is_root.to_string(),
                        output::age(Some(x.created_at_ms), now),
                    ]);
                }
                t
            })?;
        }
    }
    Ok(())
}

pub async fn principals(
    client: &ApiClient,
    out: Format,
    command: PrincipalCommand,
) -> anyhow::Result<()> {
    match command {
        PrincipalCommand::Create {
            id,
            tenant,
            name,
            grants,
        } => {
            let grants = grants
                .iter()
                .map(|g| {
                    let (permission, scope) = g.split_once('@').with_context(|| {
                        format!(
                            "--grant {g:?}: write PERMISSION@SCOPE (compute:nodes:get@pool/gpu-a)"
                        )
                    })?;
                    Ok(Grant {
                        permission: permission.to_string(),
                        scope: scope.to_string(),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let p = client
                .method::<CreatePrincipalMethod>(&CreatePrincipal {
                    id,
                    tenant,
                    name,
                    grants,
                })
                .await?;
            println!("{}", p.api_key);
            eprintln!(
                "principal {} of tenant {}; its API key is shown only once",
                p.id, p.tenant
            );
        }
        PrincipalCommand::List { tenant } => {
            let v = client
                .method::<ListPrincipalsMethod>(&ListPrincipals { tenant })
                .await?;
            let now = output::now_ms();
            output::print(out, &v, || {
                let mut t = Table::new(&["PRINCIPAL", "TENANT", "GRANTS", "DISABLED", "AGE"])
                    .wide(&["NAME", "KEY ID"]);
                for p in &v.principals {
                    let grants: Vec<String> = p
                        .grants
                        .iter()
                        .map(|g| format!("{}@{}", g.permission, g.scope))
                        .collect();
                    t.row(vec![
                        p.id.clone(),
                        p.tenant.clone(),
                        grants.join(","),
                        p.disabled.to_string(),
                        output::age(Some(p.created_at_ms), now),
                        p.name.clone(),
                        p.api_key_id.clone().unwrap_or_default(),
                    ]);
                }
                t
            })?;
        }
    }
    Ok(())
}

pub async fn audit(client: &ApiClient, out: Format, command: AuditCommand) -> anyhow::Result<()> {
    let AuditCommand::List {
        actor,
        action,
        subject,
        since,
        until,
        limit,
        before,
    } = command;
    let v = client
        .method::<ListAuditMethod>(&ListAudit {
            actor,
            action,
            subject,
            since_ms: since,
            until_ms: until,
            limit: Some(limit),
            before,
        })
        .await?;
    if let Some(next) = v.next {
        eprintln!("older events: --before {next}");
    }
    let now = output::now_ms();
    output::print(out, &v, || {
        let mut t =
            Table::new(&["AGE", "ACTOR", "ACTION", "SUBJECT"]).wide(&["ID", "TIME", "DETAIL"]);
        for e in &v.events {
            t.row(vec![
                output::age(Some(e.at_ms), now),
                e.actor.clone(),
                e.action.clone(),
                e.subject.clone(),
                e.id.to_string(),
                output::rfc3339(e.at_ms),
                e.detail.to_string(),
            ]);
        }
        t
    })
}
