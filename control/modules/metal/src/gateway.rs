//! The site side of the BMC commands, served on the gateway's SiteService: [`WithBmc`] wraps the sites module's
//! handler (everything else is delegated to it) and answers `BmcCommands` (the open commands of the agent's site,
//! long-polled) and `BmcResult` (the agent's signed result, verified against the key its certificate certifies,
//! then stored for the planner). The agent's site comes from its verified certificate, never from the request.

use crate::queries;
use bc_core::metal::{Outcome, site_report};
use bc_gateway::BoxFuture;
use bc_gateway::site::{ArtifactStream, SiteAgent, SiteHandler};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::v1;
use bc_store::Store;
use std::sync::Arc;
use std::time::Duration;
use tonic::Status;

/// The payload type of a BMC command's signed result.
pub const OUTCOME_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.bmc-outcome+json";
/// The longest a `BmcCommands` call waits for work.
pub const MAX_WAIT: Duration = Duration::from_secs(25);
/// How often a waiting call looks again.
const POLL: Duration = Duration::from_millis(250);
const MAX_COMMANDS: u32 = 64;
const MAX_RESULT: usize = 64 * 1024;

fn internal(what: &str, e: &dyn std::error::Error) -> Status {
    tracing::error!(error = %e, "{what}");
    Status::unavailable(format!(
        "{what}; the control plane logged the cause, retry later"
    ))
}

/// The sites module's site handler with the metal flow's BMC commands.
pub struct WithBmc {
    inner: Arc<dyn SiteHandler>,
    store: Store,
    trust_domain: String,
}

impl WithBmc {
    pub fn new(inner: Arc<dyn SiteHandler>, store: Store, trust_domain: &str) -> WithBmc {
        WithBmc {
            inner,
            store,
            trust_domain: trust_domain.to_owned(),
        }
    }

    async fn admit(&self, agent: &SiteAgent) -> Result<(), Status> {
        let revoked = self
            .store
            .site_revoked(&agent.site_id)
            .await
            .map_err(|e| internal("reading the site", &e))?;
        if revoked {
            return Err(Status::permission_denied(format!(
                "site {} is revoked (`better-compute sites revoke`): it gets no BMC work",
                agent.site_id
            )));
        }
        Ok(())
    }

    async fn commands(
        &self,
        agent: &SiteAgent,
        req: v1::BmcCommandsRequest,
    ) -> Result<v1::BmcCommandsResponse, Status> {
        self.admit(agent).await?;
        let wait = Duration::from_millis(u64::from(req.wait_ms)).min(MAX_WAIT);
        let max = i64::from(req.max.clamp(1, MAX_COMMANDS));
        let until = tokio::time::Instant::now() + wait;
        loop {
            // Only the agent holding the site's boot lease gets BMC work; a standby agent of the same site waits.
            // A command is handed out again after `REDELIVER_MS` without a result, and two agents must never both
            // run one (a second `power boot` of a machine that is on is a force-restart).
            let holds = self
                .store
                .boot_lease(&agent.site_id, &agent.agent_id)
                .await
                .map_err(|e| internal("reading the site's boot lease", &e))?
                .is_some_and(|l| l.held);
            let taken = if holds {
                queries::take_bmc(self.store.pool(), &agent.site_id, crate::now_ms(), max)
                    .await
                    .map_err(|e| internal("reading the site's BMC commands", &e))?
            } else {
                Vec::new()
            };
            if !taken.is_empty() || tokio::time::Instant::now() >= until {
                let commands = taken
                    .into_iter()
                    .map(|c| v1::BmcCommand {
                        op_json: serde_json::to_string(&c.op).unwrap_or_default(),
                        id: c.id,
                        mac: c.mac,
                        bmc_address: c.bmc.address,
                        credentials_ref: c.bmc.credentials,
                        deadline_unix_ms: c.deadline_ms,
                    })
                    .collect();
                return Ok(v1::BmcCommandsResponse {
                    commands,
                    clock_unix_ms: crate::now_ms(),
                });
            }
            tokio::time::sleep(POLL.min(until - tokio::time::Instant::now())).await;
        }
    }

    async fn result(
        &self,
        agent: &SiteAgent,
        req: v1::BmcResultRequest,
    ) -> Result<v1::BmcResultResponse, Status> {
        self.admit(agent).await?;
        let env = req
            .result
            .ok_or_else(|| Status::invalid_argument("result: a signed envelope is required"))?;
        if env.payload_type != OUTCOME_PAYLOAD_TYPE {
            return Err(Status::invalid_argument(format!(
                "result: payload_type {:?}, expected {OUTCOME_PAYLOAD_TYPE}",
                env.payload_type
            )));
        }
        if env.payload.len() > MAX_RESULT {
            return Err(Status::invalid_argument(format!(
                "result: payload longer than {MAX_RESULT} bytes"
            )));
        }
        let signer = SpiffeId::new(&self.trust_domain, Role::Site, &agent.site_id)
            .map_err(|e| internal("naming the site", &e))?
            .to_string();
        bc_proto::envelope::verify(&env, &agent.public_point, &signer).map_err(|e| {
            tracing::warn!(site_id = agent.site_id, agent = agent.agent_id, error = %e, "BMC result refused");
            Status::permission_denied(format!(
                "result: not signed by this agent's certified key as {signer}: {e}"
            ))
        })?;
        let outcome: Outcome = serde_json::from_slice(&env.payload)
            .map_err(|e| Status::invalid_argument(format!("result: not a BMC outcome: {e}")))?;
        let accepted = queries::finish_bmc(
            self.store.pool(),
            &agent.site_id,
            &req.id,
            &outcome,
            crate::now_ms(),
        )
        .await
        .map_err(|e| internal("storing the BMC result", &e))?;
        tracing::info!(
            site_id = agent.site_id,
            command = req.id,
            accepted,
            ?outcome,
            "BMC result"
        );
        Ok(v1::BmcResultResponse { accepted })
    }
}

