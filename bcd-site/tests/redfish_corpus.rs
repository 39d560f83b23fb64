//! The Redfish client against the corpus of public BMC captures (tests/redfish-corpus/, origins and licences in its
//! SOURCES.md): every tree served read-only by tests/common/corpus.rs, the inventory compared with the tree's
//! `expected.json` (derived from the JSON files, not from this client), with and without `$expand` and with every
//! collection split into pages. Then one test per item of the Redfish issue, most on malformed copies of the trees
//! (overlays that change one document): paging and the refusal to pick a system (1), wrong-typed properties (2),
//! counting only what is there (3), HPE GPUs (4), summary and chassis fallbacks and BMCs without systems (5), vendor
//! marks (6), pre-checks before acting (7), interrupt and clean output (8), `$expand` (9).

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bcd_site::redfish::{
    self, Bmc, BmcOptions, Credentials, Inventory, Operation, PowerAction, RedfishError,
    RetryPolicy,
};
use common::corpus::{CorpusOptions, CorpusServer, serve_corpus};
use serde_json::{Value, json};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/redfish-corpus")
}

fn creds() -> Credentials {
    Credentials {
        username: "admin".into(),
        password: "secret".into(),
    }
}

fn opts(expand: bool) -> BmcOptions {
    BmcOptions {
        use_expand: expand,
        retry: RetryPolicy::new(2, Duration::from_millis(5), Duration::from_millis(10))
            .expect("a valid retry policy"),
        ..BmcOptions::default()
    }
}

