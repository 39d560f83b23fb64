//! `scripts/bench metal`: the metal flow's figures (issue 13).
//!
//! 1. The QEMU lab ([`lab`]), `BC_METAL_RUNS` runs (default 3), each in a fresh lab: enroll → ready and
//!    ready → deployed (the installed system's `bcd` rejoined), the time in each phase, the power cycles; medians.
//!    Goals: < 120 s each under TCG (anchors, not run here: Ironic's devstack CI allows 2,000 s per deploy under
//!    TCG; MAAS documents about 60 s of commissioning on real hardware).
//! 2. `BC_METAL_FLEET` machines (default 20) in flight at once against sushy-tools' fake driver with simulated
//!    ramdisk agents ([`fleet`]): all reach ready; wall time, enroll → ready spread, and the control plane's and the
//!    site agent's CPU per machine.
//!
//! `BC_BIN_DIR` holds the release `better-compute` and `bcd`. Ends with `metal: <s> s enroll-to-ready median` (the
//! lab's). `BC_METAL_RUNS=0` runs only the fleet (no root or images needed); `BC_METAL_FLEET=0` only the lab.

#[path = "metal/fleet.rs"]
mod fleet;
#[path = "metal/lab.rs"]
mod lab;

use anyhow::Context as _;
use std::path::PathBuf;

fn env_count(name: &str, default: usize) -> anyhow::Result<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().with_context(|| format!("{name}={v:?}")))
        .transpose()
        .map(|v| v.unwrap_or(default))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> anyhow::Result<()> {
    bc_proto::install_crypto_provider();
    let bin = PathBuf::from(std::env::var_os("BC_BIN_DIR").context("BC_BIN_DIR is not set")?);
    let runs = env_count("BC_METAL_RUNS", 3)?;
    let machines = env_count("BC_METAL_FLEET", 20)?;

    let mut done = Vec::new();
    if runs > 0 {
        if let Some(why) = bc_hwtests::lab::missing() {
            anyhow::bail!(
                "metal: the lab cannot run here: {why} (BC_METAL_RUNS=0 runs only the fleet)"
            );
        }
        let images = bc_hwtests::metal_flow::images().map_err(anyhow::Error::msg)?;
        println!(
            "metal lab: {runs} run(s) of enroll → ready → deployed, one QEMU (TCG) domain, a fresh lab each"
        );
        for i in 1..=runs {
            let r = lab::one_run(&bin.join("better-compute"), &bin.join("bcd"), &images)
                .with_context(|| format!("lab run {i} of {runs}"))?;
            println!(
                "run {i}: enroll → ready {:.1} s, ready → deployed {:.1} s, {} power cycle(s)",
                r.ready_s, r.deployed_s, r.power_cycles
            );
            for (phase, s) in &r.phases {
                println!("         {phase:<16} {s:>6.1} s");
            }
            done.push(r);
        }
        let phases: std::collections::BTreeSet<&String> =
            done.iter().flat_map(|r| r.phases.keys()).collect();
        println!("medians of {runs}, time in each phase:");
        for p in phases {
            let v = done
                .iter()
                .map(|r| r.phases.get(p).copied().unwrap_or(0.0))
                .collect();
            println!("  {p:<16} {:>6.1} s", median(v));
        }
    }

    if machines > 0 {
        println!(
            "metal fleet: {machines} machines at once, sushy-tools' fake driver, simulated ramdisk agents (no VMs)"
        );
        let f = fleet::run(&bin, machines).context("the fleet run")?;
        println!(
            "  all {} ready in {:.1} s; enroll → ready min {:.1} s, median {:.1} s, max {:.1} s; at most {} power \
             cycle(s)",
            f.machines,
            f.wall_s,
            f.ready_s.first().copied().unwrap_or(f64::NAN),
            median(f.ready_s.clone()),
            f.ready_s.last().copied().unwrap_or(f64::NAN),
            f.power_cycles_max
        );
        let names: std::collections::BTreeSet<&String> =
            f.phases.iter().flat_map(|p| p.keys()).collect();
        for p in names {
            let v: Vec<f64> = f.phases.iter().filter_map(|m| m.get(p).copied()).collect();
            println!(
                "    {p:<16} median {:>6.1} s, max {:>6.1} s over {} machines",
                median(v.clone()),
                v.iter().copied().fold(f64::NAN, f64::max),
                v.len()
            );
        }
        for r in &f.rekicked {
            println!("    re-kicked: {r}");
        }
        println!(
            "  CPU per machine: control plane (dev + PostgreSQL) {:.2} s, site agent {:.2} s",
            f.control_cpu_s_per_machine, f.site_cpu_s_per_machine
        );
    }

    if runs > 0 {
        let ready = median(done.iter().map(|r| r.ready_s).collect());
        let deployed = median(done.iter().map(|r| r.deployed_s).collect());
        let cycles = done.iter().map(|r| r.power_cycles).max().unwrap_or(0);
        println!("  enroll → ready   {ready:>6.1} s median (goal < 120 s under TCG)");
        println!("  ready → deployed {deployed:>6.1} s median (goal < 120 s under TCG)");
        println!("  power cycles, enroll → deployed: at most {cycles} (goal ≤ 2)");
        println!("metal: {ready:.1} s enroll-to-ready median");
    }
    Ok(())
}
