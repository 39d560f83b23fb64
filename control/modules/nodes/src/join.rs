//! JoinService: opens the sealed token, checks it, computes the hardware key, signs the node certificate and
//! commits the node. Commits are batched (group commit): concurrent joins on a token share one transaction, so the
//! token's row lock and the WAL flush are paid once per batch instead of once per node, with every join still
//! acknowledged only after its commit is durable.

use bc_ca::{Ca, CsrError, Issued, VerifiedCsr, verify_csr};
use bc_core::hardware::{self, HardwareClaims};
use bc_core::join::TokenRejection;
use bc_proto::seal::{self, JoinPrivateKey, SealError};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::token::{Token, TokenKind};
use bc_proto::v1;
use bc_store::Store;
use bc_store::join_tokens::JoinTokenRow;
use bc_store::nodes::{JoinCandidate, JoinCommit};
use std::net::SocketAddr;
use std::sync::Arc;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

const MAX_SEALED: usize = 512;
const MAX_CSR: usize = 8 * 1024;
const MAX_STRING: usize = hardware::MAX_CLAIM;
/// How long one batch's commit may take.
const COMMIT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);
/// Join tokens kept in memory (cleared when full).
const TOKEN_CACHE: usize = 4096;
/// Most joins one transaction commits.
const MAX_BATCH: usize = 256;

pub struct JoinService {
    store: Store,
    /// Join tokens by id. Only what never changes is used from here (secret hash, pool, expect, reclaim); the
    /// mutable parts are decided at commit under the row lock, so a cached entry is never stale in a way that
    /// matters.
    tokens: std::sync::Mutex<std::collections::HashMap<String, Arc<JoinTokenRow>>>,
    ca: Arc<Ca>,
    key: JoinPrivateKey,
    batches: mpsc::Sender<Job>,
    /// Enrolls a site agent whose sealed token is a site token (the sites module's); none: site tokens are refused.
    sites: Option<SiteEnroller>,
}

/// Enrolls a site agent from its (opened) site token and verified CSR: the sites module's, handed in by the binary
/// that composes both (a module imports no other module).
pub type SiteEnroller = Arc<
    dyn Fn(Token, VerifiedCsr) -> bc_gateway::BoxFuture<'static, Result<v1::JoinResponse, Status>>
        + Send
        + Sync,
>;

struct Job {
    token_id: String,
    pool_id: String,
    candidate: JoinCandidate,
    reply: oneshot::Sender<Result<JoinCommit, String>>,
}

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

