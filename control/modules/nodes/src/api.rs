//! The handlers of `join-tokens.*` and of the node verbs and views (`nodes.list|get|drain|undrain|revoke`).

use crate::{Nodes, now_ms};
use bc_core::api::ApiCode;
use bc_core::api::nodes::*;
use bc_core::node::NodeVerb;
use bc_kernel::{ApiError, Cx};
use bc_proto::token::{Token, TokenKind};
use bc_store::join_tokens::NewJoinToken;
use bc_store::reservations::NodeStateChange;
use serde_json::Value;

fn pool_scope(pool: &impl std::fmt::Display) -> String {
    format!("pool/{pool}")
}

pub(crate) async fn create_join_token(
    cx: Cx,
    req: CreateJoinToken,
) -> Result<CreatedJoinToken, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    if !(1..=1_000_000).contains(&req.uses) {
        return Err(ApiError::invalid("uses must be between 1 and 1000000"));
    }
    if !(60..=365 * 86_400).contains(&req.ttl_seconds) {
        return Err(ApiError::invalid(
            "ttl_seconds must be between 60 and 31536000",
        ));
    }
    req.expect
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let pool = nodes.store.pool_by_id(req.pool.as_str()).await?;
    if req.reclaim && !pool.allow_reclaim {
        return Err(ApiError::invalid(format!(
            "pool {} does not allow reclaim",
            pool.id
        )));
    }
    let token =
        Token::generate(TokenKind::Join).map_err(|_| ApiError::unavailable("no randomness"))?;
    let expires_at_ms = now_ms() + req.ttl_seconds * 1000;
    nodes
        .store
        .create_join_token(NewJoinToken {
            id: token.id(),
            pool_id: &pool.id,
            secret_hash: &token.secret().hash(),
            uses: req.uses,
            expires_at_ms,
            expect: &req.expect,
            reclaim: req.reclaim,
            created_by: &cx.caller().actor(),
        })
        .await?;
    Ok(CreatedJoinToken {
        id: token.id().to_string(),
        token: token.reveal(),
        pool: req.pool,
        uses: req.uses,
        expires_at_ms,
        reclaim: req.reclaim,
    })
}

pub(crate) async fn list_join_tokens(cx: Cx, req: ListJoinTokens) -> Result<JoinTokens, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    let pools = req.pool.map(|p| vec![p.into_string()]);
    let tokens = nodes.store.list_join_tokens(pools.as_deref()).await?;
    let mut visible = Vec::new();
    for t in tokens {
        if !cx.allows(&pool_scope(&t.pool_id)) {
            continue;
        }
        let pool_id = bc_core::ids::PoolId::new(t.pool_id).map_err(|e| {
            ApiError::unavailable("a join token row is malformed; the control plane logged it")
                .with_source(e)
        })?;
        visible.push(JoinToken {
            id: t.id,
            pool_id,
            uses_total: t.uses_total,
            uses_left: t.uses_left,
            expires_at_ms: t.expires_at_ms,
            revoked: t.revoked,
            expect: t.expect,
            reclaim: t.reclaim,
            created_by: t.created_by,
            created_at_ms: t.created_at_ms,
        });
    }
    Ok(JoinTokens { tokens: visible })
}

pub(crate) async fn revoke_join_token(
    cx: Cx,
    req: JoinTokenRef,
) -> Result<RevokedJoinToken, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    let token = nodes
        .store
        .join_token(&req.id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("join token {:?} not found", req.id)))?;
    cx.authorize(&pool_scope(&token.pool_id))?;
    nodes
        .store
        .revoke_join_token(&req.id, &cx.caller().actor())
        .await?;
    Ok(RevokedJoinToken {
        id: req.id,
        revoked: true,
    })
}

/// The stored conditions as text (they are written as strings; anything else is shown as its JSON).
fn conditions(v: Value) -> Vec<String> {
    match v {
        Value::Null => Vec::new(),
        Value::Array(a) => a
            .into_iter()
            .map(|c| match c {
                Value::String(s) => s,
                other => other.to_string(),
            })
            .collect(),
        other => vec![other.to_string()],
    }
}

/// Nodes as operators see them: with `desired_state` (desired and applied generations, and while the node cannot
/// apply it, the failed generation, the node's reason and since when) and that failure among its `conditions`.
pub async fn shown(
    nodes: &Nodes,
    rows: Vec<bc_store::nodes::NodeRow>,
) -> Result<Vec<Node>, ApiError> {
    let ids: Vec<String> = rows.iter().map(|n| n.id.to_string()).collect();
    let mut status = nodes.store.desired_status(&ids).await?;
    Ok(rows
        .into_iter()
        .map(|n| {
            let s = status.remove(n.id.as_str());
            let mut conditions = conditions(n.conditions);
            conditions.extend(s.as_ref().and_then(|s| s.condition()));
            Node {
                id: n.id,
                pool_id: n.pool_id,
                state: n.state,
                hardware_key: n.hardware_key,
                claims: n.claims,
                joined_at_ms: n.joined_at_ms,
                cert_not_after_ms: n.cert_not_after_ms,
                join_token_id: n.join_token_id,
                session_epoch: n.session_epoch,
                online: n.online,
                last_seen_ms: n.last_seen_ms,
                desired_generation: n.desired_generation,
                acked_generation: n.acked_generation,
                conditions,
                desired_state: s.map(|s| DesiredState {
                    generation: s.desired_generation,
                    applied_generation: s.applied_generation,
                    failing: s.failing(),
                    failed_generation: s.failed_generation,
                    message: if s.failing() { s.message.clone() } else { None },
                    failing_since_ms: s.failing_since_ms,
                }),
            }
        })
        .collect())
}

