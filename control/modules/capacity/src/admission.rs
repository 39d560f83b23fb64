//! `reservations.create|get|list|release` and the admission sequence: validation and the tenant check are pure and
//! run before any database access (the caller's principal comes from the authentication cache); tx 1 records the
//! request under its idempotency key; the scheduler's placer books it (tx 2) and notifies; the call waits for
//! that decision, bounded, and answers with the reservation.

use crate::api::{ApiCode, ApiError, ApiState, require};
use bc_core::reservation::{ReservationRequest, tenant_allowed, valid_id};
use bc_store::iam::Principal;
use bc_store::reservations::{Admission, Reservation};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// How long `create` waits for the placer before answering with the still-pending reservation.
const DECISION_WAIT: Duration = Duration::from_secs(5);

/// API calls waiting for the placer's decision, woken by the `bc_reservation_decided` notification. One read of
/// the store per notification serves every waiter it names.
#[derive(Default)]
pub struct Decisions {
    waiting: Mutex<HashMap<String, Vec<oneshot::Sender<Reservation>>>>,
}

impl Decisions {
    fn wait(&self, id: &str) -> oneshot::Receiver<Reservation> {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.waiting.lock() {
            w.entry(id.to_string()).or_default().push(tx);
        }
        rx
    }

    fn forget(&self, id: &str) {
        if let Ok(mut w) = self.waiting.lock() {
            w.remove(id);
        }
    }

    /// Handles one notification payload (comma-separated reservation ids).
    pub async fn decided(&self, store: &bc_store::Store, payload: &str) {
        let ids: Vec<String> = {
            let Ok(w) = self.waiting.lock() else {
                return;
            };
            payload
                .split(',')
                .filter(|id| w.contains_key(*id))
                .map(str::to_string)
                .collect()
        };
        if ids.is_empty() {
            return;
        }
        match store.reservations(&ids).await {
            Ok(rows) => {
                let Ok(mut w) = self.waiting.lock() else {
                    return;
                };
                for r in rows {
                    for tx in w.remove(&r.id).unwrap_or_default() {
                        let _ = tx.send(r.clone());
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading decided reservations failed"),
        }
    }
}

/// The API process's group commit for tx 1: admissions that arrive while a batch is being written go into the
/// next one, so under load one statement (one WAL flush, one notification) records many. Alone, a request is
/// written at once.
#[derive(Clone)]
pub struct Admitter {
    tx: tokio::sync::mpsc::Sender<Ask>,
}

struct Ask {
    id: String,
    principal_id: String,
    key: String,
    body_hash: String,
    tenant: String,
    request: Value,
    duration_s: i64,
    reply: oneshot::Sender<Result<Admission, bc_store::StoreError>>,
}

impl Ask {
    fn as_new(&self) -> bc_store::reservations::NewReservation<'_> {
        bc_store::reservations::NewReservation {
            id: &self.id,
            principal_id: &self.principal_id,
            key: &self.key,
            body_hash: &self.body_hash,
            tenant: &self.tenant,
            request: &self.request,
            duration_s: self.duration_s,
        }
    }
}

const ADMIT_BATCH: usize = 256;

impl Admitter {
    pub fn start(store: bc_store::Store) -> Admitter {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Ask>(4096);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < ADMIT_BATCH {
                    match rx.try_recv() {
                        Ok(a) => batch.push(a),
                        Err(_) => break,
                    }
                }
                let news: Vec<_> = batch.iter().map(Ask::as_new).collect();
                let recorded = store.admit_reservations(&news).await;
                drop(news);
                let recorded = match recorded {
                    Ok(flags) => flags,
                    Err(e) => {
                        tracing::debug!(error = %e, n = batch.len(), "batched admission failed; admitting one by one");
                        vec![false; batch.len()]
                    }
                };
                for (ask, done) in batch.into_iter().zip(recorded) {
                    if done {
                        let _ = ask.reply.send(Ok(Admission::Recorded));
                    } else {
                        // A reused key (or a failed batch): the single path answers with what the key recorded,
                        // or with this request's own error.
                        let store = store.clone();
                        tokio::spawn(async move {
                            let r = store.admit_reservation(ask.as_new()).await;
                            let _ = ask.reply.send(r);
                        });
                    }
                }
            }
        });
        Admitter { tx }
    }

    async fn admit(
        &self,
        ask: Ask,
        rx: oneshot::Receiver<Result<Admission, bc_store::StoreError>>,
    ) -> Result<Admission, ApiError> {
        self.tx.send(ask).await.map_err(|_| {
            ApiError::new(ApiCode::Unavailable, "admission is shutting down; retry")
        })?;
        match rx.await {
            Ok(r) => r.map_err(ApiError::from),
            Err(_) => Err(ApiError::new(
                ApiCode::Unavailable,
                "admission was interrupted; retry with the same idempotency key",
            )),
        }
    }
}

