//! The metal executor (`controllers` role, shard-owned): for each machine of the shards this process leases that
//! is in a wait phase (or `ready`, for its idle timeout), one transaction assembles the planner's input (the stored
//! record, the results of the current attempt's steps, the node its ramdisk joined as while that node's session is
//! up), calls [`bc_core::metal::plan`] at `now`, and applies the plan ([`crate::apply`]). The lease's fence is
//! held `FOR SHARE` in the same transaction, so a process whose shard moved on changes nothing.

use crate::Metal;
use crate::apply::{self, Applied};
use crate::queries::{self, MetalRow};
use bc_core::metal::{MachineInput, Verb, plan};
use bc_core::shards::ShardLease;
use bc_kernel::StepCx;
use bc_store::StoreError;
use bc_store::sqlx::{self, PgConnection};

pub const ROLE: &str = "controllers";

/// How long a ramdisk whose session dropped still counts as there: a control plane restarted or a gateway that
/// failed over drops every session, and the ramdisk dials again within seconds; a ramdisk really gone (powered
/// off, kexec'd) ends its attempt this much later.
pub const SESSION_GRACE_MS: i64 = 90_000;

/// Reads what happened since the record was stored (at `now_ms`): the results of its attempt, the ramdisk's node
/// (up while its session is, or dropped less than [`SESSION_GRACE_MS`] ago), the installed system's node, and
/// whether the site holds the deploy image (`mirror`: a configured image URL serves it when the site never said).
pub async fn observe(
    tx: &mut PgConnection,
    row: &MetalRow,
    now_ms: i64,
    mirror: bool,
) -> Result<MachineInput, StoreError> {
    let mut input = MachineInput::new(row.machine.clone());
    input.results = queries::results(tx, row.mac.as_str(), row.machine.attempt_id).await?;
    input.last_dhcp_seen = row.last_dhcp_ms;
    if let bc_core::metal::Goal::Deployed(spec) = &row.machine.goal {
        let hex = spec.image.strip_prefix("sha256:").unwrap_or(&spec.image);
        let site: Option<bool> =
            sqlx::query_scalar("SELECT $2 = ANY(cached) FROM metal_sites WHERE site_id = $1")
                .bind(row.site.as_str())
                .bind(hex)
                .fetch_optional(&mut *tx)
                .await?;
        // A site that reported holds the image or not; one that never did leaves a configured mirror.
        input.image_at_site = site.unwrap_or(mirror);
    }
    // The node a ramdisk joined as with one of this machine's boot tokens (the latest).
    let joined: Option<(String, bool, String, Option<i64>)> = sqlx::query_as(
        "SELECT n.id, n.online, t.id, (extract(epoch FROM n.last_seen_at) * 1000)::bigint \
         FROM nodes n JOIN metal_boot_tokens t ON n.join_token_id = t.id \
         WHERE t.mac = $1 AND n.state <> 'revoked' ORDER BY n.joined_at DESC LIMIT 1",
    )
    .bind(row.mac.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((node, online, token, seen)) = joined {
        let online = online || seen.is_some_and(|at| now_ms.saturating_sub(at) < SESSION_GRACE_MS);
        if row.ramdisk_node.as_deref() != Some(node.as_str()) {
            queries::set_ramdisk_node(tx, row.mac.as_str(), Some(&node)).await?;
            sqlx::query(
                "UPDATE metal_boot_tokens SET node_id = $2, used_ms = coalesce(used_ms, $3) WHERE id = $1",
            )
            .bind(&token)
            .bind(&node)
            .bind(crate::now_ms())
            .execute(&mut *tx)
            .await?;
        }
        if online {
            input.ramdisk = Some(node);
        }
    }
    // The node the installed system's bcd joined as with one of this machine's join tokens (a reclaim moves the
    // node's join token from the boot token to this one, so the ramdisk above is then no longer found).
    let installed: Option<(String, bool, String)> = sqlx::query_as(
        "SELECT n.id, n.online, t.id FROM nodes n JOIN metal_join_tokens t ON n.join_token_id = t.id \
         WHERE t.mac = $1 AND n.state <> 'revoked' ORDER BY n.joined_at DESC LIMIT 1",
    )
    .bind(row.mac.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((node, online, token)) = installed {
        if row.installed_node.as_deref() != Some(node.as_str()) {
            sqlx::query("UPDATE metal_machines SET installed_node = $2 WHERE mac = $1")
                .bind(row.mac.as_str())
                .bind(&node)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "UPDATE metal_join_tokens SET used_ms = coalesce(used_ms, $2) WHERE id = $1",
            )
            .bind(&token)
            .bind(crate::now_ms())
            .execute(&mut *tx)
            .await?;
        }
        if online {
            input.installed = Some(node);
        }
    }
    Ok(input)
}

/// What one pass over one machine did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// Another transaction holds it, or this process no longer holds its shard.
    Skipped,
    Unchanged,
    Applied(Applied),
}

