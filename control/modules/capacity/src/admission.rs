//! `reservations.create|get|list|release` and the admission sequence: validation and the tenant check are pure and
//! run before any database access (the caller comes from the authentication cache; the kernel checks the grant
//! on `tenant/<tenant>` from the request before the handler runs); tx 1 records the request under its idempotency
//! key; the scheduler's placer books it (tx 2) and notifies; the call waits for that decision, bounded, and
//! answers with the reservation.

use crate::{Capacity, Placer};
use bc_core::api::capacity::{
    CreateReservation, ListReservations, Reservation, ReservationAnswer, ReservationById,
    ReservationDelivery, ReservationList, ReservationView,
};
use bc_core::ids::ReservationId;
use bc_core::reservation::{ReservationState, tenant_allowed};
use bc_kernel::{
    ApiCode, ApiError, Caller, Cx, Method, Module, Notice, ReconcileCx, Reconciler, Scope,
};
use bc_store::reservations::Admission;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;

bc_kernel::api_method!(
    /// `reservations.create`.
    pub CreateReservationMethod = "reservations" / "create": CreateReservation => ReservationAnswer
);
bc_kernel::api_method!(
    /// `reservations.get`.
    pub GetReservationMethod = "reservations" / "get": ReservationById => ReservationAnswer
);
bc_kernel::api_method!(
    /// `reservations.list`.
    pub ListReservationsMethod = "reservations" / "list": ListReservations => ReservationList
);
bc_kernel::api_method!(
    /// `reservations.release`.
    pub ReleaseReservationMethod = "reservations" / "release": ReservationById => ReservationAnswer
);

/// Registers the four methods on `module`.
pub fn register(module: Module) -> Module {
    module
        .method(
            Method::<CreateReservationMethod>::new()
                .permission("compute:reservations:create")
                .scope_from_request("tenant/<tenant>", |r| format!("tenant/{}", r.tenant))
                .handler(create),
        )
        .method(
            Method::<GetReservationMethod>::new()
                .permission("compute:reservations:get")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(get),
        )
        .method(
            Method::<ListReservationsMethod>::new()
                .permission("compute:reservations:list")
                .scope(Scope::filtered("tenant/<tenant>"))
                .handler(list),
        )
        .method(
            Method::<ReleaseReservationMethod>::new()
                .permission("compute:reservations:release")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(release),
        )
}

/// How long `create` waits for the placer before answering with the still-pending reservation.
const DECISION_WAIT: Duration = Duration::from_secs(5);

