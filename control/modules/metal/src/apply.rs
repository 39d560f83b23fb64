//! Applies a [`Plan`] in the caller's transaction, in the plan's order: BMC commands for the machine's site,
//! boot tokens (single-use join tokens the ramdisk joins with), the netboot entry (the machine's boot spec with
//! the token on the ramdisk's kernel command line), ramdisk commands on the machine's node, cancellations; then the
//! record, its timeline rows and one audit event per transition. Everything commits together or not at all, so a
//! control plane that stops between two steps resumes from the stored record and repeats nothing.

use crate::outcomes;
use crate::queries::{self, MetalRow, step_str};
use crate::{Config, POKE};
use bc_core::api::sites::BootSpec;
use bc_core::metal::{Action, Plan, RamdiskCommand, State, Step};
use bc_proto::token::{Token, TokenKind};
use bc_store::StoreError;
use bc_store::sqlx::{self, PgConnection};

/// What one application did (for logs and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    pub bmc_commands: usize,
    pub ramdisk_commands: usize,
    pub boot_tokens: usize,
    pub transitions: usize,
}

fn new_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// The kernel command line of an attempt's ramdisk: the configured one and its boot token.
pub fn ramdisk_cmdline(base: &str, token: &str) -> String {
    let base = base.trim();
    if base.is_empty() {
        format!("bc.boot_token={token}")
    } else {
        format!("{base} bc.boot_token={token}")
    }
}

/// Applies `plan` (computed at `now_ms` for `row`) and stores its record. `actor` names who caused it in the audit
/// events (`metal` for the executor, the operator's principal for a verb).
pub async fn apply(
    tx: &mut PgConnection,
    config: &Config,
    row: &MetalRow,
    plan: &Plan,
    now_ms: i64,
    actor: &str,
) -> Result<Applied, StoreError> {
    let mac = row.mac.as_str();
    let mut done = Applied::default();
    let mut boot_token: Option<String> = None;
    let mut join_token: Option<String> = None;
    // Commands of attempts that are over are withdrawn from the site and the node first: a late result is ignored
    // by the planner anyway, and a BMC must not act on a stale power kick. Those this plan sends (a disk boot
    // restored as the attempt that joined ends) are kept.
    let mut keep: Vec<u64> = plan.actions.iter().filter_map(attempt_of).collect();
    if !plan.next.state.is_failed() {
        keep.push(plan.next.attempt_id);
    }
    match &plan.next.state {
        State::Failed { reason, .. } => cancel(tx, mac, reason, &keep).await?,
        State::Active { .. } if plan.next.attempt_id != row.machine.attempt_id => {
            cancel(tx, mac, "the attempt is over", &keep).await?
        }
        State::Active { .. } => {}
    }
    for action in &plan.actions {
        match action {
            Action::Bmc {
                step,
                attempt_id,
                op,
            } => {
                let timeout = match step {
                    Step::Inspect => config.policy.inspect.timeout_ms,
                    _ => config.policy.bmc_timeout_ms,
                };
                let id = new_id();
                queries::insert_bmc(
                    tx,
                    queries::NewBmcCommand {
                        id: &id,
                        mac,
                        site: row.site.as_str(),
                        attempt_id: *attempt_id,
                        step: *step,
                        op,
                        now_ms,
                        deadline_ms: now_ms.saturating_add(timeout),
                    },
                )
                .await?;
                done.bmc_commands += 1;
            }
            Action::MintBootToken { attempt_id } => {
                boot_token = Some(mint_boot_token(tx, config, mac, *attempt_id, now_ms).await?);
                done.boot_tokens += 1;
            }
            Action::PublishNetboot { .. } => {
                let Some(token) = &boot_token else {
                    return Err(StoreError::Corrupt(format!(
                        "machine {mac}: the plan publishes a netboot entry without minting its boot token"
                    )));
                };
                let boot = BootSpec {
                    kernel: config.ramdisk.kernel.clone(),
                    initrd: config.ramdisk.initrd.clone(),
                    cmdline: ramdisk_cmdline(&config.ramdisk.cmdline, token),
                };
                set_boot(tx, mac, Some(&boot), actor).await?;
            }
            Action::WithdrawNetboot { .. } => set_boot(tx, mac, None, actor).await?,
            Action::Queue {
                step,
                attempt_id,
                node_id,
                command,
            } => {
                let url = match command {
                    RamdiskCommand::Stream { image } => {
                        Some(stream_url(tx, config, row, image).await?)
                    }
                    _ => None,
                };
                if matches!(command, RamdiskCommand::Kexec { .. }) && join_token.is_none() {
                    return Err(StoreError::Corrupt(format!(
                        "machine {mac}: the plan queues a kexec without minting the installed system's join token"
                    )));
                }
                let (kind, args) = outcomes::command(
                    command,
                    &config.deploy,
                    url.as_deref(),
                    join_token.as_deref(),
                );
                let deadline = plan
                    .next
                    .deadline
                    .unwrap_or(now_ms.saturating_add(config.policy.bmc_timeout_ms));
                queue(tx, mac, *attempt_id, *step, node_id, kind, &args, deadline).await?;
                done.ramdisk_commands += 1;
            }
            Action::MintJoinToken {
                attempt_id,
                node_id,
            } => {
                join_token =
                    Some(mint_join_token(tx, config, mac, *attempt_id, node_id, now_ms).await?);
            }
            Action::CancelCommands { reason } => cancel(tx, mac, reason, &[]).await?,
        }
    }
    record(tx, row, plan, actor, &mut done).await?;
    Ok(done)
}