fn unix_ms(t: OffsetDateTime) -> i64 {
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

/// Why a join whose node key already belongs to a node is refused, and what to do.
fn key_taken(
    node_id: &str,
    joined_at_ms: i64,
    same_token: bool,
    pool: &str,
    now_ms: i64,
) -> String {
    let ago_min = (now_ms - joined_at_ms).max(0) / 60_000;
    let window_min = bc_core::join::REPLAY_WINDOW_MS / 60_000;
    let how = if same_token {
        format!(
            "with this token {ago_min} min ago; a retry gets the same node only within {window_min} min of the join"
        )
    } else {
        format!("with another token {ago_min} min ago")
    };
    format!(
        "this node key already belongs to node {node_id} (joined {how}). If this machine is node {node_id} and lost \
         its identity, rejoin with a reclaim token (`better-compute join-tokens create --pool {pool} --reclaim`); \
         to join as a new node, revoke node {node_id} or start from an empty state directory (a new key)"
    )
}

fn internal(what: &str, e: &dyn std::error::Error) -> Status {
    tracing::error!(error = %e, "{what}");
    Status::unavailable(format!(
        "{what}; the control plane logged the cause, retry later"
    ))
}

impl JoinService {
    /// Creates the service and starts its batch committer on the current runtime.
    pub fn start(
        store: Store,
        ca: Arc<Ca>,
        key: JoinPrivateKey,
        sites: Option<SiteEnroller>,
    ) -> Arc<JoinService> {
        let (tx, rx) = mpsc::channel(4096);
        tokio::spawn(commit_loop(store.clone(), rx));
        Arc::new(JoinService {
            store,
            tokens: std::sync::Mutex::new(std::collections::HashMap::new()),
            ca,
            key,
            batches: tx,
            sites,
        })
    }

    pub async fn join(
        &self,
        mut req: v1::JoinRequest,
        peer: Option<SocketAddr>,
    ) -> Result<v1::JoinResponse, Status> {
        let claims = validate_claims(req.claims.take().unwrap_or_default())?;
        check_request(&req)?;
        let csr = verify_csr(&req.csr_der).map_err(|e| match e {
            CsrError::BadSignature => Status::permission_denied(e.to_string()),
            _ => Status::invalid_argument(e.to_string()),
        })?;
        let token =
            seal::open(&self.key, &req.sealed_token, &csr.spki_der).map_err(|e| match e {
                SealError::WrongKey => Status::permission_denied(e.to_string()),
                _ => Status::invalid_argument(e.to_string()),
            })?;
        // Site tokens enroll site agents through the same sealed-token path; each kind only on its own path.
        if check_purpose(req.purpose, &token)? == TokenKind::Site {
            return self.enroll_site(&token, csr).await;
        }
        let token = Token::parse(TokenKind::Join, &token).map_err(|e| {
            Status::invalid_argument(format!("the sealed token is not a join token: {e}"))
        })?;
        let row = self.token(token.id()).await?;
        if !token.secret().matches_hash(&row.secret_hash) {
            return Err(Status::permission_denied(format!(
                "join token {} secret does not match",
                token.id()
            )));
        }
        let key_hash = hex::encode(bc_proto::sha256(&csr.spki_der));
        let t = now();
        // What never changes about a token is checked here; revocation, expiry and uses are decided under the
        // token's row lock at commit, where a retry of a committed join is also recognised by its key.
        row.expect
            .check(&claims)
            .map_err(|r| Status::permission_denied(r.to_string()))?;
        let hk = hardware::hardware_key(&claims);
        let reclaim_of = self.reclaim_target(&row, hk.as_deref()).await?;
        let node_id = reclaim_of
            .clone()
            .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let issued = self
            .ca
            .issue_workload(&csr, Role::Node, &node_id, t)
            .map_err(|e| internal("signing the node certificate", &e))?;
        let candidate = JoinCandidate {
            node_id: node_id.clone(),
            reclaim: reclaim_of.is_some(),
            hardware_key: hk,
            claims: serde_json::to_value(&claims).map_err(|e| internal("encoding claims", &e))?,
            join_key_hash: key_hash,
            cert_serial: issued.serial_hex.clone(),
            not_after_ms: issued.not_after_ms,
            public_key_hex: hex::encode(&csr.public_point),
        };
        let (reply, rx) = oneshot::channel();
        self.batches
            .send(Job {
                token_id: row.id.clone(),
                pool_id: row.pool_id.clone(),
                candidate,
                reply,
            })
            .await
            .map_err(|_| Status::unavailable("join committer stopped"))?;
        let outcome = rx
            .await
            .map_err(|_| Status::unavailable("join committer stopped"))?
            .map_err(|e| Status::unavailable(format!("committing the join failed ({e}); retry")))?;
        match outcome {
            JoinCommit::Joined { node_id, reclaimed } => {
                tracing::info!(node_id, token = row.id, reclaimed, ?peer, "node joined");
                Ok(self.response(&node_id, &row.pool_id, issued, reclaimed, false))
            }
            JoinCommit::Exhausted => Err(Status::resource_exhausted(
                TokenRejection::Exhausted.to_string(),
            )),
            JoinCommit::Revoked => Err(Status::permission_denied(
                TokenRejection::Revoked.to_string(),
            )),
            JoinCommit::Expired => Err(Status::permission_denied(
                TokenRejection::Expired.to_string(),
            )),
            JoinCommit::Replay { node_id } => self.replay(&csr, &node_id, &row.pool_id, t).await,
            JoinCommit::HardwareTaken { node_id } => Err(Status::already_exists(format!(
                "this hardware already belongs to node {node_id}: join with a reclaim token (`better-compute \
                 join-tokens create --pool {} --reclaim`), or revoke node {node_id} first",
                row.pool_id
            ))),
            JoinCommit::KeyTaken {
                node_id,
                joined_at_ms,
                same_token,
            } => Err(Status::already_exists(key_taken(
                &node_id,
                joined_at_ms,
                same_token,
                &row.pool_id,
                unix_ms(t),
            ))),
            JoinCommit::ReclaimLost => Err(Status::aborted(
                "the node to reclaim changed during the join; retry",
            )),
            JoinCommit::Raced => Err(Status::aborted(
                "another join of this machine or key committed at the same moment; retry",
            )),
        }
    }

    /// A site token on the join path: the sites module enrolls the agent.
    async fn enroll_site(&self, token: &str, csr: VerifiedCsr) -> Result<v1::JoinResponse, Status> {
        let site = Token::parse(TokenKind::Site, token).map_err(|e| {
            Status::invalid_argument(format!("the sealed token is not a site token: {e}"))
        })?;
        let Some(enroll) = &self.sites else {
            return Err(Status::failed_precondition(
                "this control plane enrolls no site agents (its sites module is not configured); use a join token",
            ));
        };
        enroll(site, csr).await
    }

    /// The node a reclaim token re-adopts: the live node with this hardware key, when the token and its pool allow
    /// reclaim.
    async fn reclaim_target(
        &self,
        row: &JoinTokenRow,
        hk: Option<&str>,
    ) -> Result<Option<String>, Status> {
        let (true, Some(hk)) = (row.reclaim, hk) else {
            return Ok(None);
        };
        let pool = self
            .store
            .pool_by_id(&row.pool_id)
            .await
            .map_err(|e| internal("reading the pool", &e))?;
        if !pool.allow_reclaim {
            return Ok(None);
        }
        Ok(self
            .store
            .node_by_hardware_key(hk)
            .await
            .map_err(|e| internal("reading nodes", &e))?
            .map(|o| o.node_id))
    }

    async fn token(&self, id: &str) -> Result<Arc<JoinTokenRow>, Status> {
        if let Some(t) = self.tokens.lock().ok().and_then(|m| m.get(id).cloned()) {
            return Ok(t);
        }
        let row = self
            .store
            .join_token(id)
            .await
            .map_err(|e| internal("reading the join token", &e))?
            .ok_or_else(|| Status::permission_denied(format!("unknown join token {id}")))?;
        let row = Arc::new(row);
        if let Ok(mut m) = self.tokens.lock() {
            if m.len() >= TOKEN_CACHE {
                m.clear();
            }
            m.insert(id.to_string(), row.clone());
        }
        Ok(row)
    }

    /// A retry of a committed join (same token, same key): the same node and a fresh certificate, no use spent.
    async fn replay(
        &self,
        csr: &VerifiedCsr,
        node_id: &str,
        pool_id: &str,
        t: OffsetDateTime,
    ) -> Result<v1::JoinResponse, Status> {
        let issued = self
            .ca
            .issue_workload(csr, Role::Node, node_id, t)
            .map_err(|e| internal("signing the node certificate", &e))?;
        self.store
            .record_node_cert(node_id, &issued.serial_hex, issued.not_after_ms)
            .await
            .map_err(|e| internal("recording the certificate", &e))?;
        tracing::info!(node_id, "join retried: same node, no use spent");
        Ok(self.response(node_id, pool_id, issued, false, true))
    }

    fn response(
        &self,
        node_id: &str,
        pool: &str,
        issued: Issued,
        reclaimed: bool,
        replayed: bool,
    ) -> v1::JoinResponse {
        let spiffe = SpiffeId::new(self.ca.trust_domain(), Role::Node, node_id)
            .map(|s| s.to_string())
            .unwrap_or_default();
        v1::JoinResponse {
            node_id: node_id.to_string(),
            spiffe_id: spiffe,
            cert_der: issued.cert_der,
            chain_der: Vec::new(),
            trust_bundle_der: vec![self.ca.cert_der().to_vec()],
            reclaimed,
            pool: pool.to_string(),
            not_after_unix_ms: issued.not_after_ms,
            replayed,
        }
    }
}

impl bc_gateway::JoinHandler for JoinService {
    fn join(
        &self,
        request: v1::JoinRequest,
        peer: Option<SocketAddr>,
    ) -> bc_gateway::BoxFuture<'_, Result<v1::JoinResponse, Status>> {
        Box::pin(JoinService::join(self, request, peer))
    }
}

