//! The PXE lab: real firmware in QEMU boots a kernel and initramfs served by the real `bcd site serve`.
//!
//! Topology (LAB-NOTES): netns `seg` holds a bridge, the VM's tap and a plain dnsmasq (addresses only, no-ping,
//! IPv6 RA so iPXE does not wait); netns `site` holds `bcd site serve` (proxy DHCP + TFTP + HTTP) on a veth
//! joined to the bridge. Then:
//! (a) SeaBIOS + QEMU's iPXE ROM (virtio-net): proxy offer with the script URL → HTTP kernel + initrd → /init;
//! (b) OVMF with `romfile=` empty: its own PXE. bcd site runs with `[dhcp] offer = "boot-server"`, so the port-67
//!     offer carries a boot-server menu and no file: OVMF must REQUEST on 4011 → ACK with snponly.efi → TFTP →
//!     iPXE → HTTP script → /init (asserted from bcd site's log and its final `replied_4011` counter);
//! (c) a MAC not in the netboot table: bcd site logs and counts it, and never answers it.
//! The initramfs's /init prints `BCDLAB-INIT marker=<from the kernel command line>` and powers off (-no-reboot).
//! Per-phase timings are printed (from QEMU's start, as seen in bcd site's log and the serial console).
//!
//! Needs root, iproute2, qemu-system-x86, ipxe-qemu, ipxe, ovmf, dnsmasq and the artifacts of
//! `images/build-pxe-lab` (run here when missing; the kernel download needs apt once). Anything absent prints
//! `SKIP: pxe_lab: <reason>` and returns (a skip is not a pass); `BC_HWTESTS_REQUIRE_LAB=1` turns a skip into a failure.
//! Namespaces are named after this process's PID and deleted, and every child killed by PID, on every exit path.
//! QEMU runs under TCG (`-accel tcg`; LAB-NOTES: this host's KVM cannot boot a stock kernel); `BC_LAB_ACCEL=kvm`
//! overrides. `bcd` is `BCD_BIN`, else built here with `cargo build -p bcd`.

