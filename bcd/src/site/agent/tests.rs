//! The driver on paused time: a scripted [`Link`] instead of the gateway, tokio's clock instead of sleeping. A
//! 15 s lease runs out in microseconds of real time, and the instants are exact.

use super::*;
use std::collections::VecDeque;
use std::sync::Mutex;

const TTL: Duration = Duration::from_secs(15);

/// How the scripted control plane answers one lease request.
#[derive(Debug, Clone, Copy)]
enum Ask {
    Held,
    /// Held, with less left than the TTL (the holder's grant is older than this request).
    HeldFor(Duration),
    HeldBy,
    /// No answer at all (the control plane is unreachable mid-call).
    Hang,
}

#[derive(Default)]
struct Script {
    asks: VecDeque<Ask>,
    /// What to answer once the script is spent.
    then: Option<Ask>,
    asked: Vec<Instant>,
    released: bool,
}

struct FakeLink {
    script: Arc<Mutex<Script>>,
}

impl FakeLink {
    fn new(asks: &[Ask], then: Ask) -> (FakeLink, Arc<Mutex<Script>>) {
        let script = Arc::new(Mutex::new(Script {
            asks: asks.iter().copied().collect(),
            then: Some(then),
            ..Script::default()
        }));
        (
            FakeLink {
                script: script.clone(),
            },
            script,
        )
    }
}

fn one_machine() -> Netboot {
    let mut m = BTreeMap::new();
    m.insert(
        "52:54:00:12:34:56".parse::<MacAddr>().expect("a MAC"),
        DesiredBoot {
            kernel: "vmlinuz".into(),
            initrd: None,
            cmdline: String::new(),
        },
    );
    Netboot::from_machines(m)
}

impl Link for FakeLink {
    fn site(&self) -> (&str, &str) {
        ("site-a", "spiffe://test/site/site-a")
    }

    async fn connect(&mut self) -> Connect {
        Connect::Connected
    }

    async fn renew(&mut self) -> Result<Duration, String> {
        Ok(Duration::from_secs(86_400))
    }

    async fn ask(&mut self, ttl_ms: u32) -> Asked {
        let next = {
            let mut s = self.script.lock().unwrap_or_else(|p| p.into_inner());
            s.asked.push(Instant::now());
            let then = s.then;
            s.asks.pop_front().or(then).unwrap_or(Ask::Hang)
        };
        let answer = |held: bool, holder: &str, left_ms: i64| {
            Asked::Answer(v1::BootLeaseResponse {
                held,
                fence: 3,
                holder: holder.into(),
                expires_in_ms: left_ms,
                ttl_ms,
            })
        };
        match next {
            Ask::Held => answer(true, "site/a", i64::from(ttl_ms)),
            Ask::HeldFor(d) => answer(true, "site/a", d.as_millis() as i64),
            Ask::HeldBy => answer(false, "site/b", i64::from(ttl_ms)),
            Ask::Hang => std::future::pending().await,
        }
    }

    async fn table(&mut self) -> Result<Netboot, String> {
        Ok(one_machine())
    }

    async fn release(&mut self, _ttl_ms: u32) {
        self.script
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .released = true;
    }

    fn disconnect(&mut self) {}

    async fn poked(&self) {
        std::future::pending().await
    }
}

/// Runs the driver until `stop` resolves; returns when each table change happened (non-empty or empty), from the
/// start.
async fn run(
    mut link: FakeLink,
    stop: impl Future<Output = ()> + Send + 'static,
) -> (Vec<(Duration, bool)>, Result<(), SiteError>) {
    let (table, mut seen) = watch::channel(Netboot::default());
    let view = watch::channel(BootLeaseView::default()).0;
    let t0 = Instant::now();
    let watcher = tokio::spawn(async move {
        let mut changes = Vec::new();
        while seen.changed().await.is_ok() {
            changes.push((t0.elapsed(), !seen.borrow_and_update().is_empty()));
        }
        changes
    });
    let out = Outputs {
        table: &table,
        view: &view,
    };
    let result = drive(
        &mut link,
        out,
        LeaseTimes::new(TTL),
        Duration::from_secs(86_400),
        stop,
        || 1.0,
    )
    .await;
    drop(table);
    (watcher.await.unwrap_or_default(), result)
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_control_plane_stops_dhcp_exactly_when_the_lease_runs_out() {
    // The first ask is granted at t = 0; every later one hangs (the control plane is gone mid-call).
    let (link, script) = FakeLink::new(&[Ask::Held], Ask::Hang);
    let (changes, result) = run(link, tokio::time::sleep(Duration::from_secs(38))).await;
    result.expect("the agent stops cleanly");
    assert_eq!(
        changes,
        vec![(Duration::ZERO, true), (TTL, false)],
        "served from the grant, nothing from sent + TTL on"
    );
    // It kept asking (every third of the TTL, then after each 5 s request deadline) while it stood by.
    let asked = script.lock().unwrap_or_else(|p| p.into_inner()).asked.len();
    assert!(asked >= 4, "asked {asked} times");
}

#[tokio::test(start_paused = true)]
async fn a_renewed_lease_keeps_serving_and_shutdown_releases_it() {
    let (link, script) = FakeLink::new(&[], Ask::Held);
    let (changes, result) = run(link, tokio::time::sleep(Duration::from_secs(97))).await;
    result.expect("the agent stops cleanly");
    // Served from the start without a gap for 97 s (renewed every 5 s), emptied only by the shutdown.
    assert_eq!(
        changes,
        vec![(Duration::ZERO, true), (Duration::from_secs(97), false)]
    );
    let s = script.lock().unwrap_or_else(|p| p.into_inner());
    assert!(s.released, "the lease is released on shutdown");
    // Asks at 0, 5, 10, … 95 s: every third of the TTL, on the dot.
    let t0 = s.asked[0];
    let gaps: Vec<u64> = s.asked.iter().map(|t| (*t - t0).as_secs()).collect();
    assert_eq!(gaps, (0..20).map(|i| i * 5).collect::<Vec<_>>());
}

#[tokio::test(start_paused = true)]
async fn a_standby_serves_nothing_and_takes_over_when_the_holder_lets_go() {
    // Another agent holds the lease for the first three asks (0, 5, 10 s); the fourth (15 s) is granted.
    let (link, _) = FakeLink::new(&[Ask::HeldBy, Ask::HeldBy, Ask::HeldBy], Ask::Held);
    let (changes, result) = run(link, tokio::time::sleep(Duration::from_secs(17))).await;
    result.expect("the agent stops cleanly");
    assert_eq!(
        changes,
        vec![
            (Duration::from_secs(15), true),
            (Duration::from_secs(17), false)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn the_lease_ends_on_time_while_a_request_hangs() {
    // Granted at 0 with 7 s left; the ask at 5 s hangs until its 5 s deadline (10 s). DHCP stops at 7 s, not 10.
    let (link, _) = FakeLink::new(&[Ask::HeldFor(Duration::from_secs(7))], Ask::Hang);
    let (changes, result) = run(link, tokio::time::sleep(Duration::from_secs(12))).await;
    result.expect("the agent stops cleanly");
    assert_eq!(
        changes,
        vec![(Duration::ZERO, true), (Duration::from_secs(7), false)]
    );
}