/// Takes whatever joins are waiting (up to MAX_BATCH), commits them per token in one transaction each, answers.
async fn commit_loop(store: Store, mut rx: mpsc::Receiver<Job>) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        while jobs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        while !jobs.is_empty() {
            let token = jobs[0].token_id.clone();
            let pool = jobs[0].pool_id.clone();
            let (group, rest): (Vec<Job>, Vec<Job>) =
                jobs.into_iter().partition(|j| j.token_id == token);
            jobs = rest;
            let candidates: Vec<JoinCandidate> =
                group.iter().map(|j| j.candidate.clone()).collect();
            // Bounded, and cut short when the pool moves to another primary: a batch waiting on a primary that
            // hangs would otherwise hold every join after it for good. A node told to retry joins again with the
            // same key and token (its replay window answers a join that did commit).
            let committed = store.within(
                "committing joins",
                COMMIT_DEADLINE,
                store.commit_joins(&token, &pool, &candidates, unix_ms(now())),
            );
            match committed.await {
                Ok(outcomes) => {
                    for (job, outcome) in group.into_iter().zip(outcomes) {
                        let _ = job.reply.send(Ok(outcome));
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, token, "join batch failed");
                    for job in group {
                        let _ = job.reply.send(Err(e.to_string()));
                    }
                }
            }
        }
    }
}

