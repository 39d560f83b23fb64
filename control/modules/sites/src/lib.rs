//! bc-mod-sites: the control plane's sites module. It serves the operators' groups of sites ([`api`]:
//! `sites.revoke`, `site-tokens.create|list|revoke`, `machines.create|list|set-boot`, `secrets.put`,
//! `artifacts.list`, and in [`catalog`] `sites.list`, `secrets.list|delete`, `machines.delete`, `artifacts.delete`;
//! and the streamed `PUT /api/artifacts` of [`artifacts`]) and, for the gateway, the site
//! services ([`gateway`]: site agents' enrollment and renewal, the boot lease, the netboot table, artifacts and the
//! secret broker of [`secrets`]).
//!
//! Its state is a [`Sites`] resource the composition provides (the store, the CA, the secret box, the artifact
//! store and, in a process that runs the gateway role, its session registry). Requests and responses are the typed
//! ones of `bc_core::api::sites`; the kernel checks each grant where the scope is in the request (`site/<site>`),
//! the handlers where it is in a row (a token's or a machine's site). Start with [`module`].

pub mod api;
pub mod artifacts;
pub mod catalog;
pub mod gateway;
pub mod secrets;

use bc_ca::Ca;
use bc_kernel::Module;
use bc_store::Store;
use std::sync::Arc;

pub use api::methods;
pub use artifacts::ArtifactDir;
pub use gateway::{SiteBackend, enroll};
pub use secrets::SecretBox;

/// What the sites module's handlers share (a kernel resource: `builder.resource(Sites { .. })`).
#[derive(Clone)]
pub struct Sites {
    pub store: Store,
    pub ca: Arc<Ca>,
    /// The sessions of this process's gateway role, when it runs one (a revoked site's agents are refused from
    /// their next handshake here at once).
    pub sessions: Option<bc_gateway::session::Registry>,
    /// Seals secrets at rest (`secrets.put`).
    pub secrets: Arc<SecretBox>,
    /// Where artifacts are stored (`PUT /api/artifacts`).
    pub artifacts: ArtifactDir,
}

/// The `sites` module: its methods, the artifact upload route and the gateway's site service.
pub fn module() -> Module {
    let module = Module::new("sites")
        .gateway_service("site")
        .route(artifacts::route());
    api::register_all(module)
}
