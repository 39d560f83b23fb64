//! The control plane's side of sessions ([`bc_gateway::session::SessionBackend`] over bc-store): epochs,
//! inventory sections, desired-state acknowledgements, signed command results, batched liveness and the pull of
//! waiting messages.

use crate::grouped::Grouped;
use bc_ca::{Ca, CsrError, VerifiedCsr, verify_csr};
use bc_gateway::session::{RevokedSince, Seen, SessionBackend, SessionGrant, SessionRef};
use bc_gateway::{BoxFuture, STORE_DEADLINE};
use bc_proto::spiffe::{Role, SpiffeId};
use bc_proto::v1;
use bc_store::Store;
use bc_store::sessions::{OpenRefusal, OpenedSession, Outgoing};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tonic::Status;

/// Inventory sections a node reports, in the order they are requested.
pub const SECTIONS: &[&str] = bc_core::api::inventory::SECTIONS;
/// The largest progress payload kept (daemons send at most this much).
const MAX_PROGRESS_BYTES: usize = 4096;

pub struct ControlSessions {
    store: Store,
    ca: Arc<Ca>,
    trust_domain: String,
    /// Where inventory sections go (the inventory module, given by the composition).
    inventory: Arc<dyn bc_core::api::inventory::InventorySink>,
    /// Desired-state generation already sent to each (node, epoch), so it is not resent every pull.
    delivered: Mutex<HashMap<String, (u64, i64)>>,
    /// The gateway these sessions are held by, recorded on each session row (the tunnel relay finds nodes by it).
    gateway_id: Option<String>,
    /// Opens, grouped into one statement each.
    opens: OpenGroups,
    /// Closes, grouped into one statement each: (node, epoch, last heard from).
    closes: Grouped<(String, i64, i64), ()>,
}

/// How far behind its last message an online node's stored last-seen may be: liveness rewrites a node's row only
/// once it lags this much ([`Store::record_liveness`]), and the session's close writes the exact time. With 15 s
/// heartbeats, one row version per node every 75 s instead of every 15 s: at 50,000 sessions 670 rows a second
/// instead of 3,300, and none in the first minute after a reconnect storm (`scripts/bench sessions`). Kubernetes
/// makes the same trade for node status (reported on change or every 5 minutes; the lease says alive).
pub const LAST_SEEN_RESOLUTION_MS: i64 = 60_000;

/// Session opens, grouped: each answered with the session opened or why not.
type OpenGroups = Grouped<(String, Vec<u8>), Result<OpenedSession, OpenRefusal>>;

/// The grouped opens and closes: [`Store::open_sessions_on`] (on `gateway`) and [`Store::close_sessions`].
fn group_statements(
    store: &Store,
    gateway: Option<String>,
) -> (OpenGroups, Grouped<(String, i64, i64), ()>) {
    let on = store.clone();
    let opens = Grouped::new(
        "session opener",
        Arc::new(move |opens: Vec<(String, Vec<u8>)>| {
            let (store, gateway) = (on.clone(), gateway.clone());
            Box::pin(async move {
                let opens: Vec<(&str, &[u8])> = opens
                    .iter()
                    .map(|(id, key)| (id.as_str(), key.as_slice()))
                    .collect();
                store
                    .within(
                        "opening sessions",
                        STORE_DEADLINE,
                        store.open_sessions_on(&opens, gateway.as_deref()),
                    )
                    .await
            })
        }),
    );
    let off = store.clone();
    let closes = Grouped::new(
        "session closer",
        Arc::new(move |closes: Vec<(String, i64, i64)>| {
            let store = off.clone();
            Box::pin(async move {
                let n = closes.len();
                let closes: Vec<(&str, i64, Option<i64>)> = closes
                    .iter()
                    .map(|(id, epoch, seen)| (id.as_str(), *epoch, Some(*seen)))
                    .collect();
                store
                    .within(
                        "closing sessions",
                        STORE_DEADLINE,
                        store.close_sessions(&closes),
                    )
                    .await
                    .map(|()| vec![(); n])
            })
        }),
    );
    (opens, closes)
}

pub(crate) fn unavailable(e: bc_store::StoreError) -> Status {
    tracing::error!(error = %e, "store error in session");
    Status::unavailable("the control plane's database is unavailable; retry")
}

