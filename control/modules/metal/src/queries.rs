//! The metal module's queries (its own tables, `migrations/1100_metal.sql`). Rows are parsed here, once: a record
//! that does not parse is corrupt data naming the machine, never skipped.

use bc_core::api::metal::{BmcRef, Evidence, MachineSummary, StepView};
use bc_core::ids::{MachineId, SiteId};
use bc_core::metal::{BmcOp, Machine, Outcome, Phase, Step, StepResult, TimelineRow};
use bc_store::StoreError;
use bc_store::sqlx::{self, PgConnection, Row};

/// A machine as the metal module stores it.
#[derive(Debug, Clone)]
pub struct MetalRow {
    pub mac: MachineId,
    pub site: SiteId,
    pub bmc: BmcRef,
    pub machine: Machine,
    pub ramdisk_node: Option<String>,
    pub installed_node: Option<String>,
    pub last_dhcp_ms: Option<i64>,
}

fn corrupt(mac: &str, what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("metal_machines row {mac:?}: {what}"))
}

pub(crate) fn step_str(step: Step) -> String {
    match serde_json::to_value(step) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{step:?}"),
    }
}

fn step_of(s: &str) -> Option<Step> {
    serde_json::from_value(serde_json::Value::String(s.to_owned())).ok()
}

macro_rules! columns {
    () => {
        "mac, site_id, bmc_address, bmc_credentials, record, ramdisk_node, installed_node, last_dhcp_ms"
    };
}

fn row_of(r: &sqlx::postgres::PgRow) -> Result<MetalRow, StoreError> {
    let mac: String = r.get(0);
    let machine: Machine =
        serde_json::from_value(r.get(4)).map_err(|e| corrupt(&mac, format!("record: {e}")))?;
    Ok(MetalRow {
        site: SiteId::new(r.get(1)).map_err(|e| corrupt(&mac, e))?,
        bmc: BmcRef {
            address: r.get(2),
            credentials: r.get(3),
        },
        machine,
        ramdisk_node: r.get(5),
        installed_node: r.get(6),
        last_dhcp_ms: r.get(7),
        mac: MachineId::new(mac.clone()).map_err(|e| corrupt(&mac, e))?,
    })
}

fn record_json(m: &Machine) -> Result<serde_json::Value, StoreError> {
    serde_json::to_value(m).map_err(|e| StoreError::Corrupt(format!("metal record: {e}")))
}

/// Inserts an enrolled machine (its `machines` row must exist). CONFLICT when it is enrolled already.
pub async fn insert(
    tx: &mut PgConnection,
    site: &SiteId,
    bmc: &BmcRef,
    machine: &Machine,
) -> Result<(), StoreError> {
    let n = sqlx::query(
        "INSERT INTO metal_machines (mac, shard, site_id, bmc_address, bmc_credentials, record, phase, failed, \
         deadline_ms) VALUES ($1, bc_shard($1), $2, $3, $4, $5, $6, false, NULL) ON CONFLICT (mac) DO NOTHING",
    )
    .bind(&machine.mac)
    .bind(site.as_str())
    .bind(&bmc.address)
    .bind(&bmc.credentials)
    .bind(record_json(machine)?)
    .bind(machine.state.phase().as_str())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if n == 0 {
        return Err(StoreError::Conflict(format!(
            "machine {} is enrolled already: see it with `better-compute metal show {}`",
            machine.mac, machine.mac
        )));
    }
    save_timeline(tx, &machine.mac, &machine.timeline).await
}

/// The machine, locked for the caller's transaction.
pub async fn lock(tx: &mut PgConnection, mac: &str) -> Result<Option<MetalRow>, StoreError> {
    let row = sqlx::query(concat!(
        "SELECT ",
        columns!(),
        " FROM metal_machines WHERE mac = $1 FOR UPDATE"
    ))
    .bind(mac)
    .fetch_optional(&mut *tx)
    .await?;
    row.as_ref().map(row_of).transpose()
}

/// The machine, locked, when no other transaction holds it (the executor skips it this round otherwise).
pub async fn try_lock(tx: &mut PgConnection, mac: &str) -> Result<Option<MetalRow>, StoreError> {
    let row = sqlx::query(concat!(
        "SELECT ",
        columns!(),
        " FROM metal_machines WHERE mac = $1 FOR UPDATE SKIP LOCKED"
    ))
    .bind(mac)
    .fetch_optional(&mut *tx)
    .await?;
    row.as_ref().map(row_of).transpose()
}

