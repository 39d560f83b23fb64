//! `instances.create|show|list|stop|start|reboot|delete` and `instances.set-pool`. Create is the admission
//! sequence: the request's validation and the tenant check are pure and run before any database access (the
//! kernel checked the grant on `tenant/<tenant>` from the request before the handler runs); tx 1 records it under
//! its idempotency key (the same key and body replay the instance; another body is CONFLICT); tx 2 places it: on a
//! `vps-host` pool it claims the fullest node that fits (bc-core's `choose_node` order, walked on the per-node
//! free-atoms index and locked `SKIP LOCKED`), books the atoms and publishes the node's desired state; on a provider
//! pool it hands the instance to the provider workflow. Every later method changes only the instance's desired
//! state.

use crate::Instances;
use crate::queries::{self, Admission, Change, NewInstance};
use bc_core::api::instances::{
    CreateInstance, Instance, InstanceAnswer, InstanceById, InstanceList, InstancePool,
    InstanceRequest, InstanceState, ListInstances, PoolClass, Power, SetInstancePool, no_capacity,
};
use bc_core::reservation::tenant_allowed;
use bc_kernel::{ApiCode, ApiError, Caller, Cx, Method, Module, Scope};
use bc_store::sqlx::Postgres;
use bc_store::sqlx::pool::PoolConnection;
use std::time::Duration;

bc_kernel::api_method!(
    /// `instances.create`.
    pub CreateInstanceMethod = "instances" / "create": CreateInstance => InstanceAnswer
);
bc_kernel::api_method!(
    /// `instances.show`.
    pub ShowInstanceMethod = "instances" / "show": InstanceById => InstanceAnswer
);
bc_kernel::api_method!(
    /// `instances.list`.
    pub ListInstancesMethod = "instances" / "list": ListInstances => InstanceList
);
bc_kernel::api_method!(
    /// `instances.stop`.
    pub StopInstanceMethod = "instances" / "stop": InstanceById => InstanceAnswer
);
bc_kernel::api_method!(
    /// `instances.start`.
    pub StartInstanceMethod = "instances" / "start": InstanceById => InstanceAnswer
);
bc_kernel::api_method!(
    /// `instances.reboot`.
    pub RebootInstanceMethod = "instances" / "reboot": InstanceById => InstanceAnswer
);
bc_kernel::api_method!(
    /// `instances.delete`.
    pub DeleteInstanceMethod = "instances" / "delete": InstanceById => InstanceAnswer
);
bc_kernel::api_method!(
    /// `instances.set-pool`.
    pub SetInstancePoolMethod = "instances" / "set-pool": SetInstancePool => InstancePool
);

/// How many nodes whose GPUs were taken under it one placement passes over before it gives up.
const PLACEMENT_TRIES: usize = 64;
/// How long a placement keeps trying while the nodes that fit are busy with other placements.
const PLACEMENT_DEADLINE: Duration = Duration::from_secs(5);

