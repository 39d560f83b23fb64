//! The site-facing services: SiteService (boot lease, netboot table, artifacts) and SecretService. Only site identities are
//! accepted here (the node Session refuses them, see [`crate::session::node_identity`]). The agent is named by the
//! hash of the key its verified certificate certifies, never by anything it sends, so two agents of one site are
//! told apart and neither can speak for the other. The gateway only forwards: the boot lease lives in the store,
//! and secrets come back from the control plane already encrypted to the agent's per-request key.

use crate::BoxFuture;
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::v1;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// A verified site agent: its site and its agent id (first 16 hex characters of the SHA-256 of the key's public
/// point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteAgent {
    pub site_id: String,
    pub agent_id: String,
    /// The public point (uncompressed P-256) the agent's certificate certifies and the handshake proved.
    pub public_point: Vec<u8>,
}

/// What the control plane does for site agents.
pub trait SiteHandler: Send + Sync + 'static {
    fn boot_lease(
        &self,
        agent: &SiteAgent,
        request: v1::BootLeaseRequest,
    ) -> BoxFuture<'_, Result<v1::BootLeaseResponse, Status>>;
    fn netboot(&self, agent: &SiteAgent) -> BoxFuture<'_, Result<v1::NetbootResponse, Status>>;
    /// Renewal by proof of possession: the CSR must be signed by `agent.public_point`'s key.
    fn renew(
        &self,
        agent: &SiteAgent,
        request: v1::RenewRequest,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>>;
    fn secret(
        &self,
        agent: &SiteAgent,
        request: v1::SecretRequestMessage,
    ) -> BoxFuture<'_, Result<v1::SecretResponse, Status>>;
    /// An artifact the agent's site references, as a stream of chunks (relayed as is: the agent verifies it).
    fn artifact(
        &self,
        agent: &SiteAgent,
        request: v1::ArtifactRequest,
    ) -> BoxFuture<'_, Result<ArtifactStream, Status>>;
    /// The metal flow's open BMC commands for the agent's site (a composition without the metal module answers
    /// UNIMPLEMENTED).
    fn bmc_commands(
        &self,
        _agent: &SiteAgent,
        _request: v1::BmcCommandsRequest,
    ) -> BoxFuture<'_, Result<v1::BmcCommandsResponse, Status>> {
        Box::pin(async { Err(Status::unimplemented(NO_METAL)) })
    }
    /// A BMC command's signed result.
    fn bmc_result(
        &self,
        _agent: &SiteAgent,
        _request: v1::BmcResultRequest,
    ) -> BoxFuture<'_, Result<v1::BmcResultResponse, Status>> {
        Box::pin(async { Err(Status::unimplemented(NO_METAL)) })
    }
    /// What the agent saw on its boot segment (DHCP sightings) and its boot HTTP URL: the metal flow's.
    fn report(
        &self,
        _agent: &SiteAgent,
        _request: v1::SiteReport,
    ) -> BoxFuture<'_, Result<v1::SiteReportResponse, Status>> {
        Box::pin(async { Err(Status::unimplemented(NO_METAL)) })
    }
    /// A stored artifact by digest without [`SiteHandler::artifact`]'s check that a boot entry of the agent's site
    /// names it: for a wrapper that made its own check (the metal flow's deploy images). NOT_FOUND by default.
    fn stored_artifact(&self, sha256: &str) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        let msg = format!("artifact {sha256} is not served here");
        Box::pin(async move { Err(Status::not_found(msg)) })
    }
}

/// The longest a `Netboot` call waits for the table to change.
pub const NETBOOT_MAX_WAIT: Duration = Duration::from_secs(25);
/// How often a waiting `Netboot` call reads the table again: a change reaches the agent within this.
const NETBOOT_POLL: Duration = Duration::from_millis(500);

/// The table in a canonical order (machines by MAC, artifacts by digest), with its version: the first 16 hex
/// characters of the SHA-256 of that encoding.
pub fn versioned(mut table: v1::NetbootResponse) -> v1::NetbootResponse {
    table.machines.sort_by(|a, b| a.mac.cmp(&b.mac));
    table.prefetch.sort_by(|a, b| a.sha256.cmp(&b.sha256));
    table.prefetch.dedup_by(|a, b| a.sha256 == b.sha256);
    table.version = String::new();
    let digest = bc_proto::sha256(&prost::Message::encode_to_vec(&table));
    table.version = hex::encode(&digest[..8]);
    table
}

const NO_METAL: &str = "this control plane runs without the metal module: it sends no BMC work";

/// The chunks of one artifact.
pub type ArtifactStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<v1::ArtifactChunk, Status>> + Send + 'static>,
>;