use std::fs;
use std::io::{BufRead as _, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

mod common;
use bc_hwtests::netns::{Netns, ip};
use bc_hwtests::watch::Watcher;
use bc_hwtests::{have, skip};
use common::{Proc, bcd_binary, run, workspace};

const TEST: &str = "pxe_lab";
const BIOS_MAC: &str = "52:54:00:77:00:01";
const UEFI_MAC: &str = "52:54:00:77:00:02";
const UNMARKED_MAC: &str = "52:54:00:77:00:99";
const SITE_IP: &str = "10.77.0.2";
const ROGUE_IP: &str = "10.77.0.3";
const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
const LOADERS: [&str; 3] = [
    "/usr/lib/ipxe/undionly.kpxe",
    "/usr/lib/ipxe/snponly.efi",
    "/usr/lib/ipxe/ipxe.efi",
];

fn accel() -> String {
    std::env::var("BC_LAB_ACCEL").unwrap_or_else(|_| "tcg".into())
}

struct Lab {
    dir: tempfile::TempDir,
    seg: String,
    bcd_log: PathBuf,
}

/// Boots one VM and waits for its /init marker and QEMU's exit; returns the phase timings.
fn boot(
    lab: &Lab,
    name: &str,
    mac: &str,
    uefi: bool,
    limit: Duration,
) -> Result<Vec<(String, Duration)>> {
    let serial = lab.dir.path().join(format!("{name}.serial"));
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.seg, "qemu-system-x86_64"])
        .args([
            "-accel",
            &accel(),
            "-m",
            "512",
            "-smp",
            "1",
            "-nodefaults",
            "-display",
            "none",
        ])
        .args(["-no-reboot", "-monitor", "none"])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .args(["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no"]);
    if uefi {
        let vars = lab.dir.path().join(format!("{name}-vars.fd"));
        fs::copy(OVMF_VARS, &vars)?;
        cmd.args([
            "-drive",
            &format!("if=pflash,format=raw,readonly=on,file={OVMF_CODE}"),
        ])
        .args([
            "-drive",
            &format!("if=pflash,format=raw,file={}", vars.display()),
        ])
        .args([
            "-device",
            &format!("virtio-net-pci,netdev=n0,mac={mac},romfile=,bootindex=1"),
        ]);
    } else {
        cmd.args(["-boot", "n"])
            .args(["-device", &format!("virtio-net-pci,netdev=n0,mac={mac}")]);
    }
    let t0 = Instant::now();
    let mut qemu = Proc::spawn("qemu", cmd.stdout(Stdio::null()).stderr(Stdio::piped()))?;
    let mut log = Watcher::new(lab.bcd_log.clone(), t0);
    let mut console = Watcher::new(serial.clone(), t0);
    let marker = format!("BCDLAB-INIT marker={name}");
    let mac_field = format!("mac={mac}");
    let script = format!("/boot/{mac}.ipxe");
    let exited = loop {
        log.poll(&[
            (
                "proxy DHCP answered (firmware)",
                &["answered", &mac_field, "port=Dhcp"],
            ),
            (
                "proxy DHCP answered on 4011",
                &[
                    "answered",
                    &mac_field,
                    "port=PxeBoot",
                    "bootfile=snponly.efi",
                ],
            ),
            (
                "loader sent over TFTP",
                &["TFTP transfer complete", "snponly.efi"],
            ),
            ("iPXE script served", &["served iPXE script", &mac_field]),
            (
                "kernel requested over HTTP",
                &["target=/artifacts/lab/vmlinuz", "status=200"],
            ),
            (
                "initrd requested over HTTP",
                &["target=/artifacts/lab/initramfs.cpio", "status=200"],
            ),
        ]);
        console.poll(&[("/init ran (serial marker)", &[marker.as_str()])]);
        if let Some(status) = qemu.child.try_wait()? {
            break Some(status);
        }
        if t0.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let total = t0.elapsed();
    console.poll(&[("/init ran (serial marker)", &[marker.as_str()])]);
    let mut phases = log.seen;
    phases.extend(console.seen.iter().cloned());
    phases.sort_by_key(|(_, t)| *t);
    println!(
        "pxe_lab {name} ({}):",
        if uefi {
            "OVMF, its own PXE"
        } else {
            "SeaBIOS + iPXE ROM"
        }
    );
    for (label, t) in &phases {
        println!("  {:>6.1} s  {label}", t.as_secs_f64());
    }
    let serial_text = fs::read_to_string(&serial).unwrap_or_default();
    let tail: String = serial_text
        .lines()
        .rev()
        .take(15)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    match exited {
        None => {
            qemu.terminate(Duration::from_secs(2));
            bail!("{name}: no power-off within {limit:?}; phases {phases:?}; serial tail:\n{tail}");
        }
        Some(status) => {
            println!("  {:>6.1} s  QEMU exited ({status})", total.as_secs_f64());
            let mut stderr = String::new();
            if let Some(e) = qemu.child.stderr.take() {
                for line in BufReader::new(e).lines().map_while(Result::ok) {
                    stderr.push_str(&line);
                    stderr.push('\n');
                }
            }
            if !status.success() {
                bail!("{name}: QEMU failed ({status}): {stderr}\nserial tail:\n{tail}");
            }
            if !console.has("/init ran (serial marker)") {
                bail!(
                    "{name}: QEMU exited without the /init marker {marker:?} (kernel panic?); serial tail:\n{tail}"
                );
            }
        }
    }
    for needed in [
        "iPXE script served",
        "kernel requested over HTTP",
        "initrd requested over HTTP",
    ] {
        if !phases.iter().any(|(l, _)| l == needed) {
            bail!("{name}: booted, but bcd site's log lacks {needed:?} ({script})");
        }
    }
    if uefi && !phases.iter().any(|(l, _)| l == "loader sent over TFTP") {
        bail!("{name}: booted, but bcd site never completed the snponly.efi TFTP transfer");
    }
    // Firmware PXE under `offer = "boot-server"`: the file came from the 4011 ACK, not the port-67 offer.
    if uefi {
        for needed in [
            "proxy DHCP answered (firmware)",
            "proxy DHCP answered on 4011",
        ] {
            if !phases.iter().any(|(l, _)| l == needed) {
                bail!("{name}: booted, but bcd site's log lacks {needed:?}");
            }
        }
        let at = |label: &str| phases.iter().find(|(l, _)| l == label).map(|(_, t)| *t);
        if at("proxy DHCP answered on 4011") > at("loader sent over TFTP") {
            bail!("{name}: snponly.efi was sent before the 4011 ACK: {phases:?}");
        }
    }
    Ok(phases)
}

