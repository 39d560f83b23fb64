//! `bcd site redfish` against a real Redfish emulator (sushy-tools' fake driver, installed by scripts/setup;
//! bc_testkit::sushy starts it).
//! Skips with a printed reason when the emulator is absent.

use std::process::Command;

use bc_testkit::sushy::{FakeBmc, FakeOptions, fake_emulator};

fn bcd(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bcd"))
        .args(["site", "redfish", url, "--user", "admin"])
        .args(args)
        .env("BMC_PASSWORD", "password")
        .output()
        .expect("run bcd")
}

#[test]
fn inspect_and_an_unapplied_boot_override_through_the_cli() {
    let bin = match fake_emulator() {
        Ok(bin) => bin,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    // Started and serving its service root (bc_testkit::sushy), in a directory of its own.
    let emu = FakeBmc::start(&bin, &FakeOptions::default()).expect("start sushy-emulator");
    let url = emu.url();
    let out = bcd(&url, &["inspect"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.to_lowercase().contains("system"), "{text}");
    // The fake driver accepts a one-time override but keeps it Continuous: the CLI must say so and fail.
    let out = bcd(&url, &["boot-once", "pxe"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an override that was not applied was reported as success"
    );
    assert!(
        err.to_lowercase().contains("continuous") || err.to_lowercase().contains("not applied"),
        "{err}"
    );
}