/// The request's sizes and required fields, before any cryptography.
fn check_request(req: &v1::JoinRequest) -> Result<(), Status> {
    if req.agent_version.len() > MAX_STRING || req.agent_version.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "agent_version must be at most {MAX_STRING} bytes without control characters"
        )));
    }
    if req.csr_der.is_empty() {
        return Err(Status::invalid_argument(
            "csr_der is empty: send the node's PKCS#10 request",
        ));
    }
    if req.sealed_token.is_empty() {
        return Err(Status::invalid_argument(
            "sealed_token is empty: seal the join token to JoinService",
        ));
    }
    if req.sealed_token.len() > MAX_SEALED {
        return Err(Status::invalid_argument(format!(
            "sealed_token is longer than {MAX_SEALED} bytes"
        )));
    }
    if req.csr_der.len() > MAX_CSR {
        return Err(Status::invalid_argument(format!(
            "csr_der is longer than {MAX_CSR} bytes"
        )));
    }
    Ok(())
}

/// The path a request takes: the purpose the caller states must match the kind of the token it sealed. A site
/// token sent to join a node, a join token sent to enroll a site agent, or no purpose at all is refused with what to
/// run instead, before anything is read or spent.
pub fn check_purpose(purpose: i32, token: &str) -> Result<TokenKind, Status> {
    let site = token.trim().starts_with(TokenKind::Site.prefix());
    match v1::JoinPurpose::try_from(purpose) {
        Ok(v1::JoinPurpose::Node) if site => Err(Status::invalid_argument(
            "a site token (bcst_…) enrolls a rack agent, not a node: run `bcd site enroll` with it; \
             `bcd join` takes a join token (bcjt_…)",
        )),
        Ok(v1::JoinPurpose::Node) => Ok(TokenKind::Join),
        Ok(v1::JoinPurpose::Site) if site => Ok(TokenKind::Site),
        Ok(v1::JoinPurpose::Site) => Err(Status::invalid_argument(
            "a join token (bcjt_…) joins a node, not a site agent: run `bcd join` with it; \
             `bcd site enroll` takes a site token (bcst_…)",
        )),
        Ok(v1::JoinPurpose::Unspecified) | Err(_) => Err(Status::invalid_argument(
            "JoinRequest.purpose is unset or unknown: this client predates the control plane; upgrade bcd \
             (`bcd join` sends NODE, `bcd site enroll` sends SITE)",
        )),
    }
}

/// Converts wire claims to domain claims, refusing oversized or garbled values with the field's path
/// ([`HardwareClaims::check`]).
pub fn validate_claims(c: v1::HardwareClaims) -> Result<HardwareClaims, Status> {
    let dmi = c.dmi.unwrap_or_default();
    let claims = HardwareClaims {
        dmi: hardware::DmiClaims {
            system_uuid: dmi.system_uuid,
            system_serial: dmi.system_serial,
            board_serial: dmi.board_serial,
            chassis_serial: dmi.chassis_serial,
            vendor: dmi.vendor,
            product: dmi.product,
        },
        nics: c
            .nics
            .into_iter()
            .map(|n| hardware::NicClaim {
                name: n.name,
                mac: n.mac,
                driver: n.driver,
                pci_address: n.pci_address,
            })
            .collect(),
        gpus: c
            .gpus
            .into_iter()
            .map(|g| hardware::GpuClaim {
                index: g.index,
                uuid: g.uuid,
                serial: g.serial,
                model: g.model,
                pci_bus_id: g.pci_bus_id,
                memory_mib: g.memory_mib,
            })
            .collect(),
        hostname: c.hostname,
        arch: c.arch,
        gpu_backend: c.gpu_backend,
        collection_notes: c.collection_notes,
    };
    claims
        .check()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(claims)
}
