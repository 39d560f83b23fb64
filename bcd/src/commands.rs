//! Commands from the gateway, run concurrently with the session: each command is its own task, so a long wipe or
//! image stream never holds up heartbeats, inventory or desired state. A finished command's signed result goes to
//! the daemon's outbox ([`Commands`]), which outlives sessions: a result whose session ended before it was sent is
//! sent at the start of the next session. A command id already running, or recently finished, is not run twice
//! (a resent command gets the stored result again), so a gateway that resends after a reconnect is harmless.
//!
//! Running commands may report progress (a small JSON object) through a [`ProgressReporter`]; the daemon sends at
//! most one progress message per command per interval ([`ProgressLimiter`]) so the control plane's database is not
//! loaded by chatty commands.

use crate::gpu::GpuBackend;
use bc_proto::envelope::EnvelopeSigner;
use bc_proto::v1;
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// What an extra command kind produced: a payload the session signs with the node key (`payload_type` names it,
/// e.g. `application/vnd.bettercompute.ramdisk-diagnose+json`; the control plane stores JSON payloads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    pub payload_type: String,
    pub payload: Vec<u8>,
}

/// Command kinds beyond the daemon's own (`diag.nvml`), supplied by the program that embeds the session: the
/// ramdisk answers `ramdisk.*` this way. The session still owns signing and delivery, so every result is signed by
/// the node key whoever produced it.
pub trait CommandHook: Send + Sync {
    /// Whether this hook answers `kind`.
    fn handles(&self, kind: &str) -> bool;
    /// Runs one command (on a blocking thread, concurrently with other commands). `progress` takes reports of
    /// how far it got (rate-limited by the session). `Err` is reported as a signed error result.
    fn run(
        &self,
        command: &v1::Command,
        progress: &ProgressReporter,
    ) -> Result<CommandOutput, String>;
    /// Called once the signed result of command `id` was handed to a live session's stream (again for each
    /// resend). A command whose effect must follow its answer (the ramdisk's kexec) waits for this.
    fn delivered(&self, _id: &str) {}
}

/// The payload type of a signed error result.
pub const ERROR_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.error+json";
/// The largest progress payload sent (JSON bytes); larger reports are dropped with a warning.
pub const MAX_PROGRESS_BYTES: usize = 4096;
/// Finished commands whose results are kept to answer a resent command (and re-sent after a session loss).
const KEEP_FINISHED: usize = 64;
/// Results sent this close to a session's end are sent again in the next one: the old stream may have dropped
/// them from its buffer. The gateway ignores a result for a command already finished.
const RESEND_WINDOW: Duration = Duration::from_secs(30);

/// How long a command (or BMC command) whose deadline is `deadline_unix_ms` may still run at `now_unix_ms`: `None`
/// when it has none (0), `Some(ZERO)` once it passed. Past its deadline the control plane has marked the command
/// expired and may ask again (a metal retry sends the same step anew), so a command must neither start nor keep
/// changing the machine after it. Pure: the caller passes the time.
pub fn time_left(deadline_unix_ms: i64, now_unix_ms: i64) -> Option<Duration> {
    if deadline_unix_ms <= 0 {
        return None;
    }
    let left = deadline_unix_ms.saturating_sub(now_unix_ms);
    Some(Duration::from_millis(u64::try_from(left).unwrap_or(0)))
}

/// The gateway's clock minus this host's, from a clock the gateway sent (`gateway_unix_ms`, read at `now_unix_ms`);
/// `None` when it sent none (0, an older gateway).
pub fn clock_offset(gateway_unix_ms: i64, now_unix_ms: i64) -> Option<i64> {
    (gateway_unix_ms > 0).then(|| gateway_unix_ms.saturating_sub(now_unix_ms))
}

/// A deadline in the gateway's time as one in this node's: `offset_ms` is the gateway's clock minus the node's
/// (measured at the session's Welcome). 0 (no deadline) stays 0.
pub fn local_deadline(deadline_unix_ms: i64, offset_ms: i64) -> i64 {
    if deadline_unix_ms <= 0 {
        return deadline_unix_ms;
    }
    deadline_unix_ms.saturating_sub(offset_ms).max(1)
}

/// [`time_left`] as an instant on the monotonic clock, from the wall clock now.
pub fn deadline_of(c: &v1::Command) -> Option<std::time::Instant> {
    time_left(c.deadline_unix_ms, crate::session::now_ms())
        .map(|left| std::time::Instant::now() + left)
}

// === impl ProgressLimiter ===

