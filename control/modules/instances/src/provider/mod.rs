//! The provider workflow (`controllers` role, shard-owned by instance id): for each instance of a provider pool
//! that is due in the shards this process leases, one pass in one transaction that holds the instance's workflow
//! row (`FOR UPDATE SKIP LOCKED`) and the shard's fence (`FOR SHARE`): it resolves the pool's credentials from their
//! secret reference for this pass only, asks the provider about the instance (by its provider id, or by its tag
//! before one is known), lets bc-core's [`workflow::plan`] decide at most one call, makes it, lets
//! [`workflow::after`] read the result, and stores the record — or ends the story ([`Outcome`]). A process whose
//! shard moved on changes nothing; two processes never work one instance at once.

pub mod ec2;
pub mod store;

use crate::Instances;
use bc_core::provider::ec2::{self as codec, Ec2Answer, Ec2Instance, Ec2State, Form};
use bc_core::provider::workflow::{self, CallError, Observed, Outcome, Step};
use bc_core::provider::{ProviderPool, SecretRef};
use bc_core::shards::ShardLease;
use bc_kernel::StepCx;
use bc_store::StoreError;
use ec2::{Credentials, Ec2Client};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use store::Due;
use zeroize::Zeroizing;

pub const ROLE: &str = "controllers";

/// A resolved secret's value (wiped when dropped), or why it could not be read.
pub type SecretValue<'a> =
    Pin<Box<dyn Future<Output = Result<Zeroizing<Vec<u8>>, String>> + Send + 'a>>;

/// Resolves a secret reference to its value, for one operation (the composition implements it with the
/// control plane's secret store: this module imports no other).
pub trait ProviderSecrets: Send + Sync + 'static {
    fn resolve<'a>(&'a self, r: &'a SecretRef) -> SecretValue<'a>;
}

/// The kernel resource through which the workflow reaches the secrets.
#[derive(Clone)]
pub struct ProviderCredentials(pub Arc<dyn ProviderSecrets>);

/// The workflow's shared parts.
#[derive(Clone)]
pub struct Provider {
    pub client: Ec2Client,
    pub secrets: Option<ProviderCredentials>,
    pub policy: workflow::Policy,
}

/// What one pass over one instance did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// Another transaction holds it, this process no longer holds its shard, or it is not due.
    Skipped,
    Stepped {
        call: Option<String>,
        outcome: Option<Outcome>,
    },
}

async fn credentials(p: &Provider, pool: &ProviderPool) -> Result<Credentials, CallError> {
    let fail = |m: String| CallError {
        transient: true,
        message: m,
    };
    let Some(secrets) = &p.secrets else {
        return Err(fail(
            "this control plane has no secret store for provider credentials".into(),
        ));
    };
    let value = secrets.0.resolve(&pool.credentials).await.map_err(|e| {
        fail(format!(
            "credentials secret {}/{}: {e}",
            pool.credentials.site, pool.credentials.name
        ))
    })?;
    Credentials::parse(&value).map_err(|e| {
        fail(format!(
            "credentials secret {}/{}: {e}",
            pool.credentials.site, pool.credentials.name
        ))
    })
}

/// The instance the provider knows for `instance`: by its id when the record has one, else by its tag (a
/// terminated one only when nothing else carries the tag).
async fn observe(
    p: &Provider,
    pool: &ProviderPool,
    creds: &Credentials,
    instance: &str,
    provider_id: Option<&str>,
) -> Observed {
    let form = match provider_id {
        Some(id) => codec::describe_by_id(id),
        None => codec::describe_by_tag(instance),
    };
    match p
        .client
        .call(&pool.endpoint, &pool.region, creds, &form)
        .await
    {
        Ok(Ec2Answer::Instances(list)) => pick(list, instance, provider_id),
        Ok(other) => Observed::Failed(CallError {
            transient: true,
            message: format!("DescribeInstances answered {other:?}"),
        }),
        Err(e) if e.message.contains("InvalidInstanceID.NotFound") => Observed::Absent,
        Err(e) => Observed::Failed(e),
    }
}

fn pick(list: Vec<Ec2Instance>, instance: &str, provider_id: Option<&str>) -> Observed {
    let mut mine: Vec<Ec2Instance> = list
        .into_iter()
        .filter(|i| match provider_id {
            Some(id) => i.instance_id == id,
            None => i.bc_instance_id.as_deref() == Some(instance),
        })
        .collect();
    // Alive before terminated, then by id: the same choice on every pass.
    mine.sort_by(|a, b| {
        (a.state == Ec2State::Terminated, &a.instance_id)
            .cmp(&(b.state == Ec2State::Terminated, &b.instance_id))
    });
    match mine.into_iter().next() {
        Some(i) => Observed::Found {
            provider_id: i.instance_id,
            state: i.state,
        },
        None => Observed::Absent,
    }
}