fn stale(s: &SessionRef) -> Status {
    Status::aborted(format!(
        "session epoch {} of node {} is stale: a newer session exists",
        s.epoch, s.node_id
    ))
}

/// A failed acknowledgement's reason: the node's message (and what `outcome` was, when it is neither `applied`
/// nor `failed`). The store bounds it and strips what PostgreSQL cannot keep.
fn ack_reason(ack: &v1::DesiredStateAck) -> String {
    match (ack.outcome.as_str(), ack.message.trim()) {
        ("applied", _) => String::new(),
        ("failed", "") => "the node reported a failure without a reason".to_string(),
        ("failed", m) => m.to_string(),
        (other, m) => format!("the node reported outcome {other:?}: {m}"),
    }
}

fn epoch(s: &SessionRef) -> i64 {
    i64::try_from(s.epoch).unwrap_or(i64::MAX)
}

impl ControlSessions {
    /// `call` (one of the gateway's calls into this backend) given up as UNAVAILABLE when the database primary moves
    /// while it runs, or past the gateway's deadline ([`Store::cut`]). A call waiting on a primary gone silent is
    /// answered by nothing but that: it held its session, or the gateway's housekeeping (which awaits liveness and
    /// the pull of waiting messages in turn), until the gateway's own 30 s deadline.
    async fn cut<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        self.store
            .cut(what, STORE_DEADLINE, call)
            .await
            .unwrap_or_else(|e| Err(unavailable(e)))
    }

    pub fn new(
        store: Store,
        ca: Arc<Ca>,
        inventory: Arc<dyn bc_core::api::inventory::InventorySink>,
    ) -> ControlSessions {
        let (opens, closes) = group_statements(&store, None);
        ControlSessions {
            store,
            inventory,
            trust_domain: ca.trust_domain().to_string(),
            ca,
            delivered: Mutex::new(HashMap::new()),
            gateway_id: None,
            opens,
            closes,
        }
    }

    /// Sessions held by gateway `id` (each session row names it).
    pub fn on_gateway(mut self, id: &str) -> ControlSessions {
        self.gateway_id = Some(id.to_string());
        (self.opens, self.closes) = group_statements(&self.store, self.gateway_id.clone());
        self
    }

    async fn open_inner(
        &self,
        node_id: &str,
        public_key: &[u8],
        hello: &v1::Hello,
    ) -> Result<SessionGrant, Status> {
        let opened = match self
            .opens
            .call((node_id.to_string(), public_key.to_vec()))
            .await?
        {
            Ok(o) => o,
            Err(OpenRefusal::Unknown) => {
                return Err(Status::permission_denied(format!(
                    "unknown node {node_id}: join first"
                )));
            }
            Err(OpenRefusal::Revoked) => {
                return Err(Status::permission_denied(format!(
                    "node {node_id} is revoked"
                )));
            }
            Err(OpenRefusal::KeySuperseded) => {
                return Err(Status::permission_denied(format!(
                    "this certificate's key is no longer node {node_id}'s: the node was reclaimed with another key, \
                     and certificates of the old key are revoked"
                )));
            }
        };
        let want_sections = SECTIONS
            .iter()
            .filter(|name| {
                let stored = opened
                    .stored_hashes
                    .iter()
                    .find(|(n, _)| n == *name)
                    .map(|(_, h)| h.as_str());
                let known = hello
                    .known_inventory
                    .iter()
                    .find(|k| k.name == **name)
                    .map(|k| hex::encode(&k.hash));
                stored.is_none() || stored != known.as_deref()
            })
            .map(|s| s.to_string())
            .collect();
        Ok(SessionGrant {
            epoch: u64::try_from(opened.epoch).unwrap_or(0),
            want_sections,
        })
    }

    /// Hands the section to the inventory module (which checks, stores and derives it).
    async fn inventory_inner(
        &self,
        s: &SessionRef,
        section: v1::InventorySection,
    ) -> Result<(), Status> {
        use bc_core::api::inventory::{InventoryRefusal, Recorded, SectionReport};
        let node = bc_core::ids::NodeId::parse(&s.node_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let report = SectionReport {
            node: &node,
            epoch: epoch(s),
            name: &section.name,
            hash: &section.hash,
            payload: &section.payload,
        };
        match self.inventory.record(report).await {
            Ok(Recorded::Stored) => Ok(()),
            Ok(Recorded::Stale) => Err(stale(s)),
            Err(InventoryRefusal::Invalid(why)) => Err(Status::invalid_argument(why)),
            Err(InventoryRefusal::Unavailable(why)) => Err(Status::unavailable(why)),
        }
    }

    async fn result_inner(&self, s: &SessionRef, r: v1::CommandResult) -> Result<(), Status> {
        let env = r
            .envelope
            .ok_or_else(|| Status::invalid_argument("CommandResult without a signed envelope"))?;
        let key = self
            .store
            .node_public_key(&s.node_id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| Status::failed_precondition("no public key recorded for this node"))?;
        let signer = SpiffeId::new(&self.trust_domain, Role::Node, &s.node_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?
            .to_string();
        let bytes = prost::Message::encode_to_vec(&env);
        let verdict = bc_proto::envelope::verify(&env, &key, &signer)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                serde_json::from_slice::<serde_json::Value>(&env.payload).map_err(|e| e.to_string())
            });
        let stored = match &verdict {
            Ok(v) => self.store.finish_command(&s.node_id, epoch(s), &r.id, Ok(v), &bytes).await,
            Err(e) => {
                tracing::warn!(node_id = s.node_id, command = r.id, error = %e, "command result refused");
                self.store
                    .finish_command(&s.node_id, epoch(s), &r.id, Err(&format!("result refused: {e}")), &bytes)
                    .await
            }
        }
        .map_err(unavailable)?;
        if !stored {
            // A daemon re-sends a result it is not sure arrived (its session ended moments after): a repeat for a
            // command of this node that already finished is acknowledged and changes nothing.
            if self
                .store
                .command_finished(&s.node_id, &r.id)
                .await
                .map_err(unavailable)?
            {
                tracing::debug!(
                    node_id = s.node_id,
                    command = r.id,
                    "repeated result ignored"
                );
                return Ok(());
            }
            return Err(Status::failed_precondition(format!(
                "command {} is not waiting for a result",
                r.id
            )));
        }
        verdict.map(|_| ()).map_err(Status::permission_denied)
    }

    /// Keeps the latest progress of a command of this node that is running (`sent`); anything else is refused
    /// with the reason (the session goes on).
    async fn progress_inner(&self, s: &SessionRef, p: v1::CommandProgress) -> Result<(), Status> {
        if p.payload.len() > MAX_PROGRESS_BYTES {
            return Err(Status::invalid_argument(format!(
                "progress of command {} exceeds 4 KiB",
                p.id
            )));
        }
        let payload: serde_json::Value = serde_json::from_slice(&p.payload).map_err(|e| {
            Status::invalid_argument(format!("progress of command {} is not JSON: {e}", p.id))
        })?;
        if !payload.is_object() {
            return Err(Status::invalid_argument(format!(
                "progress of command {} is not a JSON object",
                p.id
            )));
        }
        let stored = self
            .store
            .command_progress(&s.node_id, epoch(s), &p.id, &payload, p.at_unix_ms)
            .await
            .map_err(unavailable)?;
        if stored {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!(
                "command {} is not a running command of node {}",
                p.id, s.node_id
            )))
        }
    }

    async fn renew_inner(
        &self,
        s: &SessionRef,
        csr_der: &[u8],
        session_key: &[u8],
    ) -> Result<v1::RenewResponse, Status> {
        let csr = renewal_csr(csr_der, session_key)?;
        let node = self
            .store
            .node(&s.node_id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| Status::not_found("node not found"))?;
        if node.state.is_revoked() || node.session_epoch != epoch(s) {
            return Err(stale(s));
        }
        // The key must still be the node's: a reclaim supersedes it (and bumps the epoch, refused above; this holds
        // even for a session opened before the reclaim committed). Renewals are rare: one read is cheap here.
        let current = self
            .store
            .node_public_key(&s.node_id)
            .await
            .map_err(unavailable)?;
        if current.as_deref() != Some(session_key) {
            return Err(Status::permission_denied(format!(
                "renewal refused: this key is no longer node {}'s (superseded by a reclaim)",
                s.node_id
            )));
        }
        let issued = self
            .ca
            .issue_workload(
                &csr,
                Role::Node,
                &s.node_id,
                time::OffsetDateTime::now_utc(),
            )
            .map_err(|e| Status::internal(e.to_string()))?;
        self.store
            .record_node_cert(&s.node_id, &issued.serial_hex, issued.not_after_ms)
            .await
            .map_err(unavailable)?;
        tracing::info!(
            node_id = s.node_id,
            serial = issued.serial_hex,
            "certificate renewed"
        );
        Ok(v1::RenewResponse {
            cert_der: issued.cert_der,
            chain_der: Vec::new(),
            trust_bundle_der: vec![self.ca.cert_der().to_vec()],
            not_after_unix_ms: issued.not_after_ms,
        })
    }

    async fn pending_inner(
        &self,
        sessions: &[SessionRef],
    ) -> Result<Vec<(String, v1::GatewayMessage)>, Status> {
        let nodes: Vec<(String, i64)> = sessions
            .iter()
            .map(|s| (s.node_id.clone(), epoch(s)))
            .collect();
        let epochs: HashMap<&str, u64> = sessions
            .iter()
            .map(|s| (s.node_id.as_str(), s.epoch))
            .collect();
        let mut out = Vec::new();
        for o in self
            .store
            .pending_for(&nodes, crate::now_ms())
            .await
            .map_err(unavailable)?
        {
            match o {
                Outgoing::Command {
                    node_id,
                    id,
                    kind,
                    args,
                    deadline_ms,
                } => out.push((
                    node_id,
                    v1::GatewayMessage {
                        msg: Some(v1::gateway_message::Msg::Command(v1::Command {
                            id,
                            kind,
                            args: args.to_string().into_bytes(),
                            deadline_unix_ms: deadline_ms,
                        })),
                    },
                )),
                Outgoing::Desired {
                    node_id,
                    generation,
                    spec,
                } => {
                    let e = epochs.get(node_id.as_str()).copied().unwrap_or(0);
                    let mut delivered = self
                        .delivered
                        .lock()
                        .map_err(|_| Status::internal("lock"))?;
                    if delivered.get(&node_id) == Some(&(e, generation)) {
                        continue;
                    }
                    delivered.insert(node_id.clone(), (e, generation));
                    out.push((
                        node_id,
                        v1::GatewayMessage {
                            msg: Some(v1::gateway_message::Msg::DesiredState(v1::DesiredState {
                                generation: u64::try_from(generation).unwrap_or(0),
                                spec: spec.to_string().into_bytes(),
                            })),
                        },
                    ));
                }
            }
        }
        Ok(out)
    }
}

