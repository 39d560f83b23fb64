//! API groups of sites: `sites.revoke`, `site-tokens.create|list|revoke`, `machines.create|list|set-boot`, `secrets.put`. Each
//! permission is `compute:<group>:<verb>` on scope `site/<id>`.

use crate::api::{ApiCode, ApiError, ApiState, now_ms, parse, require};
use crate::site::BootSpec;
use axum::Json;
use bc_core::iam::allows;
use bc_proto::token::{Token, TokenKind};
use bc_store::iam::Principal;
use bc_store::sites::{MachineRow, NewSiteToken};
use serde::Deserialize;
use serde_json::{Value, json};

pub(crate) async fn dispatch(
    state: &ApiState,
    p: &Principal,
    group: &str,
    method: &str,
    body: Value,
) -> Result<Json<Value>, ApiError> {
    match (group, method) {
        ("sites", "revoke") => revoke_site(state, p, parse(body)?).await,
        ("site-tokens", "create") => create_token(state, p, parse(body)?).await,
        ("site-tokens", "list") => list_tokens(state, p, parse(body)?).await,
        ("site-tokens", "revoke") => revoke_token(state, p, parse(body)?).await,
        ("machines", "create") => create_machine(state, p, parse(body)?).await,
        ("machines", "list") => list_machines(state, p, parse(body)?).await,
        ("machines", "set-boot") => set_boot(state, p, parse(body)?).await,
        ("secrets", "put") => put_secret(state, p, parse(body)?).await,
        _ => Err(ApiError::new(
            ApiCode::NotFound,
            format!("no method {group}.{method}"),
        )),
    }
}

fn actor(p: &Principal) -> String {
    format!("principal/{}", p.id)
}

fn check_site_id(site: &str) -> Result<(), ApiError> {
    let ok = !site.is_empty()
        && site.len() <= 64
        && site
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "site must be 1-64 characters of [A-Za-z0-9.-_] (it becomes the SPIFFE ID spiffe://<domain>/site/<site>)",
        ))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateToken {
    site: String,
    #[serde(default = "two")]
    uses: i32,
    #[serde(default = "day")]
    ttl_seconds: i64,
}

fn two() -> i32 {
    2
}

fn day() -> i64 {
    86_400
}

