//! The metal flow's BMC path end to end: a real control plane (fresh PostgreSQL, mTLS on loopback, the metal
//! module's executor in the controllers role) → the gateway's SiteService → the site agent's BMC worker (an
//! enrolled agent of rack-1, credentials from the broker per command) → sushy-tools' Redfish emulator (`--fake`,
//! HTTP Basic auth) → read back → the signed result → the planner's next step. `metal.provide` runs inspection
//! (the emulator's inventory in `metal show`), the boot token into the netboot entry, the one-time PXE override
//! (the emulator keeps it as Continuous: reported `persistent`) and the power kick (PowerState read back On). The
//! ramdisk's join is bcd's real join with the attempt's boot token (what bcd-ramdisk's agent mode does, through the
//! same library) and a real session; once joined the executor withdraws the netboot entry and the BMC worker
//! restores the disk boot, read back on the emulator by this test itself. A replay of the spent boot token from
//! another key is refused by JoinService. BMC work goes only to the agent holding the site's boot lease: none before
//! this agent takes it.
//!
//! Needs sushy-emulator (see common/sushy.rs); without it the test prints `SKIP: <test>: <reason>`.

mod common;

use bc_proto::v1;
use bcd::site::bmc::{BmcWorker, BmcWorkerOptions};
use common::sushy::{PASSWORD, USER, start_emulator};
use common::{Options, Plane, TestResult, plane_with};
use serde_json::{Value, json};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_bcd");
const MAC: &str = "52:54:00:aa:bb:07";

async fn enroll_site(p: &Plane, state: &str) -> anyhow::Result<()> {
    let v = p
        .admin
        .call(
            "site-tokens",
            "create",
            json!({"site": "rack-1", "uses": 1}),
        )
        .await?;
    let token = v["token"].as_str().unwrap_or_default().to_string();
    bcd::join::enroll_site(
        &p.node_config(state),
        &token,
        bcd::join::JoinOptions {
            attempts: 1,
            claims: v1::HardwareClaims {
                hostname: state.into(),
                ..Default::default()
            },
        },
    )
    .await?;
    Ok(())
}

async fn show(p: &Plane) -> anyhow::Result<Value> {
    Ok(p.admin.call("metal", "show", json!({"mac": MAC})).await?)
}