pub async fn get(pool: &sqlx::PgPool, mac: &str) -> Result<Option<MetalRow>, StoreError> {
    let row = sqlx::query(concat!(
        "SELECT ",
        columns!(),
        " FROM metal_machines WHERE mac = $1"
    ))
    .bind(mac)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(row_of).transpose()
}

/// Stores the record the planner returned (and the timeline rows that changed).
pub async fn save(tx: &mut PgConnection, m: &Machine) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE metal_machines SET record = $2, phase = $3, failed = $4, deadline_ms = $5, updated_at = now() \
         WHERE mac = $1",
    )
    .bind(&m.mac)
    .bind(record_json(m)?)
    .bind(m.state.phase().as_str())
    .bind(m.state.is_failed())
    .bind(m.deadline)
    .execute(&mut *tx)
    .await?;
    save_timeline(tx, &m.mac, &m.timeline).await
}

async fn save_timeline(
    tx: &mut PgConnection,
    mac: &str,
    rows: &[TimelineRow],
) -> Result<(), StoreError> {
    for (seq, r) in rows.iter().enumerate() {
        sqlx::query(
            "INSERT INTO metal_timeline (mac, seq, phase, start_ms, end_ms, attempt, outcome) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (mac, seq) DO UPDATE \
             SET end_ms = EXCLUDED.end_ms, outcome = EXCLUDED.outcome \
             WHERE metal_timeline.end_ms IS DISTINCT FROM EXCLUDED.end_ms \
                OR metal_timeline.outcome IS DISTINCT FROM EXCLUDED.outcome",
        )
        .bind(mac)
        .bind(i32::try_from(seq).unwrap_or(i32::MAX))
        .bind(r.phase.as_str())
        .bind(r.start)
        .bind(r.end)
        .bind(i32::try_from(r.attempt).unwrap_or(i32::MAX))
        .bind(&r.outcome)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Records what the executor learned about the machine's nodes.
pub async fn set_ramdisk_node(
    tx: &mut PgConnection,
    mac: &str,
    node: Option<&str>,
) -> Result<(), StoreError> {
    sqlx::query("UPDATE metal_machines SET ramdisk_node = $2 WHERE mac = $1")
        .bind(mac)
        .bind(node)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The machines of `shards` the executor looks at: every one not failed and not resting in `enrolled` or
/// `deployed` (a wait phase, or `ready` with its idle timeout).
pub async fn scan(pool: &sqlx::PgPool, shards: &[i16]) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT mac FROM metal_machines WHERE NOT failed AND shard = ANY($1) \
         AND phase NOT IN ('enrolled', 'deployed') ORDER BY mac",
    )
    .bind(shards)
    .fetch_all(pool)
    .await?)
}

pub async fn list(
    pool: &sqlx::PgPool,
    site: Option<&str>,
    phase: Option<Phase>,
    failed: Option<bool>,
) -> Result<Vec<MachineSummary>, StoreError> {
    let rows = sqlx::query(concat!(
        "SELECT ",
        columns!(),
        " FROM metal_machines WHERE ($1::text IS NULL OR site_id = $1) \
         AND ($2::text IS NULL OR phase = $2) AND ($3::boolean IS NULL OR failed = $3) ORDER BY mac"
    ))
    .bind(site)
    .bind(phase.map(Phase::as_str))
    .bind(failed)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            let m = row_of(r)?;
            Ok(MachineSummary {
                mac: m.mac,
                site: m.site,
                state: m.machine.state,
                attempt: m.machine.attempt,
                deadline_ms: m.machine.deadline,
                last_error: m.machine.last_error,
                phase_started_ms: Some(m.machine.phase_started),
                waiting_for: m.machine.waiting_for,
            })
        })
        .collect()
}

