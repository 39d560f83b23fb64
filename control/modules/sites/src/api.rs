//! API groups of sites: `sites.revoke`, `site-tokens.create|list|revoke`, `machines.create|list|set-boot`,
//! `secrets.put`, `artifacts.list` (the lists and deletions of sites, secrets, machines and artifacts are in
//! [`crate::catalog`]). Each permission is `compute:<group>:<verb>` on scope `site/<id>` (artifacts:
//! `artifacts`). Where the request names the site, the kernel checks the grant before the handler runs; where a row
//! does (a token's or a machine's site), the handler reads it and asks [`Cx::authorize`].

use crate::Sites;
use bc_core::api::sites::{
    BootSpec, BySite, CreateMachineRequest, CreateMachineResponse, CreateSiteTokenRequest,
    CreateSiteTokenResponse, ListArtifactsRequest, ListArtifactsResponse, ListMachinesResponse,
    ListSiteTokensResponse, Machine, PutSecretRequest, PutSecretResponse, RevokeSiteRequest,
    RevokeSiteResponse, RevokeSiteTokenRequest, RevokeSiteTokenResponse, SetMachineBootRequest,
    SetMachineBootResponse, SiteToken,
};
use bc_core::ids::MachineId;
use bc_kernel::{ApiCode, ApiError, Cx, Method, Module, Scope};
use bc_proto::token::{Token, TokenKind};
use bc_store::sites::{MachineRow, NewSiteToken, SiteTokenRow};

/// The method types of the sites module, for its handlers and for clients (`client.method::<RevokeSite>(..)`).
pub mod methods {
    use bc_core::api::sites::*;

    bc_kernel::api_method!(
        /// `sites.revoke`.
        pub RevokeSite = "sites" / "revoke": RevokeSiteRequest => RevokeSiteResponse
    );
    bc_kernel::api_method!(
        /// `site-tokens.create`.
        pub CreateSiteToken = "site-tokens" / "create": CreateSiteTokenRequest => CreateSiteTokenResponse
    );
    bc_kernel::api_method!(
        /// `site-tokens.list`.
        pub ListSiteTokens = "site-tokens" / "list": BySite => ListSiteTokensResponse
    );
    bc_kernel::api_method!(
        /// `site-tokens.revoke`.
        pub RevokeSiteToken = "site-tokens" / "revoke": RevokeSiteTokenRequest => RevokeSiteTokenResponse
    );
    bc_kernel::api_method!(
        /// `machines.create`.
        pub CreateMachine = "machines" / "create": CreateMachineRequest => CreateMachineResponse
    );
    bc_kernel::api_method!(
        /// `machines.list`.
        pub ListMachines = "machines" / "list": BySite => ListMachinesResponse
    );
    bc_kernel::api_method!(
        /// `machines.set-boot`.
        pub SetMachineBoot = "machines" / "set-boot": SetMachineBootRequest => SetMachineBootResponse
    );
    bc_kernel::api_method!(
        /// `secrets.put`.
        pub PutSecret = "secrets" / "put": PutSecretRequest => PutSecretResponse
    );
    bc_kernel::api_method!(
        /// `artifacts.list`.
        pub ListArtifacts = "artifacts" / "list": ListArtifactsRequest => ListArtifactsResponse
    );

    pub use crate::catalog::methods::*;
}

use methods::*;

/// The scope a request naming one site acts on.
fn site_scope(site: &bc_core::ids::SiteId) -> String {
    format!("site/{site}")
}

