//! Operator commands to nodes: `nodes.command` queues one (a free-form kind the node's daemon answers, e.g.
//! `ramdisk.wipe`), `commands.get` reads its state, latest progress and signed result. Both are authorized on the
//! node's pool: queueing needs `compute:nodes:command` (an operator permission, like `compute:nodes:drain`),
//! reading needs `compute:nodes:get`.

use crate::api::{ApiCode, ApiError, ApiState, now_ms, require};
use axum::Json;
use bc_store::iam::Principal;
use serde::Deserialize;
use serde_json::{Value, json};

/// The largest `args` object accepted (serialized JSON bytes).
pub const MAX_ARGS_BYTES: usize = 64 * 1024;
/// Deadline bounds (seconds).
const MIN_TIMEOUT_S: u64 = 1;
const MAX_TIMEOUT_S: u64 = 7 * 86_400;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QueueCommand {
    node_id: String,
    kind: String,
    #[serde(default = "empty_object")]
    args: Value,
    #[serde(default = "ten_minutes")]
    timeout_s: u64,
}

fn empty_object() -> Value {
    json!({})
}

fn ten_minutes() -> u64 {
    600
}

/// Whether `kind` matches `^[a-z][a-z0-9_.-]{0,63}$`.
pub fn valid_kind(kind: &str) -> bool {
    let b = kind.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_lowercase()
        && b[1..].iter().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'.' | b'-')
        })
}

/// Checks a request's own fields (no database): the kind's form, args an object within 64 KiB, the timeout.
fn check(req: &QueueCommand) -> Result<(), ApiError> {
    if !valid_kind(&req.kind) {
        return Err(ApiError::invalid(format!(
            "kind {:?} must match ^[a-z][a-z0-9_.-]{{0,63}}$ (e.g. ramdisk.wipe)",
            req.kind.chars().take(80).collect::<String>()
        )));
    }
    if !req.args.is_object() {
        return Err(ApiError::invalid("args must be a JSON object"));
    }
    let size = req.args.to_string().len();
    if size > MAX_ARGS_BYTES {
        return Err(ApiError::invalid(format!(
            "args is {size} bytes; at most {MAX_ARGS_BYTES} are accepted"
        )));
    }
    if !(MIN_TIMEOUT_S..=MAX_TIMEOUT_S).contains(&req.timeout_s) {
        return Err(ApiError::invalid(format!(
            "timeout_s must be between {MIN_TIMEOUT_S} and {MAX_TIMEOUT_S}"
        )));
    }
    Ok(())
}

/// `nodes.command`: queue a command for a node; answers its id.
pub(crate) async fn queue(
    state: &ApiState,
    p: &Principal,
    req: QueueCommand,
) -> Result<Json<Value>, ApiError> {
    check(&req)?;
    let node = state.store.node(&req.node_id).await?.ok_or_else(|| {
        ApiError::new(
            ApiCode::NotFound,
            format!("node {:?} not found", req.node_id),
        )
    })?;
    require(
        p,
        "compute:nodes:command",
        &format!("pool/{}", node.pool_id),
    )?;
    if node.state == "revoked" {
        return Err(ApiError::new(
            ApiCode::Conflict,
            format!("node {} is revoked; it can run no command", node.id),
        ));
    }
    let id = uuid::Uuid::now_v7().to_string();
    let deadline_ms = now_ms() + (req.timeout_s as i64) * 1000;
    state
        .store
        .queue_command_by(
            &format!("principal/{}", p.id),
            &id,
            &node.id,
            &req.kind,
            &req.args,
            deadline_ms,
        )
        .await?;
    tracing::info!(
        node_id = node.id,
        command = id,
        kind = req.kind,
        principal = p.id,
        "command queued"
    );
    Ok(Json(json!({
        "id": id,
        "node_id": node.id,
        "kind": req.kind,
        "state": "pending",
        "deadline_ms": deadline_ms,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ById {
    id: String,
}

/// `commands.get`: state, latest progress, result and error of one command.
pub(crate) async fn get(
    state: &ApiState,
    p: &Principal,
    req: ById,
) -> Result<Json<Value>, ApiError> {
    let not_found = || ApiError::new(ApiCode::NotFound, format!("command {:?} not found", req.id));
    let command = state.store.command(&req.id).await?.ok_or_else(not_found)?;
    let node = state
        .store
        .node(&command.node_id)
        .await?
        .ok_or_else(not_found)?;
    require(p, "compute:nodes:get", &format!("pool/{}", node.pool_id))?;
    Ok(Json(json!({ "command": command })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_documented_form() {
        for ok in ["ramdisk.wipe", "diag.nvml", "a", "x-y_z.0", &"a".repeat(64)] {
            assert!(valid_kind(ok), "{ok}");
        }
        for bad in [
            "",
            "Ramdisk",
            "0abc",
            ".x",
            "a b",
            "ramdisk/wipe",
            "é",
            &"a".repeat(65),
        ] {
            assert!(!valid_kind(bad), "{bad}");
        }
    }

    #[test]
    fn args_must_be_a_small_object_and_the_timeout_bounded() {
        let req = |args: Value, timeout_s: u64| QueueCommand {
            node_id: "n".into(),
            kind: "ramdisk.wipe".into(),
            args,
            timeout_s,
        };
        assert!(check(&req(json!({"disks": "all"}), 600)).is_ok());
        assert!(check(&req(json!([1]), 600)).is_err());
        assert!(check(&req(json!("x"), 600)).is_err());
        assert!(check(&req(json!({"x": "y".repeat(MAX_ARGS_BYTES)}), 600)).is_err());
        assert!(check(&req(json!({}), 0)).is_err());
        assert!(check(&req(json!({}), MAX_TIMEOUT_S + 1)).is_err());
    }
}
