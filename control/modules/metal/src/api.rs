//! The `metal` group: `enroll|inspect|provide|deploy|release|abort|retry|show|list`. Each permission is
//! `compute:metal:<verb>` on scope `site/<id>`: the kernel checks it where the request names the site (enroll), the
//! handlers where the machine's row does ([`Cx::authorize`]). A verb is applied through the planner: one that is
//! not possible in the machine's state is FAILED_PRECONDITION with the planner's reason and changes nothing.

use crate::executor;
use crate::queries::{self, MetalRow};
use crate::{Metal, now_ms};
use bc_core::api::metal::{
    DeployRequest, EnrollRequest, ListRequest, ListResponse, MachineRef, MachineView,
};
use bc_core::ids::MachineId;
use bc_core::metal::{DeploySpec, Machine, Verb};
use bc_kernel::{ApiCode, ApiError, Cx, Method, Module, Scope};
use bc_store::sqlx;

/// The method types of the metal module, for its handlers and for clients (`client.method::<Enroll>(..)`).
pub mod methods {
    use bc_core::api::metal::*;

    bc_kernel::api_method!(
        /// `metal.enroll`.
        pub Enroll = "metal" / "enroll": EnrollRequest => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.inspect`.
        pub Inspect = "metal" / "inspect": MachineRef => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.provide`.
        pub Provide = "metal" / "provide": MachineRef => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.deploy`.
        pub Deploy = "metal" / "deploy": DeployRequest => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.release`.
        pub Release = "metal" / "release": MachineRef => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.abort`.
        pub Abort = "metal" / "abort": MachineRef => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.retry`.
        pub Retry = "metal" / "retry": MachineRef => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.show`.
        pub Show = "metal" / "show": MachineRef => MachineView
    );
    bc_kernel::api_method!(
        /// `metal.list`.
        pub List = "metal" / "list": ListRequest => ListResponse
    );
}

use methods::*;

fn site_scope(site: &bc_core::ids::SiteId) -> String {
    format!("site/{site}")
}

macro_rules! verb_method {
    ($module:expr, $m:ty, $perm:literal, $verb:expr) => {
        $module.method(
            Method::<$m>::new()
                .permission($perm)
                .scope(Scope::resource("site/<site>"))
                .handler(
                    |cx: Cx, req: MachineRef| async move { apply_verb(cx, &req.mac, $verb).await },
                ),
        )
    };
}

pub(crate) fn register(module: Module) -> Module {
    let module = module.method(
        Method::<Enroll>::new()
            .permission("compute:metal:enroll")
            .scope_from_request("site/<site>", |r| site_scope(&r.site))
            .handler(enroll),
    );
    let module = verb_method!(module, Inspect, "compute:metal:inspect", Verb::Inspect);
    let module = verb_method!(module, Provide, "compute:metal:provide", Verb::Provide);
    let module = verb_method!(module, Release, "compute:metal:release", Verb::Release);
    let module = verb_method!(module, Abort, "compute:metal:abort", Verb::Abort);
    let module = verb_method!(module, Retry, "compute:metal:retry", Verb::Retry);
    module
        .method(
            Method::<Deploy>::new()
                .permission("compute:metal:deploy")
                .scope(Scope::resource("site/<site>"))
                .handler(deploy),
        )
        .method(
            Method::<Show>::new()
                .permission("compute:metal:show")
                .scope(Scope::resource("site/<site>"))
                .handler(show),
        )
        .method(
            Method::<List>::new()
                .permission("compute:metal:list")
                .scope(Scope::filtered("site/<site>"))
                .handler(list),
        )
}

/// `mac` in canonical form (`aa:bb:cc:dd:ee:ff`) from any common one.
pub fn canonical_mac(mac: &str) -> Result<MachineId, ApiError> {
    bc_core::metal::site_report::canonical_mac(mac)
        .and_then(|m| MachineId::new(m).ok())
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "mac {mac:?} is not a MAC address: use aa:bb:cc:dd:ee:ff"
            ))
        })
}

fn check_bmc(bmc: &bc_core::api::metal::BmcRef) -> Result<(), ApiError> {
    let a = &bmc.address;
    if !(a.starts_with("https://") || a.starts_with("http://"))
        || a.len() > 512
        || a.contains(char::is_whitespace)
    {
        return Err(ApiError::invalid(format!(
            "bmc.address {a:?}: give the Redfish service's base URL, e.g. https://10.0.0.5"
        )));
    }
    let c = &bmc.credentials;
    let ok = !c.is_empty()
        && c.len() <= 128
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'/'));
    if !ok {
        return Err(ApiError::invalid(format!(
            "bmc.credentials {c:?}: name a site secret (1-128 of [A-Za-z0-9._/-]) stored with `better-compute secrets put`"
        )));
    }
    Ok(())
}

/// The machine's view: its record, its BMC and the steps of its current attempt.
pub async fn view(metal: &Metal, row: MetalRow) -> Result<MachineView, ApiError> {
    let m = row.machine;
    let steps = queries::steps(
        metal.store.pool(),
        row.mac.as_str(),
        m.attempt_id,
        m.attempt_started,
    )
    .await?;
    let evidence = queries::evidence(metal.store.pool(), row.mac.as_str()).await?;
    Ok(MachineView {
        mac: row.mac,
        site: row.site,
        bmc: row.bmc,
        state: m.state,
        goal: m.goal,
        attempt: m.attempt,
        deadline_ms: m.deadline,
        waiting_for: m.waiting_for,
        node_id: m.node_id,
        power_cycles: m.power_cycles,
        inspection: m.inspection,
        diagnosis: m.diagnosis,
        conditions: m.conditions,
        last_error: m.last_error,
        last_dhcp_ms: row.last_dhcp_ms,
        timeline: m.timeline,
        steps,
        evidence,
    })
}

async fn row_for(cx: &Cx, metal: &Metal, mac: &MachineId) -> Result<MetalRow, ApiError> {
    let row = queries::get(metal.store.pool(), mac.as_str())
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "machine {mac} is not enrolled: enroll it with `better-compute metal enroll`"
            ))
        })?;
    cx.authorize(&site_scope(&row.site))?;
    Ok(row)
}

async fn enroll(cx: Cx, req: EnrollRequest) -> Result<MachineView, ApiError> {
    let metal = cx.get::<Metal>()?;
    let row = enroll_machine(metal, req, &cx.caller().actor(), now_ms()).await?;
    view(metal, row).await
}

/// Enrolls a machine at `now_ms` (creating its `machines` row, without a netboot entry, when the site has none):
/// it rests in `enrolled` until a verb.
pub async fn enroll_machine(
    metal: &Metal,
    req: EnrollRequest,
    actor: &str,
    now_ms: i64,
) -> Result<MetalRow, ApiError> {
    let mac = canonical_mac(&req.mac)?;
    check_bmc(&req.bmc)?;
    let mut tx = metal
        .store
        .pool()
        .begin()
        .await
        .map_err(bc_store::StoreError::from)?;
    let site_exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM sites WHERE id = $1)")
        .bind(req.site.as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(bc_store::StoreError::from)?;
    if !site_exists {
        return Err(ApiError::not_found(format!(
            "site {} does not exist: create a site token for it first (`better-compute site-tokens create`)",
            req.site
        )));
    }
    let existing: Option<String> =
        sqlx::query_scalar("SELECT site_id FROM machines WHERE mac = $1 FOR UPDATE")
            .bind(mac.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(bc_store::StoreError::from)?;
    match existing {
        Some(site) if site != req.site.as_str() => {
            return Err(ApiError::conflict(format!(
                "machine {mac} belongs to site {site}, not {}",
                req.site
            )));
        }
        Some(_) => {}
        None => {
            sqlx::query("INSERT INTO machines (mac, site_id, boot) VALUES ($1, $2, NULL)")
                .bind(mac.as_str())
                .bind(req.site.as_str())
                .execute(&mut *tx)
                .await
                .map_err(bc_store::StoreError::from)?;
        }
    }
    let machine = Machine::enrolled(mac.as_str(), req.expected.clone(), now_ms);
    queries::insert(&mut tx, &req.site, &req.bmc, &machine).await?;
    crate::apply::audit(
        &mut tx,
        actor,
        "metal.enroll",
        mac.as_str(),
        serde_json::json!({"site": req.site, "bmc": req.bmc.address, "credentials": req.bmc.credentials}),
    )
    .await?;
    tx.commit().await.map_err(bc_store::StoreError::from)?;
    Ok(MetalRow {
        mac,
        site: req.site,
        bmc: req.bmc,
        machine,
        ramdisk_node: None,
        installed_node: None,
        last_dhcp_ms: None,
    })
}

async fn apply_verb(cx: Cx, mac: &str, verb: Verb) -> Result<MachineView, ApiError> {
    let metal = cx.get::<Metal>()?;
    let mac = canonical_mac(mac)?;
    row_for(&cx, metal, &mac).await?;
    match executor::verb(metal, mac.as_str(), verb, now_ms(), &cx.caller().actor()).await? {
        Ok(row) => view(metal, row).await,
        Err(why) => Err(ApiError::new(ApiCode::FailedPrecondition, why)),
    }
}

fn check_digest(image: &str) -> Result<&str, ApiError> {
    image
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "image {image:?}: give the artifact's digest, sha256:<64 lowercase hex> (see `better-compute artifacts list`)"
            ))
        })
}

async fn deploy(cx: Cx, req: DeployRequest) -> Result<MachineView, ApiError> {
    let metal = cx.get::<Metal>()?;
    let hex = check_digest(&req.image)?;
    if req.user_data.len() > 64 * 1024 || req.meta_data.len() > 64 * 1024 {
        return Err(ApiError::invalid(
            "user_data and meta_data are at most 64 KiB each",
        ));
    }
    if metal.store.artifact(hex).await?.is_none() {
        return Err(ApiError::not_found(format!(
            "artifact {} is not stored: upload it first (PUT /api/artifacts)",
            req.image
        )));
    }
    let verb = Verb::Deploy(DeploySpec {
        image: req.image,
        user_data: req.user_data,
        meta_data: req.meta_data,
    });
    apply_verb(cx, &req.mac, verb).await
}

async fn show(cx: Cx, req: MachineRef) -> Result<MachineView, ApiError> {
    let metal = cx.get::<Metal>()?;
    let mac = canonical_mac(&req.mac)?;
    let row = row_for(&cx, metal, &mac).await?;
    view(metal, row).await
}

async fn list(cx: Cx, req: ListRequest) -> Result<ListResponse, ApiError> {
    let metal = cx.get::<Metal>()?;
    let machines = queries::list(
        metal.store.pool(),
        req.site.as_ref().map(|s| s.as_str()),
        req.phase,
        req.failed,
    )
    .await?
    .into_iter()
    .filter(|m| cx.allows(&site_scope(&m.site)))
    .collect();
    Ok(ListResponse { machines })
}
