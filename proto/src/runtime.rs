//! The one runtime builder and shutdown signal the binaries share (`bcd`, `better-compute`).

/// A multi-threaded tokio runtime with `workers` threads (all cores when `None`). Raises the process's descriptor
/// limit first ([`raise_nofile_limit`]): every binary that builds a runtime is a daemon or talks to one.
pub fn build(workers: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    raise_nofile_limit();
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

/// Raises the soft descriptor limit (RLIMIT_NOFILE) to the hard limit and returns the soft limit now in force.
///
/// Service managers start processes with a soft limit of 1,024 (systemd's default, kept low for programs that use
/// select(2)) and a hard limit far above it (systemd: 524,288), leaving it to each program to raise its own: a
/// gateway holding thousands of connections fails with "Too many open files" otherwise. None of our binaries use
/// select(2). An infinite hard limit is capped at the kernel's `fs.nr_open`. If the raise fails the limit stays as
/// it was, and that is what is returned.
pub fn raise_nofile_limit() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20)
    });
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= hard {
        return soft;
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard),
            maximum: limit.maximum,
        },
    ) {
        Ok(()) => hard,
        Err(_) => soft,
    }
}

/// The soft descriptor limit (RLIMIT_NOFILE) in force: what the process may open before "Too many open files".
pub fn nofile_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_descriptor_limit_is_raised_to_the_hard_limit() {
        let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
        let now = raise_nofile_limit();
        assert_eq!(now, nofile_limit(), "returns the limit in force");
        if let Some(hard) = hard {
            assert_eq!(now, hard, "soft raised to the hard limit");
        }
        assert_eq!(raise_nofile_limit(), now, "raising again changes nothing");
    }
}
