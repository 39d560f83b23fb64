//! What the failover scenario checks on the promoted standby once the load stopped.

use super::{Daemon, Shared, lock};
use anyhow::bail;
use bc_store::Store;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// Checks, on the promoted standby, that nothing acknowledged was lost, nothing booked twice and no command ran
/// twice; returns what it saw, or fails naming the first broken invariant.
pub(super) async fn verify(
    store: &Store,
    ledger: &Shared,
    daemons: &[Daemon],
) -> anyhow::Result<Vec<String>> {
    let (admitted, joined, commands) = {
        let l = lock(ledger);
        (l.admitted.clone(), l.joined.clone(), l.commands.clone())
    };
    let mut checks = Vec::new();
    // Acknowledged admissions: each key's reservation exists, once.
    let rows: Vec<(String, String)> = bc_store::sqlx::query_as(
        "SELECT key, reservation_id FROM idempotency WHERE key LIKE 'fo-%'",
    )
    .fetch_all(store.pool())
    .await?;
    let stored: HashMap<String, String> = rows.into_iter().collect();
    for (key, (id, _, _)) in &admitted {
        match stored.get(key) {
            Some(s) if s == id => {}
            other => bail!(
                "acknowledged admission {key} → {id} is not on the new primary (found {other:?})"
            ),
        }
    }
    let (resv, ids): (i64, i64) = bc_store::sqlx::query_as(
        "SELECT count(*), count(DISTINCT i.reservation_id) FROM idempotency i JOIN reservations r ON r.id = i.reservation_id WHERE i.key LIKE 'fo-%'",
    )
    .fetch_one(store.pool())
    .await?;
    if resv != ids {
        bail!("{resv} keys but {ids} reservations: a reservation under two keys");
    }
    checks.push(format!("{} acknowledged admissions all on the new primary, one reservation per key ({resv} keys stored)", admitted.len()));
    // Booked once: no reservation holds more GPUs than it asked, none expired twice.
    let over: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT r.id FROM reservations r JOIN devices d ON d.reservation_id = r.id \
         GROUP BY r.id, r.request HAVING count(*) > (r.request->>'gpus')::int) x",
    )
    .fetch_one(store.pool())
    .await?;
    let twice: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT subject FROM audit_events WHERE action = 'reservation.expired' GROUP BY subject HAVING count(*) > 1) x",
    )
    .fetch_one(store.pool())
    .await?;
    if over != 0 || twice != 0 {
        bail!(
            "booked twice: {over} reservations hold more GPUs than asked; {twice} expired more than once"
        );
    }
    checks.push("no reservation holds more GPUs than it asked, none expired twice".into());
    // Acknowledged joins: every node exists.
    let nodes: Vec<String> = bc_store::sqlx::query_scalar("SELECT id FROM nodes")
        .fetch_all(store.pool())
        .await?;
    let nodes: HashSet<String> = nodes.into_iter().collect();
    if let Some((lost, _, _)) = joined.iter().find(|(id, _, _)| !nodes.contains(id)) {
        bail!("acknowledged join of node {lost} is not on the new primary");
    }
    checks.push(format!(
        "{} acknowledged joins all on the new primary",
        joined.len()
    ));
    checks.push(commands_ran_once(store, &commands, daemons).await?);
    Ok(checks)
}

/// Every acknowledged command exists and finishes, and each daemon ran each command id at most once.
async fn commands_ran_once(
    store: &Store,
    commands: &[(String, String, Instant)],
    daemons: &[Daemon],
) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let ids: Vec<String> = commands.iter().map(|(id, _, _)| id.clone()).collect();
    let (done, deliveries) = loop {
        let rows: Vec<(String, String, i32)> = bc_store::sqlx::query_as(
            "SELECT id, state, deliveries FROM commands WHERE id = ANY($1)",
        )
        .bind(&ids)
        .fetch_all(store.pool())
        .await?;
        if rows.len() != ids.len() {
            bail!(
                "{} acknowledged commands, {} on the new primary",
                ids.len(),
                rows.len()
            );
        }
        let open = rows
            .iter()
            .filter(|(_, s, _)| s == "pending" || s == "sent")
            .count();
        if open == 0 {
            if let Some((id, s, _)) = rows.iter().find(|(_, s, _)| s != "done") {
                bail!("command {id} ended {s}, not done");
            }
            break (
                rows.len(),
                rows.iter().map(|(_, _, d)| *d as i64).sum::<i64>(),
            );
        }
        if Instant::now() > deadline {
            bail!("{open} acknowledged commands still open 120 s after the load stopped");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut runs: HashMap<String, usize> = HashMap::new();
    for d in daemons {
        let text = std::fs::read_to_string(&d.log).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("running command")) {
            if let Some(id) = line
                .split("command=")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
            {
                *runs.entry(id.trim_matches('"').to_string()).or_default() += 1;
            }
        }
    }
    if let Some((id, n)) = runs.iter().find(|(_, n)| **n > 1) {
        bail!("command {id} ran {n} times");
    }
    let ran: usize = ids.iter().filter(|id| runs.contains_key(*id)).count();
    if ran != ids.len() {
        bail!(
            "{} acknowledged commands done, but the daemons' logs show {ran} of them run",
            ids.len()
        );
    }
    Ok(format!(
        "{done} acknowledged commands all done, each run once by its daemon ({deliveries} deliveries)"
    ))
}