async fn create_token(
    state: &ApiState,
    p: &Principal,
    req: CreateToken,
) -> Result<Json<Value>, ApiError> {
    check_site_id(&req.site)?;
    require(
        p,
        "compute:site-tokens:create",
        &format!("site/{}", req.site),
    )?;
    if state.store.site_revoked(&req.site).await? {
        return Err(ApiError::new(
            ApiCode::FailedPrecondition,
            format!(
                "site {} is revoked and enrolls no agent: create a token for a new site id",
                req.site
            ),
        ));
    }
    if !(1..=1000).contains(&req.uses) {
        return Err(ApiError::invalid("uses must be between 1 and 1000"));
    }
    if !(60..=365 * 86_400).contains(&req.ttl_seconds) {
        return Err(ApiError::invalid(
            "ttl_seconds must be between 60 and 31536000",
        ));
    }
    let token = Token::generate(TokenKind::Site)
        .map_err(|_| ApiError::new(ApiCode::Unavailable, "no randomness"))?;
    let expires_at_ms = now_ms() + req.ttl_seconds * 1000;
    state
        .store
        .create_site_token(NewSiteToken {
            id: token.id(),
            site_id: &req.site,
            secret_hash: &token.secret().hash(),
            uses: req.uses,
            expires_at_ms,
            created_by: &actor(p),
        })
        .await?;
    Ok(Json(json!({
        "id": token.id(),
        "token": token.reveal(),
        "site": req.site,
        "uses": req.uses,
        "expires_at_ms": expires_at_ms,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BySite {
    site: Option<String>,
}

async fn list_tokens(
    state: &ApiState,
    p: &Principal,
    req: BySite,
) -> Result<Json<Value>, ApiError> {
    let tokens: Vec<_> = state
        .store
        .list_site_tokens(req.site.as_deref())
        .await?
        .into_iter()
        .filter(|t| {
            allows(
                &p.grants,
                "compute:site-tokens:list",
                &format!("site/{}", t.site_id),
            )
        })
        .collect();
    Ok(Json(json!({ "tokens": tokens })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ById {
    id: String,
}

async fn revoke_token(state: &ApiState, p: &Principal, req: ById) -> Result<Json<Value>, ApiError> {
    let token = state.store.site_token(&req.id).await?.ok_or_else(|| {
        ApiError::new(
            ApiCode::NotFound,
            format!("site token {:?} not found", req.id),
        )
    })?;
    require(
        p,
        "compute:site-tokens:revoke",
        &format!("site/{}", token.site_id),
    )?;
    state.store.revoke_site_token(&req.id, &actor(p)).await?;
    Ok(Json(json!({"id": req.id, "revoked": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BySiteId {
    site: String,
}

/// Revokes a site: every agent of it is refused (at the TLS handshake once the gateways' revocation sets are
/// refreshed, and by the site services at once), its unspent tokens are revoked and its boot lease released.
async fn revoke_site(
    state: &ApiState,
    p: &Principal,
    req: BySiteId,
) -> Result<Json<Value>, ApiError> {
    check_site_id(&req.site)?;
    require(p, "compute:sites:revoke", &format!("site/{}", req.site))?;
    let done = state
        .store
        .revoke_site(&req.site, &actor(p))
        .await?
        .ok_or_else(|| {
            ApiError::new(
                ApiCode::NotFound,
                format!(
                    "site {:?} not found: sites are created by `site-tokens create`",
                    req.site
                ),
            )
        })?;
    // This process's gateway refuses the site's agents from their next handshake; gateways in other processes read
    // the revocation on their own interval.
    if let Some(sessions) = &state.sessions
        && let Ok(id) = bc_proto::spiffe::SpiffeId::new(
            state.ca.trust_domain(),
            bc_proto::spiffe::Role::Site,
            &req.site,
        )
    {
        sessions.revoke([id]);
    }
    Ok(Json(json!({
        "site": req.site,
        "revoked": true,
        "already_revoked": !done.newly,
        "tokens_revoked": done.tokens_revoked,
        "lease_released": done.lease_released,
    })))
}

/// A MAC in canonical form (lowercase, colons), or an INVALID_ARGUMENT naming the expected form.
fn canonical_mac(mac: &str) -> Result<String, ApiError> {
    let hex: String = mac
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() != 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::invalid(format!(
            "mac {mac:?} is not a MAC address: use aa:bb:cc:dd:ee:ff"
        )));
    }
    let parts: Vec<&str> = (0..6).map(|i| &hex[i * 2..i * 2 + 2]).collect();
    Ok(parts.join(":"))
}

fn check_boot(boot: &Option<BootSpec>) -> Result<Option<Value>, ApiError> {
    let Some(b) = boot else { return Ok(None) };
    if b.kernel.trim().is_empty() {
        return Err(ApiError::invalid(
            "boot.kernel is empty: give an http(s) URL or a path under the site's artifact cache",
        ));
    }
    for (field, v) in [
        ("boot.kernel", b.kernel.as_str()),
        ("boot.initrd", b.initrd.as_deref().unwrap_or("")),
        ("boot.cmdline", b.cmdline.as_str()),
    ] {
        if v.len() > 2048 || v.chars().any(char::is_control) {
            return Err(ApiError::invalid(format!(
                "{field} must be at most 2048 bytes without control characters"
            )));
        }
    }
    serde_json::to_value(b)
        .map(Some)
        .map_err(|e| ApiError::invalid(format!("boot: {e}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateMachine {
    mac: String,
    site: String,
    #[serde(default)]
    boot: Option<BootSpec>,
}

async fn create_machine(
    state: &ApiState,
    p: &Principal,
    req: CreateMachine,
) -> Result<Json<Value>, ApiError> {
    check_site_id(&req.site)?;
    require(p, "compute:machines:create", &format!("site/{}", req.site))?;
    let mac = canonical_mac(&req.mac)?;
    if let Some(existing) = state.store.machine(&mac).await? {
        return Err(ApiError::new(
            ApiCode::Conflict,
            if existing.site_id == req.site {
                format!(
                    "machine {mac} already exists in site {}; change its boot with machines.set-boot",
                    req.site
                )
            } else {
                format!(
                    "machine {mac} belongs to site {}; change its boot with machines.set-boot, or remove it there first",
                    existing.site_id
                )
            },
        ));
    }
    let boot = check_boot(&req.boot)?;
    if let Some(b) = &req.boot {
        crate::artifacts::check_references(state, b).await?;
    }
    let row = MachineRow {
        mac,
        site_id: req.site,
        boot,
    };
    state.store.create_machine(&row, &actor(p)).await?;
    Ok(Json(json!({ "machine": row })))
}

async fn list_machines(
    state: &ApiState,
    p: &Principal,
    req: BySite,
) -> Result<Json<Value>, ApiError> {
    let machines: Vec<_> = state
        .store
        .list_machines(req.site.as_deref())
        .await?
        .into_iter()
        .filter(|m| {
            allows(
                &p.grants,
                "compute:machines:list",
                &format!("site/{}", m.site_id),
            )
        })
        .collect();
    Ok(Json(json!({ "machines": machines })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetBoot {
    mac: String,
    /// null: the machine must not netboot.
    boot: Option<BootSpec>,
}

async fn set_boot(state: &ApiState, p: &Principal, req: SetBoot) -> Result<Json<Value>, ApiError> {
    let mac = canonical_mac(&req.mac)?;
    let site = state
        .store
        .machine(&mac)
        .await?
        .map(|m| m.site_id)
        .ok_or_else(|| {
            ApiError::new(
                ApiCode::NotFound,
                format!("machine {mac} not found: create it with machines.create"),
            )
        })?;
    require(p, "compute:machines:set-boot", &format!("site/{site}"))?;
    let boot = check_boot(&req.boot)?;
    if let Some(b) = &req.boot {
        crate::artifacts::check_references(state, b).await?;
    }
    state
        .store
        .set_machine_boot(&mac, boot.as_ref(), &actor(p))
        .await?;
    Ok(Json(json!({"mac": mac, "site": site, "boot": boot})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutSecret {
    site: String,
    name: String,
    value: String,
}

async fn put_secret(
    state: &ApiState,
    p: &Principal,
    req: PutSecret,
) -> Result<Json<Value>, ApiError> {
    check_site_id(&req.site)?;
    require(p, "compute:secrets:put", &format!("site/{}", req.site))?;
    let sealed = state
        .secrets
        .seal(&req.site, &req.name, req.value.as_bytes())
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    state
        .store
        .put_secret(&req.site, &req.name, &sealed, &actor(p))
        .await?;
    Ok(Json(
        json!({"site": req.site, "name": req.name, "stored": true}),
    ))
}
