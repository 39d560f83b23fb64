use super::*;

/// An entry as a session's task registers it; the receiver sees the status the session is asked to end with.
fn entry(epoch: u64) -> (Entry, watch::Receiver<Option<Status>>) {
    let (tx, _rx) = mpsc::channel(1);
    let (close, closed) = watch::channel(None);
    let e = Entry {
        epoch,
        last_seen_ms: Arc::new(AtomicI64::new(0)),
        tx,
        close,
    };
    (e, closed)
}

/// A stopping gateway's repeated close leaves a session already told to close as it was told: a revoked node's
/// PERMISSION_DENIED (it stops) is not turned into the stop's ABORTED (it would reconnect).
#[test]
fn closing_every_session_keeps_a_close_already_given() {
    let registry = Registry::default();
    let (revoked, revoked_closed) = entry(1);
    registry.insert("revoked", revoked);
    let (other, other_closed) = entry(1);
    registry.insert("other", other);
    registry.close_with("revoked", Status::permission_denied("revoked"));
    for _ in 0..2 {
        registry.close_all("gateway shutting down");
    }
    let code = |c: &watch::Receiver<Option<Status>>| c.borrow().as_ref().map(Status::code);
    assert_eq!(code(&revoked_closed), Some(tonic::Code::PermissionDenied));
    assert_eq!(code(&other_closed), Some(tonic::Code::Aborted));
}

/// The store judges the sessions of one snapshot; a node that reconnected while it did keeps its new session.
#[test]
fn a_verdict_on_a_superseded_session_spares_the_nodes_newer_one() {
    let registry = Registry::default();
    let (first, first_closed) = entry(1);
    registry.insert("n", first);
    let seen = registry.snapshot();
    // The node reconnects while the liveness statement runs: epoch 2 replaces epoch 1 here.
    let (second, second_closed) = entry(2);
    registry.insert("n", second);
    assert!(
        first_closed.borrow().is_some(),
        "the first session was superseded"
    );
    // The store answers for the snapshot: epoch 1 must end.
    close_judged(&registry, &seen, &["n".to_string()]);
    assert!(
        second_closed.borrow().is_none(),
        "the verdict on epoch 1 closed epoch 2"
    );
    // A verdict on the current session closes it.
    close_judged(&registry, &registry.snapshot(), &["n".to_string()]);
    let status = second_closed.borrow().clone();
    assert_eq!(
        status.map(|s| s.message().to_string()).as_deref(),
        Some("revoked, superseded or closed by the control plane")
    );
    // A node the snapshot did not hold is not touched.
    let (other, other_closed) = entry(1);
    registry.insert("m", other);
    close_judged(&registry, &seen, &["m".to_string()]);
    assert!(other_closed.borrow().is_none());
}

/// What a restarted gateway asks before it takes a node it once held for offline (`Registry::holds`): only the epoch
/// it holds now counts, and a superseded session's task, ending after its successor registered, does not take the
/// successor out of the registry.
#[test]
fn it_holds_only_the_current_epoch_and_a_superseded_sessions_end_keeps_the_new_one() {
    let registry = Registry::default();
    assert!(!registry.holds("n", 1), "nothing is held before a session");
    let (first, _first_closed) = entry(1);
    registry.insert("n", first);
    assert!(registry.holds("n", 1));
    assert!(!registry.holds("n", 2));
    assert!(!registry.holds("m", 1));
    let (second, _second_closed) = entry(2);
    registry.insert("n", second);
    assert!(!registry.holds("n", 1), "epoch 1 was superseded");
    assert!(registry.holds("n", 2));
    let session = |epoch| SessionRef {
        node_id: "n".into(),
        epoch,
    };
    registry.remove(&session(1));
    assert!(
        registry.holds("n", 2),
        "the old session's end removed the new one"
    );
    registry.remove(&session(2));
    assert!(!registry.holds("n", 2));
    assert!(registry.is_empty());
}

/// A store call that never answers (a primary gone silent) ends at the deadline as UNAVAILABLE naming what it was,
/// so a session's task or the housekeeping task goes on; one that answers is passed through.
#[tokio::test(start_paused = true)]
async fn a_store_call_that_never_answers_ends_at_the_deadline() {
    let t = tokio::time::Instant::now();
    let silent = stored(
        "storing inventory",
        std::future::pending::<Result<(), Status>>(),
    )
    .await;
    let s = silent.expect_err("no answer");
    assert_eq!(s.code(), tonic::Code::Unavailable);
    assert_eq!(
        s.message(),
        "storing inventory: the database did not answer within 30 s"
    );
    assert_eq!(t.elapsed(), STORE_DEADLINE);
    assert_eq!(
        stored("x", async { Ok::<_, Status>(7) }).await.ok(),
        Some(7)
    );
}

/// A queue with no room (a node that stopped reading) is given up at the deadline; one with room takes the message.
#[tokio::test(start_paused = true)]
async fn queueing_for_a_node_that_reads_nothing_ends_at_the_deadline() {
    let (tx, _rx) = mpsc::channel::<Outbound>(1);
    assert!(queue_within(&tx, Err(Status::aborted("first")), CLOSE_QUEUE_WITHIN).await);
    let t = tokio::time::Instant::now();
    assert!(!queue_within(&tx, Err(Status::aborted("second")), CLOSE_QUEUE_WITHIN).await);
    assert_eq!(t.elapsed(), CLOSE_QUEUE_WITHIN);
}
