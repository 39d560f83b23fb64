//! Sites: enrollment of site agents with a `bcst_` token (reached through JoinService, which opens the sealed token
//! and hands site tokens here), and the site services the gateway forwards ([`SiteBackend`]: boot lease, netboot
//! table, secret broker).

use crate::artifacts::{ArtifactDir, REF_PREFIX, is_sha256_hex, referenced};
use crate::secrets::SecretBox;
use bc_ca::{Ca, VerifiedCsr, verify_csr};
use bc_core::api::sites::BootSpec;
use bc_gateway::BoxFuture;
use bc_gateway::site::{ArtifactStream, SiteAgent, SiteHandler, agent_id_of};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::token::Token;
use bc_proto::v1;
use bc_store::Store;
use bc_store::artifacts::ArtifactRow;
use bc_store::sites::EnrollCommit;
use std::collections::HashMap;
use std::sync::Arc;
use tonic::Status;

/// Shortest and longest boot lease an agent may ask for.
pub const LEASE_MIN_MS: u32 = 1_000;
pub const LEASE_MAX_MS: u32 = 120_000;

fn internal(what: &str, e: &dyn std::error::Error) -> Status {
    tracing::error!(error = %e, "{what}");
    Status::unavailable(format!(
        "{what}; the control plane logged the cause, retry later"
    ))
}

/// Enrolls a site agent: checks the site token, signs a site certificate for the CSR key and records the agent.
/// A retry with the same token and key returns a fresh certificate without spending another use.
pub async fn enroll(
    store: &Store,
    ca: &Ca,
    token: &Token,
    csr: &VerifiedCsr,
) -> Result<v1::JoinResponse, Status> {
    let row = store
        .site_token(token.id())
        .await
        .map_err(|e| internal("reading the site token", &e))?
        .ok_or_else(|| Status::permission_denied(format!("unknown site token {}", token.id())))?;
    if !token.secret().matches_hash(&row.secret_hash) {
        return Err(Status::permission_denied(format!(
            "site token {} secret does not match",
            token.id()
        )));
    }
    let issued = ca
        .issue_workload(
            csr,
            Role::Site,
            row.site_id.as_str(),
            time::OffsetDateTime::now_utc(),
        )
        .map_err(|e| internal("signing the site certificate", &e))?;
    let key_hash = hex::encode(bc_proto::sha256(&csr.public_point));
    let outcome = store
        .commit_enrollment(&row.id, &key_hash, &issued.serial_hex, issued.not_after_ms)
        .await
        .map_err(|e| internal("committing the enrollment", &e))?;
    let (site_id, replayed) = match outcome {
        EnrollCommit::Enrolled { site_id } => (site_id, false),
        EnrollCommit::Replay { site_id } => (site_id, true),
        EnrollCommit::Exhausted => {
            return Err(Status::resource_exhausted(format!(
                "site token {} has no uses left: create another with `better-compute site-tokens create`",
                row.id
            )));
        }
        EnrollCommit::Revoked => {
            return Err(Status::permission_denied(format!(
                "site token {} has been revoked",
                row.id
            )));
        }
        EnrollCommit::Expired => {
            return Err(Status::permission_denied(format!(
                "site token {} expired: create another with `better-compute site-tokens create`",
                row.id
            )));
        }
        EnrollCommit::Unknown => {
            return Err(Status::permission_denied(format!(
                "unknown site token {}",
                row.id
            )));
        }
        EnrollCommit::SiteRevoked { site_id } => {
            return Err(Status::permission_denied(format!(
                "site {site_id} has been revoked (`better-compute sites revoke`); its tokens enroll no agent"
            )));
        }
    };
    let spiffe = SpiffeId::new(ca.trust_domain(), Role::Site, &site_id)
        .map(|s| s.to_string())
        .map_err(|e| internal("naming the site", &e))?;
    tracing::info!(
        site_id,
        agent = agent_id_of(&csr.public_point),
        replayed,
        "site agent enrolled"
    );
    Ok(v1::JoinResponse {
        node_id: site_id,
        spiffe_id: spiffe,
        cert_der: issued.cert_der,
        chain_der: Vec::new(),
        trust_bundle_der: vec![ca.cert_der().to_vec()],
        reclaimed: false,
        pool: String::new(),
        not_after_unix_ms: issued.not_after_ms,
        replayed,
    })
}

/// The control plane's side of the site services.
pub struct SiteBackend {
    store: Store,
    ca: Arc<Ca>,
    secrets: Arc<SecretBox>,
    artifacts: ArtifactDir,
}