async fn make_call(
    p: &Provider,
    pool: &ProviderPool,
    creds: &Credentials,
    due: &Due,
    call: &workflow::Call,
) -> Result<Vec<(String, Ec2State)>, CallError> {
    use base64::Engine as _;
    let form: Form = match call {
        workflow::Call::Launch => {
            let spec = pool.launch_for(&due.request).map_err(|m| CallError {
                transient: false,
                message: m,
            })?;
            let user_data = spec
                .user_data
                .as_deref()
                .map(|u| base64::engine::general_purpose::STANDARD.encode(u));
            codec::run_instances(&codec::Launch {
                instance: &due.instance_id,
                image_id: &spec.image_id,
                instance_type: &spec.instance_type,
                user_data_b64: user_data.as_deref(),
            })
        }
        workflow::Call::Change(action, id) => codec::change_state(*action, id),
    };
    match p
        .client
        .call(&pool.endpoint, &pool.region, creds, &form)
        .await?
    {
        Ec2Answer::Instances(list) => {
            Ok(list.into_iter().map(|i| (i.instance_id, i.state)).collect())
        }
        Ec2Answer::StateChanges(list) => Ok(list),
        Ec2Answer::Accepted => Ok(Vec::new()),
        Ec2Answer::Error { code, message } => Err(CallError {
            transient: false,
            message: format!("{code}: {message}"),
        }),
    }
}

/// Asks, decides, calls and decides again: the I/O of one pass, outside the database.
async fn step_instance(p: &Provider, due: &Due, now_ms: i64, unit: f64) -> (Step, Option<String>) {
    let desired = due.desired();
    let plan = |observed| {
        workflow::plan(
            &desired,
            &due.record,
            observed,
            due.created_ms,
            now_ms,
            &p.policy,
            unit,
        )
    };
    let creds = match credentials(p, &due.pool).await {
        Ok(c) => c,
        Err(e) => return (plan(Observed::Failed(e)), None),
    };
    let provider_id = due.record.provider_id.as_deref();
    let step = plan(observe(p, &due.pool, &creds, &due.instance_id, provider_id).await);
    let Some(call) = step.call.clone() else {
        return (step, None);
    };
    let result = make_call(p, &due.pool, &creds, due, &call).await;
    let name = match &call {
        workflow::Call::Launch => "RunInstances".to_owned(),
        workflow::Call::Change(a, _) => a.as_str().to_owned(),
    };
    let after = workflow::after(
        &desired,
        &step.record,
        &call,
        result,
        crate::now_ms(),
        &p.policy,
        unit,
    );
    (after, Some(name))
}

/// One pass over instance `id` at `now_ms`, fenced by `leases`.
pub async fn pass(
    instances: &Instances,
    p: &Provider,
    worker: &str,
    leases: &[ShardLease],
    id: &str,
    now_ms: i64,
) -> Result<Pass, StoreError> {
    let mut tx = instances.store.pool().begin().await?;
    if !store::fenced(&mut tx, ROLE, worker, leases, id).await? {
        return Ok(Pass::Skipped);
    }
    let Some(due) = store::lock_due(&mut tx, id).await? else {
        return Ok(Pass::Skipped);
    };
    if !workflow::due(&due.record, now_ms) {
        return Ok(Pass::Skipped);
    }
    let (step, call) = step_instance(p, &due, now_ms, rand::random::<f64>()).await;
    store::apply(&mut tx, &due, &step).await?;
    tx.commit().await?;
    if step.call.is_some() || call.is_some() || step.outcome.is_some() {
        tracing::info!(
            instance = id,
            call = call.as_deref().unwrap_or("-"),
            state = ?step.record.state,
            outcome = ?step.outcome,
            reason = step.record.reason.as_deref().unwrap_or(""),
            "provider workflow pass"
        );
    }
    Ok(Pass::Stepped {
        call,
        outcome: step.outcome,
    })
}

/// One pass over every due instance of `leases`; returns how many it stepped.
pub async fn step(
    instances: &Instances,
    p: &Provider,
    worker: &str,
    leases: &[ShardLease],
    now_ms: i64,
) -> Result<usize, StoreError> {
    let shards: Vec<i16> = leases.iter().map(|l| l.shard.get()).collect();
    if shards.is_empty() {
        return Ok(0);
    }
    let mut stepped = 0;
    for id in store::scan_due(instances.store.pool(), &shards, now_ms).await? {
        match pass(instances, p, worker, leases, &id, now_ms).await {
            Ok(Pass::Stepped { .. }) => stepped += 1,
            Ok(Pass::Skipped) => {}
            Err(e) => {
                tracing::warn!(instance = id, error = %e, "provider pass failed; retrying next tick")
            }
        }
    }
    Ok(stepped)
}

/// The reconciler's step (the kernel runs it on every tick, notification (`bc_instances`) and change of shards):
/// the hosted pools' deletions and node changes ([`crate::hosted`]), then the provider workflow's passes.
pub async fn reconcile(cx: StepCx) -> Result<(), StoreError> {
    let (Some(instances), Some(provider)) = (
        cx.resources.get::<Instances>().cloned(),
        cx.resources.get::<Provider>().cloned(),
    ) else {
        return Err(StoreError::Corrupt(
            "instances: the module did not start; its reconciler cannot run".into(),
        ));
    };
    let now = crate::now_ms();
    // A failed hosted sweep does not hold up the provider workflow; each is retried on the next tick.
    let hosted = crate::hosted::step(&instances, &cx.worker.id, &cx.leases, now).await;
    step(&instances, &provider, &cx.worker.id, &cx.leases, now).await?;
    hosted?;
    Ok(())
}