fn body_tenant_check(p: &Principal, tenant: &str) -> Result<(), ApiError> {
    if tenant_allowed(&p.tenant_id, p.tenant_is_root, tenant) {
        Ok(())
    } else {
        Err(ApiError::new(
            ApiCode::AccessDenied,
            format!(
                "principal {} belongs to tenant {} and cannot act in tenant {tenant}",
                p.id, p.tenant_id
            ),
        ))
    }
}

pub async fn create(state: &ApiState, p: &Principal, body: Value) -> Result<Value, ApiError> {
    let mut body = match body {
        Value::Object(m) => m,
        _ => {
            return Err(ApiError::new(
                ApiCode::InvalidArgument,
                "body must be an object",
            ));
        }
    };
    let key = match body.remove("idempotency_key") {
        None | Some(Value::Null) => None,
        Some(Value::String(k))
            if !k.is_empty() && k.len() <= 128 && k.chars().all(|c| c.is_ascii_graphic()) =>
        {
            Some(k)
        }
        Some(_) => {
            return Err(ApiError::new(
                ApiCode::InvalidArgument,
                "idempotency_key must be 1 to 128 printable ASCII characters",
            ));
        }
    };
    let req: ReservationRequest = serde_json::from_value(Value::Object(body))
        .map_err(|e| ApiError::new(ApiCode::InvalidArgument, format!("request body: {e}")))?;
    req.validate()
        .map_err(|e| ApiError::new(ApiCode::InvalidArgument, e.to_string()))?;
    // Before any database access: the tenant boundary, then the grant.
    body_tenant_check(p, &req.tenant)?;
    require(
        p,
        "compute:reservations:create",
        &format!("tenant/{}", req.tenant),
    )?;
    let id = format!("rsv-{}", uuid::Uuid::now_v7().simple());
    let key = key.unwrap_or_else(|| id.clone());
    let decisions = state.decisions.clone().ok_or_else(|| {
        ApiError::new(
            ApiCode::Unavailable,
            "this process does not admit reservations",
        )
    })?;
    let waiter = decisions.wait(&id);
    let admitter = state.admitter.clone().ok_or_else(|| {
        ApiError::new(
            ApiCode::Unavailable,
            "this process does not admit reservations",
        )
    })?;
    let (reply, rx) = oneshot::channel();
    let ask = Ask {
        id: id.clone(),
        principal_id: p.id.clone(),
        key: key.clone(),
        body_hash: req.body_hash(),
        tenant: req.tenant.clone(),
        request: serde_json::to_value(&req).unwrap_or_default(),
        duration_s: i64::from(req.duration_s),
        reply,
    };
    let admitted = admitter.admit(ask, rx).await;
    let admitted = match admitted {
        Ok(a) => a,
        Err(e) => {
            decisions.forget(&id);
            return Err(e);
        }
    };
    let reservation = match admitted {
        Admission::Recorded => await_decision(state, &decisions, &id, waiter).await?,
        Admission::Existing {
            body_hash,
            reservation,
        } => {
            decisions.forget(&id);
            if body_hash != req.body_hash() {
                return Err(ApiError::new(
                    ApiCode::Conflict,
                    format!(
                        "idempotency key {key:?} was used for a different request (reservation {}); use a new key",
                        reservation.id
                    ),
                ));
            }
            if reservation.state == "pending" {
                let waiter = decisions.wait(&reservation.id);
                await_decision(state, &decisions, &reservation.id, waiter).await?
            } else {
                *reservation
            }
        }
    };
    answer(reservation)
}