/// At most one report per `every` (the first always passes). Pure: the caller passes the time.
#[derive(Debug, Clone)]
pub struct ProgressLimiter {
    every: Duration,
    last: Option<tokio::time::Instant>,
}

impl ProgressLimiter {
    pub fn new(every: Duration) -> ProgressLimiter {
        ProgressLimiter { every, last: None }
    }

    /// Whether a report at `now` may go out; records it when so.
    pub fn admit(&mut self, now: tokio::time::Instant) -> bool {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.every => false,
            _ => {
                self.last = Some(now);
                true
            }
        }
    }
}

// === impl ProgressReporter ===

/// Hands a running command's progress to the session, rate-limited. Cheap to clone; usable from any thread.
#[derive(Clone)]
pub struct ProgressReporter {
    inner: Arc<dyn Fn(serde_json::Value) + Send + Sync>,
}

impl ProgressReporter {
    /// A reporter that calls `f` with every report (no rate limit): for tests and programs without a session.
    pub fn from_fn(f: impl Fn(serde_json::Value) + Send + Sync + 'static) -> ProgressReporter {
        ProgressReporter { inner: Arc::new(f) }
    }

    /// A reporter that drops every report.
    pub fn discard() -> ProgressReporter {
        ProgressReporter::from_fn(|_| {})
    }

    /// Reports how far the command got (a small JSON object).
    pub fn report(&self, progress: serde_json::Value) {
        (self.inner)(progress)
    }

    /// Sends `CommandProgress` for command `id` on `outbox`, at most once per `every`; never blocks (a full outbox
    /// drops the report: progress is advisory).
    fn to_outbox(id: String, outbox: mpsc::Sender<Outgoing>, every: Duration) -> ProgressReporter {
        let limiter = Mutex::new(ProgressLimiter::new(every));
        ProgressReporter::from_fn(move |v| {
            let admitted = limiter
                .lock()
                .map(|mut l| l.admit(tokio::time::Instant::now()))
                .unwrap_or(false);
            if !admitted {
                return;
            }
            let payload = v.to_string().into_bytes();
            if payload.len() > MAX_PROGRESS_BYTES {
                tracing::warn!(
                    command = id,
                    bytes = payload.len(),
                    "progress report over 4 KiB dropped"
                );
                return;
            }
            let p = v1::CommandProgress {
                id: id.clone(),
                payload,
                at_unix_ms: crate::session::now_ms(),
            };
            let _ = outbox.try_send(Outgoing::Progress(p));
        })
    }
}

// === impl Commands ===

/// What command tasks hand to the session for sending.
#[derive(Debug)]
pub(crate) enum Outgoing {
    Result(v1::CommandResult),
    Progress(v1::CommandProgress),
}

#[derive(Default)]
struct Ledger {
    running: HashSet<String>,
    /// The most recent finished results, newest last.
    finished: VecDeque<v1::CommandResult>,
}

/// The daemon's commands across sessions: which run, which finished, and the outbox their messages wait in.
pub(crate) struct Commands {
    ledger: Arc<Mutex<Ledger>>,
    tx: mpsc::Sender<Outgoing>,
    /// Held by the live session (locked for its duration); messages wait here between sessions.
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Outgoing>>>,
    /// Results sent in the current session, with when: re-queued if it ends soon after.
    sent: Vec<(tokio::time::Instant, v1::CommandResult)>,
}

/// What a command task needs from the daemon.
#[derive(Clone)]
pub(crate) struct CommandContext {
    pub gpu: Option<Arc<dyn GpuBackend>>,
    pub hook: Option<Arc<dyn CommandHook>>,
    pub signer: Arc<EnvelopeSigner>,
    pub progress_interval: Duration,
}

impl Commands {
    pub(crate) fn new() -> Commands {
        let (tx, rx) = mpsc::channel(256);
        Commands {
            ledger: Arc::new(Mutex::new(Ledger::default())),
            tx,
            rx: Arc::new(tokio::sync::Mutex::new(rx)),
            sent: Vec::new(),
        }
    }

    /// The outbox receiver, for the session to drain while it lives.
    pub(crate) fn outbox(&self) -> Arc<tokio::sync::Mutex<mpsc::Receiver<Outgoing>>> {
        self.rx.clone()
    }

    /// Remembers a result sent in this session.
    pub(crate) fn sent(&mut self, r: &v1::CommandResult) {
        let now = tokio::time::Instant::now();
        self.sent
            .retain(|(at, _)| now.saturating_duration_since(*at) < RESEND_WINDOW);
        self.sent.push((now, r.clone()));
    }

