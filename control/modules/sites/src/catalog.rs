//! The sites module's listings and deletions: `sites.list`, `secrets.list|delete` (names and metadata, never a
//! value), `machines.delete` and `artifacts.delete`. A deletion that would leave a reference dangling is refused
//! with FAILED_PRECONDITION naming the referrers (an artifact a machine boots, a secret a metal machine's BMC uses,
//! a machine the metal flow holds), so the operator knows what to change first.

use crate::Sites;
use bc_core::api::sites::*;
use bc_kernel::{ApiCode, ApiError, Cx, Method, Module, Scope};
use bc_store::artifacts::ArtifactDeletion;
use bc_store::secrets::SecretDeletion;
use bc_store::sites::MachineDeletion;

/// The method types (re-exported in [`crate::methods`]).
pub mod methods {
    use bc_core::api::sites::*;

    bc_kernel::api_method!(
        /// `sites.list`.
        pub ListSites = "sites" / "list": ListSitesRequest => ListSitesResponse
    );
    bc_kernel::api_method!(
        /// `secrets.list`.
        pub ListSecrets = "secrets" / "list": BySite => ListSecretsResponse
    );
    bc_kernel::api_method!(
        /// `secrets.delete`.
        pub DeleteSecret = "secrets" / "delete": DeleteSecretRequest => DeleteSecretResponse
    );
    bc_kernel::api_method!(
        /// `machines.delete`.
        pub DeleteMachine = "machines" / "delete": DeleteMachineRequest => DeleteMachineResponse
    );
    bc_kernel::api_method!(
        /// `artifacts.delete`.
        pub DeleteArtifact = "artifacts" / "delete": DeleteArtifactRequest => DeleteArtifactResponse
    );
}

use methods::*;

fn site_scope(site: &impl std::fmt::Display) -> String {
    format!("site/{site}")
}

pub(crate) fn register(module: Module) -> Module {
    module
        .method(
            Method::<ListSites>::new()
                .permission("compute:sites:list")
                .scope(Scope::filtered("site/<site>"))
                .handler(list_sites),
        )
        .method(
            Method::<ListSecrets>::new()
                .permission("compute:secrets:list")
                .scope(Scope::filtered("site/<site>"))
                .handler(list_secrets),
        )
        .method(
            Method::<DeleteSecret>::new()
                .permission("compute:secrets:delete")
                .scope_from_request("site/<site>", |r| site_scope(&r.site))
                .handler(delete_secret),
        )
        .method(
            Method::<DeleteMachine>::new()
                .permission("compute:machines:delete")
                .scope(Scope::resource("site/<site>"))
                .handler(delete_machine),
        )
        .method(
            Method::<DeleteArtifact>::new()
                .permission("compute:artifacts:delete")
                .scope(Scope::fixed("artifacts"))
                .handler(delete_artifact),
        )
}

async fn list_sites(cx: Cx, _: ListSitesRequest) -> Result<ListSitesResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let sites = state
        .store
        .list_sites()
        .await?
        .into_iter()
        .filter(|s| cx.allows(&site_scope(&s.id)))
        .collect();
    Ok(ListSitesResponse { sites })
}

async fn list_secrets(cx: Cx, req: BySite) -> Result<ListSecretsResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let secrets = state
        .store
        .list_secrets(req.site.as_ref().map(|s| s.as_str()))
        .await?
        .into_iter()
        .filter(|s| cx.allows(&site_scope(&s.site_id)))
        .collect();
    Ok(ListSecretsResponse { secrets })
}

async fn delete_secret(cx: Cx, req: DeleteSecretRequest) -> Result<DeleteSecretResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let site = req.site.as_str();
    match state
        .store
        .delete_secret(site, &req.name, &cx.caller().actor())
        .await?
    {
        SecretDeletion::Deleted => Ok(DeleteSecretResponse {
            site: req.site,
            name: req.name,
            deleted: true,
        }),
        SecretDeletion::NotFound => Err(ApiError::not_found(format!(
            "secret {:?} of site {site} not found",
            req.name
        ))),
        SecretDeletion::InUse(users) => Err(ApiError::new(
            ApiCode::FailedPrecondition,
            format!(
                "secret {:?} of site {site} is the BMC credentials of {}: re-enroll those with other \
                 credentials or release them first",
                req.name,
                users.join(", ")
            ),
        )),
    }
}

async fn delete_machine(
    cx: Cx,
    req: DeleteMachineRequest,
) -> Result<DeleteMachineResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let mac = crate::api::canonical_mac(&req.mac)?;
    let machine = state
        .store
        .machine(mac.as_str())
        .await?
        .ok_or_else(|| ApiError::not_found(format!("machine {mac} not found")))?;
    cx.authorize(&site_scope(&machine.site_id))?;
    match state
        .store
        .delete_machine(mac.as_str(), &cx.caller().actor())
        .await?
    {
        MachineDeletion::Deleted { site } => Ok(DeleteMachineResponse {
            mac,
            site,
            deleted: true,
        }),
        MachineDeletion::NotFound => Err(ApiError::not_found(format!("machine {mac} not found"))),
        MachineDeletion::InUse(table) => Err(ApiError::new(
            ApiCode::FailedPrecondition,
            if table == "metal_machines" {
                format!(
                    "machine {mac} is in the metal flow: `better-compute metal release {mac}` (or abort it) \
                     first"
                )
            } else {
                format!("machine {mac} is still named by {table} rows: remove those first")
            },
        )),
    }
}

async fn delete_artifact(
    cx: Cx,
    req: DeleteArtifactRequest,
) -> Result<DeleteArtifactResponse, ApiError> {
    let state = cx.get::<Sites>()?;
    let sha256 = req
        .sha256
        .strip_prefix(crate::artifacts::REF_PREFIX)
        .unwrap_or(&req.sha256)
        .to_ascii_lowercase();
    if !crate::artifacts::is_sha256_hex(&sha256) {
        return Err(ApiError::invalid(format!(
            "{:?} is not an artifact hash: give its 64 hex digits or sha256:<hex> (see `artifacts list`)",
            req.sha256
        )));
    }
    match state
        .store
        .delete_artifact(&sha256, &cx.caller().actor())
        .await?
    {
        ArtifactDeletion::Deleted => {}
        ArtifactDeletion::NotFound => {
            return Err(ApiError::not_found(format!("artifact {sha256} not found")));
        }
        ArtifactDeletion::Referenced(by) => {
            return Err(ApiError::new(
                ApiCode::FailedPrecondition,
                format!(
                    "artifact {sha256} is still referenced by {}: point those at another artifact (`machines \
                     set-boot`) or delete them first",
                    by.join(", ")
                ),
            ));
        }
    }
    // The row is gone: the file follows (a file already gone is fine; one that cannot be removed is logged and
    // left for an operator, the artifact being unlisted either way).
    let path = state.artifacts.path(&sha256);
    match tokio::fs::remove_file(&path).await {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "artifact file not removed"),
    }
    Ok(DeleteArtifactResponse {
        sha256,
        deleted: true,
    })
}