pub(crate) fn register(module: Module) -> Module {
    module
        .method(
            Method::<RevokeSite>::new()
                .permission("compute:sites:revoke")
                .scope_from_request("site/<site>", |r| site_scope(&r.site))
                .handler(revoke_site),
        )
        .method(
            Method::<CreateSiteToken>::new()
                .permission("compute:site-tokens:create")
                .scope_from_request("site/<site>", |r| site_scope(&r.site))
                .handler(create_token),
        )
        .method(
            Method::<ListSiteTokens>::new()
                .permission("compute:site-tokens:list")
                .scope(Scope::filtered("site/<site>"))
                .handler(list_tokens),
        )
        .method(
            Method::<RevokeSiteToken>::new()
                .permission("compute:site-tokens:revoke")
                .scope(Scope::resource("site/<site>"))
                .handler(revoke_token),
        )
        .method(
            Method::<CreateMachine>::new()
                .permission("compute:machines:create")
                .scope_from_request("site/<site>", |r| site_scope(&r.site))
                .handler(create_machine),
        )
        .method(
            Method::<ListMachines>::new()
                .permission("compute:machines:list")
                .scope(Scope::filtered("site/<site>"))
                .handler(list_machines),
        )
        .method(
            Method::<SetMachineBoot>::new()
                .permission("compute:machines:set-boot")
                .scope(Scope::resource("site/<site>"))
                .handler(set_boot),
        )
        .method(
            Method::<PutSecret>::new()
                .permission("compute:secrets:put")
                .scope_from_request("site/<site>", |r| site_scope(&r.site))
                .handler(put_secret),
        )
        .method(
            Method::<ListArtifacts>::new()
                .permission("compute:artifacts:list")
                .scope(Scope::fixed("artifacts"))
                .handler(list_artifacts),
        )
}

/// Every method of the module: these and [`crate::catalog`]'s.
pub(crate) fn register_all(module: Module) -> Module {
    crate::catalog::register(register(module))
}

fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

fn token_of(t: SiteTokenRow) -> SiteToken {
    SiteToken {
        id: t.id,
        site_id: t.site_id,
        uses_total: t.uses_total,
        uses_left: t.uses_left,
        expires_at_ms: t.expires_at_ms,
        revoked: t.revoked,
        created_by: t.created_by,
        created_at_ms: t.created_at_ms,
    }
}

fn machine_of(m: MachineRow) -> Machine {
    Machine {
        mac: m.mac,
        site_id: m.site_id,
        boot: m.boot,
    }
}

async fn create_token(
    cx: Cx,
    req: CreateSiteTokenRequest,
) -> Result<CreateSiteTokenResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    if state.store.site_revoked(req.site.as_str()).await? {
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
            site_id: req.site.as_str(),
            secret_hash: &token.secret().hash(),
            uses: req.uses,
            expires_at_ms,
            created_by: &cx.caller().actor(),
        })
        .await?;
    Ok(CreateSiteTokenResponse {
        id: token.id().to_string(),
        token: token.reveal(),
        site: req.site,
        uses: req.uses,
        expires_at_ms,
    })
}

async fn list_tokens(cx: Cx, req: BySite) -> Result<ListSiteTokensResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let tokens = state
        .store
        .list_site_tokens(req.site.as_ref().map(|s| s.as_str()))
        .await?
        .into_iter()
        .filter(|t| cx.allows(&site_scope(&t.site_id)))
        .map(token_of)
        .collect();
    Ok(ListSiteTokensResponse { tokens })
}

async fn revoke_token(
    cx: Cx,
    req: RevokeSiteTokenRequest,
) -> Result<RevokeSiteTokenResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let token = state.store.site_token(&req.id).await?.ok_or_else(|| {
        ApiError::new(
            ApiCode::NotFound,
            format!("site token {:?} not found", req.id),
        )
    })?;
    cx.authorize(&site_scope(&token.site_id))?;
    state
        .store
        .revoke_site_token(&req.id, &cx.caller().actor())
        .await?;
    Ok(RevokeSiteTokenResponse {
        id: req.id,
        revoked: true,
    })
}

/// Revokes a site: every agent of it is refused (at the TLS handshake once the gateways' revocation sets are
/// refreshed, and by the site services at once), its unspent tokens are revoked and its boot lease released.
async fn revoke_site(cx: Cx, req: RevokeSiteRequest) -> Result<RevokeSiteResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let done = state
        .store
        .revoke_site(req.site.as_str(), &cx.caller().actor())
        .await?
        .ok_or_else(|| {
            ApiError::new(
                ApiCode::NotFound,
                format!(
                    "site {:?} not found: sites are created by `site-tokens create`",
                    req.site.as_str()
                ),
            )
        })?;
    // This process's gateway refuses the site's agents from their next handshake; gateways in other processes read
    // the revocation on their own interval.
    if let Some(sessions) = &state.sessions
        && let Ok(id) = bc_proto::spiffe::SpiffeId::new(
            state.ca.trust_domain(),
            bc_proto::spiffe::Role::Site,
            req.site.as_str(),
        )
    {
        sessions.revoke([id]);
    }
    Ok(RevokeSiteResponse {
        site: req.site,
        revoked: true,
        already_revoked: !done.newly,
        tokens_revoked: done.tokens_revoked,
        lease_released: done.lease_released,
    })
}

