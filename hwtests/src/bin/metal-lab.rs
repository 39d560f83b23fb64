//! `metal-lab`: the metal lab by hand (scripts/lab wraps it).
//!
//! `metal-lab up [--basic-auth USER:PASSWORD] [--domain NAME:bios|uefi[:isolated]]...` sets the lab up, defines
//! the domains (numbered from 1: fixed UUIDs and MACs), prints where everything is, and tears it all down when
//! its standard input reaches a line or its end. `metal-lab down` tears down every lab whose process is gone
//! (killed, crashed), by the names and PIDs in its manifest.

use std::io::BufRead as _;

use anyhow::{Context, Result, bail};
use bc_hwtests::lab::{self, BasicAuth, DomainSpec, Firmware, LabOptions, MetalLab, Segment};

const USAGE: &str = "usage: metal-lab up [--basic-auth USER:PASSWORD] [--domain NAME:bios|uefi[:isolated]]...\n       metal-lab down";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("up") => up(&args[1..]),
        Some("down") => {
            let r = lab::manifest::reap();
            println!(
                "metal-lab: tore down {} lab(s); processes {:?}; namespaces {:?}",
                r.labs.len(),
                r.processes,
                r.namespaces
            );
            Ok(())
        }
        _ => bail!("{USAGE}"),
    }
}

fn up(args: &[String]) -> Result<()> {
    let mut opts = LabOptions::default();
    let mut specs = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--basic-auth" => {
                let v = it.next().context("--basic-auth needs USER:PASSWORD")?;
                let (user, password) = v
                    .split_once(':')
                    .context("--basic-auth needs USER:PASSWORD")?;
                opts.basic_auth = Some(BasicAuth {
                    user: user.into(),
                    password: password.into(),
                });
            }
            "--domain" => {
                let v = it.next().context("--domain needs NAME:bios|uefi")?;
                let parts: Vec<&str> = v.split(':').collect();
                let firmware = match parts.get(1).copied() {
                    Some("bios") => Firmware::SeaBios,
                    Some("uefi") => Firmware::Ovmf,
                    _ => bail!("--domain {v}: the firmware is bios or uefi\n{USAGE}"),
                };
                let segment = match parts.get(2).copied() {
                    None => Segment::Boot,
                    Some("isolated") => Segment::Isolated,
                    Some(other) => bail!("--domain {v}: {other:?} is not \"isolated\"\n{USAGE}"),
                };
                let n = u8::try_from(specs.len() + 1).context("at most 255 domains")?;
                specs.push(DomainSpec::new(parts[0], n, firmware).on(segment));
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if let Some(why) = lab::missing() {
        bail!("the metal lab cannot run here: {why}");
    }
    let mut lab = MetalLab::up(opts)?;
    for s in &specs {
        lab.define(s)?;
    }
    lab.print_timings();
    println!("folder        {}", lab.dir.display());
    println!(
        "namespaces    segment {} (br0 boot segment, br1 isolated), site {} ({} {})",
        lab.segment.name(),
        lab.site.name(),
        lab::SITE_IFACE,
        lab::SITE_IP
    );
    println!("libvirt       {}", lab.libvirt_uri);
    println!(
        "BMC           {} (from the site namespace: ip netns exec {} curl {}/redfish/v1/Systems)",
        lab.bmc_url,
        lab.site.name(),
        lab.bmc_url
    );
    for d in lab.domains() {
        println!(
            "domain        {} {:?} on {} mac {} system {} serial {}",
            d.name,
            d.firmware,
            d.segment.bridge(),
            d.mac,
            d.redfish_path(),
            d.serial.display()
        );
    }
    println!("metal-lab: up; press Enter (or close stdin) to tear it down");
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    drop(lab);
    println!("metal-lab: torn down");
    Ok(())
}