/// The site identity of a verified peer certificate, or why it is not one.
pub fn site_identity(
    certs: Option<&[rustls::pki_types::CertificateDer<'static>]>,
    trust_domain: &str,
) -> Result<SiteAgent, Status> {
    let leaf = certs.and_then(|c| c.first()).ok_or_else(|| {
        Status::unauthenticated(
            "site services need a site certificate: run `bcd site enroll` first",
        )
    })?;
    let id = SpiffeId::from_cert_der(leaf)
        .map_err(|e| Status::unauthenticated(format!("client certificate: {e}")))?;
    if id.trust_domain() != trust_domain {
        return Err(Status::permission_denied(format!(
            "{id} is not of trust domain {trust_domain}"
        )));
    }
    if id.role() != Role::Site {
        return Err(Status::permission_denied(format!(
            "{id} is a {} identity; the site services take site identities only",
            id.role().as_str()
        )));
    }
    let point = bc_proto::envelope::cert_public_point(leaf)
        .map_err(|e| Status::unauthenticated(format!("client certificate key: {e}")))?;
    Ok(SiteAgent {
        site_id: id.id().to_string(),
        agent_id: agent_id_of(&point),
        public_point: point,
    })
}

/// The agent id of a key's public point.
pub fn agent_id_of(public_point: &[u8]) -> String {
    hex::encode(&bc_proto::sha256(public_point)[..8])
}

pub(crate) struct SiteSvc {
    pub handler: Arc<dyn SiteHandler>,
    pub trust_domain: String,
}

impl SiteSvc {
    fn agent<T>(&self, request: &Request<T>) -> Result<SiteAgent, Status> {
        let certs = request.peer_certs();
        site_identity(certs.as_deref().map(|v| v.as_slice()), &self.trust_domain).inspect_err(
            |s| {
                tracing::warn!(peer = ?request.remote_addr(), reason = s.message(), "site call refused");
            },
        )
    }
}

#[tonic::async_trait]
impl v1::site_service_server::SiteService for SiteSvc {
    async fn boot_lease(
        &self,
        request: Request<v1::BootLeaseRequest>,
    ) -> Result<Response<v1::BootLeaseResponse>, Status> {
        let agent = self.agent(&request)?;
        let r = self
            .handler
            .boot_lease(&agent, request.into_inner())
            .await?;
        Ok(Response::new(r))
    }

    async fn netboot(
        &self,
        request: Request<v1::NetbootRequest>,
    ) -> Result<Response<v1::NetbootResponse>, Status> {
        let agent = self.agent(&request)?;
        let req = request.into_inner();
        let wait = Duration::from_millis(u64::from(req.wait_ms)).min(NETBOOT_MAX_WAIT);
        let until = tokio::time::Instant::now() + wait;
        loop {
            let table = versioned(self.handler.netboot(&agent).await?);
            let now = tokio::time::Instant::now();
            if table.version != req.known_version || now >= until {
                return Ok(Response::new(table));
            }
            tokio::time::sleep(NETBOOT_POLL.min(until - now)).await;
        }
    }

    async fn renew(
        &self,
        request: Request<v1::RenewRequest>,
    ) -> Result<Response<v1::RenewResponse>, Status> {
        let agent = self.agent(&request)?;
        let r = self.handler.renew(&agent, request.into_inner()).await?;
        Ok(Response::new(r))
    }

    async fn artifact(
        &self,
        request: Request<v1::ArtifactRequest>,
    ) -> Result<Response<ArtifactStream>, Status> {
        let agent = self.agent(&request)?;
        let r = self.handler.artifact(&agent, request.into_inner()).await?;
        Ok(Response::new(r))
    }

    async fn bmc_commands(
        &self,
        request: Request<v1::BmcCommandsRequest>,
    ) -> Result<Response<v1::BmcCommandsResponse>, Status> {
        let agent = self.agent(&request)?;
        let r = self
            .handler
            .bmc_commands(&agent, request.into_inner())
            .await?;
        Ok(Response::new(r))
    }

    async fn bmc_result(
        &self,
        request: Request<v1::BmcResultRequest>,
    ) -> Result<Response<v1::BmcResultResponse>, Status> {
        let agent = self.agent(&request)?;
        let r = self
            .handler
            .bmc_result(&agent, request.into_inner())
            .await?;
        Ok(Response::new(r))
    }

    async fn report(
        &self,
        request: Request<v1::SiteReport>,
    ) -> Result<Response<v1::SiteReportResponse>, Status> {
        let agent = self.agent(&request)?;
        let r = self.handler.report(&agent, request.into_inner()).await?;
        Ok(Response::new(r))
    }
}

#[tonic::async_trait]
impl v1::secret_service_server::SecretService for SiteSvc {
    async fn secret_request(
        &self,
        request: Request<v1::SecretRequestMessage>,
    ) -> Result<Response<v1::SecretResponse>, Status> {
        let agent = self.agent(&request)?;
        let r = self.handler.secret(&agent, request.into_inner()).await?;
        Ok(Response::new(r))
    }
}
