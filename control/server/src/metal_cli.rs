//! Operator commands of the metal flow: `better-compute metal enroll|inspect|provide|deploy|release|abort|retry|
//! show|list`, thin calls of the API. `--wait` follows the machine through its phases (each timeline row as it
//! opens and closes) until it rests, fails, or the wait's own deadline passes.

use crate::client::ApiClient;
use crate::output::{self, Format, Table};
use anyhow::Context as _;
use bc_core::api::metal::{
    BmcRef, DeployRequest, EnrollRequest, ListRequest, MachineRef, MachineView,
};
use bc_core::ids::SiteId;
use bc_core::metal::{ExpectedHardware, Phase, State, TimelineRow, fmt_utc};
use bc_mod_metal::api::methods::{
    Abort, Deploy, Enroll, Inspect, List, Provide, Release, Retry, Show,
};
use clap::{Args, Subcommand};
use std::time::Duration;

/// How a verb's answer is followed.
#[derive(Args, Debug, Clone)]
pub struct WaitArgs {
    /// Follow the machine's phases until it rests (enrolled, ready, deployed) or fails; exits 1 when it fails.
    #[arg(long)]
    pub wait: bool,
    /// The longest `--wait` waits: 90s, 30m, 1h.
    #[arg(long, default_value = "30m", value_parser = bc_proto::duration::parse)]
    pub wait_timeout: Duration,
}

