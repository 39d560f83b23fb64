//! Calls of one kind carried out in groups, one statement per group (the sessions' opens and closes).

use bc_gateway::BoxFuture;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::session::unavailable;

/// The most opens, or closes, one statement takes.
pub(crate) const GROUP: usize = 256;

/// One group's statement: one answer per request, in the order of the requests.
pub(crate) type RunGroup<R, A> =
    Arc<dyn Fn(Vec<R>) -> BoxFuture<'static, Result<Vec<A>, bc_store::StoreError>> + Send + Sync>;

/// A request waiting for its group's statement, and where its answer goes.
type Waiting<R, A> = (R, oneshot::Sender<Result<A, Status>>);

/// Calls of one kind carried out in groups, one statement for all the calls that waited while the previous one ran
/// (group commit): a call that finds none running goes at once, alone, and in a reconnect storm (opens) or a
/// gateway's stop (closes) the calls that arrive while one statement runs share the next one instead of each taking
/// a connection, a statement and a commit of its own. The task that runs the groups starts at the first call and
/// ends when the sessions' backend is dropped.
pub(crate) struct Grouped<R, A> {
    /// What runs the groups, for the error when it is gone ("session opener").
    what: &'static str,
    run: RunGroup<R, A>,
    queue: std::sync::OnceLock<mpsc::Sender<Waiting<R, A>>>,
}

impl<R: Send + 'static, A: Send + 'static> Grouped<R, A> {
    pub(crate) fn new(what: &'static str, run: RunGroup<R, A>) -> Grouped<R, A> {
        Grouped {
            what,
            run,
            queue: std::sync::OnceLock::new(),
        }
    }

    /// Waits for the group that takes `request`, and its answer.
    pub(crate) async fn call(&self, request: R) -> Result<A, Status> {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(4 * GROUP);
            tokio::spawn(run_groups(rx, self.run.clone()));
            tx
        });
        let lost =
            || Status::unavailable(format!("the control plane's {} stopped; retry", self.what));
        let (answer, answered) = oneshot::channel();
        queue.send((request, answer)).await.map_err(|_| lost())?;
        answered.await.map_err(|_| lost())?
    }
}

async fn run_groups<R, A>(mut rx: mpsc::Receiver<Waiting<R, A>>, run: RunGroup<R, A>) {
    let mut group = Vec::with_capacity(GROUP);
    while rx.recv_many(&mut group, GROUP).await > 0 {
        let (requests, answers): (Vec<R>, Vec<_>) = group.drain(..).unzip();
        match run(requests).await {
            Ok(results) => {
                for (answer, result) in answers.into_iter().zip(results) {
                    let _ = answer.send(Ok(result));
                }
            }
            Err(e) => {
                let status = unavailable(e);
                for answer in answers {
                    let _ = answer.send(Err(status.clone()));
                }
            }
        }
    }
}