/// Plans machine `mac` at `now_ms` and applies the plan, fenced by `leases` (`None`: unfenced, for a verb).
pub async fn pass(
    metal: &Metal,
    worker: &str,
    leases: &[ShardLease],
    mac: &str,
    now_ms: i64,
) -> Result<Pass, StoreError> {
    let mut tx = metal.store.pool().begin().await?;
    let shards: Vec<i16> = leases.iter().map(|l| l.shard.get()).collect();
    let fences: Vec<i64> = leases.iter().map(|l| l.fence).collect();
    let held: Option<i16> = sqlx::query_scalar(
        "SELECT l.shard FROM shard_leases l JOIN unnest($3::smallint[], $4::bigint[]) AS h(shard, fence) \
           ON l.shard = h.shard AND l.fence = h.fence \
         WHERE l.role = $1 AND l.owner = $2 AND l.expires_at > now() \
           AND l.shard = (SELECT shard FROM metal_machines WHERE mac = $5) FOR SHARE OF l",
    )
    .bind(ROLE)
    .bind(worker)
    .bind(&shards)
    .bind(&fences)
    .bind(mac)
    .fetch_optional(&mut *tx)
    .await?;
    if held.is_none() {
        return Ok(Pass::Skipped);
    }
    let Some(row) = queries::try_lock(&mut tx, mac).await? else {
        return Ok(Pass::Skipped);
    };
    let mirror = metal.config.deploy.image_base_url.is_some();
    let input = observe(&mut tx, &row, now_ms, mirror).await?;
    let p = plan(&input, now_ms, &metal.config.policy);
    if p.actions.is_empty() && p.next == row.machine {
        tx.commit().await?;
        return Ok(Pass::Unchanged);
    }
    let applied = apply::apply(&mut tx, &metal.config, &row, &p, now_ms, "metal").await?;
    tx.commit().await?;
    for t in &p.transitions {
        tracing::info!(mac, from = %t.from, to = %t.to, why = t.why, "metal transition");
    }
    Ok(Pass::Applied(applied))
}

/// Applies an operator's verb to `mac` at `now_ms`: the planner decides (a refused verb changes nothing and
/// answers why), the plan is applied as the executor would, with `actor` in the audit events.
pub async fn verb(
    metal: &Metal,
    mac: &str,
    verb: Verb,
    now_ms: i64,
    actor: &str,
) -> Result<Result<MetalRow, String>, StoreError> {
    let mut tx = metal.store.pool().begin().await?;
    let Some(row) = queries::lock(&mut tx, mac).await? else {
        return Err(StoreError::NotFound {
            what: "metal machine",
            id: mac.to_owned(),
        });
    };
    let mirror = metal.config.deploy.image_base_url.is_some();
    let mut input = observe(&mut tx, &row, now_ms, mirror).await?;
    let name = format!("{verb:?}").to_ascii_lowercase();
    let name = name.split('(').next().unwrap_or_default().to_owned();
    input.verb = Some(verb);
    let p = plan(&input, now_ms, &metal.config.policy);
    if let Some(why) = p.rejected {
        return Ok(Err(why));
    }
    apply::audit(
        &mut tx,
        actor,
        &format!("metal.{name}"),
        mac,
        serde_json::json!({"at_ms": now_ms}),
    )
    .await?;
    apply::apply(&mut tx, &metal.config, &row, &p, now_ms, actor).await?;
    let mut after = row;
    after.machine = p.next;
    tx.commit().await?;
    Ok(Ok(after))
}

/// One pass over every machine of `leases` the executor looks at; returns how many changed.
pub async fn step(
    metal: &Metal,
    worker: &str,
    leases: &[ShardLease],
    now_ms: i64,
) -> Result<usize, StoreError> {
    let shards: Vec<i16> = leases.iter().map(|l| l.shard.get()).collect();
    if shards.is_empty() {
        return Ok(0);
    }
    let mut changed = 0;
    for mac in queries::scan(metal.store.pool(), &shards).await? {
        match pass(metal, worker, leases, &mac, now_ms).await {
            Ok(Pass::Applied(_)) => changed += 1,
            Ok(_) => {}
            Err(e) => tracing::warn!(mac, error = %e, "metal pass failed; retrying next tick"),
        }
    }
    Ok(changed)
}

/// The reconciler's step (the kernel runs it on every tick, notification (`bc_metal`: a result or a verb) and change
/// of shards), at the wall clock read here.
pub async fn reconcile(cx: StepCx) -> Result<(), StoreError> {
    let Some(metal) = cx.resources.get::<Metal>().cloned() else {
        return Err(StoreError::Corrupt(
            "metal: the module did not start; the executor cannot run".into(),
        ));
    };
    step(&metal, &cx.worker.id, &cx.leases, crate::now_ms()).await?;
    Ok(())
}
