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

/// Whether log lines may carry colour codes: stderr is a terminal and `NO_COLOR` (no-color.org) is unset or
/// empty. Logs written to files and journals stay greppable.
pub fn ansi() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// What `--version` prints after the program's name: the package version and the commit it was built from
/// (`0.1.0 (commit 1a2b3c4d5e6f)`), or that the build was not stamped. The binaries pass `option_env!("BC_COMMIT")`
/// from their `main.rs` (scripts/package sets it), so only the binary crate reads it and a new commit never
/// rebuilds a library.
pub fn version(package: &str, commit: Option<&str>) -> &'static str {
    let text = match commit.map(str::trim).filter(|c| !c.is_empty()) {
        Some(c) => format!("{package} (commit {c})"),
        None => format!("{package} (commit unknown: built without BC_COMMIT)"),
    };
    Box::leak(text.into_boxed_str())
}

/// The exit status of a program whose reader went away (128 + SIGPIPE), as a shell reports `seq 9999 | head -1`.
pub const BROKEN_PIPE_EXIT: i32 = 141;

/// Makes a write to a closed stdout (`better-compute nodes list | head -1`) end the program quietly with
/// [`BROKEN_PIPE_EXIT`], as SIGPIPE ends C programs, instead of `println!`'s panic and its message. Rust ignores
/// SIGPIPE, so the write fails with EPIPE and `println!` panics with "failed printing to stdout"; that one panic
/// is recognised here and every other goes to the default hook. Call it first in `main`.
pub fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(BROKEN_PIPE_EXIT);
        }
        default(info);
    }));
}

/// The service manager's side of a daemon (systemd's `Type=notify`, sd_notify(3)): readiness, a status line,
/// stopping, and the watchdog. Every call is a no-op when the process was not started with `NOTIFY_SOCKET` (a
/// terminal, a test, another supervisor), and a failed send is logged, never fatal: the service manager is an
/// observer of the daemon, not a dependency.
pub mod service {
    use sd_notify::NotifyState;
    use std::time::Duration;

    fn send(states: &[NotifyState]) {
        // sd_notify is itself a no-op without NOTIFY_SOCKET.
        if let Err(e) = sd_notify::notify(false, states) {
            tracing::warn!(error = %e, "telling the service manager failed (NOTIFY_SOCKET)");
        }
    }

    /// The daemon does its job now (its listeners are bound, its loops started): `READY=1` with a status line.
    pub fn ready(status: &str) {
        send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    /// A one-line status (`systemctl status` shows it), e.g. whether the session is up.
    pub fn status(status: &str) {
        send(&[NotifyState::Status(status)]);
    }

    /// The daemon is shutting down on purpose (`STOPPING=1`), so a slow drain is not mistaken for a hang.
    pub fn stopping() {
        send(&[NotifyState::Stopping]);
    }

    /// The ping interval the service manager asked for (half of `WATCHDOG_USEC`, as sd_watchdog_enabled(3)
    /// advises), or None when it asked for none or asked another process (`WATCHDOG_PID`).
    pub fn watchdog_interval() -> Option<Duration> {
        let mut usec = 0u64;
        (sd_notify::watchdog_enabled(false, &mut usec) && usec > 0)
            .then(|| Duration::from_micros(usec / 2).max(Duration::from_millis(10)))
    }

    /// The watchdog's pinger; the pings stop when it is dropped.
    pub struct Watchdog(Option<tokio::task::JoinHandle<()>>);

    impl Drop for Watchdog {
        fn drop(&mut self) {
            if let Some(task) = self.0.take() {
                task.abort();
            }
        }
    }

    /// Pings the watchdog (`WATCHDOG=1`) from a task on the current runtime, at [`watchdog_interval`], until the
    /// returned guard is dropped. The pings stop when the runtime stops making progress (every worker stuck, the
    /// timer wheel not turning), and then the service manager restarts the daemon: that is the hang it catches.
    /// Pings nothing when no watchdog was asked for. Call it from inside the runtime.
    pub fn spawn_watchdog() -> Watchdog {
        let Some(every) = watchdog_interval() else {
            return Watchdog(None);
        };
        tracing::info!(every_ms = every.as_millis() as u64, "watchdog pings on");
        Watchdog(Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                send(&[NotifyState::Watchdog]);
            }
        })))
    }
}