/// Registers the methods on `module`.
pub fn register(module: Module) -> Module {
    module
        .method(
            Method::<CreateInstanceMethod>::new()
                .permission("compute:instances:create")
                .scope_from_request("tenant/<tenant>", |r| format!("tenant/{}", r.tenant))
                .handler(create),
        )
        .method(
            Method::<ShowInstanceMethod>::new()
                .permission("compute:instances:show")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(show),
        )
        .method(
            Method::<ListInstancesMethod>::new()
                .permission("compute:instances:list")
                .scope(Scope::filtered("tenant/<tenant>"))
                .handler(list),
        )
        .method(
            Method::<StopInstanceMethod>::new()
                .permission("compute:instances:stop")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(|cx, r: InstanceById| change(cx, r, Change::Power(Power::Stopped))),
        )
        .method(
            Method::<StartInstanceMethod>::new()
                .permission("compute:instances:start")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(|cx, r: InstanceById| change(cx, r, Change::Power(Power::Running))),
        )
        .method(
            Method::<RebootInstanceMethod>::new()
                .permission("compute:instances:reboot")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(|cx, r: InstanceById| change(cx, r, Change::Reboot)),
        )
        .method(
            Method::<DeleteInstanceMethod>::new()
                .permission("compute:instances:delete")
                .scope(Scope::resource("tenant/<tenant>"))
                .handler(|cx, r: InstanceById| change(cx, r, Change::Delete)),
        )
        .method(
            Method::<SetInstancePoolMethod>::new()
                .permission("compute:instance-pools:set")
                .scope_from_request("pool/<pool>", |r| format!("pool/{}", r.pool))
                .handler(set_pool),
        )
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

async fn create(cx: Cx, body: CreateInstance) -> Result<InstanceAnswer, ApiError> {
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
    let instances = cx.get::<Instances>()?;
    let id = format!("inst-{}", uuid::Uuid::now_v7().simple());
    let key = body.idempotency_key.clone().unwrap_or_else(|| id.clone());
    let body_hash = req.body_hash();
    let new = NewInstance {
        id: &id,
        principal_id: &cx.caller().id,
        key: &key,
        body_hash: &body_hash,
        request: &req,
    };
    // One connection for the admission's statements (each acquisition from the pool costs a round trip: sqlx
    // checks the connection it hands out).
    let mut conn = instances
        .store
        .pool()
        .acquire()
        .await
        .map_err(bc_store::StoreError::from)?;
    // Tx 1 for the common case, a hosted pool, checks the pool's class in its own statement; any other pool's
    // class is read first and decides what may be recorded.
    let (class, admitted) = match queries::admit_if_hosted(&mut conn, new).await? {
        Some(admitted) => (PoolClass::VpsHost, admitted),
        None => {
            let class = other_class(&mut conn, &req).await?;
            (class, queries::admit(&mut conn, new).await?)
        }
    };
    let instance = match admitted {
        Admission::Recorded => place(instances, conn, class, &id, &req).await?,
        Admission::Existing {
            body_hash: stored,
            instance,
        } => {
            if stored != body_hash {
                return Err(ApiError::new(
                    ApiCode::Conflict,
                    format!(
                        "idempotency key {key:?} was used for a different request (instance {}); use a new key",
                        instance.id
                    ),
                ));
            }
            if instance.state == InstanceState::Pending {
                // The call that recorded it did not finish placing it: this one does.
                place(instances, conn, class, &instance.id, &instance.request).await?
            } else {
                *instance
            }
        }
    };
    if instance.state == InstanceState::Failed {
        return Err(ApiError::new(
            ApiCode::Unavailable,
            format!(
                "instance {} was not placed: {}; retry later, ask for less, or use a new idempotency key",
                instance.id,
                instance.error.as_deref().unwrap_or("no reason recorded")
            ),
        ));
    }
    Ok(InstanceAnswer { instance })
}

/// The class of the request's pool when tx 1 found it is not a hosted pool: a provider pool (whose configuration
/// can launch the request, checked before anything is recorded), a hosted pool after all (its class changed since),
/// or an error saying what to do.
async fn other_class(
    conn: &mut bc_store::sqlx::PgConnection,
    req: &InstanceRequest,
) -> Result<PoolClass, ApiError> {
    match queries::pool_class(conn, &req.pool).await? {
        (Some(PoolClass::VpsHost), _) => Ok(PoolClass::VpsHost),
        (Some(PoolClass::Provider), Some(provider)) => {
            provider
                .launch_for(req)
                .map_err(|why| ApiError::invalid(format!("pool {}: {why}", req.pool)))?;
            Ok(PoolClass::Provider)
        }
        (Some(PoolClass::Provider), None) => Err(ApiError::new(
            ApiCode::FailedPrecondition,
            format!(
                "pool {} is a provider pool without its configuration: set it again with `better-compute \
                 instances set-pool {} provider --provider <file>`",
                req.pool, req.pool
            ),
        )),
        (None, _) => Err(ApiError::new(
            ApiCode::FailedPrecondition,
            format!(
                "pool {} hosts no instances: make it a hosted pool (`better-compute instances set-pool {} \
                 vps-host`) with nodes that run bcd with a [vmm] table, or a provider pool, or name such a pool",
                req.pool, req.pool
            ),
        )),
    }
}

/// Tx 2: books the atoms of the best node that still fits under its lock, records the placement and publishes
/// the node's desired state, in one transaction; with no node that fits, records why. A node another placement
/// holds is skipped; when every node that fits was busy, the placement tries again shortly, within
/// [`PLACEMENT_DEADLINE`].
async fn place(
    instances: &Instances,
    mut conn: PoolConnection<Postgres>,
    class: PoolClass,
    id: &str,
    req: &InstanceRequest,
) -> Result<Instance, ApiError> {
    let pool = instances.store.pool();
    if class == PoolClass::Provider {
        // The provider workflow launches it: the placement is its hand-over, in one transaction.
        let mut tx = bc_store::sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(bc_store::StoreError::from)?;
        queries::mark_placed_provider(&mut tx, id, &req.pool).await?;
        tx.commit().await.map_err(bc_store::StoreError::from)?;
        return read(instances, id).await;
    }
    if req.gpus == 0 {
        // The common case in one statement; when it places nothing, the loop below finds out why.
        let entry = queries::placement_entry(id, req, serde_json::json!([]));
        if let Some(placed) = queries::place_without_gpus(&mut conn, req, id, entry).await? {
            instances.outbox.poke();
            tracing::debug!(instance = id, node = ?placed.node, "instance placed");
            return Ok(placed);
        }
    }
    let deadline = tokio::time::Instant::now() + PLACEMENT_DEADLINE;
    let mut pause = Duration::from_millis(2);
    // Nodes whose GPUs a reservation booked between the claim and the booking: not tried again by this call.
    let mut short: Vec<String> = Vec::new();
    // The admission's connection, given back to the pool while this call waits for a busy node.
    let mut held = Some(conn);
    loop {
        let mut conn = match held.take() {
            Some(c) => c,
            None => pool.acquire().await.map_err(bc_store::StoreError::from)?,
        };
        let mut tx = bc_store::sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(bc_store::StoreError::from)?;
        let Some(node) = queries::claim_node(&mut tx, req, &short).await? else {
            drop(tx);
            drop(conn);
            let busy = queries::any_fits(pool, req, &short).await?;
            if !busy
                || tokio::time::Instant::now() + pause > deadline
                || short.len() >= PLACEMENT_TRIES
            {
                let candidates = queries::free_atoms(pool, &req.pool).await?;
                let why = no_capacity(&req.pool, req, &candidates);
                queries::mark_failed(pool, id, &why).await?;
                return read(instances, id).await;
            }
            // Every node that fits is held by another placement right now.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(100));
            continue;
        };
        let want = i64::from(req.gpus);
        let gpus = queries::book_gpus(&mut tx, &node, id, want).await?;
        if gpus.len() as i64 != want {
            short.push(node);
            drop(tx);
            held = Some(conn);
            continue;
        }
        let entry = queries::placement_entry(id, req, serde_json::json!(gpus));
        let Some(placed) = queries::place_and_publish(&mut tx, id, &node, &gpus, entry).await?
        else {
            // Another call placed (or the owner deleted) it meanwhile: what it did stands.
            drop(tx);
            return read(instances, id).await;
        };
        tx.commit().await.map_err(bc_store::StoreError::from)?;
        instances.outbox.poke();
        tracing::debug!(instance = id, node = %node, gpus = gpus.len(), "instance placed");
        return Ok(placed);
    }
}

async fn read(instances: &Instances, id: &str) -> Result<Instance, ApiError> {
    queries::instance(instances.store.pool(), id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("instance {id:?} not found")))
}

