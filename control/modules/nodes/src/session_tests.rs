//! Tests of the control plane's side of sessions (`session.rs`).

use super::*;
use rcgen::{CertificateParams, KeyPair, PKCS_ECDSA_P256_SHA256, PublicKeyData, SigningKey};

/// Names one key in the CSR and signs with another: what a thief of the certificate (not the key) could send.
struct Impostor<'a> {
    named: &'a KeyPair,
    signer: &'a KeyPair,
}

impl PublicKeyData for Impostor<'_> {
    fn der_bytes(&self) -> &[u8] {
        self.named.der_bytes()
    }
    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        self.named.algorithm()
    }
}

impl SigningKey for Impostor<'_> {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.signer.sign(msg)
    }
}

#[test]
fn renewal_needs_proof_of_possession_of_the_session_key() -> Result<(), Box<dyn std::error::Error>>
{
    let node = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let stranger = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let session_key = node.public_key_raw().to_vec();
    let csr = |k: &dyn Fn(&CertificateParams) -> Result<Vec<u8>, rcgen::Error>| {
        k(&CertificateParams::default())
    };
    let own = csr(&|p| Ok(p.serialize_request(&node)?.der().to_vec()))?;
    let other = csr(&|p| Ok(p.serialize_request(&stranger)?.der().to_vec()))?;
    let forged = csr(&|p| {
        let k = Impostor {
            named: &node,
            signer: &stranger,
        };
        Ok(p.serialize_request(&k)?.der().to_vec())
    })?;

    assert!(
        renewal_csr(&own, &session_key).is_ok(),
        "the node's own key renews"
    );
    let e = renewal_csr(&other, &session_key)
        .err()
        .ok_or("another key renewed")?;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("another key"), "{e:?}");
    let e = renewal_csr(&forged, &session_key)
        .err()
        .ok_or("a forged CSR renewed")?;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("signature"), "{e:?}");
    let e = renewal_csr(&own, &[])
        .err()
        .ok_or("a session without a key renewed")?;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    let e = renewal_csr(b"not a csr", &session_key)
        .err()
        .ok_or("garbage renewed")?;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    Ok(())
}

/// Takes no section: the opens below send none.
struct NoInventory;

impl bc_core::api::inventory::InventorySink for NoInventory {
    fn record<'a>(
        &'a self,
        _: bc_core::api::inventory::SectionReport<'a>,
    ) -> bc_core::api::inventory::RecordFuture<'a> {
        Box::pin(async {
            Err(bc_core::api::inventory::InventoryRefusal::Invalid(
                "this test takes no inventory".into(),
            ))
        })
    }
}

/// Transactions that took a transaction id (every write) since `since`, on a clock of the database's own:
/// exact, unlike the statistics, which a backend reports up to a second late.
async fn writes_since(store: &Store, since: i64) -> i64 {
    let now: i64 = bc_store::sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
        .fetch_one(store.pool())
        .await
        .expect("xid");
    now - since - 1
}

/// Nodes `n1` to `n{count}` in pool `p1`, adopting, each with the public key `04ab` (what a session open checks).
async fn adopting_nodes(store: &Store, count: i32) -> Result<(), Box<dyn std::error::Error>> {
    store.ensure_root_tenant().await?;
    store.ensure_pool("p1", "root", "pool one", true).await?;
    bc_store::sqlx::query(
        "INSERT INTO nodes (id, shard, pool_id, state, claims, join_key_hash, joined_at, cert_serial, \
         cert_not_after, public_key) SELECT 'n' || i, bc_shard('n' || i), 'p1', 'adopting', '{}', 'k' || i, now(), i::text, now() + interval '1 day', \
         '\\x04ab'::bytea FROM generate_series(1, $1) i",
    )
    .bind(count)
    .execute(store.pool())
    .await?;
    Ok(())
}