/// The daemons' and CLIs' log setup: to stderr, filtered by `$<filter_env>` (else `default`), colour only on a
/// terminal without `NO_COLOR` ([`ansi`]). Under systemd (stderr is the journal's stream, [`logs::to_journal`]) each
/// line starts with its syslog priority as sd-daemon(3) spells it (`<3>` error, `<4>` warn, `<6>` info, `<7>`
/// debug and trace) and carries no timestamp of its own, so journald files it at that priority and
/// `journalctl -p err` shows the errors alone.
#[cfg(feature = "logs")]
pub mod logs {
    use std::fmt;
    use tracing::{Event, Level, Subscriber};
    use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
    use tracing_subscriber::fmt::{FmtContext, format};
    use tracing_subscriber::registry::LookupSpan;

    /// Installs the global subscriber (once, first thing in `main`).
    pub fn init(filter_env: &str, default: &str) {
        let filter = tracing_subscriber::EnvFilter::try_from_env(filter_env)
            .unwrap_or_else(|_| default.into());
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        if to_journal() {
            builder
                .with_ansi(false)
                .event_format(journal_format())
                .init();
        } else {
            builder.with_ansi(super::ansi()).init();
        }
    }

    /// The journal's line format: `<priority>` first, no timestamp (journald stamps each line itself).
    fn journal_format() -> Prioritized<format::Format<format::Full, ()>> {
        Prioritized(format().without_time())
    }

    /// Whether stderr is connected to the journal: systemd sets `JOURNAL_STREAM=<device>:<inode>` to the stream it
    /// gave the service (systemd.exec(5)); a child whose stderr was redirected elsewhere sees another file.
    pub fn to_journal() -> bool {
        let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
            return false;
        };
        let Ok(stat) = rustix::fs::fstat(std::io::stderr()) else {
            return false;
        };
        journal_stream_is(&v.to_string_lossy(), stat.st_dev, stat.st_ino)
    }

    /// `JOURNAL_STREAM`'s `<device>:<inode>` names this file.
    pub fn journal_stream_is(value: &str, dev: u64, ino: u64) -> bool {
        value
            .split_once(':')
            .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)))
            == Some((dev, ino))
    }

    /// The sd-daemon(3) prefix of a level.
    pub fn priority(level: &Level) -> u8 {
        match *level {
            Level::ERROR => 3,
            Level::WARN => 4,
            Level::INFO => 6,
            _ => 7,
        }
    }

    /// A format with each event's `<priority>` before it.
    struct Prioritized<F>(F);

    impl<S, N, F> FormatEvent<S, N> for Prioritized<F>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'a> FormatFields<'a> + 'static,
        F: FormatEvent<S, N>,
    {
        fn format_event(
            &self,
            ctx: &FmtContext<'_, S, N>,
            mut writer: Writer<'_>,
            event: &Event<'_>,
        ) -> fmt::Result {
            write!(writer, "<{}>", priority(event.metadata().level()))?;
            self.0.format_event(ctx, writer, event)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// A writer the test reads back.
        #[derive(Clone, Default)]
        struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0
                    .lock()
                    .map_err(|_| std::io::Error::other("poisoned"))?
                    .extend_from_slice(b);
                Ok(b.len())
            }

            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }

        #[test]
        fn each_line_starts_with_its_level_priority_and_no_time() {
            let buffer = Buffer::default();
            let out = buffer.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_max_level(Level::TRACE)
                .with_ansi(false)
                .with_writer(move || out.clone())
                .event_format(journal_format())
                .finish();
            tracing::subscriber::with_default(subscriber, || {
                tracing::error!(node = "n-1", "session lost");
                tracing::warn!("retrying");
                tracing::info!("ready");
                tracing::debug!("detail");
            });
            let text = String::from_utf8(buffer.0.lock().map(|b| b.clone()).unwrap_or_default())
                .unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 4, "{text}");
            for (line, prefix) in lines.iter().zip(["<3>", "<4>", "<6>", "<7>"]) {
                assert!(line.starts_with(prefix), "{line}");
                // No timestamp: the level follows the priority.
                assert!(
                    line[3..].trim_start().starts_with(['E', 'W', 'I', 'D']),
                    "{line}"
                );
            }
            assert!(lines[0].contains("session lost") && lines[0].contains("node=\"n-1\""));
        }

        #[test]
        fn the_journal_stream_names_a_device_and_inode() {
            assert!(journal_stream_is("64768:1234", 64768, 1234));
            assert!(!journal_stream_is("64768:1234", 64768, 1235));
            assert!(!journal_stream_is("garbage", 0, 0));
            assert!(!journal_stream_is("", 0, 0));
            assert_eq!(
                [
                    Level::ERROR,
                    Level::WARN,
                    Level::INFO,
                    Level::DEBUG,
                    Level::TRACE
                ]
                .map(|l| priority(&l)),
                [3, 4, 6, 7, 7]
            );
        }
    }
}