impl WithBmc {
    /// The images machines of the agent's site are being deployed with (`sha256` hex): the site holds them in its
    /// cache and serves them to the ramdisks.
    async fn images(&self, agent: &SiteAgent) -> Result<Vec<String>, Status> {
        let images: Vec<String> = bc_store::sqlx::query_scalar(
            "SELECT DISTINCT record->'goal'->>'image' FROM metal_machines \
             WHERE site_id = $1 AND phase = 'deploying' AND record->'goal'->>'image' IS NOT NULL",
        )
        .bind(&agent.site_id)
        .fetch_all(self.store.pool())
        .await
        .map_err(|e| internal("reading the site's deploy images", &e))?;
        Ok(images
            .into_iter()
            .filter_map(|i| i.strip_prefix("sha256:").map(str::to_owned))
            .collect())
    }

    async fn netboot_with_images(&self, agent: &SiteAgent) -> Result<v1::NetbootResponse, Status> {
        let mut table = self.inner.netboot(agent).await?;
        for sha256 in self.images(agent).await? {
            let row = self
                .store
                .artifact(&sha256)
                .await
                .map_err(|e| internal("reading an artifact", &e))?;
            if let Some(row) = row {
                table.prefetch.push(v1::NetbootArtifact {
                    sha256: row.sha256,
                    size: u64::try_from(row.size).unwrap_or(0),
                    name: row.name,
                });
            }
        }
        Ok(table)
    }

    async fn image_or_boot_artifact(
        &self,
        agent: &SiteAgent,
        req: v1::ArtifactRequest,
    ) -> Result<ArtifactStream, Status> {
        if self.images(agent).await?.contains(&req.sha256) {
            tracing::info!(
                site_id = agent.site_id,
                sha256 = req.sha256,
                "deploy image sent"
            );
            return self.inner.stored_artifact(&req.sha256).await;
        }
        self.inner.artifact(agent, req).await
    }

    /// The agent's boot HTTP URL and the last DHCP it saw from machines of its site.
    async fn report(
        &self,
        agent: &SiteAgent,
        req: v1::SiteReport,
    ) -> Result<v1::SiteReportResponse, Status> {
        self.admit(agent).await?;
        let now = crate::now_ms();
        let dhcp: Vec<(&str, i64)> = req
            .dhcp
            .iter()
            .map(|d| (d.mac.as_str(), d.at_unix_ms))
            .collect();
        let report = site_report::check(&req.boot_url, &dhcp, &req.cached, now)
            .map_err(Status::invalid_argument)?;
        if let Some(boot_url) = &report.boot_url {
            bc_store::sqlx::query(
                "INSERT INTO metal_sites (site_id, boot_url, cached, reported_ms) VALUES ($1, $2, $4, $3) \
                 ON CONFLICT (site_id) DO UPDATE SET boot_url = $2, cached = $4, reported_ms = $3",
            )
            .bind(&agent.site_id)
            .bind(boot_url)
            .bind(now)
            .bind(&report.cached)
            .execute(self.store.pool())
            .await
            .map_err(|e| internal("storing the site's boot URL", &e))?;
        }
        if !report.macs.is_empty() {
            bc_store::sqlx::query(
                "UPDATE metal_machines m SET last_dhcp_ms = greatest(coalesce(m.last_dhcp_ms, 0), s.at) \
                 FROM (SELECT mac, max(at) AS at FROM unnest($2::text[], $3::bigint[]) AS x(mac, at) GROUP BY mac) s \
                 WHERE m.mac = s.mac AND m.site_id = $1",
            )
            .bind(&agent.site_id)
            .bind(&report.macs)
            .bind(&report.seen_ms)
            .execute(self.store.pool())
            .await
            .map_err(|e| internal("storing DHCP sightings", &e))?;
        }
        Ok(v1::SiteReportResponse {})
    }
}

impl WithBmc {
    /// `call` given up as UNAVAILABLE when the database primary moves while it runs, or past the gateway's deadline
    /// ([`Store::cut`]), as the site backend it wraps does.
    async fn cut<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        self.store
            .cut(what, bc_gateway::STORE_DEADLINE, call)
            .await
            .unwrap_or_else(|e| Err(internal(what, &e)))
    }
}