/// Where the ramdisk streams `image` from: the machine's site's boot HTTP, as its agent last reported it (the site
/// holds the image in its cache while a machine of the site deploys it), else the configured base URL.
async fn stream_url(
    tx: &mut PgConnection,
    config: &Config,
    row: &MetalRow,
    image: &str,
) -> Result<String, StoreError> {
    let hex = image.strip_prefix("sha256:").unwrap_or(image);
    let site_url: Option<String> =
        sqlx::query_scalar("SELECT boot_url FROM metal_sites WHERE site_id = $1")
            .bind(row.site.as_str())
            .fetch_optional(&mut *tx)
            .await?;
    outcomes::image_url(&config.deploy, site_url.as_deref(), hex).ok_or_else(|| {
        StoreError::NotFound {
            what: "boot HTTP URL (the site agent reports it once it serves boot; no [metal] image_base_url either) of site",
            id: row.site.as_str().to_owned(),
        }
    })
}

/// Stores the plan's record with one audit event per transition, and wakes the site and the executor.
async fn record(
    tx: &mut PgConnection,
    row: &MetalRow,
    plan: &Plan,
    actor: &str,
    done: &mut Applied,
) -> Result<(), StoreError> {
    let mac = row.mac.as_str();
    queries::save(tx, &plan.next).await?;
    for t in &plan.transitions {
        audit(
            tx,
            actor,
            "metal.transition",
            mac,
            serde_json::json!({"at_ms": t.at, "from": t.from, "to": t.to, "why": t.why}),
        )
        .await?;
        done.transitions += 1;
    }
    if done.bmc_commands > 0 {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(crate::BMC_WRITTEN)
            .bind(row.site.as_str())
            .execute(&mut *tx)
            .await?;
    }
    if !plan.transitions.is_empty() {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(POKE)
            .bind(mac)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

pub(crate) async fn audit(
    tx: &mut PgConnection,
    actor: &str,
    action: &str,
    mac: &str,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_events (actor, action, subject, detail) VALUES ($1, $2, $3, $4)",
    )
    .bind(actor)
    .bind(action)
    .bind(format!("machine/{mac}"))
    .bind(detail)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

async fn set_boot(
    tx: &mut PgConnection,
    mac: &str,
    boot: Option<&BootSpec>,
    actor: &str,
) -> Result<(), StoreError> {
    let json = boot
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    sqlx::query("UPDATE machines SET boot = $2, updated_at = now() WHERE mac = $1")
        .bind(mac)
        .bind(&json)
        .execute(&mut *tx)
        .await?;
    // The boot spec carries the boot token: the audit event names the change, never the token.
    audit(
        tx,
        actor,
        if boot.is_some() {
            "metal.netboot-published"
        } else {
            "metal.netboot-withdrawn"
        },
        mac,
        serde_json::json!({"kernel": boot.map(|b| &b.kernel)}),
    )
    .await
}

/// Mints the attempt's boot token: a single-use join token of the metal pool that expires with the netboot
/// wait, recorded against the machine and attempt (the executor finds the node that joined with it).
async fn mint_boot_token(
    tx: &mut PgConnection,
    config: &Config,
    mac: &str,
    attempt_id: u64,
    now_ms: i64,
) -> Result<String, StoreError> {
    let token = Token::generate(TokenKind::Join)
        .map_err(|e| StoreError::Corrupt(format!("no randomness for a boot token: {e}")))?;
    let expires = now_ms
        .saturating_add(config.policy.bmc_timeout_ms)
        .saturating_add(config.policy.netboot.timeout_ms);
    // Reclaim: a machine whose ramdisk joined before (an earlier attempt, a release after a deploy) is the same
    // hardware and comes back as the same node; without it JoinService refuses the second join ("this hardware
    // already belongs to node …").
    insert_join_token(tx, config, &token, true, expires).await?;
    sqlx::query(
        "INSERT INTO metal_boot_tokens (id, mac, attempt_id, secret_hash, created_ms) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(token.id())
    .bind(mac)
    .bind(i64::try_from(attempt_id).unwrap_or(i64::MAX))
    .bind(token.secret().hash())
    .bind(now_ms)
    .execute(&mut *tx)
    .await?;
    Ok(token.reveal())
}

async fn insert_join_token(
    tx: &mut PgConnection,
    config: &Config,
    token: &Token,
    reclaim: bool,
    expires_ms: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO pools (id, tenant_id, name, acceptance) VALUES ($1, 'root', $1, '[]') ON CONFLICT (id) DO NOTHING",
    )
    .bind(&config.pool)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO join_tokens (id, pool_id, secret_hash, uses_total, uses_left, expires_at, reclaim, created_by) \
         VALUES ($1, $2, $3, 1, 1, to_timestamp($4 / 1000.0), $5, 'metal')",
    )
    .bind(token.id())
    .bind(&config.pool)
    .bind(token.secret().hash())
    .bind(expires_ms as f64)
    .bind(reclaim)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The installed system's join token: single use, reclaiming the machine's node.
async fn mint_join_token(
    tx: &mut PgConnection,
    config: &Config,
    mac: &str,
    attempt_id: u64,
    node_id: &str,
    now_ms: i64,
) -> Result<String, StoreError> {
    let token = Token::generate(TokenKind::Join)
        .map_err(|e| StoreError::Corrupt(format!("no randomness for a join token: {e}")))?;
    let expires = now_ms.saturating_add(config.policy.deploy.timeout_ms);
    insert_join_token(tx, config, &token, true, expires).await?;
    sqlx::query(
        "INSERT INTO metal_join_tokens (id, mac, attempt_id, node_id, created_ms) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(token.id())
    .bind(mac)
    .bind(i64::try_from(attempt_id).unwrap_or(i64::MAX))
    .bind(node_id)
    .bind(now_ms)
    .execute(&mut *tx)
    .await?;
    audit(
        tx,
        "metal",
        "metal.join-token",
        mac,
        serde_json::json!({"token": token.id(), "attempt_id": attempt_id, "reclaims": node_id}),
    )
    .await?;
    Ok(token.reveal())
}

#[allow(clippy::too_many_arguments)]
async fn queue(
    tx: &mut PgConnection,
    mac: &str,
    attempt_id: u64,
    step: Step,
    node_id: &str,
    kind: &str,
    args: &serde_json::Value,
    deadline_ms: i64,
) -> Result<(), StoreError> {
    let id = new_id();
    sqlx::query(
        "INSERT INTO commands (id, node_id, kind, args, deadline_at) VALUES ($1, $2, $3, $4, to_timestamp($5 / 1000.0))",
    )
    .bind(&id)
    .bind(node_id)
    .bind(kind)
    .bind(args)
    .bind(deadline_ms as f64)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO metal_commands (command_id, mac, attempt_id, step) VALUES ($1, $2, $3, $4)",
    )
    .bind(&id)
    .bind(mac)
    .bind(i64::try_from(attempt_id).unwrap_or(i64::MAX))
    .bind(step_str(step))
    .execute(&mut *tx)
    .await?;
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(bc_store::pokes::OUTBOX)
        .bind(node_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

fn attempt_of(a: &Action) -> Option<u64> {
    match a {
        Action::Bmc { attempt_id, .. }
        | Action::Queue { attempt_id, .. }
        | Action::MintBootToken { attempt_id }
        | Action::PublishNetboot { attempt_id, .. }
        | Action::MintJoinToken { attempt_id, .. } => Some(*attempt_id),
        Action::WithdrawNetboot { .. } | Action::CancelCommands { .. } => None,
    }
}

/// Cancels the machine's open commands (BMC and ramdisk) of every attempt but those in `keep`, except a disk boot
/// being restored: that undoes the PXE override a BMC stores as persistent, and a machine that failed or was aborted
/// must not be left netbooting forever (the BMC worker still runs it and its result is still stored).
async fn cancel(
    tx: &mut PgConnection,
    mac: &str,
    reason: &str,
    keep: &[u64],
) -> Result<(), StoreError> {
    let keep: Vec<i64> = keep
        .iter()
        .map(|k| i64::try_from(*k).unwrap_or(i64::MAX))
        .collect();
    sqlx::query(
        "UPDATE metal_bmc_commands SET state = 'cancelled' WHERE mac = $1 AND state IN ('pending', 'sent') \
         AND NOT (attempt_id = ANY($2)) AND step <> 'restore-disk-boot'",
    )
    .bind(mac)
    .bind(&keep)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE commands SET state = 'failed', error = $3, finished_at = now() WHERE state IN ('pending', 'sent') \
         AND id IN (SELECT command_id FROM metal_commands WHERE mac = $1 AND NOT (attempt_id = ANY($2)))",
    )
    .bind(mac)
    .bind(&keep)
    .bind(format!("cancelled by the metal flow: {reason}"))
    .execute(&mut *tx)
    .await?;
    Ok(())
}
