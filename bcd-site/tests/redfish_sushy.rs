//! The Redfish client against a real emulator: sushy-tools' `sushy-emulator --fake`, started by the test on a free
//! loopback port. Its fake driver accepts a one-time boot override but keeps `Enabled=Continuous` (its template
//! hard-codes it), and applies power changes 1-11 s after answering 204 (../shared/LAB-NOTES.md saw `PowerState`
//! "stay Off": a read-back done too early). The client must report the override as not applied, report a power
//! change read back before it shows as not applied, and see it applied when it waits long enough.
//!
//! The emulator is found through `BC_SUSHY_EMULATOR`, the checkout's `.venv-sushy` or the PATH
//! (`bc_testkit::sushy::fake_emulator`); without it the test prints `SKIP: <test>: <reason>` and returns.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use bc_testkit::sushy::{FakeBmc, FakeOptions, fake_emulator};
use bcd_site::redfish::{
    Bmc, BmcOptions, BootTarget, Credentials, PowerAction, PowerOutcome, RedfishError, RetryPolicy,
};

/// The fake driver on a free port, in a directory of its own (bc_testkit::sushy), or a skip.
fn start() -> Result<Option<FakeBmc>> {
    let bin = match fake_emulator() {
        Ok(bin) => bin,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(Some(
        FakeBmc::start(&bin, &FakeOptions::default()).map_err(anyhow::Error::msg)?,
    ))
}

fn opts() -> BmcOptions {
    BmcOptions {
        boot_readback: Duration::from_secs(1),
        power_apply_time: Some(Duration::from_secs(2)),
        poll_interval: Duration::from_millis(200),
        retry: RetryPolicy::new(3, Duration::from_millis(50), Duration::from_millis(200))
            .expect("a valid retry policy"),
        ..BmcOptions::default()
    }
}

fn creds() -> Credentials {
    Credentials {
        username: "admin".into(),
        password: "password".into(),
    }
}

#[tokio::test]
async fn sushy_fake_power_and_boot_override_are_read_back() -> Result<()> {
    let Some(emu) = start()? else {
        return Ok(());
    };
    let bmc = Bmc::connect(&emu.url(), creds(), opts()).await?;
    // No SessionService on the fake driver: Basic, with the reason kept.
    assert_eq!(bmc.auth_kind(), "basic");
    assert_eq!(bmc.basic_reason(), Some("the BMC has no SessionService"));
    assert_eq!(bmc.quirks().name, "generic");
    let system = bmc.system_path(None).await?;

    let inv = bmc.inventory().await?;
    println!("{inv}");
    assert_eq!(inv.systems.len(), 1);

    // The fake driver applies a power change 1-11 s after the 204 (fakedriver.py: "hardware actions are not
    // immediate"), and keeps its state in SQLite (here one directory per test). Asking for the state it is in sends
    // nothing. Asking for the other one and reading back at once finds the old state: an error naming what was read
    // (LAB-NOTES' "stays Off" is this read-back done too early).
    let quick = BmcOptions {
        power_apply_time: Some(Duration::ZERO),
        ..opts()
    };
    let quick_bmc = Bmc::connect(&emu.url(), creds(), quick).await?;
    let mut not_applied = None;
    for _ in 0..3 {
        let (sys, _) = bmc
            .get::<bcd_site::redfish::models::ComputerSystem>(&system)
            .await?;
        let state = sys.power_state.context("PowerState")?;
        let (same, other) = match state.as_str() {
            "On" => (PowerAction::On, PowerAction::Off),
            "Off" => (PowerAction::Off, PowerAction::On),
            s => bail!("unexpected PowerState {s}"),
        };
        assert_eq!(
            bmc.power(&system, same).await?,
            PowerOutcome::AlreadyInState(state.clone())
        );
        match quick_bmc.power(&system, other).await {
            Err(e @ RedfishError::PowerNotApplied { .. }) => {
                println!("{e}");
                not_applied = Some((e, state, other));
                break;
            }
            // Applied within the same instant: possible (the delay is random), so flip again.
            Ok(PowerOutcome::Applied { .. }) => continue,
            other => bail!("expected PowerNotApplied from the fake driver, got {other:?}"),
        }
    }
    let Some((err, state, wanted)) = not_applied else {
        bail!("the fake applied three changes at once")
    };
    let RedfishError::PowerNotApplied { observed, .. } = &err else {
        unreachable!()
    };
    assert_eq!(observed, &state);
    assert!(
        err.to_string().contains("the power action was not applied"),
        "{err}"
    );
    quick_bmc.close().await?;

    // With a budget longer than the fake's delay the same request is read back as applied.
    let patient = BmcOptions {
        power_apply_time: Some(Duration::from_secs(15)),
        ..opts()
    };
    let patient_bmc = Bmc::connect(&emu.url(), creds(), patient).await?;
    let started = std::time::Instant::now();
    match patient_bmc.power(&system, wanted).await? {
        PowerOutcome::Applied { power_state, .. } => assert_ne!(power_state, state),
        other => bail!("expected Applied within 15 s, got {other:?}"),
    }
    println!("fake driver applied {wanted} after {:?}", started.elapsed());
    patient_bmc.close().await?;

    // Restarts have no steady state: accepted is all that can be said.
    assert!(matches!(
        bmc.power(&system, PowerAction::Reset).await?,
        PowerOutcome::Accepted { .. }
    ));

    // The one-time override is accepted but stays Continuous: not applied, and the message says so.
    let err = match bmc.boot_once(&system, BootTarget::Pxe).await {
        Err(e @ RedfishError::BootOverrideNotApplied { .. }) => e,
        other => bail!("expected BootOverrideNotApplied from the fake driver, got {other:?}"),
    };
    let text = err.to_string();
    println!("{text}");
    assert!(text.contains("Target=Pxe, Enabled=Continuous"), "{text}");
    assert!(text.contains("not applied"), "{text}");

    // UEFI HTTP boot: the fake keeps even the previous target (Pxe); still reported, never a success.
    let http = bmc.boot_once(&system, BootTarget::UefiHttp).await;
    println!("{http:?}");
    assert!(
        matches!(http, Err(RedfishError::BootOverrideNotApplied { ref target, .. }) if target == "UefiHttp")
    );
    bmc.close().await?;

    // The one-call operator form gives the same answer.
    let one_call =
        bcd_site::redfish::boot_once(&emu.url(), creds(), opts(), None, BootTarget::Pxe).await;
    assert!(matches!(
        one_call,
        Err(RedfishError::BootOverrideNotApplied { .. })
    ));
    Ok(())
}