/// API calls waiting for the placer's decision, woken by the `bc_reservation_decided` notification, which carries
/// the decided reservations: a waiter is answered from it, and only one the payload names by id alone is read (one
/// read per notification for all such).
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

    /// Handles one notification payload ([`bc_store::reservations::decided_entries`]): a waited-for reservation the
    /// payload carries is answered from it; one named only by its id (or carried in a form this build cannot read)
    /// is read, all such in one statement.
    pub async fn decided(&self, store: &bc_store::Store, payload: &str) {
        // The entries this process waits for; parsed outside the lock that every admission takes.
        let waited: Vec<(&str, Option<&str>)> = {
            let Ok(w) = self.waiting.lock() else {
                return;
            };
            bc_store::reservations::decided_entries(payload)
                .filter(|(id, _)| w.contains_key(*id))
                .collect()
        };
        let mut carried = Vec::new();
        let mut read: Vec<String> = Vec::new();
        for (id, json) in waited {
            match json.map(bc_store::reservations::decided_reservation) {
                Some(Ok(r)) if r.id.as_str() == id => carried.push(r),
                Some(Ok(_)) | None => read.push(id.to_string()),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, id, "a decision's notification was unreadable; reading it");
                    read.push(id.to_string());
                }
            }
        }
        self.answer(carried);
        if read.is_empty() {
            return;
        }
        match store.reservations(&read).await {
            Ok(rows) => self.answer(rows),
            Err(e) => tracing::warn!(error = %e, "reading decided reservations failed"),
        }
    }

    /// After notifications may have been lost (the kernel's [`Notice::Resync`]: the LISTEN connection was
    /// replaced, at a move of the database primary or a broken connection, or the queue overflowed): every
    /// reservation a call waits for is read, in one statement, and those decided are answered. A decision
    /// notified while the connection was being replaced otherwise left its call waiting out [`DECISION_WAIT`]
    /// (`scripts/bench failover`: the first admission after the kill answered 5 s late in 6 of 10 runs before this
    /// read, in none of 10 after).
    pub async fn resync(&self, store: &bc_store::Store) {
        let waited: Vec<String> = match self.waiting.lock() {
            Ok(w) => w.keys().cloned().collect(),
            Err(_) => return,
        };
        if waited.is_empty() {
            return;
        }
        match store.reservations(&waited).await {
            Ok(rows) => self.answer(
                rows.into_iter()
                    .filter(|r| r.state != ReservationState::Pending)
                    .collect(),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "reading waited-for reservations after a resync failed")
            }
        }
    }

    /// Hands each reservation to the calls waiting for it.
    fn answer(&self, decided: Vec<Reservation>) {
        if decided.is_empty() {
            return;
        }
        let Ok(mut w) = self.waiting.lock() else {
            return;
        };
        for r in decided {
            for tx in w.remove(r.id.as_str()).unwrap_or_default() {
                let _ = tx.send(r.clone());
            }
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
/// How long one batch's (or one reservation's) admission may take.
const ADMIT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

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
                // Bounded, and cut short when the pool moves to another primary: a batch waiting on a primary that
                // hangs would otherwise hold every admission after it (the one-by-one path below retries it).
                let recorded = store
                    .within(
                        "admitting reservations",
                        ADMIT_DEADLINE,
                        store.admit_reservations(&news),
                    )
                    .await;
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
                            let r = {
                                let one = store.admit_reservation(ask.as_new());
                                store
                                    .within("admitting a reservation", ADMIT_DEADLINE, one)
                                    .await
                            };
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

fn tenant_check(caller: &Caller, tenant: &str) -> Result<(), ApiError> {
    if tenant_allowed(&caller.tenant_id, caller.tenant_is_root, tenant) {
        Ok(())
    } else {
        Err(ApiError::new(
            ApiCode::AccessDenied,
            format!(
                "principal {} belongs to tenant {} and cannot act in tenant {tenant}",
                caller.id, caller.tenant_id
            ),
        ))
    }
}

async fn create(cx: Cx, body: CreateReservation) -> Result<ReservationAnswer, ApiError> {
    if !body.key_is_valid() {
        return Err(ApiError::invalid(
            "idempotency_key must be 1 to 128 printable ASCII characters",
        ));
    }
    let req = body.request();
    req.validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    // Before any database access: the tenant boundary (the kernel checked the grant).
    tenant_check(cx.caller(), &req.tenant)?;
    let capacity = cx.get::<Capacity>()?;
    if capacity.placer == Placer::PoolLease && req.pool.is_none() {
        return Err(ApiError::invalid(
            "pool is required: this control plane places reservations by pool (capacity.placer = \
             \"pool-lease\"); name the pool to book in",
        ));
    }
    let id = format!("rsv-{}", uuid::Uuid::now_v7().simple());
    let key = body.idempotency_key.unwrap_or_else(|| id.clone());
    let decisions = &capacity.decisions;
    let waiter = decisions.wait(&id);
    let (reply, rx) = oneshot::channel();
    let ask = Ask {
        id: id.clone(),
        principal_id: cx.caller().id.clone(),
        key: key.clone(),
        body_hash: req.body_hash(),
        tenant: req.tenant.clone(),
        request: serde_json::to_value(&req).unwrap_or_default(),
        duration_s: i64::from(req.duration_s),
        reply,
    };
    let admitted = match capacity.admitter.admit(ask, rx).await {
        Ok(a) => a,
        Err(e) => {
            decisions.forget(&id);
            return Err(e);
        }
    };
    let reservation = match admitted {
        Admission::Recorded => await_decision(capacity, &id, waiter).await?,
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
            if reservation.state == ReservationState::Pending {
                let id = reservation.id.as_str();
                let waiter = decisions.wait(id);
                await_decision(capacity, id, waiter).await?
            } else {
                *reservation
            }
        }
    };
    answer(reservation)
}

async fn await_decision(
    capacity: &Capacity,
    id: &str,
    waiter: oneshot::Receiver<Reservation>,
) -> Result<Reservation, ApiError> {
    match tokio::time::timeout(DECISION_WAIT, waiter).await {
        Ok(Ok(r)) if r.state != ReservationState::Pending => Ok(r),
        _ => {
            capacity.decisions.forget(id);
            // Missed or slow: read what is there (possibly still pending; `get` follows it).
            let not_found =
                || ApiError::new(ApiCode::NotFound, format!("reservation {id:?} not found"));
            let id = ReservationId::parse(id).map_err(|_| not_found())?;
            capacity.store.reservation(&id).await?.ok_or_else(not_found)
        }
    }
}

/// A failed placement is an error the caller can act on; anything else is the reservation.
fn answer(r: Reservation) -> Result<ReservationAnswer, ApiError> {
    if r.state == ReservationState::Failed {
        return Err(ApiError::new(
            ApiCode::Unavailable,
            format!(
                "reservation {} was not placed: {}; retry later, ask for fewer GPUs, or use a new idempotency key",
                r.id,
                r.error.as_deref().unwrap_or("no reason recorded")
            ),
        ));
    }
    Ok(plain(r))
}

fn plain(reservation: Reservation) -> ReservationAnswer {
    ReservationAnswer {
        reservation: ReservationView {
            reservation,
            delivery: None,
        },
    }
}

/// The reservation `id` if the caller may see it (another tenant's does not exist as far as it can tell), with
/// the method's grant checked on its tenant.
async fn visible(cx: &Cx, id: &ReservationId) -> Result<Reservation, ApiError> {
    let not_found = || ApiError::new(ApiCode::NotFound, format!("reservation {id} not found"));
    let capacity = cx.get::<Capacity>()?;
    let r = capacity
        .store
        .reservation(id)
        .await?
        .ok_or_else(not_found)?;
    let caller = cx.caller();
    if !tenant_allowed(&caller.tenant_id, caller.tenant_is_root, r.tenant.as_str()) {
        return Err(not_found());
    }
    cx.authorize(&format!("tenant/{}", r.tenant))?;
    Ok(r)
}

async fn get(cx: Cx, req: ReservationById) -> Result<ReservationAnswer, ApiError> {
    let r = visible(&cx, &req.id).await?;
    let capacity = cx.get::<Capacity>()?;
    let mut shown = with_delivery(capacity, vec![r]).await?;
    let reservation = shown
        .pop()
        .ok_or_else(|| ApiError::not_found(format!("reservation {} not found", req.id)))?;
    Ok(ReservationAnswer { reservation })
}

/// Reservations as operators see them: a placed one carries `delivery`, how far its booking has reached its nodes
/// (`state`: pending, applied or failed, and per node the generation carrying it, its state and, while it fails,
/// the node's reason).
async fn with_delivery(
    capacity: &Capacity,
    rows: Vec<Reservation>,
) -> Result<Vec<ReservationView>, ApiError> {
    let placed: Vec<String> = rows
        .iter()
        .filter(|r| r.state == ReservationState::Placed)
        .map(|r| r.id.to_string())
        .collect();
    let mut deliveries = if placed.is_empty() {
        HashMap::new()
    } else {
        capacity.store.deliveries(&placed).await?
    };
    Ok(rows
        .into_iter()
        .map(|r| {
            let delivery = deliveries
                .remove(r.id.as_str())
                .map(|nodes| ReservationDelivery {
                    state: bc_core::reservation::delivery(nodes.iter().map(|n| n.state)),
                    nodes,
                });
            ReservationView {
                reservation: r,
                delivery,
            }
        })
        .collect())
}

async fn list(cx: Cx, req: ListReservations) -> Result<ReservationList, ApiError> {
    let caller = cx.caller();
    let tenant = match req.tenant {
        Some(t) => {
            tenant_check(caller, &t)?;
            Some(t)
        }
        None if caller.tenant_is_root => None,
        None => Some(caller.tenant_id.clone()),
    };
    let limit = req.limit.unwrap_or(100).clamp(1, 1000);
    let capacity = cx.get::<Capacity>()?;
    let rows: Vec<Reservation> = capacity
        .store
        .list_reservations(tenant.as_deref(), limit)
        .await?
        .into_iter()
        .filter(|r| cx.allows(&format!("tenant/{}", r.tenant)))
        .collect();
    Ok(ReservationList {
        reservations: with_delivery(capacity, rows).await?,
    })
}

async fn release(cx: Cx, req: ReservationById) -> Result<ReservationAnswer, ApiError> {
    let r = visible(&cx, &req.id).await?;
    let capacity = cx.get::<Capacity>()?;
    let actor = format!("principal/{}", cx.caller().id);
    match capacity
        .store
        .end_reservation(&r.id, ReservationState::Released, &actor)
        .await?
    {
        Some(r) => Ok(plain(r)),
        None => Err(ApiError::new(
            ApiCode::Conflict,
            format!("reservation {} has already ended ({})", r.id, r.state),
        )),
    }
}

/// Hands admission's waiting API calls the placer's decisions (`bc_reservation_decided`).
pub(crate) fn decisions_reconciler() -> Reconciler {
    Reconciler::new("admission-decisions")
        .role("api")
        .poked_by(bc_store::reservations::DECIDED_CHANNEL)
        .run(|mut cx: ReconcileCx| async move {
            let capacity = cx.resources.get_arc::<Capacity>();
            loop {
                tokio::select! {
                    n = cx.pokes.recv() => match (n, &capacity) {
                        (Some(Notice::Message { payload, .. }), Some(c)) => {
                            // Bounded, and cut short when the pool moves to another primary: the waiting calls
                            // read their decisions back on their own deadline.
                            let handed = c.store.within("handing out decisions", bc_kernel::STEP_DEADLINE, async {
                                c.decisions.decided(&c.store, &payload).await;
                                Ok(())
                            });
                            if let Err(e) = handed.await {
                                tracing::warn!(error = %e, "handing out placement decisions failed");
                            }
                        }
                        (Some(Notice::Resync), Some(c)) => {
                            let resynced = c.store.within("reading decisions after a resync", bc_kernel::STEP_DEADLINE, async {
                                c.decisions.resync(&c.store).await;
                                Ok(())
                            });
                            if let Err(e) = resynced.await {
                                tracing::warn!(error = %e, "reading placement decisions after a resync failed");
                            }
                        }
                        (Some(_), None) => {}
                        // The listener ended: the process is stopping.
                        (None, _) => break,
                    },
                    _ = cx.stop.stopped() => return,
                }
            }
            cx.stop.stopped().await;
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resync (notifications may have been lost) answers the calls waiting for reservations that were decided,
    /// from one read, and leaves those still pending waiting.
    #[tokio::test]
    async fn a_resync_answers_the_calls_whose_reservations_were_decided() {
        let db = bc_store::testing::test_db().await;
        let store = bc_store::Store::new(db.pool.clone());
        store.ensure_root_tenant().await.expect("root tenant");
        for (prefix, state) in [("rsv-placed-", "placed"), ("rsv-pending-", "pending")] {
            bc_store::testing::insert_reservations(
                &db.pool,
                prefix,
                (1, 1),
                state,
                "jsonb_build_object('tenant', 'root', 'gpus', 1, 'duration_s', 60)",
            )
            .await
            .expect("a reservation");
        }
        let decisions = Decisions::default();
        let placed = decisions.wait("rsv-placed-1");
        let mut pending = decisions.wait("rsv-pending-1");
        decisions.resync(&store).await;
        let r = tokio::time::timeout(Duration::from_secs(1), placed)
            .await
            .expect("answered by the resync")
            .expect("a reservation");
        assert_eq!(
            (r.id.as_str(), r.state),
            ("rsv-placed-1", ReservationState::Placed)
        );
        assert!(
            matches!(
                pending.try_recv(),
                Err(tokio::sync::oneshot::error::TryRecvError::Empty)
            ),
            "a pending reservation's call was answered"
        );
        assert_eq!(
            decisions.waiting.lock().expect("lock").len(),
            1,
            "the pending one is still waited for"
        );
    }
}