/// Opens that wait together share a statement: 200 nodes opening at once (a reconnect storm's shape) each get
/// their session and epoch, in a few write transactions, not 200; the last open, alone, still goes at once.
#[tokio::test]
async fn opens_that_wait_together_share_one_statement() -> Result<(), Box<dyn std::error::Error>> {
    let db = bc_store::testing::test_db().await;
    let store = Store::new(db.pool.clone());
    adopting_nodes(&store, 200).await?;
    let dir = tempfile::tempdir()?;
    let ca = Arc::new(Ca::load_or_create(dir.path(), "test.local")?);
    let sessions = Arc::new(
        ControlSessions::new(store.clone(), ca, Arc::new(NoInventory)).on_gateway("gw-test"),
    );
    let hello = v1::Hello::default();
    let before: i64 = bc_store::sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
        .fetch_one(store.pool())
        .await?;
    let mut opens = tokio::task::JoinSet::new();
    for i in 1..=200 {
        let (sessions, hello) = (sessions.clone(), hello.clone());
        opens.spawn(async move { sessions.open(&format!("n{i}"), &[0x04, 0xab], &hello).await });
    }
    let mut epochs = Vec::new();
    while let Some(opened) = opens.join_next().await {
        epochs.push(opened??.epoch);
    }
    assert_eq!(epochs, vec![1; 200], "every node opened its first session");
    let writes = writes_since(&store, before).await;
    assert!(
        (1..=20).contains(&writes),
        "200 opens at once took {writes} write transactions"
    );
    let online: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM nodes WHERE online AND session_epoch = 1 AND gateway_id = 'gw-test'",
    )
    .fetch_one(store.pool())
    .await?;
    assert_eq!(online, 200);
    // Alone: answered by a statement of its own, and a refusal says why.
    let again = sessions.open("n7", &[0x04, 0xab], &hello).await?;
    assert_eq!(again.epoch, 2);
    let e = sessions
        .open("n8", &[0x04, 0xcd], &hello)
        .await
        .err()
        .ok_or("a key that is not the node's opened a session")?;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    Ok(())
}

/// The database primary goes silent (no reset) under the gateway's calls, and the pool moves to another primary:
/// liveness, the pull of waiting messages and an open (its group's statement) are answered UNAVAILABLE at the
/// move, not at the gateway's 30 s deadline, and the next open is served on the new primary. Before, the
/// gateway's housekeeping waited out its calls in turn: in `BC_FAILOVER_FAILURE=hang scripts/bench failover` a
/// command queued after the hang was done 6.8–7.0 s after it, 5.0–5.1 s with the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_on_a_silent_primary_are_answered_at_its_move()
-> Result<(), Box<dyn std::error::Error>> {
    let primary = bc_store::testing::SilentPrimary::start(6).await;
    adopting_nodes(&Store::new(primary.db.pool.clone()), 3).await?;
    let dir = tempfile::tempdir()?;
    let ca = Arc::new(Ca::load_or_create(dir.path(), "test.local")?);
    let sessions = Arc::new(
        ControlSessions::new(primary.store.clone(), ca, Arc::new(NoInventory))
            .on_gateway("gw-test"),
    );
    let hello = v1::Hello::default();
    let first = sessions.open("n1", &[0x04, 0xab], &hello).await?;
    let live = SessionRef {
        node_id: "n1".into(),
        epoch: first.epoch,
    };

    primary.silence();
    let mut waiting = tokio::task::JoinSet::new();
    let s = sessions.clone();
    let seen = vec![Seen {
        session: live.clone(),
        at_ms: crate::now_ms(),
    }];
    waiting.spawn(async move { ("liveness", s.liveness(&seen).await.err()) });
    let s = sessions.clone();
    let refs = vec![live.clone()];
    waiting.spawn(async move { ("pending", s.pending(&refs).await.err()) });
    let s = sessions.clone();
    waiting.spawn(async move {
        (
            "open",
            s.open("n2", &[0x04, 0xab], &v1::Hello::default())
                .await
                .err(),
        )
    });
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert_eq!(waiting.len(), 3);
    assert!(
        waiting.try_join_next().is_none(),
        "a call answered through a silent database"
    );

    let moved_now = std::time::Instant::now();
    primary.move_primary();
    let answered = tokio::time::timeout(std::time::Duration::from_secs(5), waiting.join_all())
        .await
        .map_err(|_| "the calls were not answered at the move")?;
    assert!(
        moved_now.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        moved_now.elapsed()
    );
    for (call, e) in answered {
        let e = e.ok_or(format!("{call} succeeded through a silent database"))?;
        assert_eq!(e.code(), tonic::Code::Unavailable, "{call}: {e:?}");
    }
    // The group statements are free again: an open goes to the new primary (connections opened now pass).
    let next = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        sessions.open("n3", &[0x04, 0xab], &hello),
    )
    .await
    .map_err(|_| "an open after the move waited on the old primary")??;
    assert_eq!(next.epoch, 1);
    Ok(())
}