#[test]
fn pxe_boots_bios_and_uefi_and_ignores_unmarked_macs() -> Result<()> {
    let started = Instant::now();
    let uid = run(Command::new("id").arg("-u")).unwrap_or_default();
    if uid.trim() != "0" {
        return skip(
            TEST,
            "not root (network namespaces, taps and port 67 need root)",
        );
    }
    for tool in ["ip", "qemu-system-x86_64", "dnsmasq", "cpio"] {
        if !have(tool) {
            return skip(
                TEST,
                format!("{tool} not found (scripts/setup installs it)"),
            );
        }
    }
    for file in LOADERS.iter().chain([&OVMF_CODE, &OVMF_VARS]) {
        if !Path::new(file).is_file() {
            return skip(TEST, format!("{file} missing (packages ipxe, ovmf)"));
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        return skip(TEST, "/dev/net/tun missing (no tap devices)");
    }
    let images = workspace().join("images/out/pxe-lab");
    if !images.join("vmlinuz").is_file() || !images.join("initramfs.cpio").is_file() {
        let out = Command::new(workspace().join("images/build-pxe-lab")).output()?;
        if !out.status.success() {
            return skip(
                TEST,
                format!(
                    "lab kernel/initramfs unavailable: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            );
        }
    }
    let probe = format!("bcdlab{}p", std::process::id());
    match Netns::create(probe) {
        Ok(ns) => drop(ns),
        Err(e) => return skip(TEST, format!("cannot create a network namespace: {e:#}")),
    }
    let built = Instant::now();
    let bcd = bcd_binary()?;
    println!(
        "pxe_lab: accel {}, bcd {} (checked/built in {:.1} s)",
        accel(),
        bcd.display(),
        built.elapsed().as_secs_f64()
    );

    // === files ===
    let dir = tempfile::tempdir()?;
    let tftp = dir.path().join("tftp");
    let artifacts = dir.path().join("artifacts/lab");
    fs::create_dir_all(&tftp)?;
    fs::create_dir_all(&artifacts)?;
    let public = |from: &Path, to: PathBuf| -> Result<()> {
        fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o644))?;
        Ok(())
    };
    for l in LOADERS {
        let l = Path::new(l);
        public(l, tftp.join(l.file_name().context("loader name")?))?;
    }
    public(&images.join("vmlinuz"), artifacts.join("vmlinuz"))?;
    public(
        &images.join("initramfs.cpio"),
        artifacts.join("initramfs.cpio"),
    )?;
    let machine = |mac: &str, marker: &str| {
        format!(
            "[[machine]]\nmac = \"{mac}\"\nkernel = \"lab/vmlinuz\"\ninitrd = \"lab/initramfs.cpio\"\n\
             cmdline = \"console=ttyS0 quiet panic=-1 BCDLAB_MARKER={marker}\"\n\n"
        )
    };
    let site_toml = dir.path().join("site.toml");
    fs::write(
        &site_toml,
        format!(
            "[boot]\ninterface = \"vsite\"\nserver_ip = \"{SITE_IP}\"\ntftp_root = \"{}\"\nartifacts = \"{}\"\n\
             report_interval_s = 0\n\n[dhcp]\noffer = \"boot-server\"\n\n{}{}",
            tftp.display(),
            dir.path().join("artifacts").display(),
            machine(BIOS_MAC, "bios"),
            machine(UEFI_MAC, "uefi"),
        ),
    )?;

    // === network: seg (bridge, tap, dnsmasq) + site (bcd) joined by a veth ===
    let pid = std::process::id();
    let seg = Netns::create(format!("bcdlab{pid}s"))?;
    let site = Netns::create(format!("bcdlab{pid}b"))?;
    let (s, b) = (seg.0.as_str(), site.0.as_str());
    ip(&[
        "-n",
        s,
        "link",
        "add",
        "br0",
        "type",
        "bridge",
        "forward_delay",
        "0",
    ])?;
    ip(&["-n", s, "addr", "add", "10.77.0.1/24", "dev", "br0"])?;
    ip(&["-n", s, "addr", "add", "fd77::1/64", "dev", "br0", "nodad"])?;
    ip(&["-n", s, "tuntap", "add", "tap0", "mode", "tap"])?;
    ip(&["-n", s, "link", "set", "tap0", "master", "br0", "up"])?;
    ip(&[
        "-n", s, "link", "add", "vseg", "type", "veth", "peer", "name", "vsite", "netns", b,
    ])?;
    ip(&["-n", s, "link", "set", "vseg", "master", "br0", "up"])?;
    ip(&["-n", s, "link", "set", "br0", "up"])?;
    ip(&[
        "-n",
        b,
        "addr",
        "add",
        &format!("{SITE_IP}/24"),
        "dev",
        "vsite",
    ])?;
    ip(&["-n", b, "link", "set", "vsite", "up"])?;

    let d = dir.path();
    let _dnsmasq = Proc::spawn(
        "dnsmasq",
        Command::new("ip")
            .args([
                "netns",
                "exec",
                s,
                "dnsmasq",
                "--keep-in-foreground",
                "--conf-file=/dev/null",
            ])
            .args([
                "--port=0",
                "--interface=br0",
                "--bind-interfaces",
                "--no-ping",
                "--log-dhcp",
            ])
            .args(["--dhcp-range=10.77.0.100,10.77.0.150,255.255.255.0,1h"])
            .args(["--enable-ra", "--dhcp-range=fd77::,ra-only"])
            .arg(format!("--dhcp-leasefile={}", d.join("leases").display()))
            .arg(format!("--pid-file={}", d.join("dnsmasq.pid").display()))
            .arg(format!(
                "--log-facility={}",
                d.join("dnsmasq.log").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )?;
    let bcd_log = d.join("bcd.log");
    let mut bcd_proc = Proc::spawn(
        "bcd site serve",
        Command::new("ip")
            .args(["netns", "exec", b])
            .arg(&bcd)
            .args(["site", "serve", "--config"])
            .arg(&site_toml)
            .env("BCD_LOG", "info,bcd_site=debug")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&bcd_log)?),
    )?;
    let mut ready = Watcher::new(bcd_log.clone(), Instant::now());
    while !ready.has("serving") {
        ready.poll(&[("serving", &["bcd site serving"])]);
        if let Some(status) = bcd_proc.child.try_wait()? {
            bail!(
                "bcd site serve exited ({status}): {}",
                fs::read_to_string(&bcd_log)?
            );
        }
        if ready.t0.elapsed() > Duration::from_secs(10) {
            bail!(
                "bcd site serve did not start: {}",
                fs::read_to_string(&bcd_log)?
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("pxe_lab: setup {:.1} s", started.elapsed().as_secs_f64());

    let lab = Lab {
        dir,
        seg: s.to_owned(),
        bcd_log: bcd_log.clone(),
    };
    let show_logs = |e: anyhow::Error| {
        let log = fs::read_to_string(&bcd_log).unwrap_or_default();
        let dns = fs::read_to_string(lab.dir.path().join("dnsmasq.log")).unwrap_or_default();
        let tail = |t: &str| {
            t.lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        };
        e.context(format!(
            "bcd site log tail:\n{}\ndnsmasq log tail:\n{}",
            tail(&log),
            tail(&dns)
        ))
    };

    // (a) BIOS: QEMU's iPXE ROM asks with user-class iPXE and gets the script URL straight away.
    boot(&lab, "bios", BIOS_MAC, false, Duration::from_secs(90)).map_err(show_logs)?;
    // (b) UEFI: OVMF's own PXE, 4011, snponly.efi over TFTP, then iPXE over HTTP.
    boot(&lab, "uefi", UEFI_MAC, true, Duration::from_secs(120)).map_err(show_logs)?;

    // (c) An unmarked MAC: bcd site sees it, logs it once and never answers it. Meanwhile a second PXE server
    // (dnsmasq in proxy mode, netns `bcdlab<pid>r` on the bridge) does answer it: bcd site must report that one as
    // a rogue, and only that one.
    let rogue_ns = Netns::create(format!("bcdlab{pid}r"))?;
    let r = rogue_ns.0.as_str();
    ip(&[
        "-n", s, "link", "add", "vrseg", "type", "veth", "peer", "name", "vrogue", "netns", r,
    ])?;
    ip(&["-n", s, "link", "set", "vrseg", "master", "br0", "up"])?;
    ip(&[
        "-n",
        r,
        "addr",
        "add",
        &format!("{ROGUE_IP}/24"),
        "dev",
        "vrogue",
    ])?;
    ip(&["-n", r, "link", "set", "vrogue", "up"])?;
    let _rogue = Proc::spawn(
        "dnsmasq (rogue PXE proxy)",
        Command::new("ip")
            .args([
                "netns",
                "exec",
                r,
                "dnsmasq",
                "--keep-in-foreground",
                "--conf-file=/dev/null",
            ])
            .args([
                "--port=0",
                "--interface=vrogue",
                "--bind-interfaces",
                "--dhcp-range=10.77.0.0,proxy",
            ])
            .args([
                "--pxe-service=x86PC,Rogue,undionly.kpxe",
                "--pxe-service=X86-64_EFI,Rogue,ipxe.efi",
            ])
            .args(["--dhcp-leasefile=/dev/null"])
            .arg(format!(
                "--pid-file={}",
                lab.dir.path().join("rogue.pid").display()
            ))
            .arg(format!(
                "--log-facility={}",
                lab.dir.path().join("rogue.log").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let serial = lab.dir.path().join("unmarked.serial");
    let mut qemu = Proc::spawn(
        "qemu (unmarked)",
        Command::new("ip")
            .args(["netns", "exec", s, "qemu-system-x86_64"])
            .args([
                "-accel",
                &accel(),
                "-m",
                "256",
                "-smp",
                "1",
                "-nodefaults",
                "-display",
                "none",
            ])
            .args(["-no-reboot", "-monitor", "none", "-boot", "n"])
            .arg("-serial")
            .arg(format!("file:{}", serial.display()))
            .args(["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no"])
            .args([
                "-device",
                &format!("virtio-net-pci,netdev=n0,mac={UNMARKED_MAC}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )?;
    let mac_field = format!("mac={UNMARKED_MAC}");
    let mut log = Watcher::new(bcd_log.clone(), t0);
    let mut leases = Watcher::new(lab.dir.path().join("dnsmasq.log"), t0);
    // Seen by bcd, and given an address by dnsmasq (so the client really was on the wire and did DHCP), then a
    // few seconds for any proxy answer to show up.
    while !(log.has("seen") && leases.has("acked")) && t0.elapsed() < Duration::from_secs(60) {
        log.poll(&[("seen", &["not marked for netboot", &mac_field])]);
        leases.poll(&[("acked", &["DHCPACK", UNMARKED_MAC])]);
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    qemu.terminate(Duration::from_secs(2));
    println!(
        "pxe_lab unmarked: bcd site saw it at {:?}, dnsmasq leased at {:?}",
        log.seen.first().map(|s| s.1),
        leases.seen.first().map(|s| s.1)
    );
    if !log.has("seen") {
        return Err(show_logs(anyhow::anyhow!(
            "bcd site never logged the unmarked MAC {UNMARKED_MAC}"
        )));
    }
    if !leases.has("acked") {
        return Err(show_logs(anyhow::anyhow!(
            "dnsmasq never leased to {UNMARKED_MAC}"
        )));
    }

    // Stop bcd site and read its final counters.
    if !bcd_proc.terminate(Duration::from_secs(10)) {
        bail!("bcd site serve did not stop on SIGTERM within 10 s");
    }
    let text = fs::read_to_string(&bcd_log)?;
    let answered_unmarked = text
        .lines()
        .filter(|l| {
            l.contains(&mac_field) && (l.contains("answered") && !l.contains("not answered"))
        })
        .count();
    assert_eq!(
        answered_unmarked, 0,
        "bcd site answered the unmarked MAC:\n{text}"
    );
    assert!(
        !text.contains(&format!("/boot/{UNMARKED_MAC}.ipxe")),
        "the unmarked MAC fetched a script"
    );
    let counters = text
        .lines()
        .rfind(|l| l.contains("proxy DHCP counters"))
        .context("no final proxy DHCP counters line")?;
    println!("pxe_lab: final {}", counters.trim());
    let ignored = counters
        .split("not_marked_for_netboot=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(ignored >= 1, "the unmarked MAC was not counted: {counters}");
    let acks_4011 = counters
        .split("replied_4011=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<u64>().ok())
        .context("no replied_4011 in the final counters")?;
    assert!(
        acks_4011 >= 1,
        "OVMF never got a 4011 ACK (offer = \"boot-server\"): {counters}"
    );
    let rogue_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("another server is answering PXE clients"))
        .collect();
    assert!(
        !rogue_lines.is_empty() && !counters.contains("rogue_seen=0"),
        "the rogue PXE proxy at {ROGUE_IP} was not reported: {counters}"
    );
    let rogue_server = format!("server={ROGUE_IP}");
    assert!(
        rogue_lines.iter().all(|l| l.contains(&rogue_server)),
        "something other than {ROGUE_IP} (dnsmasq handing out addresses only?) was reported: {rogue_lines:?}"
    );
    assert!(
        text.contains("other PXE servers answer on the boot segment"),
        "the final report does not name the rogue server"
    );
    println!(
        "pxe_lab: rogue reported {} time(s): {}",
        rogue_lines.len(),
        rogue_lines[0].trim()
    );
    assert!(text.contains("stopped"), "no clean stop in the log");
    println!("pxe_lab: total {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