/// `nodes.list`: the visible nodes matching the request's filters, by id, one page. The filters and the page are
/// applied here, on the server, so a page holds `limit` matching nodes.
pub(crate) async fn list_nodes(cx: Cx, req: ListNodes) -> Result<Nodes_, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    let mut rows: Vec<_> = nodes
        .store
        .list_nodes()
        .await?
        .into_iter()
        .filter(|n| cx.allows(&pool_scope(&n.pool_id)))
        .filter(|n| {
            req.pool
                .as_ref()
                .is_none_or(|p| n.pool_id.as_str() == p.as_str())
        })
        .filter(|n| req.state.is_none_or(|s| n.state == s))
        .collect();
    rows.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
    let shown = shown(nodes, rows).await?.into_iter().filter(|n| {
        req.condition
            .as_ref()
            .is_none_or(|c| n.conditions.iter().any(|have| have.contains(c.as_str())))
            && req
                .hostname
                .as_ref()
                .is_none_or(|h| bc_core::api::glob_matches(h, n.hostname()))
    });
    let (page, next) = bc_core::api::page(
        shown.collect(),
        |n| n.id.as_str(),
        req.after.as_ref().map(|a| a.as_str()),
        req.limit,
    );
    Ok(Nodes_ { nodes: page, next })
}

/// `nodes.delete`: forgets a revoked node without bookings (see [`bc_store::nodes::NodeDeletion`]).
pub(crate) async fn delete_node(cx: Cx, req: NodeRef) -> Result<DeletedNode, ApiError> {
    use bc_store::nodes::NodeDeletion;
    let nodes = cx.get::<Nodes>()?;
    let node = authorized_node(&cx, nodes, &req.id).await?;
    match nodes
        .store
        .delete_node(node.id.as_str(), &cx.caller().actor())
        .await?
    {
        NodeDeletion::Deleted => Ok(DeletedNode {
            id: node.id,
            deleted: true,
        }),
        NodeDeletion::NotFound => Err(ApiError::not_found(format!(
            "node {:?} not found",
            req.id.as_str()
        ))),
        NodeDeletion::Refused(why) => Err(ApiError::new(ApiCode::FailedPrecondition, why)),
    }
}

/// The `nodes.list` response (named apart from the module's state, [`Nodes`]).
type Nodes_ = bc_core::api::nodes::Nodes;

/// The node `id`, once the caller may act on its pool.
async fn authorized_node(
    cx: &Cx,
    nodes: &Nodes,
    id: &bc_core::ids::NodeId,
) -> Result<bc_store::nodes::NodeRow, ApiError> {
    let node = nodes
        .store
        .node(id.as_str())
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {:?} not found", id.as_str())))?;
    cx.authorize(&pool_scope(&node.pool_id))?;
    Ok(node)
}

pub(crate) async fn get_node(cx: Cx, req: NodeRef) -> Result<NodeDetail, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    let node = authorized_node(&cx, nodes, &req.id).await?;
    let inventory = nodes
        .store
        .inventory(node.id.as_str())
        .await?
        .into_iter()
        .map(|(name, _, payload)| (name, payload))
        .collect();
    let node = shown(nodes, vec![node])
        .await?
        .pop()
        .ok_or_else(|| ApiError::not_found(format!("node {:?} not found", req.id.as_str())))?;
    Ok(NodeDetail { node, inventory })
}

pub(crate) async fn set_node_state(
    cx: Cx,
    req: NodeRef,
    verb: NodeVerb,
) -> Result<NodeStateChanged, ApiError> {
    let nodes = cx.get::<Nodes>()?;
    let node = authorized_node(&cx, nodes, &req.id).await?;
    let change = nodes
        .store
        .set_node_schedulable(node.id.as_str(), verb, &cx.caller().actor())
        .await?;
    let changed = match change {
        NodeStateChange::Changed { .. } => true,
        NodeStateChange::Unchanged => false,
        NodeStateChange::Refused { reason, .. } => {
            return Err(ApiError::new(ApiCode::Conflict, reason));
        }
    };
    // This process's gateway refuses the node from its next handshake and closes its session now; gateways in other
    // processes read the revocation on their own interval.
    if verb == NodeVerb::Revoke
        && let Some(sessions) = &nodes.sessions
        && let Ok(id) = bc_proto::spiffe::SpiffeId::new(
            nodes.ca.trust_domain(),
            bc_proto::spiffe::Role::Node,
            node.id.as_str(),
        )
    {
        sessions.revoke([id]);
    }
    Ok(NodeStateChanged {
        id: node.id,
        state: verb.target(),
        changed,
    })
}