impl SiteBackend {
    pub fn new(
        store: Store,
        ca: Arc<Ca>,
        secrets: Arc<SecretBox>,
        artifacts: ArtifactDir,
    ) -> SiteBackend {
        SiteBackend {
            store,
            ca,
            secrets,
            artifacts,
        }
    }

    async fn lease(
        &self,
        agent: &SiteAgent,
        req: v1::BootLeaseRequest,
    ) -> Result<v1::BootLeaseResponse, Status> {
        let ttl = req.ttl_ms.clamp(LEASE_MIN_MS, LEASE_MAX_MS);
        if req.release {
            let released = self
                .store
                .release_boot_lease(&agent.site_id, &agent.agent_id)
                .await
                .map_err(|e| internal("releasing the boot lease", &e))?;
            if released {
                tracing::info!(
                    site_id = agent.site_id,
                    agent = agent.agent_id,
                    "boot lease released"
                );
            }
        }
        let lease = if req.release {
            self.store
                .boot_lease(&agent.site_id, &agent.agent_id)
                .await
                .map_err(|e| internal("reading the boot lease", &e))?
                .unwrap_or_default_lease()
        } else {
            self.store
                .acquire_boot_lease(&agent.site_id, &agent.agent_id, i64::from(ttl))
                .await
                .map_err(|e| match e {
                    bc_store::StoreError::Db(ref db)
                        if db
                            .as_database_error()
                            .is_some_and(|d| d.is_foreign_key_violation()) =>
                    {
                        Status::not_found(format!(
                            "site {} does not exist any more: enroll again with a new site token",
                            agent.site_id
                        ))
                    }
                    other => internal("taking the boot lease", &other),
                })?
        };
        Ok(v1::BootLeaseResponse {
            held: lease.held,
            fence: lease.fence,
            expires_in_ms: lease.expires_in_ms,
            holder: lease.holder,
            ttl_ms: ttl,
        })
    }

    async fn table(&self, agent: &SiteAgent) -> Result<v1::NetbootResponse, Status> {
        let machines = self
            .store
            .list_machines(Some(&agent.site_id))
            .await
            .map_err(|e| internal("reading the site's machines", &e))?;
        let mut out = Vec::new();
        // Machines of a site mostly boot the same few artifacts (the ramdisk): each is read once per table, which
        // the agent's push (a long poll) reads every 500 ms.
        let mut known = HashMap::new();
        for m in machines {
            let Some(boot) = m.boot else {
                continue;
            };
            match self.resolve(m.mac.as_str(), boot, &mut known).await? {
                Some(entry) => out.push(entry),
                None => continue,
            }
        }
        Ok(v1::NetbootResponse {
            machines: out,
            prefetch: Vec::new(),
            version: String::new(),
        })
    }

    /// A machine's entry with its `sha256:` references turned into cache paths (`sha256/<hex>`) and listed as
    /// artifacts; `None` (logged) when a referenced artifact is unknown, so the site never gets a boot it cannot
    /// serve.
    async fn resolve(
        &self,
        mac: &str,
        boot: BootSpec,
        known: &mut HashMap<String, Option<ArtifactRow>>,
    ) -> Result<Option<v1::NetbootMachine>, Status> {
        let mut artifacts = Vec::new();
        let mut path_of = async |field: &str| -> Result<Option<String>, Status> {
            let Some(sha) = referenced(field) else {
                return Ok(Some(field.to_string()));
            };
            let row = if let Some(row) = known.get(sha) {
                row.clone()
            } else if is_sha256_hex(sha) {
                let row = self
                    .store
                    .artifact(sha)
                    .await
                    .map_err(|e| internal("reading an artifact", &e))?;
                known.insert(sha.to_string(), row.clone());
                row
            } else {
                None
            };
            let Some(row) = row else {
                tracing::warn!(
                    mac,
                    reference = field,
                    "netboot entry references an unknown artifact: left out"
                );
                return Ok(None);
            };
            let path = format!("sha256/{}", row.sha256);
            if !artifacts
                .iter()
                .any(|a: &v1::NetbootArtifact| a.sha256 == row.sha256)
            {
                artifacts.push(v1::NetbootArtifact {
                    sha256: row.sha256,
                    size: u64::try_from(row.size).unwrap_or(0),
                    name: row.name,
                });
            }
            Ok(Some(path))
        };
        let Some(kernel) = path_of(&boot.kernel).await? else {
            return Ok(None);
        };
        let initrd = match &boot.initrd {
            None => String::new(),
            Some(i) => match path_of(i).await? {
                Some(p) => p,
                None => return Ok(None),
            },
        };
        Ok(Some(v1::NetbootMachine {
            mac: mac.to_string(),
            kernel,
            initrd,
            cmdline: boot.cmdline,
            artifacts,
        }))
    }