impl SiteHandler for WithBmc {
    fn boot_lease(
        &self,
        agent: &SiteAgent,
        request: v1::BootLeaseRequest,
    ) -> BoxFuture<'_, Result<v1::BootLeaseResponse, Status>> {
        self.inner.boot_lease(agent, request)
    }

    fn netboot(&self, agent: &SiteAgent) -> BoxFuture<'_, Result<v1::NetbootResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("reading the netboot table", async move {
            self.netboot_with_images(&agent).await
        }))
    }

    fn renew(
        &self,
        agent: &SiteAgent,
        request: v1::RenewRequest,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>> {
        self.inner.renew(agent, request)
    }

    fn secret(
        &self,
        agent: &SiteAgent,
        request: v1::SecretRequestMessage,
    ) -> BoxFuture<'_, Result<v1::SecretResponse, Status>> {
        self.inner.secret(agent, request)
    }

    fn artifact(
        &self,
        agent: &SiteAgent,
        request: v1::ArtifactRequest,
    ) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("opening an artifact", async move {
            self.image_or_boot_artifact(&agent, request).await
        }))
    }

    fn stored_artifact(&self, sha256: &str) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        self.inner.stored_artifact(sha256)
    }

    fn report(
        &self,
        agent: &SiteAgent,
        request: v1::SiteReport,
    ) -> BoxFuture<'_, Result<v1::SiteReportResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("storing the site's report", async move {
            WithBmc::report(self, &agent, request).await
        }))
    }

    fn bmc_commands(
        &self,
        agent: &SiteAgent,
        request: v1::BmcCommandsRequest,
    ) -> BoxFuture<'_, Result<v1::BmcCommandsResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("reading BMC commands", async move {
            self.commands(&agent, request).await
        }))
    }

    fn bmc_result(
        &self,
        agent: &SiteAgent,
        request: v1::BmcResultRequest,
    ) -> BoxFuture<'_, Result<v1::BmcResultResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("storing a BMC result", async move {
            self.result(&agent, request).await
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The site services WithBmc does not answer itself: none in this test.
    struct NoSite;

    fn none<T: Send + 'static>() -> BoxFuture<'static, Result<T, Status>> {
        Box::pin(async { Err(Status::unimplemented("this test has no site backend")) })
    }

    impl SiteHandler for NoSite {
        fn boot_lease(
            &self,
            _: &SiteAgent,
            _: v1::BootLeaseRequest,
        ) -> BoxFuture<'_, Result<v1::BootLeaseResponse, Status>> {
            none()
        }
        fn netboot(&self, _: &SiteAgent) -> BoxFuture<'_, Result<v1::NetbootResponse, Status>> {
            none()
        }
        fn renew(
            &self,
            _: &SiteAgent,
            _: v1::RenewRequest,
        ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>> {
            none()
        }
        fn secret(
            &self,
            _: &SiteAgent,
            _: v1::SecretRequestMessage,
        ) -> BoxFuture<'_, Result<v1::SecretResponse, Status>> {
            none()
        }
        fn artifact(
            &self,
            _: &SiteAgent,
            _: v1::ArtifactRequest,
        ) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
            none()
        }
        fn stored_artifact(&self, _: &str) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
            none()
        }
    }

    /// The database primary goes silent (no reset) under a site agent's BMC calls, and the pool moves to another
    /// primary: each is answered UNAVAILABLE at the move, not at the gateway's 30 s deadline, and the next is
    /// served on the new primary.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bmc_calls_waiting_on_a_silent_primary_are_answered_at_its_move() {
        let primary = bc_store::testing::SilentPrimary::start(4).await;
        let bmc = WithBmc::new(Arc::new(NoSite), primary.store.clone(), "test.local");
        let agent = SiteAgent {
            site_id: "s1".into(),
            agent_id: "a1".into(),
            public_point: vec![0x04; 65],
        };
        let poll = v1::BmcCommandsRequest::default();
        let none_yet = bmc.bmc_commands(&agent, poll).await.expect("read through");
        assert!(none_yet.commands.is_empty());

        primary.silence();
        let (polled, reported) = (
            bmc.bmc_commands(&agent, poll),
            SiteHandler::report(&bmc, &agent, v1::SiteReport::default()),
        );
        let both = async { tokio::join!(polled, reported) };
        tokio::pin!(both);
        assert!(
            tokio::time::timeout(Duration::from_millis(700), &mut both)
                .await
                .is_err(),
            "answered through a silent database"
        );
        let moved = std::time::Instant::now();
        primary.move_primary();
        let (polled, reported) = tokio::time::timeout(Duration::from_secs(5), both)
            .await
            .expect("answered at the move");
        assert!(
            moved.elapsed() < Duration::from_secs(3),
            "{:?}",
            moved.elapsed()
        );
        for e in [polled.err(), reported.err()] {
            let e = e.expect("served through a silent database");
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        }
        let after = tokio::time::timeout(Duration::from_secs(5), bmc.bmc_commands(&agent, poll))
            .await
            .expect("a call after the move waited on the old primary")
            .expect("served on the new primary");
        assert!(after.commands.is_empty());
    }
}