/// The results of attempt `attempt_id`'s steps: the BMC commands the site reported and the ramdisk commands the
/// node did (done, failed or expired).
pub async fn results(
    tx: &mut PgConnection,
    mac: &str,
    attempt_id: u64,
) -> Result<Vec<StepResult>, StoreError> {
    let attempt = i64::try_from(attempt_id).unwrap_or(i64::MAX);
    let mut out = Vec::new();
    let bmc = sqlx::query(
        "SELECT step, outcome FROM metal_bmc_commands WHERE mac = $1 AND attempt_id = $2 \
         AND state IN ('done', 'failed') AND outcome IS NOT NULL ORDER BY finished_ms",
    )
    .bind(mac)
    .bind(attempt)
    .fetch_all(&mut *tx)
    .await?;
    for r in bmc {
        let step: String = r.get(0);
        let Some(step) = step_of(&step) else {
            return Err(corrupt(mac, format!("bmc command step {step:?}")));
        };
        let outcome: Outcome = serde_json::from_value(r.get(1))
            .map_err(|e| corrupt(mac, format!("bmc outcome: {e}")))?;
        out.push(StepResult {
            attempt_id,
            step,
            outcome,
        });
    }
    let ramdisk = sqlx::query(
        "SELECT m.step, c.state, c.result, c.error FROM metal_commands m JOIN commands c ON c.id = m.command_id \
         WHERE m.mac = $1 AND m.attempt_id = $2 AND c.state IN ('done', 'failed', 'expired') \
         ORDER BY c.finished_at NULLS LAST",
    )
    .bind(mac)
    .bind(attempt)
    .fetch_all(&mut *tx)
    .await?;
    for r in ramdisk {
        let step: String = r.get(0);
        let Some(step) = step_of(&step) else {
            return Err(corrupt(mac, format!("ramdisk command step {step:?}")));
        };
        let state: String = r.get(1);
        let outcome = bc_core::metal::ramdisk::ramdisk_outcome(step, &state, r.get(2), r.get(3));
        out.push(StepResult {
            attempt_id,
            step,
            outcome,
        });
    }
    Ok(out)
}

/// The steps of attempt `attempt_id` for `metal show`, and those planned as it began (`since_ms`, the attempt's
/// start) for the attempt it closed: the disk boot restored when the ramdisk joined belongs to the netboot attempt,
/// but is carried out while the machine already diagnoses, and an operator (or a test) waits on its read-back.
pub async fn steps(
    pool: &sqlx::PgPool,
    mac: &str,
    attempt_id: u64,
    since_ms: i64,
) -> Result<Vec<StepView>, StoreError> {
    let attempt = i64::try_from(attempt_id).unwrap_or(i64::MAX);
    let rows = sqlx::query(
        "SELECT step, 'bmc', state, outcome, created_ms, attempt_id FROM metal_bmc_commands \
         WHERE mac = $1 AND (attempt_id = $2 OR created_ms >= $3) \
         UNION ALL \
         SELECT m.step, 'ramdisk', c.state, coalesce(c.result, to_jsonb(c.error)), \
                (extract(epoch FROM c.created_at) * 1000)::bigint, m.attempt_id \
         FROM metal_commands m JOIN commands c ON c.id = m.command_id WHERE m.mac = $1 AND m.attempt_id = $2 \
         ORDER BY 5",
    )
    .bind(mac)
    .bind(attempt)
    .bind(since_ms)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            let step: String = r.get(0);
            let attempt: i64 = r.get(5);
            Ok(StepView {
                attempt_id: u64::try_from(attempt).unwrap_or_default(),
                step: step_of(&step).ok_or_else(|| corrupt(mac, format!("step {step:?}")))?,
                via: r.get(1),
                state: r.get(2),
                outcome: r.get(3),
            })
        })
        .collect()
}

/// The latest signed result of each ramdisk step of machine `mac` (any attempt), with the envelope's signer.
pub async fn evidence(pool: &sqlx::PgPool, mac: &str) -> Result<Vec<Evidence>, StoreError> {
    use prost::Message as _;
    let rows = sqlx::query(
        "SELECT DISTINCT ON (m.step) m.step, c.id, c.node_id, \
                (extract(epoch FROM c.finished_at) * 1000)::bigint, c.envelope, c.result \
         FROM metal_commands m JOIN commands c ON c.id = m.command_id \
         WHERE m.mac = $1 AND c.state = 'done' AND c.envelope IS NOT NULL \
         ORDER BY m.step, c.finished_at DESC",
    )
    .bind(mac)
    .fetch_all(pool)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let step: String = r.get(0);
        let envelope: Vec<u8> = r.get(4);
        let env = bc_proto::v1::SignedEnvelope::decode(envelope.as_slice())
            .map_err(|e| corrupt(mac, format!("a stored result envelope: {e}")))?;
        out.push(Evidence {
            step: step_of(&step).ok_or_else(|| corrupt(mac, format!("step {step:?}")))?,
            command_id: r.get(1),
            node_id: r.get(2),
            finished_ms: r.get(3),
            signer: env.signer,
            payload_type: env.payload_type,
            result: r.get::<Option<serde_json::Value>, _>(5).unwrap_or_default(),
        });
    }
    Ok(out)
}

