//! The site-facing services: SiteService (boot lease, netboot table, artifacts) and SecretService. Only site identities are
//! accepted here (the node Session refuses them, see [`crate::session::node_identity`]). The agent is named by the
//! hash of the key its verified certificate certifies, never by anything it sends, so two agents of one site are
//! told apart and neither can speak for the other. The gateway only forwards: the boot lease lives in the store,
//! and secrets come back from the control plane already encrypted to the agent's per-request key.

use crate::{BoxFuture, STORE_DEADLINE, stored};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::v1;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
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

/// A [`SiteHandler`] whose every call is answered within [`STORE_DEADLINE`], and every chunk of an artifact
/// within as long of waiting for it: the gateway serves site agents through it. A site agent's own timeout ends
/// most calls sooner; this one holds for an agent that keeps its call open (an older agent, a stuck one), so a
/// store gone silent never holds the gateway's tasks or connections for ever. Past it the agent gets UNAVAILABLE
/// naming the call, and retries.
pub(crate) struct Bounded(pub Arc<dyn SiteHandler>);

impl SiteHandler for Bounded {
    fn boot_lease(
        &self,
        agent: &SiteAgent,
        request: v1::BootLeaseRequest,
    ) -> BoxFuture<'_, Result<v1::BootLeaseResponse, Status>> {
        Box::pin(stored("the boot lease", self.0.boot_lease(agent, request)))
    }
    fn netboot(&self, agent: &SiteAgent) -> BoxFuture<'_, Result<v1::NetbootResponse, Status>> {
        Box::pin(stored("reading the netboot table", self.0.netboot(agent)))
    }
    fn renew(
        &self,
        agent: &SiteAgent,
        request: v1::RenewRequest,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>> {
        Box::pin(stored(
            "renewing the certificate",
            self.0.renew(agent, request),
        ))
    }
    fn secret(
        &self,
        agent: &SiteAgent,
        request: v1::SecretRequestMessage,
    ) -> BoxFuture<'_, Result<v1::SecretResponse, Status>> {
        Box::pin(stored("reading a secret", self.0.secret(agent, request)))
    }
    fn artifact(
        &self,
        agent: &SiteAgent,
        request: v1::ArtifactRequest,
    ) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        let opened = self.0.artifact(agent, request);
        Box::pin(async move {
            stored("opening an artifact", opened)
                .await
                .map(chunks_within)
        })
    }
    fn bmc_commands(
        &self,
        agent: &SiteAgent,
        request: v1::BmcCommandsRequest,
    ) -> BoxFuture<'_, Result<v1::BmcCommandsResponse, Status>> {
        Box::pin(stored(
            "reading the BMC commands",
            self.0.bmc_commands(agent, request),
        ))
    }
    fn bmc_result(
        &self,
        agent: &SiteAgent,
        request: v1::BmcResultRequest,
    ) -> BoxFuture<'_, Result<v1::BmcResultResponse, Status>> {
        Box::pin(stored(
            "storing a BMC result",
            self.0.bmc_result(agent, request),
        ))
    }
    fn report(
        &self,
        agent: &SiteAgent,
        request: v1::SiteReport,
    ) -> BoxFuture<'_, Result<v1::SiteReportResponse, Status>> {
        Box::pin(stored(
            "storing the site report",
            self.0.report(agent, request),
        ))
    }
    fn stored_artifact(&self, sha256: &str) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        let opened = self.0.stored_artifact(sha256);
        Box::pin(async move {
            stored("opening an artifact", opened)
                .await
                .map(chunks_within)
        })
    }
}

/// `chunks` with each chunk due within [`STORE_DEADLINE`] of the stream's first finding it not ready; past it one
/// UNAVAILABLE and the end. The clock starts when the stream is waited on, so an agent that reads slowly (and so
/// leaves the stream unpolled) is never cut off.
fn chunks_within(chunks: ArtifactStream) -> ArtifactStream {
    Box::pin(ChunksWithin {
        chunks,
        due: Box::pin(tokio::time::sleep(STORE_DEADLINE)),
        waiting: false,
        ended: false,
    })
}

struct ChunksWithin {
    chunks: ArtifactStream,
    due: Pin<Box<tokio::time::Sleep>>,
    /// The last poll found no chunk ready, and `due` runs from then.
    waiting: bool,
    ended: bool,
}