    /// The session ended: results it sent moments ago may be lost with its stream; queue them again.
    pub(crate) fn session_ended(&mut self) {
        let now = tokio::time::Instant::now();
        for (at, r) in self.sent.drain(..) {
            if now.saturating_duration_since(at) < RESEND_WINDOW {
                let _ = self.tx.try_send(Outgoing::Result(r));
            }
        }
    }

    /// Starts `c` as its own task unless it is running already; a command that finished recently is answered
    /// with its stored result again.
    pub(crate) fn start(&self, c: v1::Command, ctx: CommandContext) {
        {
            let Ok(mut ledger) = self.ledger.lock() else {
                return;
            };
            if ledger.running.contains(&c.id) {
                tracing::info!(
                    command = c.id,
                    kind = c.kind,
                    "command already running; not started twice"
                );
                return;
            }
            if let Some(r) = ledger.finished.iter().find(|r| r.id == c.id) {
                tracing::info!(
                    command = c.id,
                    kind = c.kind,
                    "command already finished; sending its result again"
                );
                let _ = self.tx.try_send(Outgoing::Result(r.clone()));
                return;
            }
            ledger.running.insert(c.id.clone());
        }
        tracing::info!(command = c.id, kind = c.kind, "running command");
        let ledger = self.ledger.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let progress =
                ProgressReporter::to_outbox(c.id.clone(), tx.clone(), ctx.progress_interval);
            let envelope = run(&c, &ctx, progress).await;
            let result = match envelope {
                Ok(env) => v1::CommandResult {
                    id: c.id.clone(),
                    envelope: Some(env),
                },
                Err(e) => {
                    tracing::warn!(command = c.id, error = %e, "command failed to produce a result");
                    if let Ok(mut l) = ledger.lock() {
                        l.running.remove(&c.id);
                    }
                    return;
                }
            };
            if let Ok(mut l) = ledger.lock() {
                l.running.remove(&c.id);
                l.finished.push_back(result.clone());
                while l.finished.len() > KEEP_FINISHED {
                    l.finished.pop_front();
                }
            }
            // Waits while the outbox is full (bounded memory); the daemon owns the receiver, so this only fails
            // when the daemon itself is gone.
            let _ = tx.send(Outgoing::Result(result)).await;
        });
    }
}