async fn await_decision(
    state: &ApiState,
    decisions: &Decisions,
    id: &str,
    waiter: oneshot::Receiver<Reservation>,
) -> Result<Reservation, ApiError> {
    match tokio::time::timeout(DECISION_WAIT, waiter).await {
        Ok(Ok(r)) if r.state != "pending" => Ok(r),
        _ => {
            decisions.forget(id);
            // Missed or slow: read what is there (possibly still pending; `get` follows it).
            state.store.reservation(id).await?.ok_or_else(|| {
                ApiError::new(ApiCode::NotFound, format!("reservation {id:?} not found"))
            })
        }
    }
}

/// A failed placement is an error the caller can act on; anything else is the reservation.
fn answer(r: Reservation) -> Result<Value, ApiError> {
    if r.state == "failed" {
        return Err(ApiError::new(
            ApiCode::Unavailable,
            format!(
                "reservation {} was not placed: {}; retry later, ask for fewer GPUs, or use a new idempotency key",
                r.id,
                r.error.as_deref().unwrap_or("no reason recorded")
            ),
        ));
    }
    Ok(json!({ "reservation": r }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ById {
    id: String,
}

async fn visible(
    state: &ApiState,
    p: &Principal,
    id: &str,
    verb: &str,
) -> Result<Reservation, ApiError> {
    let not_found = || ApiError::new(ApiCode::NotFound, format!("reservation {id:?} not found"));
    let r = state.store.reservation(id).await?.ok_or_else(not_found)?;
    // Another tenant's reservation does not exist as far as this caller can tell.
    if !tenant_allowed(&p.tenant_id, p.tenant_is_root, &r.tenant) {
        return Err(not_found());
    }
    require(
        p,
        &format!("compute:reservations:{verb}"),
        &format!("tenant/{}", r.tenant),
    )?;
    Ok(r)
}

pub async fn get(state: &ApiState, p: &Principal, req: ById) -> Result<Value, ApiError> {
    let r = visible(state, p, &req.id, "get").await?;
    let mut shown = with_delivery(state, vec![r]).await?;
    Ok(json!({ "reservation": shown.pop() }))
}

/// Reservations as operators see them: a placed one carries `delivery`, how far its booking has reached its nodes
/// (`state`: pending, applied or failed, and per node the generation carrying it, its state and, while it fails,
/// the node's reason).
async fn with_delivery(state: &ApiState, rows: Vec<Reservation>) -> Result<Vec<Value>, ApiError> {
    let placed: Vec<String> = rows
        .iter()
        .filter(|r| r.state == "placed")
        .map(|r| r.id.clone())
        .collect();
    let mut deliveries = if placed.is_empty() {
        HashMap::new()
    } else {
        state.store.deliveries(&placed).await?
    };
    Ok(rows
        .into_iter()
        .map(|r| {
            let nodes = deliveries.remove(&r.id);
            let mut v = serde_json::to_value(r).unwrap_or_default();
            if let Some(nodes) = nodes {
                v["delivery"] = json!({
                    "state": bc_core::reservation::delivery(nodes.iter().map(|n| n.state)),
                    "nodes": nodes,
                });
            }
            v
        })
        .collect())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct List {
    tenant: Option<String>,
    limit: Option<i64>,
}

pub async fn list(state: &ApiState, p: &Principal, req: List) -> Result<Value, ApiError> {
    let tenant = match req.tenant {
        Some(t) => {
            body_tenant_check(p, &t)?;
            Some(t)
        }
        None if p.tenant_is_root => None,
        None => Some(p.tenant_id.clone()),
    };
    let limit = req.limit.unwrap_or(100).clamp(1, 1000);
    let rows: Vec<Reservation> = state
        .store
        .list_reservations(tenant.as_deref(), limit)
        .await?
        .into_iter()
        .filter(|r| {
            bc_core::iam::allows(
                &p.grants,
                "compute:reservations:list",
                &format!("tenant/{}", r.tenant),
            )
        })
        .collect();
    Ok(json!({ "reservations": with_delivery(state, rows).await? }))
}

pub async fn release(state: &ApiState, p: &Principal, req: ById) -> Result<Value, ApiError> {
    let r = visible(state, p, &req.id, "release").await?;
    match state
        .store
        .end_reservation(&r.id, "released", &format!("principal/{}", p.id))
        .await?
    {
        Some(r) => Ok(json!({ "reservation": r })),
        None => Err(ApiError::new(
            ApiCode::Conflict,
            format!("reservation {} has already ended ({})", r.id, r.state),
        )),
    }
}

// === IAM: tenants and principals ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    id: String,
    name: Option<String>,
}

pub async fn create_tenant(
    state: &ApiState,
    p: &Principal,
    req: CreateTenant,
) -> Result<Value, ApiError> {
    if !p.tenant_is_root {
        return Err(ApiError::new(
            ApiCode::AccessDenied,
            "only the root tenant creates tenants",
        ));
    }
    require(p, "compute:tenants:create", &format!("tenant/{}", req.id))?;
    if !valid_id(&req.id) {
        return Err(ApiError::new(
            ApiCode::InvalidArgument,
            "id must be letters, digits, '-' or '_' (at most 64)",
        ));
    }
    let name = req.name.unwrap_or_else(|| req.id.clone());
    state.store.ensure_tenant(&req.id, &name).await?;
    Ok(json!({"id": req.id, "name": name}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreatePrincipal {
    id: String,
    tenant: String,
    name: Option<String>,
    #[serde(default)]
    grants: Vec<bc_core::iam::Grant>,
}

pub async fn create_principal(
    state: &ApiState,
    p: &Principal,
    req: CreatePrincipal,
) -> Result<Value, ApiError> {
    body_tenant_check(p, &req.tenant)?;
    require(
        p,
        "compute:principals:create",
        &format!("tenant/{}", req.tenant),
    )?;
    if !valid_id(&req.id) {
        return Err(ApiError::new(
            ApiCode::InvalidArgument,
            "id must be letters, digits, '-' or '_' (at most 64)",
        ));
    }
    for (i, g) in req.grants.iter().enumerate() {
        if !valid_pattern(&g.permission) || !valid_pattern(&g.scope) {
            return Err(ApiError::invalid(format!(
                "grants[{i}]: permission and scope must be 1 to 256 visible ASCII characters (e.g. \
                 compute:nodes:get on pool/gpu-a)"
            )));
        }
    }
    // A non-root caller may hand out only grants scoped to its own tenant.
    if !p.tenant_is_root {
        let own = format!("tenant/{}", req.tenant);
        if let Some(g) = req.grants.iter().find(|g| g.scope != own) {
            return Err(ApiError::new(
                ApiCode::AccessDenied,
                format!("grant scope {:?} is outside tenant {}", g.scope, req.tenant),
            ));
        }
    }
    // Nobody hands out what it does not hold: each grant must be covered by one of the caller's own.
    if let Some(g) = bc_core::iam::first_uncovered(&p.grants, &req.grants) {
        return Err(ApiError::new(
            ApiCode::AccessDenied,
            format!(
                "principal {} cannot grant {} on {}: none of its own grants covers it (a principal grants only \
                 what it holds); ask a principal that holds it, or grant something narrower",
                p.id, g.permission, g.scope
            ),
        ));
    }
    let key = bc_proto::token::Token::generate(bc_proto::token::TokenKind::ApiKey)
        .map_err(|_| ApiError::new(ApiCode::Unavailable, "no randomness"))?;
    let name = req.name.unwrap_or_else(|| req.id.clone());
    state
        .store
        .create_principal(
            &req.id,
            &req.tenant,
            &name,
            key.id(),
            &key.secret().hash(),
            &req.grants,
        )
        .await?;
    Ok(json!({"id": req.id, "tenant": req.tenant, "api_key": key.reveal()}))
}

/// A grant's permission or scope as stored: 1 to 256 visible ASCII characters.
fn valid_pattern(s: &str) -> bool {
    (1..=256).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Shared handle type for ApiState.
pub type SharedDecisions = Arc<Decisions>;
