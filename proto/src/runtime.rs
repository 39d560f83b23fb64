//! The one runtime builder and shutdown signal the binaries share (`bcd`, `better-compute`).

/// A multi-threaded tokio runtime with `workers` threads (all cores when `None`).
pub fn build(workers: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = workers {
        b.worker_threads(n.max(1));
    }
    b.enable_all().build()
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when the future is first
/// polled: a program that prints "ready" and then awaits it must not be killed by a signal sent right after the
/// print (a test that did exactly that saw `dev` die of SIGTERM on a fresh machine).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).ok();
    let int = signal(SignalKind::interrupt()).ok();
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = wait(term) => {}
            _ = wait(int) => {}
        }
    }
}