    /// Streams an artifact the agent's site references (anything else is NOT_FOUND, as if it did not exist).
    async fn artifact_stream(
        &self,
        agent: &SiteAgent,
        req: v1::ArtifactRequest,
    ) -> Result<ArtifactStream, Status> {
        if !is_sha256_hex(&req.sha256) {
            return Err(Status::invalid_argument(
                "sha256 must be 64 lowercase hex characters",
            ));
        }
        let wanted = format!("{REF_PREFIX}{}", req.sha256);
        let referenced_here = self
            .store
            .list_machines(Some(&agent.site_id))
            .await
            .map_err(|e| internal("reading the site's machines", &e))?
            .into_iter()
            .filter_map(|m| m.boot)
            .any(|b| b.kernel == wanted || b.initrd.as_deref() == Some(wanted.as_str()));
        let not_found = || {
            Status::not_found(format!(
                "artifact {} is not referenced by a machine of site {}",
                req.sha256, agent.site_id
            ))
        };
        if !referenced_here {
            return Err(not_found());
        }
        tracing::info!(
            site_id = agent.site_id,
            agent = agent.agent_id,
            sha256 = req.sha256,
            "artifact sent"
        );
        self.open_artifact(&req.sha256).await
    }

    /// The stored artifact `sha256` as a stream (NOT_FOUND when no such artifact is recorded).
    async fn open_artifact(&self, sha256: &str) -> Result<ArtifactStream, Status> {
        if !is_sha256_hex(sha256) {
            return Err(Status::invalid_argument(
                "sha256 must be 64 lowercase hex characters",
            ));
        }
        let known = self
            .store
            .artifact(sha256)
            .await
            .map_err(|e| internal("reading an artifact", &e))?;
        if known.is_none() {
            return Err(Status::not_found(format!("no artifact {sha256}")));
        }
        let file = std::fs::File::open(self.artifacts.path(sha256)).map_err(|e| {
            tracing::error!(sha256, error = %e, "artifact file missing from the state directory");
            Status::unavailable(format!(
                "artifact {sha256} is recorded but its file cannot be read; the control plane logged why"
            ))
        })?;
        Ok(crate::artifacts::stream_file(file))
    }
}

impl SiteBackend {
    async fn renew_cert(
        &self,
        agent: &SiteAgent,
        req: v1::RenewRequest,
    ) -> Result<v1::RenewResponse, Status> {
        if req.csr_der.len() > 8 * 1024 {
            return Err(Status::invalid_argument(
                "csr_der is longer than 8192 bytes",
            ));
        }
        let csr = verify_csr(&req.csr_der).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if agent.public_point.is_empty() || csr.public_point != agent.public_point {
            return Err(Status::permission_denied(
                "renewal CSR is signed by another key than the one the presented certificate certifies",
            ));
        }
        let issued = self
            .ca
            .issue_workload(
                &csr,
                Role::Site,
                &agent.site_id,
                time::OffsetDateTime::now_utc(),
            )
            .map_err(|e| internal("signing the site certificate", &e))?;
        let key_hash = hex::encode(bc_proto::sha256(&csr.public_point));
        let known = self
            .store
            .record_site_agent_cert(
                &agent.site_id,
                &key_hash,
                &issued.serial_hex,
                issued.not_after_ms,
            )
            .await
            .map_err(|e| internal("recording the certificate", &e))?;
        if !known {
            return Err(Status::permission_denied(format!(
                "agent {} is not enrolled in site {}: enroll again with a site token",
                agent.agent_id, agent.site_id
            )));
        }
        tracing::info!(
            site_id = agent.site_id,
            agent = agent.agent_id,
            serial = issued.serial_hex,
            "site certificate renewed"
        );
        Ok(v1::RenewResponse {
            cert_der: issued.cert_der,
            chain_der: Vec::new(),
            trust_bundle_der: vec![self.ca.cert_der().to_vec()],
            not_after_unix_ms: issued.not_after_ms,
        })
    }
}

trait OrFree {
    fn unwrap_or_default_lease(self) -> bc_store::sites::BootLease;
}

impl OrFree for Option<bc_store::sites::BootLease> {
    fn unwrap_or_default_lease(self) -> bc_store::sites::BootLease {
        self.unwrap_or(bc_store::sites::BootLease {
            held: false,
            holder: String::new(),
            fence: 0,
            expires_in_ms: 0,
        })
    }
}