#[derive(Subcommand)]
pub enum MetalCommand {
    /// Enroll a machine of a site: its BMC (Redfish base URL and the site secret with its credentials, stored
    /// with `secrets put`) and its boot NIC's MAC. It rests in `enrolled`.
    Enroll {
        #[arg(long)]
        site: String,
        /// The boot NIC's MAC.
        #[arg(long)]
        mac: String,
        /// The BMC's Redfish base URL (https://10.0.0.5).
        #[arg(long)]
        bmc: String,
        /// The site secret holding {"username", "password"} for the BMC.
        #[arg(long)]
        credentials: String,
        /// Expected hardware: a machine with fewer fails (diagnose is compared with it).
        #[arg(long)]
        expect_cpus: Option<u32>,
        #[arg(long)]
        expect_memory_mib: Option<u64>,
        #[arg(long)]
        expect_gpus: Option<u32>,
        #[arg(long)]
        expect_disks: Option<u32>,
        /// A NIC that must be present (repeat for several).
        #[arg(long)]
        expect_mac: Vec<String>,
    },
    /// Inspect (the BMC's Redfish inventory); the machine rests in `enrolled` again.
    Inspect {
        mac: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Provide: inspect if not yet, netboot the ramdisk, diagnose, wipe; it rests in `ready`.
    Provide {
        mac: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Deploy an image artifact (by digest) with cloud-init NoCloud data.
    Deploy {
        mac: String,
        /// The image artifact's digest, sha256:<hex> (`artifacts list`).
        #[arg(long)]
        image: String,
        /// A file with the cloud-init user-data.
        #[arg(long)]
        user_data: Option<std::path::PathBuf>,
        /// A file with the cloud-init meta-data.
        #[arg(long)]
        meta_data: Option<std::path::PathBuf>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Release a deployed machine: netboot the ramdisk, wipe, ready.
    Release {
        mac: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Abort the phase a machine waits in: it fails there, with the reason "aborted by the operator".
    Abort { mac: String },
    /// Retry a failed machine's phase with a fresh plan.
    Retry {
        mac: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// A machine's state, phase, deadline, timeline, last error and the evidence of its current attempt.
    /// One machine: state, deadline, node, timeline, steps (`-o json|yaml`: the API's answer).
    Show { mac: String },
    /// Enrolled machines, optionally of one site, in one phase, failed or not.
    List {
        #[arg(long)]
        site: Option<String>,
        /// enrolled, inspecting, booting-ramdisk, diagnosing, wiping, ready, deploying, deployed, releasing.
        #[arg(long)]
        phase: Option<String>,
        /// Only failed machines.
        #[arg(long, conflicts_with = "active")]
        failed: bool,
        /// Only machines that are not failed.
        #[arg(long)]
        active: bool,
    },
}

fn phase_arg(s: &str) -> anyhow::Result<Phase> {
    Phase::ALL
        .into_iter()
        .find(|p| p.as_str() == s)
        .with_context(|| {
            let all: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
            format!("--phase {s:?}: one of {}", all.join(", "))
        })
}

fn read_file(path: Option<std::path::PathBuf>) -> anyhow::Result<String> {
    match path {
        None => Ok(String::new()),
        Some(p) => std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display())),
    }
}

pub async fn metal(client: &ApiClient, out: Format, command: MetalCommand) -> anyhow::Result<()> {
    let r = |mac: &str| MachineRef {
        mac: mac.to_owned(),
    };
    let (view, wait) = match command {
        MetalCommand::Enroll {
            site,
            mac,
            bmc,
            credentials,
            expect_cpus,
            expect_memory_mib,
            expect_gpus,
            expect_disks,
            expect_mac,
        } => {
            let any = expect_cpus.is_some()
                || expect_memory_mib.is_some()
                || expect_gpus.is_some()
                || expect_disks.is_some()
                || !expect_mac.is_empty();
            let expected = any.then(|| ExpectedHardware {
                cpus: expect_cpus,
                memory_mib: expect_memory_mib,
                gpus: expect_gpus,
                disks: expect_disks,
                macs: expect_mac.iter().map(|m| m.to_ascii_lowercase()).collect(),
            });
            let req = EnrollRequest {
                site: SiteId::parse(&site).context("--site")?,
                mac,
                bmc: BmcRef {
                    address: bmc,
                    credentials,
                },
                expected,
            };
            (client.method::<Enroll>(&req).await?, None)
        }
        MetalCommand::Inspect { mac, wait } => {
            (client.method::<Inspect>(&r(&mac)).await?, Some(wait))
        }
        MetalCommand::Provide { mac, wait } => {
            (client.method::<Provide>(&r(&mac)).await?, Some(wait))
        }
        MetalCommand::Deploy {
            mac,
            image,
            user_data,
            meta_data,
            wait,
        } => {
            let req = DeployRequest {
                mac,
                image,
                user_data: read_file(user_data)?,
                meta_data: read_file(meta_data)?,
            };
            (client.method::<Deploy>(&req).await?, Some(wait))
        }
        MetalCommand::Release { mac, wait } => {
            (client.method::<Release>(&r(&mac)).await?, Some(wait))
        }
        MetalCommand::Abort { mac } => (client.method::<Abort>(&r(&mac)).await?, None),
        MetalCommand::Retry { mac, wait } => (client.method::<Retry>(&r(&mac)).await?, Some(wait)),
        MetalCommand::Show { mac } => {
            let v = client.method::<Show>(&r(&mac)).await?;
            return match out {
                Format::Table | Format::Wide => {
                    print!("{}", render(&v));
                    Ok(())
                }
                _ => output::print(out, &v, Table::default),
            };
        }
        MetalCommand::List {
            site,
            phase,
            failed,
            active,
        } => {
            let req = ListRequest {
                site: site
                    .map(|s| SiteId::parse(&s).context("--site"))
                    .transpose()?,
                phase: phase.as_deref().map(phase_arg).transpose()?,
                failed: (failed || active).then_some(failed),
            };
            let v = client.method::<List>(&req).await?;
            let now = output::now_ms();
            return output::print(out, &v, || {
                let mut t =
                    Table::new(&["MAC", "SITE", "STATE", "ATTEMPT", "DEADLINE", "LAST ERROR"])
                        .wide(&["DEADLINE AT"]);
                for m in &v.machines {
                    t.row(vec![
                        m.mac.to_string(),
                        m.site.to_string(),
                        m.state.to_string(),
                        m.attempt.to_string(),
                        output::age(m.deadline_ms, now),
                        m.last_error.clone().unwrap_or_default(),
                        m.deadline_ms.map(fmt_utc).unwrap_or_default(),
                    ]);
                }
                t
            });
        }
    };
    match wait {
        Some(w) if w.wait => follow(client, view, w.wait_timeout).await,
        _ if matches!(out, Format::Json | Format::Yaml) => {
            output::print(out, &view, Table::default)
        }
        _ => {
            println!("{} {}", view.mac, view.state);
            Ok(())
        }
    }
}

fn row_line(r: &TimelineRow) -> String {
    match (&r.end, &r.outcome) {
        (Some(end), outcome) => format!(
            "{:<16} attempt {}  {} → {}  {}",
            r.phase,
            r.attempt,
            fmt_utc(r.start),
            fmt_utc(*end),
            outcome.as_deref().unwrap_or("")
        ),
        (None, _) => format!(
            "{:<16} attempt {}  {} → …",
            r.phase,
            r.attempt,
            fmt_utc(r.start)
        ),
    }
}

/// `metal show` as text.
pub fn render(v: &MachineView) -> String {
    let mut out = format!(
        "machine   {}  (site {}, BMC {})\n",
        v.mac, v.site, v.bmc.address
    );
    out += &format!("state     {}\n", v.state);
    out += &format!("attempt   {}\n", v.attempt);
    if let Some(d) = v.deadline_ms {
        out += &format!(
            "deadline  {}  ({})\n",
            fmt_utc(d),
            v.waiting_for.as_deref().unwrap_or("")
        );
    }
    if let Some(n) = &v.node_id {
        out += &format!("node      {n}\n");
    }
    out += &format!("power     {} cycle(s)\n", v.power_cycles);
    if let Some(e) = &v.last_error {
        out += &format!("error     {e}\n");
    }
    for c in &v.conditions {
        out += &format!("condition {c}\n");
    }
    for (what, hw) in [("inspected", &v.inspection), ("diagnosed", &v.diagnosis)] {
        if let Some(h) = hw {
            out += &format!(
                "{what} cpus {:?}, memory {:?} MiB, gpus {:?}, disks {:?}, nics {}\n",
                h.cpus,
                h.memory_mib,
                h.gpus,
                h.disks,
                h.macs.join(" ")
            );
        }
    }
    out += "timeline\n";
    for r in &v.timeline {
        out += &format!("  {}\n", row_line(r));
    }
    if !v.steps.is_empty() {
        out += "steps of this attempt\n";
        for s in &v.steps {
            out += &format!(
                "  {:<18} {:<8} {:<9} {}\n",
                format!("{:?}", s.step),
                s.via,
                s.state,
                s.outcome
                    .as_ref()
                    .map(|o| o.to_string())
                    .unwrap_or_default()
            );
        }
    }
    out
}

/// Prints the timeline as it grows until the machine rests or fails, or `limit` passes.
async fn follow(client: &ApiClient, mut v: MachineView, limit: Duration) -> anyhow::Result<()> {
    let until = tokio::time::Instant::now() + limit;
    let mut printed: Vec<TimelineRow> = Vec::new();
    loop {
        for (i, r) in v.timeline.iter().enumerate() {
            if printed.get(i) != Some(r) {
                println!("{}", row_line(r));
            }
        }
        printed = v.timeline.clone();
        match &v.state {
            State::Failed { phase, reason } => {
                anyhow::bail!("{} failed in {phase}: {reason}", v.mac)
            }
            State::Active { phase } if !phase.is_wait() => {
                println!("{} {phase}", v.mac);
                return Ok(());
            }
            State::Active { .. } => {}
        }
        if tokio::time::Instant::now() >= until {
            anyhow::bail!(
                "{} is still {} after {} s (waiting for {}); follow it with `better-compute metal show {}`",
                v.mac,
                v.state,
                limit.as_secs(),
                v.waiting_for.as_deref().unwrap_or("?"),
                v.mac
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        v = client
            .method::<Show>(&MachineRef {
                mac: v.mac.to_string(),
            })
            .await?;
    }
}