/// Polls `metal show` until `f` holds, or fails after `secs` with the last answer.
async fn wait_show(
    p: &Plane,
    secs: u64,
    what: &str,
    f: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let until = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let v = show(p).await?;
        if f(&v) {
            return Ok(v);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < until,
            "timed out after {secs} s waiting for {what}: {}",
            serde_json::to_string_pretty(&v)?
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn sys_macs(v: &Value) -> Vec<String> {
    v["inspection"]["macs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn step<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v["steps"].as_array()?.iter().find(|s| s["step"] == name)
}

/// The emulator's only system, read with the BMC credentials (independently of the agent).
async fn system(url: &str) -> anyhow::Result<Value> {
    let http = reqwest::Client::new();
    let list: Value = http
        .get(format!("{url}/redfish/v1/Systems"))
        .basic_auth(USER, Some(PASSWORD))
        .send()
        .await?
        .json()
        .await?;
    let path = list["Members"][0]["@odata.id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no system: {list}"))?
        .to_string();
    Ok(http
        .get(format!("{url}{path}"))
        .basic_auth(USER, Some(PASSWORD))
        .send()
        .await?
        .json()
        .await?)
}

async fn netboot_token(p: &Plane) -> anyhow::Result<Option<String>> {
    let boot: Option<Value> =
        bc_store::sqlx::query_scalar("SELECT boot FROM machines WHERE mac = $1")
            .bind(MAC)
            .fetch_one(p.store.pool())
            .await?;
    Ok(boot.and_then(|b| {
        b["cmdline"].as_str().and_then(|c| {
            c.split_whitespace()
                .find_map(|x| x.strip_prefix("bc.boot_token="))
                .map(str::to_owned)
        })
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provide_drives_a_real_redfish_emulator_through_the_site_agent() -> TestResult {
    bc_proto::install_crypto_provider();
    let emu = match start_emulator()? {
        Ok(emu) => emu,
        Err(why) => bc_testkit::skip!("{why}"),
    };
    let p = plane_with(Options {
        controllers: true,
        fast: true,
        ..Default::default()
    })
    .await;
    enroll_site(&p, "site-1").await?;
    p.admin
        .call(
            "secrets",
            "put",
            json!({"site": "rack-1", "name": "bmc/m7", "value": json!({"username": USER, "password": PASSWORD}).to_string()}),
        )
        .await?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let worker = BmcWorker::new(
        p.dir.path().join("site-1"),
        BmcWorkerOptions {
            poll_wait: Duration::from_secs(2),
            bmc: bcd_site::redfish::BmcOptions {
                boot_readback: Duration::from_secs(2),
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let worker = tokio::spawn(worker.run(async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));

    p.admin
        .call(
            "metal",
            "enroll",
            json!({"site": "rack-1", "mac": MAC, "bmc": {"address": emu.url(), "credentials": "bmc/m7"}}),
        )
        .await?;
    let v = p
        .admin
        .call("metal", "provide", json!({"mac": MAC}))
        .await?;
    assert_eq!(v["state"]["phase"], "inspecting", "{v}");

    // Only the agent holding the site's boot lease gets BMC work: this agent has not asked for it, so the
    // inspection waits (a standby agent of a site never runs a command the holder may be running too).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let states: Vec<String> =
        bc_store::sqlx::query_scalar("SELECT state FROM metal_bmc_commands WHERE mac = $1")
            .bind(MAC)
            .fetch_all(p.store.pool())
            .await?;
    assert_eq!(
        states,
        ["pending"],
        "BMC work went to an agent without the boot lease"
    );
    let cert = bcd::state::StateDir::open(&p.dir.path().join("site-1"))?.certificate()?;
    let agent = bc_gateway::site::agent_id_of(&bc_proto::envelope::cert_public_point(&cert)?);
    let lease = p
        .store
        .acquire_boot_lease("rack-1", &agent, 600_000)
        .await?;
    assert!(lease.held, "{lease:?}");

    // Inspection, the override and the power kick, each through the agent and read back on the emulator.
    let v = wait_show(&p, 90, "the power kick to be read back", |v| {
        step(v, "power-kick").is_some_and(|s| s["state"] == "done")
    })
    .await?;
    assert_eq!(v["state"]["phase"], "booting-ramdisk", "{v}");
    let macs = sys_macs(&v);
    assert!(
        !macs.is_empty(),
        "the emulator's NICs are in the inspection: {v}"
    );
    let boot_once = step(&v, "boot-once").expect("boot-once step");
    assert_eq!(
        boot_once["outcome"],
        json!({"outcome": "boot-once-set", "persistent": true}),
        "the fake driver keeps Once as Continuous: {v}"
    );
    let sys = system(&emu.url()).await?;
    assert_eq!(sys["PowerState"], "On", "{sys}");
    assert_eq!(sys["Boot"]["BootSourceOverrideTarget"], "Pxe", "{sys}");
    let delivered: i64 = bc_store::sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE action = 'secret.delivered' AND subject = 'site/rack-1/secret/bmc/m7'",
    )
    .fetch_one(p.store.pool())
    .await?;
    assert_eq!(
        delivered, 3,
        "credentials fetched once per BMC command (inspect, boot-once, power)"
    );

    // The ramdisk joins with the attempt's single-use boot token and keeps a session.
    let token = netboot_token(&p)
        .await?
        .expect("the netboot entry carries a boot token");
    let joined = common::join(&p, "ramdisk-7", &token, common::claims("m7", 0)).await?;
    let dir = tempfile::tempdir()?;
    let fixture = dir.path().join("gpus.json");
    std::fs::write(&fixture, bcd::gpu::fixture::synthetic(0, "m7"))?;
    common::fake_hardware(&dir.path().join("root"), "m7")?;
    let mut session = common::bcd_run(
        std::path::Path::new(BIN),
        &p,
        &p.dir.path().join("ramdisk-7"),
        &fixture,
        &dir.path().join("root"),
    )
    .kill_on_drop(true)
    .spawn()?;

    let v = wait_show(&p, 60, "diagnosing with the disk boot restored", |v| {
        v["state"]["phase"] == "diagnosing"
    })
    .await?;
    assert_eq!(
        v["node_id"].as_str(),
        Some(joined.identity.node_id.as_str()),
        "{v}"
    );
    assert_eq!(
        netboot_token(&p).await?,
        None,
        "the netboot entry is withdrawn once joined"
    );
    // The disk boot is restored by a BMC command the executor planned with the join: wait on what the flow reports
    // (the step done, which the worker reports only after reading Hdd/Continuous back), as long as that command may
    // take (its deadline, the policy's BMC timeout, plus the worker's long poll), then look at the emulator once.
    let bmc_deadline = Duration::from_millis(
        u64::try_from(bc_core::metal::Policy::default().bmc_timeout_ms).unwrap_or(120_000),
    );
    let v = wait_show(
        &p,
        (bmc_deadline + Duration::from_secs(30)).as_secs(),
        "the disk boot restored (read back by the BMC worker)",
        |v| {
            step(v, "restore-disk-boot")
                .is_some_and(|s| s["state"] != "pending" && s["state"] != "sent")
        },
    )
    .await?;
    let restore = step(&v, "restore-disk-boot").expect("restore step");
    assert_eq!(restore["state"], "done", "disk boot not restored: {v}");
    let sys = system(&emu.url()).await?;
    assert_eq!(
        (
            &sys["Boot"]["BootSourceOverrideTarget"],
            &sys["Boot"]["BootSourceOverrideEnabled"]
        ),
        (&json!("Hdd"), &json!("Continuous")),
        "disk boot not restored on the emulator although the worker read it back: {sys}"
    );
    // The diagnose went to the ramdisk's node. A real `bcd` answers it as an unknown kind, which fails the machine
    // in diagnosing; the disk-boot restore above is never cancelled by a failure (it may finish after it).
    let kind: String = bc_store::sqlx::query_scalar(
        "SELECT kind FROM commands WHERE node_id = $1 AND kind LIKE 'ramdisk.%'",
    )
    .bind(&joined.identity.node_id)
    .fetch_one(p.store.pool())
    .await?;
    assert_eq!(kind, "ramdisk.diagnose");

    // The spent boot token, replayed from another key, is refused.
    let replay = common::join(&p, "replay-7", &token, common::claims("m7-other", 0)).await;
    assert!(replay.is_err(), "a replayed boot token joined: {replay:?}");

    let _ = session.kill().await;
    let _ = stop_tx.send(true);
    worker.await??;
    Ok(())
}