impl SiteBackend {
    /// Refuses agents of a revoked site. The gateways refuse them at the TLS handshake once their revocation set
    /// is refreshed; this covers requests on a connection opened before that (and the refresh interval itself).
    async fn admit(&self, agent: &SiteAgent) -> Result<(), Status> {
        let revoked = self
            .store
            .site_revoked(&agent.site_id)
            .await
            .map_err(|e| internal("reading the site", &e))?;
        if revoked {
            tracing::warn!(
                site_id = agent.site_id,
                agent = agent.agent_id,
                "request of a revoked site refused"
            );
            return Err(Status::permission_denied(format!(
                "site {} is revoked (`better-compute sites revoke`): enroll this host into another site with a new site token",
                agent.site_id
            )));
        }
        Ok(())
    }
}

impl SiteBackend {
    /// `call` (one of the gateway's calls into this backend) given up as UNAVAILABLE when the database primary
    /// moves while it runs, or past the gateway's deadline ([`Store::cut`]): one waiting on a primary gone silent
    /// would otherwise hold the agent's call until the gateway's own deadline.
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

impl SiteHandler for SiteBackend {
    fn boot_lease(
        &self,
        agent: &SiteAgent,
        request: v1::BootLeaseRequest,
    ) -> BoxFuture<'_, Result<v1::BootLeaseResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("the boot lease", async move {
            self.admit(&agent).await?;
            self.lease(&agent, request).await
        }))
    }

    fn netboot(&self, agent: &SiteAgent) -> BoxFuture<'_, Result<v1::NetbootResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("reading the netboot table", async move {
            self.admit(&agent).await?;
            self.table(&agent).await
        }))
    }

    fn renew(
        &self,
        agent: &SiteAgent,
        request: v1::RenewRequest,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("renewing a certificate", async move {
            self.admit(&agent).await?;
            self.renew_cert(&agent, request).await
        }))
    }

    fn secret(
        &self,
        agent: &SiteAgent,
        request: v1::SecretRequestMessage,
    ) -> BoxFuture<'_, Result<v1::SecretResponse, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("reading a secret", async move {
            self.admit(&agent).await?;
            self.secrets.answer(&self.store, &agent, request).await
        }))
    }

    fn artifact(
        &self,
        agent: &SiteAgent,
        request: v1::ArtifactRequest,
    ) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        let agent = agent.clone();
        Box::pin(self.cut("opening an artifact", async move {
            self.admit(&agent).await?;
            self.artifact_stream(&agent, request).await
        }))
    }

    fn stored_artifact(&self, sha256: &str) -> BoxFuture<'_, Result<ArtifactStream, Status>> {
        let sha256 = sha256.to_owned();
        Box::pin(self.cut("opening an artifact", async move {
            self.open_artifact(&sha256).await
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The database primary goes silent (no reset) under a site agent's calls, and the pool moves to another
    /// primary: each is answered UNAVAILABLE at the move, not at the gateway's 30 s deadline, and the next call is
    /// served on the new primary.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agents_calls_waiting_on_a_silent_primary_are_answered_at_its_move()
    -> Result<(), Box<dyn std::error::Error>> {
        let primary = bc_store::testing::SilentPrimary::start(4).await;
        let dir = tempfile::tempdir()?;
        let site = SiteBackend::new(
            primary.store.clone(),
            Arc::new(Ca::load_or_create(dir.path(), "test.local")?),
            Arc::new(SecretBox::load_or_create(dir.path())?),
            ArtifactDir::new(dir.path()),
        );
        let agent = SiteAgent {
            site_id: "s1".into(),
            agent_id: "a1".into(),
            public_point: vec![0x04; 65],
        };
        // A site with no machines yet (its certificate vouches for it): an empty table, read from the database.
        assert!(site.netboot(&agent).await?.machines.is_empty());

        primary.silence();
        let lease = v1::BootLeaseRequest::default();
        let (netboot, leased) = (site.netboot(&agent), site.boot_lease(&agent, lease));
        let both = async { tokio::join!(netboot, leased) };
        tokio::pin!(both);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(700), &mut both)
                .await
                .is_err(),
            "answered through a silent database"
        );
        let moved = std::time::Instant::now();
        primary.move_primary();
        let (netboot, leased) = tokio::time::timeout(std::time::Duration::from_secs(5), both)
            .await
            .map_err(|_| "the calls were not answered at the move")?;
        assert!(
            moved.elapsed() < std::time::Duration::from_secs(3),
            "{:?}",
            moved.elapsed()
        );
        for e in [netboot.err(), leased.err()] {
            let e = e.ok_or("served through a silent database")?;
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        }
        let after = tokio::time::timeout(std::time::Duration::from_secs(5), site.netboot(&agent))
            .await
            .map_err(|_| "a call after the move waited on the old primary")??;
        assert!(after.machines.is_empty());
        Ok(())
    }
}
