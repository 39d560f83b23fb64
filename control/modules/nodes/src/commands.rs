//! Operator commands to nodes: `nodes.command` queues one (a free-form kind the node's daemon answers, e.g.
//! `ramdisk.wipe`), `commands.get` reads its state, latest progress and signed result, `commands.list` a node's, newest first. Both are authorized on the
//! node's pool: queueing needs `compute:nodes:command` (an operator permission, like `compute:nodes:drain`),
//! reading needs `compute:nodes:get`.

use crate::{Nodes, now_ms};
use bc_core::api::nodes::{
    Command, CommandDetail, CommandRef, CommandState, Commands, ListCommands, QueueCommand,
    QueuedCommand,
};
use bc_core::api::{ApiCode, MAX_PAGE};
use bc_core::ids::CommandId;
use bc_kernel::{ApiError, Cx};

/// The largest `args` object accepted (serialized JSON bytes).
pub const MAX_ARGS_BYTES: usize = 64 * 1024;
/// Deadline bounds (seconds).
const MIN_TIMEOUT_S: u64 = 1;
const MAX_TIMEOUT_S: u64 = 7 * 86_400;

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
pub(crate) async fn queue(cx: Cx, req: QueueCommand) -> Result<QueuedCommand, ApiError> {
    check(&req)?;
    let nodes = cx.get::<Nodes>()?;
    let node = nodes
        .store
        .node(req.node_id.as_str())
        .await?
        .ok_or_else(|| {
            ApiError::new(
                ApiCode::NotFound,
                format!("node {:?} not found", req.node_id.as_str()),
            )
        })?;
    cx.authorize(&format!("pool/{}", node.pool_id))?;
    if node.state.is_revoked() {
        return Err(ApiError::new(
            ApiCode::Conflict,
            format!("node {} is revoked; it can run no command", node.id),
        ));
    }
    let id = CommandId::new(uuid::Uuid::now_v7().to_string())
        .map_err(|e| ApiError::unavailable("a command id could not be made").with_source(e))?;
    let deadline_ms = now_ms() + (req.timeout_s as i64) * 1000;
    let actor = cx.caller().actor();
    nodes
        .store
        .queue_command_by(
            &actor,
            id.as_str(),
            node.id.as_str(),
            &req.kind,
            &req.args,
            deadline_ms,
        )
        .await?;
    tracing::info!(
        node_id = %node.id,
        command = %id,
        kind = req.kind,
        principal = cx.caller().id,
        "command queued"
    );
    Ok(QueuedCommand {
        id,
        node_id: node.id,
        kind: req.kind,
        state: CommandState::Pending,
        deadline_ms,
    })
}

/// `commands.get`: state, latest progress, result and error of one command.
pub(crate) async fn get(cx: Cx, req: CommandRef) -> Result<CommandDetail, ApiError> {
    let not_found = || {
        ApiError::new(
            ApiCode::NotFound,
            format!("command {:?} not found", req.id.as_str()),
        )
    };
    let nodes = cx.get::<Nodes>()?;
    let c = nodes
        .store
        .command(req.id.as_str())
        .await?
        .ok_or_else(not_found)?;
    let node = nodes
        .store
        .node(c.node_id.as_str())
        .await?
        .ok_or_else(not_found)?;
    cx.authorize(&format!("pool/{}", node.pool_id))?;
    Ok(CommandDetail { command: shown(c) })
}

/// `commands.list`: a node's commands, newest first.
pub(crate) async fn list(cx: Cx, req: ListCommands) -> Result<Commands, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    let node = nodes.store.node(req.node.as_str()).await?.ok_or_else(|| {
        ApiError::new(
            ApiCode::NotFound,
            format!("node {:?} not found", req.node.as_str()),
        )
    })?;
    cx.authorize(&format!("pool/{}", node.pool_id))?;
    let limit = req.limit.unwrap_or(MAX_PAGE).clamp(1, MAX_PAGE);
    let commands = nodes
        .store
        .node_commands(node.id.as_str(), i64::from(limit))
        .await?;
    Ok(Commands {
        commands: commands.into_iter().map(shown).collect(),
    })
}

fn shown(c: bc_store::sessions::CommandView) -> Command {
    Command {
        id: c.id,
        node_id: c.node_id,
        kind: c.kind,
        args: c.args,
        state: c.state,
        created_ms: c.created_ms,
        sent_ms: c.sent_ms,
        deadline_ms: c.deadline_ms,
        finished_ms: c.finished_ms,
        progress: c.progress,
        progress_ms: c.progress_ms,
        result: c.result,
        error: c.error,
        deliveries: c.deliveries,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

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
            node_id: bc_core::ids::NodeId::parse("n").expect("an id"),
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