/// The instance `id` if the caller may see it (another tenant's does not exist as far as it can tell), with the
/// method's grant checked on its tenant.
async fn visible(cx: &Cx, id: &str) -> Result<Instance, ApiError> {
    let not_found = || ApiError::not_found(format!("instance {id:?} not found"));
    let instances = cx.get::<Instances>()?;
    let i = queries::instance(instances.store.pool(), id)
        .await?
        .ok_or_else(not_found)?;
    let caller = cx.caller();
    if !tenant_allowed(&caller.tenant_id, caller.tenant_is_root, i.tenant.as_str()) {
        return Err(not_found());
    }
    cx.authorize(&format!("tenant/{}", i.tenant))?;
    Ok(i)
}

/// Adds each placed (or deleting) instance's report: its node's, or the provider workflow's (only a report about
/// its current generation or an older one is shown; one about a newer generation cannot exist).
async fn with_observed(
    instances: &Instances,
    mut list: Vec<Instance>,
) -> Result<Vec<Instance>, ApiError> {
    let live = |i: &Instance| matches!(i.state, InstanceState::Placed | InstanceState::Deleting);
    let mut nodes: Vec<String> = list
        .iter()
        .filter(|i| live(i))
        .filter_map(|i| i.node.as_ref().map(|n| n.to_string()))
        .collect();
    nodes.sort();
    nodes.dedup();
    let on_provider: Vec<String> = list
        .iter()
        .filter(|i| i.node.is_none() && i.state != InstanceState::Pending)
        .map(|i| i.id.clone())
        .collect();
    let pool = instances.store.pool();
    let mut observed = match nodes.is_empty() {
        true => Default::default(),
        false => queries::observed(pool, &nodes).await?,
    };
    if !on_provider.is_empty() {
        observed.extend(crate::provider::store::observed(pool, &on_provider).await?);
    }
    for i in &mut list {
        if live(i) || i.node.is_none() {
            i.observed = observed.remove(&i.id);
        }
    }
    Ok(list)
}