impl tokio_stream::Stream for ChunksWithin {
    type Item = Result<v1::ArtifactChunk, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Poll::Ready(item) = self.chunks.as_mut().poll_next(cx) {
            self.waiting = false;
            self.ended = item.is_none();
            return Poll::Ready(item);
        }
        if !self.waiting {
            self.waiting = true;
            let at = tokio::time::Instant::now() + STORE_DEADLINE;
            self.due.as_mut().reset(at);
        }
        match self.due.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.ended = true;
                Poll::Ready(Some(Err(Status::unavailable(format!(
                    "the artifact's next chunk did not come within {} s: fetch it again",
                    STORE_DEADLINE.as_secs()
                )))))
            }
            Poll::Pending => Poll::Pending,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    /// A store that never answers: every call waits for ever, and an artifact opens and never sends a chunk.
    struct Silent;

    fn never<T: Send + 'static>() -> BoxFuture<'static, Result<T, Status>> {
        Box::pin(std::future::pending())
    }

    impl SiteHandler for Silent {
        fn boot_lease(
            &self,
            _: &SiteAgent,
            _: v1::BootLeaseRequest,
        ) -> BoxFuture<'_, Result<v1::BootLeaseResponse, Status>> {
            never()
        }
        fn netboot(&self, _: &SiteAgent) -> BoxFuture<'_, Result<v1::NetbootResponse, Status>> {
            never()
        }
        fn renew(
            &self,
            _: &SiteAgent,
            _: v1::RenewRequest,
        ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>> {
            never()
        }
        fn secret(
            &self,
            _: &SiteAgent,
            _: v1::SecretRequestMessage,
        ) -> BoxFuture<'_, Result<v1::SecretResponse, Status>> {
            never()
        }
        fn artifact(
            &self,
            _: &SiteAgent,
            r: v1::ArtifactRequest,
        ) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
            if r.sha256 == "opens" {
                let s: ArtifactStream = Box::pin(tokio_stream::pending());
                return Box::pin(async move { Ok(s) });
            }
            never()
        }
        fn bmc_commands(
            &self,
            _: &SiteAgent,
            _: v1::BmcCommandsRequest,
        ) -> BoxFuture<'_, Result<v1::BmcCommandsResponse, Status>> {
            never()
        }
        fn bmc_result(
            &self,
            _: &SiteAgent,
            _: v1::BmcResultRequest,
        ) -> BoxFuture<'_, Result<v1::BmcResultResponse, Status>> {
            never()
        }
        fn report(
            &self,
            _: &SiteAgent,
            _: v1::SiteReport,
        ) -> BoxFuture<'_, Result<v1::SiteReportResponse, Status>> {
            never()
        }
        fn stored_artifact(&self, _: &str) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
            never()
        }
    }

    /// `call` ends within twice the deadline (a regression fails here rather than hanging), with UNAVAILABLE.
    async fn unavailable<T: std::fmt::Debug>(
        what: &str,
        call: impl std::future::Future<Output = Result<T, Status>>,
    ) {
        let r = tokio::time::timeout(STORE_DEADLINE * 2, call)
            .await
            .unwrap_or_else(|_| panic!("{what}: still waiting after twice the deadline"));
        let e = r.expect_err(what);
        assert_eq!(e.code(), tonic::Code::Unavailable, "{what}: {e:?}");
        assert!(
            e.message().contains("did not answer within 30 s")
                || e.message().contains("did not come within 30 s"),
            "{what}: {}",
            e.message()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn every_site_call_on_a_silent_store_is_answered_at_the_deadline() {
        let h = Bounded(Arc::new(Silent));
        let a = SiteAgent {
            site_id: "s1".into(),
            agent_id: "a1".into(),
            public_point: vec![4; 65],
        };
        let t = tokio::time::Instant::now();
        unavailable("boot_lease", h.boot_lease(&a, Default::default())).await;
        unavailable("netboot", h.netboot(&a)).await;
        unavailable("renew", h.renew(&a, Default::default())).await;
        unavailable("secret", h.secret(&a, Default::default())).await;
        unavailable("artifact", async {
            h.artifact(&a, Default::default()).await.map(|_| ())
        })
        .await;
        unavailable("bmc_commands", h.bmc_commands(&a, Default::default())).await;
        unavailable("bmc_result", h.bmc_result(&a, Default::default())).await;
        unavailable("report", h.report(&a, Default::default())).await;
        unavailable("stored_artifact", async {
            h.stored_artifact("ab").await.map(|_| ())
        })
        .await;
        assert_eq!(t.elapsed(), STORE_DEADLINE * 9);

        // An artifact that opens and then sends nothing: one UNAVAILABLE at the deadline, then the end.
        let req = v1::ArtifactRequest {
            sha256: "opens".into(),
        };
        let mut chunks = h.artifact(&a, req).await.expect("opens");
        let t = tokio::time::Instant::now();
        unavailable("the first chunk", async {
            chunks.next().await.expect("an item")
        })
        .await;
        assert_eq!(t.elapsed(), STORE_DEADLINE);
        assert!(chunks.next().await.is_none(), "the stream ends after it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_pauses_is_not_cut_off() {
        // Two chunks with the second 20 s after the first; the reader waits 40 s before it asks for the second.
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let mut chunks = chunks_within(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)));
        tx.send(Ok(v1::ArtifactChunk::default()))
            .await
            .expect("the stream holds it");
        assert!(chunks.next().await.expect("first").is_ok());
        tokio::time::sleep(Duration::from_secs(40)).await;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            let _ = tx.send(Ok(v1::ArtifactChunk::default())).await;
        });
        assert!(chunks.next().await.expect("second").is_ok());
        assert!(chunks.next().await.is_none(), "the sender is gone");
    }
}
