//! A deadline on every call into a GPU backend. A GPU in a bad state (one that fell off the bus, Xid 79) can keep
//! an NVML call from returning for minutes or for good, and the daemon calls its backend from its session loop
//! (inventory, desired state), its commands and its telemetry: one such call would freeze the session, and the
//! node would drop out of the fleet exactly when it is needed. [`Watchdog`] runs each call on a thread of its own
//! and waits at most its deadline; a call that has not returned by then is left to finish on its thread, the
//! caller gets an error saying so, and until that call returns every further call is refused at once (no pile of
//! threads on a wedged driver).

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{GpuBackend, GpuError, GpuHealth, GpuInfo, GpuSample};

/// How long one call into the GPU driver may take (NVML answers in milliseconds on a healthy machine).
pub const CALL_DEADLINE: Duration = Duration::from_secs(10);

/// The backend behind a deadline; see the module's doc.
pub struct Watchdog {
    inner: Arc<dyn GpuBackend>,
    deadline: Duration,
    /// Calls given up while still running, and when the oldest of them started.
    stuck: Arc<Mutex<(usize, Option<Instant>)>>,
}

/// One call's end, as its thread and its caller see it.
#[derive(Default)]
struct Call {
    finished: bool,
    abandoned: bool,
}

impl Watchdog {
    pub fn new(inner: Arc<dyn GpuBackend>, deadline: Duration) -> Watchdog {
        Watchdog {
            inner,
            deadline,
            stuck: Arc::new(Mutex::new((0, None))),
        }
    }

    fn error(&self, message: String) -> GpuError {
        GpuError::Query {
            backend: self.inner.name(),
            message,
        }
    }

    fn call<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&dyn GpuBackend) -> Result<T, GpuError> + Send + 'static,
    ) -> Result<T, GpuError> {
        if let (n, Some(since)) = *self.stuck.lock().unwrap_or_else(|p| p.into_inner())
            && n > 0
        {
            return Err(self.error(format!(
                "{what} not asked: the driver has not returned from a call made {} s ago (a GPU that fell off \
                 the bus, Xid 79, does this: see the kernel log and nvidia-smi)",
                since.elapsed().as_secs()
            )));
        }
        let started = Instant::now();
        let (tx, rx) = mpsc::sync_channel(1);
        let call = Arc::new(Mutex::new(Call::default()));
        let (inner, stuck, mine) = (self.inner.clone(), self.stuck.clone(), call.clone());
        let spawned = std::thread::Builder::new()
            .name("gpu-call".into())
            .spawn(move || {
                let r = f(inner.as_ref());
                let mut c = mine.lock().unwrap_or_else(|p| p.into_inner());
                c.finished = true;
                if c.abandoned {
                    let mut s = stuck.lock().unwrap_or_else(|p| p.into_inner());
                    s.0 = s.0.saturating_sub(1);
                    if s.0 == 0 {
                        s.1 = None;
                    }
                }
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            return Err(self.error(format!("{what}: no thread for the call: {e}")));
        }
        match rx.recv_timeout(self.deadline) {
            Ok(r) => r,
            Err(_) => {
                let mut c = call.lock().unwrap_or_else(|p| p.into_inner());
                if c.finished {
                    // It returned between the deadline and this lock: its answer is in the channel.
                    drop(c);
                    return rx.try_recv().unwrap_or_else(|_| {
                        Err(self.error(format!("{what}: the call ended without an answer")))
                    });
                }
                c.abandoned = true;
                let mut s = self.stuck.lock().unwrap_or_else(|p| p.into_inner());
                s.0 += 1;
                s.1 = Some(s.1.map_or(started, |t| t.min(started)));
                Err(self.error(format!(
                    "{what}: the driver did not return within {} s (a GPU that fell off the bus, Xid 79, does \
                     this: see the kernel log and nvidia-smi); further calls are refused until it returns",
                    self.deadline.as_secs_f64()
                )))
            }
        }
    }
}

impl GpuBackend for Watchdog {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.call("listing the GPUs", |b| b.gpus())
    }

    fn health(&self) -> Result<Vec<GpuHealth>, GpuError> {
        self.call("reading GPU health", |b| b.health())
    }

    fn sample(&self, at_ms: i64) -> Result<Vec<GpuSample>, GpuError> {
        self.call("sampling the GPUs", move |b| b.sample(at_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A backend whose calls block while `wedged` is set, as a driver stuck on a GPU that fell off the bus.
    struct Wedgeable {
        wedged: Arc<AtomicBool>,
    }

    impl GpuBackend for Wedgeable {
        fn name(&self) -> &'static str {
            "test"
        }

        fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
            while self.wedged.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(Vec::new())
        }
    }

    #[test]
    fn a_call_that_does_not_return_is_given_up_and_the_next_refused_until_it_does() {
        let wedged = Arc::new(AtomicBool::new(false));
        let gpu = Watchdog::new(
            Arc::new(Wedgeable {
                wedged: wedged.clone(),
            }),
            Duration::from_millis(200),
        );
        assert!(gpu.gpus().is_ok(), "a healthy driver answers");
        wedged.store(true, Ordering::SeqCst);
        let t = Instant::now();
        let e = gpu.gpus().expect_err("a wedged call").to_string();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(e.contains("did not return within 0.2 s"), "{e}");
        // While it is still stuck, further calls (health and samples too) are refused at once.
        let t = Instant::now();
        let e = gpu.health().expect_err("refused").to_string();
        assert!(e.contains("has not returned from a call made"), "{e}");
        assert!(gpu.sample(0).is_err());
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
        // Once the driver returns, calls go through again.
        wedged.store(false, Ordering::SeqCst);
        let t = Instant::now();
        while gpu.gpus().is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "still refused after the driver returned"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