// === the site's BMC commands ===

/// A BMC command as the site agent receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BmcCommand {
    pub id: String,
    pub mac: String,
    pub bmc: BmcRef,
    pub op: BmcOp,
    pub deadline_ms: i64,
}

/// A BMC command to write for the machine's site.
#[derive(Debug, Clone)]
pub struct NewBmcCommand<'a> {
    pub id: &'a str,
    pub mac: &'a str,
    pub site: &'a str,
    pub attempt_id: u64,
    pub step: Step,
    pub op: &'a BmcOp,
    pub now_ms: i64,
    pub deadline_ms: i64,
}

/// Inserts a BMC command for the machine's site (once per attempt and step).
pub async fn insert_bmc(tx: &mut PgConnection, c: NewBmcCommand<'_>) -> Result<(), StoreError> {
    let op = serde_json::to_value(c.op).map_err(|e| corrupt(c.mac, e))?;
    sqlx::query(
        "INSERT INTO metal_bmc_commands (id, mac, site_id, attempt_id, step, op, created_ms, deadline_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (mac, attempt_id, step) DO NOTHING",
    )
    .bind(c.id)
    .bind(c.mac)
    .bind(c.site)
    .bind(i64::try_from(c.attempt_id).unwrap_or(i64::MAX))
    .bind(step_str(c.step))
    .bind(op)
    .bind(c.now_ms)
    .bind(c.deadline_ms)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// How long a command handed to the site waits for its result before it is handed out again (a lost answer, an
/// agent that restarted).
pub const REDELIVER_MS: i64 = 30_000;

/// The open BMC commands of `site` (pending, or sent [`REDELIVER_MS`] ago without a result), oldest first, marked
/// sent at `now_ms`.
pub async fn take_bmc(
    pool: &sqlx::PgPool,
    site: &str,
    now_ms: i64,
    limit: i64,
) -> Result<Vec<BmcCommand>, StoreError> {
    let rows = sqlx::query(
        "UPDATE metal_bmc_commands b SET state = 'sent', sent_ms = $2 FROM metal_machines m \
         WHERE b.id IN (SELECT id FROM metal_bmc_commands WHERE site_id = $1 AND deadline_ms > $2 \
                        AND (state = 'pending' OR (state = 'sent' AND sent_ms < $2 - $4)) \
                        ORDER BY created_ms LIMIT $3) AND m.mac = b.mac \
         RETURNING b.id, b.mac, m.bmc_address, m.bmc_credentials, b.op, b.deadline_ms",
    )
    .bind(site)
    .bind(now_ms)
    .bind(limit)
    .bind(REDELIVER_MS)
    .fetch_all(pool)
    .await?;
    let mut out = Vec::new();
    for r in rows {
        let mac: String = r.get(1);
        out.push(BmcCommand {
            id: r.get(0),
            bmc: BmcRef {
                address: r.get(2),
                credentials: r.get(3),
            },
            op: serde_json::from_value(r.get(4)).map_err(|e| corrupt(&mac, e))?,
            deadline_ms: r.get(5),
            mac,
        });
    }
    out.sort_by_key(|c| (c.deadline_ms, c.id.clone()));
    Ok(out)
}

/// Stores the site's report of BMC command `id` (only a command of `site` that is still open); false otherwise.
pub async fn finish_bmc(
    pool: &sqlx::PgPool,
    site: &str,
    id: &str,
    outcome: &Outcome,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let state = match outcome {
        Outcome::Failed { .. } => "failed",
        _ => "done",
    };
    let outcome = serde_json::to_value(outcome).map_err(|e| corrupt(id, e))?;
    let n = sqlx::query(
        "UPDATE metal_bmc_commands SET state = $3, outcome = $4, finished_ms = $5 \
         WHERE id = $1 AND site_id = $2 AND state IN ('pending', 'sent')",
    )
    .bind(id)
    .bind(site)
    .bind(state)
    .bind(outcome)
    .bind(now_ms)
    .execute(pool)
    .await?
    .rows_affected();
    if n == 1 {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(crate::POKE)
            .bind(id)
            .execute(pool)
            .await?;
    }
    Ok(n == 1)
}