fn trees() -> Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(corpus_dir())? {
        let e = e?;
        if e.path().join("expected.json").is_file() {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    Ok(out)
}

async fn serve(tree: &str, o: CorpusOptions) -> Result<CorpusServer> {
    serve_corpus(corpus_dir().join(tree), o).await
}

fn expected(tree: &str) -> Result<Value> {
    let text = std::fs::read_to_string(corpus_dir().join(tree).join("expected.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// Differences between an inventory and a tree's expected.json, one line each.
fn compare(tree: &str, inv: &Inventory, quirks: &str, want: &Value) -> Vec<String> {
    let mut diffs = Vec::new();
    let mut check = |what: String, got: Value, want: &Value| {
        if &got != want {
            diffs.push(format!("{tree}: {what}: got {got}, want {want}"));
        }
    };
    check("quirks".into(), json!(quirks), &want["quirks"]);
    check(
        "managers".into(),
        json!(inv.managers.len()),
        &want["managers"],
    );
    check("chassis".into(), json!(inv.chassis.len()), &want["chassis"]);
    let systems = want["systems"].as_array().cloned().unwrap_or_default();
    check(
        "systems".into(),
        json!(inv.systems.len()),
        &json!(systems.len()),
    );
    for w in &systems {
        let Some(s) = inv
            .systems
            .iter()
            .find(|s| s.system.id == w["id"].as_str().map(String::from))
        else {
            check(
                format!("system {}", w["id"]),
                json!("missing"),
                &json!("present"),
            );
            continue;
        };
        let id = w["id"].as_str().unwrap_or("?");
        let x = &s.system;
        check(
            format!("{id} manufacturer"),
            json!(x.manufacturer),
            &w["manufacturer"],
        );
        check(format!("{id} model"), json!(x.model), &w["model"]);
        check(format!("{id} serial"), json!(x.serial_number), &w["serial"]);
        check(format!("{id} uuid"), json!(x.uuid), &w["uuid"]);
        check(format!("{id} power"), json!(x.power_state), &w["power"]);
        check(format!("{id} cpus"), json!(s.cpu_count()), &w["cpus"]);
        check(format!("{id} gpus"), json!(s.gpus.len()), &w["gpus"]);
        let mut models: Vec<String> = s.gpus.iter().filter_map(|g| g.model.clone()).collect();
        models.sort();
        models.dedup();
        check(format!("{id} gpu models"), json!(models), &w["gpu_models"]);
        let modules = if s.memory_from_summary {
            Value::Null
        } else {
            json!(s.memory.len())
        };
        check(
            format!("{id} memory modules"),
            modules,
            &w["memory_modules"],
        );
        check(
            format!("{id} memory MiB"),
            json!(s.memory_mib()),
            &w["memory_mib"],
        );
        check(format!("{id} drives"), json!(s.drives.len()), &w["drives"]);
        check(format!("{id} nics"), json!(s.nics.len()), &w["nics"]);
        let macs: Vec<&str> = s.macs().collect();
        check(format!("{id} macs"), json!(macs), &w["macs"]);
        check(
            format!("{id} pcie devices"),
            json!(s.pcie_devices.len()),
            &w["pcie_devices"],
        );
    }
    diffs
}

async fn inspect(srv: &CorpusServer, expand: bool) -> Result<(Inventory, &'static str, u64)> {
    srv.reset_requests();
    let bmc = Bmc::connect(&srv.url, creds(), opts(expand)).await?;
    let inv = bmc.inventory().await?;
    let quirks = bmc.quirks().name;
    bmc.close().await?;
    Ok((inv, quirks, srv.requests()))
}

#[tokio::test]
async fn every_tree_reads_as_its_expected_inventory() -> Result<()> {
    let trees = trees()?;
    ensure!(trees.len() >= 15, "the corpus has {} trees", trees.len());
    let mut diffs = Vec::new();
    for tree in &trees {
        let want = expected(tree)?;
        let plain = serve(
            tree,
            CorpusOptions {
                expand: true,
                ..CorpusOptions::default()
            },
        )
        .await?;
        let (inv, quirks, n_plain) = inspect(&plain, false).await?;
        diffs.extend(compare(tree, &inv, quirks, &want));
        let summary = inv.to_string();
        for debug_text in ["Some(", "\"\"", " { ", "Vec<"] {
            if summary.contains(debug_text) {
                diffs.push(format!(
                    "{tree}: the summary holds Rust Debug text {debug_text:?}:\n{summary}"
                ));
            }
        }
        let (inv_x, _, n_expand) = inspect(&plain, true).await?;
        diffs.extend(compare(&format!("{tree} ($expand)"), &inv_x, quirks, &want));
        // Every collection in pages of two: the same inventory.
        let paged = serve(
            tree,
            CorpusOptions {
                page_size: Some(2),
                ..CorpusOptions::default()
            },
        )
        .await?;
        let (inv_p, _, _) = inspect(&paged, false).await?;
        diffs.extend(compare(&format!("{tree} (paged)"), &inv_p, quirks, &want));
        println!(
            "{tree}: {} system(s), {n_plain} requests, {n_expand} with $expand ({}), {} warning(s)",
            inv.systems.len(),
            inv_x.expand.unwrap_or("not offered"),
            inv.warnings.len()
        );
        for w in &inv.warnings {
            if w.trim().is_empty() || w.contains("HTTP 404 for )") || w.contains(": : ") {
                diffs.push(format!("{tree}: an empty warning or path: {w:?}"));
            }
        }
    }
    if !diffs.is_empty() {
        bail!("{} difference(s):\n{}", diffs.len(), diffs.join("\n"));
    }
    Ok(())
}

// === 1: paging, and no system picked from an incomplete or ambiguous list ===

#[tokio::test]
async fn a_paged_multi_node_bmc_is_read_whole_and_never_acted_on_blind() -> Result<()> {
    // DMTF's bladed mockup, one system per page.
    let srv = serve(
        "dmtf-bladed",
        CorpusOptions {
            page_size: Some(1),
            ..CorpusOptions::default()
        },
    )
    .await?;
    let bmc = Bmc::connect(&srv.url, creds(), opts(false)).await?;
    let systems = bmc.systems().await?;
    assert_eq!(systems.members.len(), 4, "{:?}", systems.warnings);
    assert!(systems.complete);
    let err = bmc
        .system_path(None)
        .await
        .err()
        .context("four systems and no --system")?;
    let text = err.to_string();
    assert!(matches!(err, RedfishError::SeveralSystems { .. }), "{text}");
    for id in ["529QB9450R6", "529QB9451R6", "529QB9452R6", "529QB9453R6"] {
        assert!(text.contains(id), "{text}");
    }
    assert!(text.contains("--system"), "{text}");
    // An Id or a full @odata.id.
    assert_eq!(
        bmc.system_path(Some("529QB9452R6")).await?,
        "/redfish/v1/Systems/529QB9452R6"
    );
    assert_eq!(
        bmc.system_path(Some("/redfish/v1/Systems/529QB9453R6/"))
            .await?,
        "/redfish/v1/Systems/529QB9453R6"
    );
    let err = bmc
        .system_path(Some("nope"))
        .await
        .err()
        .context("unknown id")?;
    assert!(matches!(err, RedfishError::NoSuchSystem { .. }), "{err}");
    bmc.close().await?;

    // `power off` without --system on the paged 4-node BMC: refused, nothing POSTed.
    let err = redfish::power(&srv.url, creds(), opts(false), None, PowerAction::Off)
        .await
        .err()
        .context("must refuse")?;
    assert!(matches!(err, RedfishError::SeveralSystems { .. }), "{err}");
    assert_eq!(srv.writes(), 0, "no action may reach the BMC");

    // A next link that leads nowhere: the first page shows one system, but the list is incomplete, so none is
    // picked.
    let broken = serve(
        "dmtf-bladed",
        CorpusOptions {
            overlay: HashMap::from([(
                "/redfish/v1/Systems".to_owned(),
                json!({"Members": [{"@odata.id": "/redfish/v1/Systems/529QB9450R6"}], "Members@odata.count": 4,
                       "Members@odata.nextLink": "/redfish/v1/Systems/page-2"}),
            )]),
            ..CorpusOptions::default()
        },
    )
    .await?;
    let err = redfish::power(&broken.url, creds(), opts(false), None, PowerAction::Off)
        .await
        .err()
        .context("must refuse an incomplete list")?;
    assert!(
        matches!(err, RedfishError::SystemsIncomplete { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("page-2"), "{err}");
    assert_eq!(broken.writes(), 0);
    Ok(())
}

// === 2: wrong-typed properties ===

#[tokio::test]
async fn wrong_typed_properties_keep_the_resource_and_are_named() -> Result<()> {
    let sys_path = "/redfish/v1/Systems/Self";
    let tree = corpus_dir().join("gigabyte-ami");
    let mut system: Value =
        serde_json::from_slice(&std::fs::read(tree.join("Systems/Self/index.json"))?)?;
    system["MemorySummary"]["TotalSystemMemoryGiB"] = json!("244");
    system["ProcessorSummary"]["Count"] = json!(2.0);
    system["PowerState"] = json!(1);
    let mut cpu: Value = serde_json::from_slice(&std::fs::read(
        tree.join("Systems/Self/Processors/1/index.json"),
    )?)?;
    cpu["TotalCores"] = json!("64");
    cpu["MaxSpeedMHz"] = json!(3350.5);
    let srv = serve(
        "gigabyte-ami",
        CorpusOptions {
            overlay: HashMap::from([
                (sys_path.to_owned(), system),
                ("/redfish/v1/Systems/Self/Processors/1".to_owned(), cpu),
                (
                    "/redfish/v1/Systems/Self/Memory".to_owned(),
                    json!({"Members@odata.count": "16", "Members": (1..=16).map(|i| json!({"@odata.id": format!("/redfish/v1/Systems/Self/Memory/{i}")})).collect::<Vec<_>>()}),
                ),
            ]),
            ..CorpusOptions::default()
        },
    )
    .await?;
    let (inv, _, _) = inspect(&srv, false).await?;
    let s = &inv.systems[0];
    assert_eq!(
        s.system.model.as_deref(),
        Some("H262-Z63-00"),
        "the system survives"
    );
    assert_eq!(
        s.system.power_state.as_deref(),
        Some("1"),
        "a number read as the string it says"
    );
    assert_eq!(s.cpu_count(), 2);
    let cpu = s
        .processors
        .iter()
        .find(|p| p.id.as_deref() == Some("1"))
        .context("CPU 1 kept")?;
    assert_eq!(cpu.total_cores, Some(64));
    assert_eq!(cpu.max_speed_mhz, Some(3351));
    assert_eq!(s.memory.len(), 16);
    let w = inv.warnings.join("\n");
    for needle in [
        "/redfish/v1/Systems/Self: field MemorySummary.TotalSystemMemoryGiB: invalid type: string \"244\"",
        "/redfish/v1/Systems/Self/Processors/1: field TotalCores: invalid type: string \"64\", expected u64; read as 64",
        "field MaxSpeedMHz: invalid type: floating point `3350.5`, expected u64; read as 3351",
        "/redfish/v1/Systems/Self/Memory: field Members@odata.count: invalid type: string \"16\"",
    ] {
        assert!(w.contains(needle), "{needle:?} not in:\n{w}");
    }
    Ok(())
}

// === 3: count what is there ===

#[tokio::test]
async fn only_present_components_count_and_error_bodies_are_errors() -> Result<()> {
    // HPE DL325: 16 DIMM slots, 12 Absent.
    let (inv, _, _) = inspect(
        &serve("hpe-ilo5-dl325", CorpusOptions::default()).await?,
        false,
    )
    .await?;
    assert_eq!(inv.systems[0].memory.len(), 4);
    assert_eq!(inv.systems[0].absent.get("DIMM slots"), Some(&12));
    // Intel: one drive listed 31 times, and what the capture holds for it is the BMC's 404 error body: no drive,
    // one warning (not 31).
    let (inv, _, _) = inspect(&serve("intel", CorpusOptions::default()).await?, false).await?;
    assert_eq!(inv.systems[0].drives.len(), 0);
    let hdd0: Vec<&String> = inv
        .warnings
        .iter()
        .filter(|w| w.contains("Drives/HDD0"))
        .collect();
    assert_eq!(hdd0.len(), 1, "{hdd0:?}");
    assert!(
        hdd0[0].contains("an error instead of the resource"),
        "{hdd0:?}"
    );

    // A count that disagrees, a member answered 200 with an error body, and an Absent processor in Storage's
    // sibling: each a warning, never a component.
    let srv = serve(
        "gigabyte-ami",
        CorpusOptions {
            overlay: HashMap::from([
                (
                    "/redfish/v1/Systems/Self/Processors".to_owned(),
                    json!({"Members@odata.count": 3, "Members": [
                        {"@odata.id": "/redfish/v1/Systems/Self/Processors/1"},
                        {"@odata.id": "/redfish/v1/Systems/Self/Processors/2"},
                        {"@odata.id": "/redfish/v1/Systems/Self/Processors/2/"}]}),
                ),
                (
                    "/redfish/v1/Systems/Self/Processors/2".to_owned(),
                    json!({"error": {"code": "Base.1.8.InternalError", "message": "The request failed due to an internal service error."}}),
                ),
            ]),
            ..CorpusOptions::default()
        },
    )
    .await?;
    let (inv, _, _) = inspect(&srv, false).await?;
    assert_eq!(
        inv.systems[0].cpu_count(),
        1,
        "the error body is not a CPU, the duplicate link is one"
    );
    let w = inv.warnings.join("\n");
    assert!(
        w.contains("Members@odata.count says 3 but 2 member(s) were listed"),
        "{w}"
    );
    assert!(w.contains("listed more than once"), "{w}");
    assert!(w.contains("answered with an error instead of the resource: The request failed due to an internal service error. (Base.1.8.InternalError)"), "{w}");
    Ok(())
}

// === 4: GPUs where vendors put them ===

#[tokio::test]
async fn hpe_gpus_come_from_chassis_devices_and_pci_devices() -> Result<()> {
    let (inv, quirks, _) = inspect(
        &serve("hpe-ilo5-xl675d-a100", CorpusOptions::default()).await?,
        false,
    )
    .await?;
    assert_eq!(quirks, "hpe-ilo");
    let s = &inv.systems[0];
    assert_eq!(
        s.gpus.len(),
        8,
        "8 A100; the NVSwitch and the HGX baseboard iLO also types GPU are not GPUs"
    );
    assert!(
        s.gpus
            .iter()
            .all(|g| g.model.as_deref() == Some("NVIDIA A100-SXM4-40GB"))
    );
    assert!(
        s.gpus
            .iter()
            .any(|g| g.serial_number.as_deref() == Some("1323620023536"))
    );
    assert_eq!(
        s.pcie_devices.len(),
        32,
        "the standard PCIeDevices is empty: Systems/1/PCIDevices"
    );
    let summary = inv.to_string();
    assert!(summary.contains("gpus: 8"), "{summary}");
    Ok(())
}

// === 5: fallbacks, and BMCs without systems ===

#[tokio::test]
async fn summaries_chassis_drives_and_managers_without_systems() -> Result<()> {
    // Dell: the capture has no Processors or Memory members: ProcessorSummary and MemorySummary count.
    let (inv, quirks, _) =
        inspect(&serve("dell-idrac", CorpusOptions::default()).await?, false).await?;
    assert_eq!(quirks, "dell-idrac");
    let s = &inv.systems[0];
    assert!(s.processors_from_summary && s.memory_from_summary);
    assert_eq!((s.cpu_count(), s.memory_mib()), (1, 64 * 1024));
    let summary = inv.to_string();
    assert!(summary.contains("from ProcessorSummary"), "{summary}");
    assert!(
        inv.warnings
            .iter()
            .any(|w| w.contains("members of") && w.contains("could not be read")),
        "{:?}",
        inv.warnings
    );

    // Gigabyte without its Storage: the drive is found through the chassis' Links.Drives.
    let mut system: Value = serde_json::from_slice(&std::fs::read(
        corpus_dir().join("gigabyte-ami/Systems/Self/index.json"),
    )?)?;
    system.as_object_mut().map(|o| {
        o.remove("Storage");
        o.remove("SimpleStorage")
    });
    let srv = serve(
        "gigabyte-ami",
        CorpusOptions {
            overlay: HashMap::from([("/redfish/v1/Systems/Self".to_owned(), system)]),
            ..CorpusOptions::default()
        },
    )
    .await?;
    let (inv, _, _) = inspect(&srv, false).await?;
    assert_eq!(inv.systems[0].drives.len(), 1);
    assert_eq!(inv.systems[0].drives[0].capacity_bytes, Some(2013667524608));

    // A chassis manager and a switch: no Systems, managers and chassis all the same.
    for (tree, chassis) in [("cray-cmm", 17), ("cray-slingshot-switch", 1)] {
        let (inv, _, _) = inspect(&serve(tree, CorpusOptions::default()).await?, false).await?;
        assert!(inv.systems.is_empty());
        assert_eq!(
            (inv.managers.len(), inv.chassis.len()),
            (1, chassis),
            "{tree}"
        );
        assert!(inv.to_string().contains("no systems"), "{tree}");
    }
    Ok(())
}

// === 6: vendor marks ===

#[tokio::test]
async fn vendors_are_recognised_without_a_vendor_field() -> Result<()> {
    for (tree, mark) in [
        ("supermicro-1.9-oem", "Oem key \"Supermicro\""),
        (
            "supermicro-1.9-bare",
            "UUID \"00000000-0000-0000-0000-3CECEFCEFEDA\"",
        ),
    ] {
        let srv = serve(tree, CorpusOptions::default()).await?;
        let bmc = Bmc::connect(&srv.url, creds(), opts(false)).await?;
        assert_eq!(bmc.quirks().name, "supermicro", "{tree}");
        let line = bmc.vendor_line();
        assert!(
            line.starts_with("Supermicro (no Vendor; recognised by ") && line.contains(mark),
            "{tree}: {line}"
        );
        bmc.close().await?;
    }
    // AMI's Gigabyte states its Vendor.
    let (inv, quirks, _) = inspect(
        &serve("gigabyte-ami", CorpusOptions::default()).await?,
        false,
    )
    .await?;
    assert_eq!((quirks, inv.vendor.as_str()), ("ami-megarac", "AMI"));
    Ok(())
}

// === 8: interrupt, and clean output ===

#[tokio::test]
async fn an_interrupt_logs_the_session_out() -> Result<()> {
    let (srv, state) = common::fake_bmc(common::FakeState {
        get_delay: Duration::from_secs(30),
        ..common::FakeState::default()
    })
    .await?;
    let shutdown = async {
        // The session is open (login done) and the inventory is waiting on the slow GET of the system.
        loop {
            let open = state
                .lock()
                .map(|s| !s.sessions.is_empty() && s.in_flight > 0)
                .unwrap_or(false);
            if open {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let started = std::time::Instant::now();
    let err = redfish::run(
        &srv.url,
        creds(),
        opts(false),
        None,
        Operation::Inspect,
        shutdown,
    )
    .await
    .err()
    .context("interrupted")?;
    assert!(matches!(err, RedfishError::Interrupted { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let st = state.lock().map_err(|_| anyhow::anyhow!("lock"))?;
    assert!(st.sessions.is_empty(), "the session leaked: {:?}", st.log);
    assert_eq!(
        st.log
            .iter()
            .filter(|l| l.starts_with("DELETE /redfish/v1/SessionService/Sessions/"))
            .count(),
        1
    );
    Ok(())
}

#[tokio::test]
async fn a_wrong_password_is_reported_as_wrong_credentials() -> Result<()> {
    // This BMC answers a bad login with 400 (not 401); Basic with the same password is 401.
    let (srv, _state) = common::fake_bmc(common::FakeState {
        bad_login_400: true,
        ..common::FakeState::default()
    })
    .await?;
    let bad = Credentials {
        username: "admin".into(),
        password: "wrong".into(),
    };
    let err = Bmc::connect(&srv.url, bad, opts(false))
        .await
        .err()
        .context("refused")?;
    let text = err.to_string();
    assert!(matches!(err, RedfishError::AuthRejected { .. }), "{text}");
    assert!(text.contains("check the BMC user and password"), "{text}");
    assert!(!text.contains("free sessions"), "{text}");
    Ok(())
}

#[test]
fn outcomes_read_as_sentences() {
    let p = redfish::PowerOutcome::Applied {
        reset_type: "ForceOff".into(),
        power_state: "Off".into(),
    };
    assert_eq!(
        p.to_string(),
        "Reset ForceOff applied: PowerState reads Off"
    );
    let b = redfish::BootOverride {
        target: "UefiHttp".into(),
        enabled: "Once".into(),
        mode: Some("UEFI".into()),
    };
    assert_eq!(
        b.to_string(),
        "one-time boot override read back: Target=UefiHttp, Enabled=Once, Mode=UEFI"
    );
    assert!(redfish::valid_mac("b4:96:91:67:d8:e8") && !redfish::valid_mac("Not Available"));
    assert!(!redfish::valid_mac("00:00:00:00:00:00") && !redfish::valid_mac(""));
}

#[tokio::test]
async fn not_available_is_not_a_mac_and_host_interfaces_are_not_nics() -> Result<()> {
    let (inv, _, _) = inspect(
        &serve("cray-ex235a", CorpusOptions::default()).await?,
        false,
    )
    .await?;
    let s = &inv.systems[0];
    assert_eq!(s.nics.len(), 5);
    assert_eq!(s.macs().collect::<Vec<_>>(), ["00:40:a6:83:3a:52"]);
    let summary = inv.to_string();
    let nic_lines: Vec<&str> = summary
        .lines()
        .filter(|l| l.contains("HPCNet"))
        .filter(|l| !l.starts_with("warning"))
        .collect();
    assert_eq!(nic_lines.len(), 4, "{summary}");
    assert!(
        nic_lines
            .iter()
            .all(|l| l.contains("no MAC") && !l.contains("Not Available")),
        "{summary}"
    );
    assert!(
        inv.warnings
            .iter()
            .any(|w| w.contains("HPCNet0: MACAddress \"Not Available\" is not a MAC address"))
    );
    Ok(())
}

/// Inspecting one machine reads its system alone (`Bmc::inventory_of`), and finds in it what the whole inventory
/// finds: the same system, field for field, in every tree, for every system, at a fraction of the requests where a
/// BMC holds several systems. The site agent inspects a machine this way; a BMC with N machines behind it was read
/// whole N times before (the metal bench's fleet: 20 systems behind one sushy).
#[tokio::test]
async fn one_system_reads_as_it_does_in_the_whole_inventory() -> Result<()> {
    let mut diffs = Vec::new();
    let mut several = 0;
    for tree in &trees()? {
        let srv = serve(tree, CorpusOptions::default()).await?;
        let (whole, _, n_whole) = inspect(&srv, false).await?;
        let bmc = Bmc::connect(&srv.url, creds(), opts(false)).await?;
        let mut n_one = Vec::new();
        for s in &whole.systems {
            srv.reset_requests();
            let one = bmc.inventory_of(&s.path).await?;
            n_one.push(srv.requests());
            match one.systems.as_slice() {
                [only] if format!("{only:?}") == format!("{s:?}") => {}
                [only] => diffs.push(format!("{tree} {}: {only:?}\nwhole: {s:?}", s.path)),
                other => diffs.push(format!("{tree} {}: {} systems", s.path, other.len())),
            }
        }
        bmc.close().await?;
        println!(
            "{tree}: {} system(s); the whole inventory {n_whole} requests, one system {:?}",
            whole.systems.len(),
            n_one
        );
        if whole.systems.len() > 1 {
            several += 1;
            let most = n_one.iter().copied().max().unwrap_or(0);
            if most * 2 > n_whole {
                diffs.push(format!(
                    "{tree}: one of {} systems took {most} requests, the whole inventory {n_whole}",
                    whole.systems.len()
                ));
            }
        }
    }
    ensure!(several >= 1, "no tree holds several systems");
    ensure!(diffs.is_empty(), "{}", diffs.join("\n"));
    Ok(())
}

// === 9: $expand ===

#[tokio::test]
async fn expand_costs_fewer_requests_for_the_same_inventory() -> Result<()> {
    let srv = serve(
        "gigabyte-ami",
        CorpusOptions {
            expand: true,
            ..CorpusOptions::default()
        },
    )
    .await?;
    let (plain, quirks, n_plain) = inspect(&srv, false).await?;
    let (expanded, _, n_expand) = inspect(&srv, true).await?;
    assert_eq!(expanded.expand, Some("$expand=.($levels=1)"));
    assert!(
        n_expand * 2 < n_plain,
        "{n_expand} requests with $expand, {n_plain} without"
    );
    let want = expected("gigabyte-ami")?;
    let diffs = compare("gigabyte-ami", &expanded, quirks, &want);
    assert!(diffs.is_empty(), "{diffs:?}");
    assert_eq!(
        plain.to_string().lines().count(),
        expanded.to_string().lines().count()
    );
    // A service that advertises $expand but ignores it (links only): every member is read, same inventory.
    let refusing = serve(
        "gigabyte-ami",
        CorpusOptions {
            expand: false,
            ..CorpusOptions::default()
        },
    )
    .await?;
    let (inv, _, _) = inspect(&refusing, true).await?;
    assert!(compare("gigabyte-ami (refused)", &inv, quirks, &want).is_empty());
    Ok(())
}