/// Runs one command to its signed envelope.
async fn run(
    c: &v1::Command,
    ctx: &CommandContext,
    progress: ProgressReporter,
) -> Result<v1::SignedEnvelope, String> {
    let signer = &ctx.signer;
    // A failure once the deadline has passed is marked so: the control plane has given up on the command (a
    // stream cut at its deadline fails for that reason) and records it as expired, which a metal step retries,
    // rather than as the command's own failure.
    let error = |message: String| {
        let mut payload = serde_json::json!({ "error": message });
        if time_left(c.deadline_unix_ms, crate::session::now_ms()) == Some(Duration::ZERO) {
            payload["deadline_passed"] = serde_json::Value::Bool(true);
        }
        signer
            .sign(ERROR_PAYLOAD_TYPE, payload.to_string().into_bytes())
            .map_err(|e| bc_error_chain::chain(&e))
    };
    let now = crate::session::now_ms();
    if time_left(c.deadline_unix_ms, now) == Some(Duration::ZERO) {
        let late = now.saturating_sub(c.deadline_unix_ms);
        tracing::warn!(
            command = c.id,
            kind = c.kind,
            late_ms = late,
            "command arrived after its deadline; not run"
        );
        return error(format!(
            "{}: arrived {late} ms after its deadline, so it was not run (the control plane has given up on it); \
             check the node's clock against the control plane's if this repeats",
            c.kind
        ));
    }
    match c.kind.as_str() {
        crate::diag::KIND => {
            // The control plane's policy (expected GPU count and any thresholds it sets); a malformed policy is
            // reported in a signed error rather than run with guessed thresholds.
            let policy = match crate::diag::DiagPolicy::from_json(&c.args) {
                Ok(p) => p,
                Err(e) => return error(format!("diag.nvml arguments: {e}")),
            };
            let gpu = ctx.gpu.clone();
            let report = tokio::task::spawn_blocking(move || {
                let backend: &dyn GpuBackend = match &gpu {
                    Some(b) => b.as_ref(),
                    None => &crate::gpu::NoGpus,
                };
                crate::diag::run(backend, &policy)
            })
            .await
            .map_err(|e| bc_error_chain::chain(&e))?;
            crate::diag::sign(&report, signer).map_err(|e| bc_error_chain::chain(&e))
        }
        kind if ctx.hook.as_ref().is_some_and(|h| h.handles(kind)) => {
            let hook = ctx.hook.clone();
            let command = c.clone();
            let out = tokio::task::spawn_blocking(move || match hook {
                Some(h) => h.run(&command, &progress),
                None => Err("no command hook".into()),
            })
            .await
            .unwrap_or_else(|e| Err(format!("the {kind} command panicked or was cancelled: {e}")));
            match out {
                Ok(o) => signer.sign(&o.payload_type, o.payload),
                Err(e) => {
                    tracing::warn!(command = c.id, kind, error = %e, "command failed");
                    return error(format!("{kind}: {e}"));
                }
            }
            .map_err(|e| bc_error_chain::chain(&e))
        }
        other => error(format!("unknown command kind {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn progress_is_limited_to_one_report_per_interval() {
        let mut l = ProgressLimiter::new(Duration::from_secs(1));
        let t0 = tokio::time::Instant::now();
        assert!(l.admit(t0), "the first report passes");
        assert!(!l.admit(t0));
        assert!(!l.admit(t0 + Duration::from_millis(999)));
        assert!(l.admit(t0 + Duration::from_millis(1000)));
        assert!(!l.admit(t0 + Duration::from_millis(1500)));
        assert!(l.admit(t0 + Duration::from_millis(2100)));
        // A clock that goes backwards never floods.
        assert!(!l.admit(t0));
    }

    /// A hook whose one kind takes a while and counts its runs.
    struct Slow(Arc<std::sync::atomic::AtomicUsize>);

    impl CommandHook for Slow {
        fn handles(&self, kind: &str) -> bool {
            kind == "test.slow"
        }

        fn run(
            &self,
            _: &v1::Command,
            progress: &ProgressReporter,
        ) -> Result<CommandOutput, String> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            progress.report(serde_json::json!({"step": 1}));
            std::thread::sleep(Duration::from_millis(300));
            Ok(CommandOutput {
                payload_type: "application/json".into(),
                payload: b"{}".to_vec(),
            })
        }
    }

    fn result_of(m: Option<Outgoing>) -> v1::CommandResult {
        match m {
            Some(Outgoing::Result(r)) => r,
            other => panic!("expected a result, got {other:?}"),
        }
    }

    /// A context whose hook runs `test.slow`, and the count of its runs.
    fn slow_context() -> (Arc<std::sync::atomic::AtomicUsize>, CommandContext) {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let key = rcgen::KeyPair::generate().expect("key");
        let signer =
            EnvelopeSigner::new(&key.serialize_der(), "spiffe://t/node/n".into()).expect("signer");
        let ctx = CommandContext {
            gpu: None,
            hook: Some(Arc::new(Slow(runs.clone()))),
            signer: Arc::new(signer),
            progress_interval: Duration::from_secs(60),
        };
        (runs, ctx)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_id_runs_once_and_its_result_outlives_the_session() {
        let (runs, ctx) = slow_context();
        let mut commands = Commands::new();
        let c = v1::Command {
            id: "c1".into(),
            kind: "test.slow".into(),
            args: Vec::new(),
            deadline_unix_ms: 0,
        };
        // Sent twice while running (a gateway resending after a reconnect): started once.
        commands.start(c.clone(), ctx.clone());
        commands.start(c.clone(), ctx.clone());
        let outbox = commands.outbox();
        let mut outbox = outbox.lock().await;
        let wait = Duration::from_secs(10);
        let first = match tokio::time::timeout(wait, outbox.recv())
            .await
            .expect("in time")
        {
            Some(Outgoing::Progress(p)) => {
                assert_eq!(p.id, "c1");
                result_of(
                    tokio::time::timeout(wait, outbox.recv())
                        .await
                        .expect("in time"),
                )
            }
            other => result_of(other),
        };
        assert_eq!(first.id, "c1");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Sent again after it finished: answered with the stored result, not run again.
        commands.start(c.clone(), ctx.clone());
        let again = result_of(
            tokio::time::timeout(wait, outbox.recv())
                .await
                .expect("in time"),
        );
        assert_eq!(again, first);
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        // A session that ends right after sending it: the result is queued for the next session.
        commands.sent(&first);
        commands.session_ended();
        assert_eq!(result_of(outbox.try_recv().ok()), first);
        // Nothing else is waiting.
        assert!(outbox.try_recv().is_err());
    }

    /// A node whose clock runs an hour behind the gateway's (a fresh machine's RTC) still gives a command the
    /// minute it was given; without the offset it would have an hour and a minute, and one an hour ahead would
    /// refuse every command as late.
    #[test]
    fn deadlines_are_read_in_the_gateways_time() {
        let hour = 3_600_000;
        let gateway_now = 1_800_000_000_000;
        let deadline = gateway_now + 60_000;
        for node_now in [gateway_now - hour, gateway_now, gateway_now + hour] {
            let offset = clock_offset(gateway_now, node_now).expect("a clock was sent");
            assert_eq!(
                time_left(local_deadline(deadline, offset), node_now),
                Some(Duration::from_secs(60)),
                "node at {node_now}"
            );
        }
        assert_eq!(
            clock_offset(0, gateway_now),
            None,
            "an older gateway sends none"
        );
        assert_eq!(local_deadline(0, hour), 0, "no deadline stays none");
        assert_eq!(local_deadline(5, hour), 1, "never turns into none");
        assert_eq!(local_deadline(i64::MAX, -hour), i64::MAX, "saturates");
    }

    #[test]
    fn time_left_counts_to_the_deadline_and_stops_at_zero() {
        assert_eq!(time_left(0, 5_000), None, "no deadline");
        assert_eq!(time_left(-1, 5_000), None);
        assert_eq!(time_left(7_500, 5_000), Some(Duration::from_millis(2_500)));
        assert_eq!(time_left(5_000, 5_000), Some(Duration::ZERO));
        assert_eq!(time_left(1, i64::MAX), Some(Duration::ZERO));
        assert_eq!(
            time_left(i64::MAX, i64::MIN),
            Some(Duration::from_millis(i64::MAX as u64)),
            "saturates rather than wraps"
        );
    }

    /// A command that reaches the node after its deadline (a session that delivered it late, a resend after a
    /// reconnect) is answered with a signed error and never run: the control plane has marked it expired and a
    /// retry may already be on its way. Before, it ran whatever its deadline.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_past_its_deadline_is_answered_and_not_run() {
        let (runs, ctx) = slow_context();
        let commands = Commands::new();
        let late = v1::Command {
            id: "late".into(),
            kind: "test.slow".into(),
            args: Vec::new(),
            deadline_unix_ms: crate::session::now_ms() - 1_500,
        };
        commands.start(late, ctx.clone());
        let outbox = commands.outbox();
        let mut outbox = outbox.lock().await;
        let r = result_of(
            tokio::time::timeout(Duration::from_secs(10), outbox.recv())
                .await
                .expect("in time"),
        );
        let env = r.envelope.expect("signed");
        assert_eq!(env.payload_type, ERROR_PAYLOAD_TYPE);
        let body: serde_json::Value = serde_json::from_slice(&env.payload).expect("JSON");
        let message = body["error"].as_str().expect("error text");
        assert!(
            message.starts_with("test.slow: arrived ") && message.contains("after its deadline"),
            "{message}"
        );
        assert_eq!(body["deadline_passed"], true, "{body}");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
        // One with time left runs.
        let timely = v1::Command {
            id: "timely".into(),
            kind: "test.slow".into(),
            args: Vec::new(),
            deadline_unix_ms: crate::session::now_ms() + 60_000,
        };
        commands.start(timely, ctx);
        loop {
            match tokio::time::timeout(Duration::from_secs(10), outbox.recv())
                .await
                .expect("in time")
            {
                Some(Outgoing::Progress(_)) => continue,
                other => {
                    let r = result_of(other);
                    assert_eq!(r.id, "timely");
                    assert_eq!(r.envelope.expect("signed").payload_type, "application/json");
                    break;
                }
            }
        }
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_chatty_command_sends_about_one_progress_a_second() {
        let (tx, mut rx) = mpsc::channel(1024);
        let r = ProgressReporter::to_outbox("c1".into(), tx, Duration::from_secs(1));
        // 100 reports a second for 5 s.
        for i in 0..500u32 {
            r.report(serde_json::json!({ "i": i }));
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        r.report(serde_json::json!({ "big": "x".repeat(MAX_PROGRESS_BYTES) }));
        let mut sent = Vec::new();
        while let Ok(m) = rx.try_recv() {
            match m {
                Outgoing::Progress(p) => sent.push(p),
                Outgoing::Result(_) => panic!("no results here"),
            }
        }
        assert_eq!(sent.len(), 5, "one per second over 5 s");
        assert!(sent.iter().all(|p| p.id == "c1" && p.at_unix_ms > 0));
        let first: serde_json::Value = serde_json::from_slice(&sent[0].payload).expect("JSON");
        assert_eq!(first["i"], 0);
    }
}