/// Proof of possession for a renewal: the CSR's signature verifies with the key it names, and that key is the one
/// the session's certificate certifies (`session_key`, proven in the TLS handshake). A CSR naming the node's key but
/// signed by another, or signed by another key altogether, is refused.
pub fn renewal_csr(csr_der: &[u8], session_key: &[u8]) -> Result<VerifiedCsr, Status> {
    let csr = verify_csr(csr_der).map_err(|e| match e {
        CsrError::BadSignature => Status::permission_denied(format!("renewal refused: {e}")),
        _ => Status::invalid_argument(format!("renewal refused: {e}")),
    })?;
    if session_key.is_empty() || csr.public_point != session_key {
        return Err(Status::permission_denied(
            "renewal CSR is signed by another key than the one this session's certificate certifies",
        ));
    }
    Ok(csr)
}

impl SessionBackend for ControlSessions {
    fn open(
        &self,
        node_id: &str,
        public_key: &[u8],
        hello: &v1::Hello,
    ) -> BoxFuture<'_, Result<SessionGrant, Status>> {
        let (node_id, key, hello) = (node_id.to_string(), public_key.to_vec(), hello.clone());
        Box::pin(self.cut("opening a session", async move {
            self.open_inner(&node_id, &key, &hello).await
        }))
    }

    fn inventory(
        &self,
        s: &SessionRef,
        section: v1::InventorySection,
    ) -> BoxFuture<'_, Result<(), Status>> {
        let s = s.clone();
        Box::pin(self.cut("storing inventory", async move {
            self.inventory_inner(&s, section).await
        }))
    }

    fn ack(&self, s: &SessionRef, ack: v1::DesiredStateAck) -> BoxFuture<'_, Result<(), Status>> {
        let s = s.clone();
        Box::pin(self.cut("storing an acknowledgement", async move {
            let generation = i64::try_from(ack.generation).unwrap_or(i64::MAX);
            let applied = ack.outcome == "applied";
            let message = ack_reason(&ack);
            let ok = self
                .store
                .ack_desired(&s.node_id, epoch(&s), generation, applied, &message)
                .await
                .map_err(unavailable)?;
            if ok {
                if applied {
                    tracing::info!(node_id = s.node_id, generation, "desired state applied");
                } else {
                    tracing::warn!(
                        node_id = s.node_id,
                        generation,
                        reason = message,
                        "the node could not apply its desired state"
                    );
                }
                Ok(())
            } else {
                Err(stale(&s))
            }
        }))
    }

    fn result(
        &self,
        s: &SessionRef,
        result: v1::CommandResult,
    ) -> BoxFuture<'_, Result<(), Status>> {
        let s = s.clone();
        Box::pin(self.cut("storing a command result", async move {
            self.result_inner(&s, result).await
        }))
    }

    fn progress(
        &self,
        s: &SessionRef,
        progress: v1::CommandProgress,
    ) -> BoxFuture<'_, Result<(), Status>> {
        let s = s.clone();
        Box::pin(self.cut("storing progress", async move {
            self.progress_inner(&s, progress).await
        }))
    }

    fn renew(
        &self,
        s: &SessionRef,
        csr_der: Vec<u8>,
        session_key: Vec<u8>,
    ) -> BoxFuture<'_, Result<v1::RenewResponse, Status>> {
        let s = s.clone();
        Box::pin(self.cut("renewing a certificate", async move {
            self.renew_inner(&s, &csr_der, &session_key).await
        }))
    }

    fn closed(&self, ended: &Seen) -> BoxFuture<'_, ()> {
        let (s, at_ms) = (ended.session.clone(), ended.at_ms);
        Box::pin(async move {
            let close = self.closes.call((s.node_id.clone(), epoch(&s), at_ms));
            if let Err(e) = self.cut("recording a session's close", close).await {
                tracing::warn!(
                    error = e.message(),
                    node_id = s.node_id,
                    "recording session close"
                );
            }
            if let Ok(mut d) = self.delivered.lock()
                && d.get(&s.node_id).is_some_and(|(e, _)| *e == s.epoch)
            {
                d.remove(&s.node_id);
            }
        })
    }

    fn liveness(&self, seen: &[Seen]) -> BoxFuture<'_, Result<Vec<String>, Status>> {
        let rows: Vec<(String, i64, i64)> = seen
            .iter()
            .map(|s| (s.session.node_id.clone(), epoch(&s.session), s.at_ms))
            .collect();
        Box::pin(self.cut("writing liveness", async move {
            self.store
                .record_liveness(&rows, LAST_SEEN_RESOLUTION_MS)
                .await
                .map_err(unavailable)
        }))
    }

    fn pending(
        &self,
        sessions: &[SessionRef],
    ) -> BoxFuture<'_, Result<Vec<(String, v1::GatewayMessage)>, Status>> {
        let sessions = sessions.to_vec();
        Box::pin(self.cut("pulling pending messages", async move {
            self.pending_inner(&sessions).await
        }))
    }

    fn revoked_since(&self, since: Option<i64>) -> BoxFuture<'_, Result<RevokedSince, Status>> {
        Box::pin(self.cut("reading revocations", async move {
            let revoked = self
                .store
                .revoked_identities_since(since)
                .await
                .map_err(unavailable)?;
            let nodes = revoked.nodes.iter().map(|id| (Role::Node, id));
            let sites = revoked.sites.iter().map(|id| (Role::Site, id));
            let identities = nodes
                .chain(sites)
                .filter_map(|(role, id)| SpiffeId::new(&self.trust_domain, role, id).ok())
                .collect();
            let keys = revoked
                .keys
                .iter()
                .filter_map(|k| hex::decode(k).ok()?.try_into().ok())
                .collect();
            Ok(RevokedSince {
                identities,
                keys,
                watermark_ms: revoked.watermark_ms,
            })
        }))
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