/// A MAC in canonical form (lowercase, colons), or an INVALID_ARGUMENT naming the expected form.
pub(crate) fn canonical_mac(mac: &str) -> Result<MachineId, ApiError> {
    let hex: String = mac
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect::<String>()
        .to_ascii_lowercase();
    let bad = || {
        ApiError::invalid(format!(
            "mac {mac:?} is not a MAC address: use aa:bb:cc:dd:ee:ff"
        ))
    };
    if hex.len() != 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let parts: Vec<&str> = (0..6).map(|i| &hex[i * 2..i * 2 + 2]).collect();
    MachineId::new(parts.join(":")).map_err(|_| bad())
}

fn check_boot(boot: &Option<BootSpec>) -> Result<(), ApiError> {
    let Some(b) = boot else { return Ok(()) };
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
    Ok(())
}

async fn create_machine(
    cx: Cx,
    req: CreateMachineRequest,
) -> Result<CreateMachineResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let mac = canonical_mac(&req.mac)?;
    if let Some(existing) = state.store.machine(mac.as_str()).await? {
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
    check_boot(&req.boot)?;
    if let Some(b) = &req.boot {
        crate::artifacts::check_references(&state.store, b).await?;
    }
    let row = MachineRow {
        mac,
        site_id: req.site,
        boot: req.boot,
    };
    state
        .store
        .create_machine(&row, &cx.caller().actor())
        .await?;
    Ok(CreateMachineResponse {
        machine: machine_of(row),
    })
}

async fn list_machines(cx: Cx, req: BySite) -> Result<ListMachinesResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let machines = state
        .store
        .list_machines(req.site.as_ref().map(|s| s.as_str()))
        .await?
        .into_iter()
        .filter(|m| cx.allows(&site_scope(&m.site_id)))
        .map(machine_of)
        .collect();
    Ok(ListMachinesResponse { machines })
}

async fn set_boot(cx: Cx, req: SetMachineBootRequest) -> Result<SetMachineBootResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let mac = canonical_mac(&req.mac)?;
    let site = state
        .store
        .machine(mac.as_str())
        .await?
        .map(|m| m.site_id)
        .ok_or_else(|| {
            ApiError::new(
                ApiCode::NotFound,
                format!("machine {mac} not found: create it with machines.create"),
            )
        })?;
    cx.authorize(&site_scope(&site))?;
    check_boot(&req.boot)?;
    if let Some(b) = &req.boot {
        crate::artifacts::check_references(&state.store, b).await?;
    }
    state
        .store
        .set_machine_boot(mac.as_str(), req.boot.as_ref(), &cx.caller().actor())
        .await?;
    Ok(SetMachineBootResponse {
        mac,
        site,
        boot: req.boot,
    })
}

async fn put_secret(cx: Cx, req: PutSecretRequest) -> Result<PutSecretResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let sealed = state
        .secrets
        .seal(req.site.as_str(), &req.name, req.value.as_bytes())
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    state
        .store
        .put_secret(req.site.as_str(), &req.name, &sealed, &cx.caller().actor())
        .await?;
    Ok(PutSecretResponse {
        site: req.site,
        name: req.name,
        stored: true,
    })
}

async fn list_artifacts(
    cx: Cx,
    _: ListArtifactsRequest,
) -> Result<ListArtifactsResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let artifacts = state
        .store
        .list_artifacts()
        .await?
        .into_iter()
        .map(crate::artifacts::artifact_of)
        .collect();
    Ok(ListArtifactsResponse { artifacts })
}