async fn show(cx: Cx, req: InstanceById) -> Result<InstanceAnswer, ApiError> {
    let i = visible(&cx, &req.id).await?;
    let instances = cx.get::<Instances>()?;
    let instance = with_observed(instances, vec![i])
        .await?
        .pop()
        .ok_or_else(|| ApiError::not_found(format!("instance {:?} not found", req.id)))?;
    Ok(InstanceAnswer { instance })
}

async fn list(cx: Cx, req: ListInstances) -> Result<InstanceList, ApiError> {
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
    let instances = cx.get::<Instances>()?;
    let rows: Vec<Instance> = queries::list(
        instances.store.pool(),
        tenant.as_deref(),
        req.deleted,
        limit,
    )
    .await?
    .into_iter()
    .filter(|i| cx.allows(&format!("tenant/{}", i.tenant)))
    .collect();
    Ok(InstanceList {
        instances: with_observed(instances, rows).await?,
    })
}

/// Stop, start, reboot and delete: one change to the instance's desired state and, when it is on a node, that
/// node's next desired-state generation, in one transaction.
async fn change(cx: Cx, req: InstanceById, change: Change) -> Result<InstanceAnswer, ApiError> {
    let i = visible(&cx, &req.id).await?;
    let instances = cx.get::<Instances>()?;
    let mut tx = instances
        .store
        .pool()
        .begin()
        .await
        .map_err(bc_store::StoreError::from)?;
    let Some(changed) = queries::change(&mut tx, &i.id, &change).await? else {
        return Err(ApiError::new(
            ApiCode::Conflict,
            format!(
                "instance {} is {}; create a new one",
                i.id,
                if i.state == InstanceState::Deleting {
                    "being deleted"
                } else {
                    "deleted"
                }
            ),
        ));
    };
    if let Some(node) = &changed.node {
        let generation = queries::publish(&mut tx, node).await?;
        if changed.state == InstanceState::Deleting {
            queries::set_removal_generation(&mut tx, &i.id, generation).await?;
        }
    }
    crate::provider::store::poke(&mut tx, &i.id).await?;
    tx.commit().await.map_err(bc_store::StoreError::from)?;
    if changed.node.is_some() {
        instances.outbox.poke();
    }
    let actor = &cx.caller().id;
    tracing::info!(instance = %i.id, actor = %actor, change = change_name(&change), "instance changed");
    let instance = with_observed(instances, vec![read(instances, &i.id).await?])
        .await?
        .pop()
        .ok_or_else(|| ApiError::not_found(format!("instance {:?} not found", i.id)))?;
    Ok(InstanceAnswer { instance })
}

fn change_name(c: &Change) -> &'static str {
    match c {
        Change::Power(Power::Running) => "start",
        Change::Power(Power::Stopped) => "stop",
        Change::Reboot => "reboot",
        Change::Delete => "delete",
    }
}

async fn set_pool(cx: Cx, req: SetInstancePool) -> Result<InstancePool, ApiError> {
    req.validate().map_err(ApiError::invalid)?;
    let instances = cx.get::<Instances>()?;
    queries::set_pool_class(
        instances.store.pool(),
        &req.pool,
        req.class,
        req.provider.as_ref(),
    )
    .await?;
    Ok(InstancePool {
        pool: req.pool,
        class: req.class,
        provider: req.provider,
    })
}
