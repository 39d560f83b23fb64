//! PID 1: bring the machine up from the initramfs, run what the kernel command line asks, and never exit.
//!
//! Mounts `/proc`, `/sys`, `/dev` (devtmpfs), `/run` and `/tmp`; makes `/dev/console` stdio; reaps children on a
//! thread; loads the modules of `/lib/modules/load-order` (written at image build time, dependencies first) that
//! the present devices need, with `finit_module`; reads `/proc/cmdline` ([`crate::cmdline`]); runs the `bc.action` list; then powers off.
//! Any fatal error is printed (`bc-fatal: …`) and the machine powers off: PID 1 returning would panic the kernel.
//!
//! Results go to the console as single lines `bc-report <kind> <json>`, phase timings as
//! `bc-phase <name> <ms since PID 1 started> <kernel uptime s>`, so a serial log is the record.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{error, info, warn};

use crate::actions;
use crate::cmdline::{self, Action, DiskSelection, Mode, RamdiskParams};
use crate::os::sys;

/// Where the image build puts the module load list ([`crate::modules::load`]).
pub const LOAD_ORDER: &str = "/lib/modules/load-order";

/// A clock for phase lines.
pub struct Phases {
    start: Instant,
}

impl Phases {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    pub fn mark(&self, name: &str) {
        let uptime = std::fs::read_to_string("/proc/uptime")
            .ok()
            .and_then(|u| u.split_whitespace().next().map(str::to_string))
            .unwrap_or_else(|| "?".into());
        say(&format!(
            "bc-phase {name} {} {uptime}",
            self.start.elapsed().as_millis()
        ));
    }
}

impl Default for Phases {
    fn default() -> Self {
        Self::new()
    }
}

/// One line on the console (stdout), flushed.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// `bc-report <kind> <json>`.
pub fn report<T: Serialize>(kind: &str, value: &T) {
    match serde_json::to_string(value) {
        Ok(json) => say(&format!("bc-report {kind} {json}")),
        Err(e) => say(&format!(
            "bc-report {kind} {{\"error\":\"serializing: {e}\"}}"
        )),
    }
}

/// Power off, and if even that fails, idle forever (PID 1 must not exit).
pub fn halt() -> ! {
    let e = sys::power_off();
    say(&format!("bc-fatal: power off failed: {e}; idling"));
    idle()
}

fn idle() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn fatal(what: &str) -> ! {
    error!("{what}");
    say(&format!("bc-fatal: {what}"));
    halt()
}

/// The early mounts. Already-mounted targets (`EBUSY`) are fine.
pub fn mount_early() -> Vec<String> {
    let mut problems = Vec::new();
    let mounts: [(&str, &str, &str, libc::c_ulong); 5] = [
        (
            "proc",
            "/proc",
            "proc",
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        ),
        (
            "sysfs",
            "/sys",
            "sysfs",
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        ),
        ("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID),
        ("tmpfs", "/run", "tmpfs", libc::MS_NOSUID | libc::MS_NODEV),
        ("tmpfs", "/tmp", "tmpfs", libc::MS_NOSUID | libc::MS_NODEV),
    ];
    for (source, target, fstype, flags) in mounts {
        let _ = std::fs::create_dir_all(target);
        if let Err(e) = sys::mount(source, Path::new(target), fstype, flags, None)
            && e.raw_os_error() != Some(libc::EBUSY)
        {
            problems.push(format!("mount {fstype} on {target}: {e}"));
        }
    }
    problems
}

/// Every device `modalias` under `sys_bus` (`/sys/bus/*/devices/*/modalias`).
pub fn present_modaliases(sys_bus: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(buses) = std::fs::read_dir(sys_bus) else {
        return out;
    };
    for bus in buses.flatten() {
        let Ok(devices) = std::fs::read_dir(bus.path().join("devices")) else {
            continue;
        };
        for dev in devices.flatten() {
            if let Ok(alias) = std::fs::read_to_string(dev.path().join("modalias")) {
                out.push(alias.trim().to_string());
            }
        }
    }
    out
}

/// What module loading did.
#[derive(Debug, Default, Serialize)]
pub struct ModulesReport {
    pub loaded: Vec<String>,
    /// Drivers for devices this machine does not have (and their dependencies).
    pub not_needed: Vec<String>,
    pub failures: Vec<String>,
}

/// Load the modules of the load list (see [`crate::modules::load`]) that this machine needs, in passes until no
/// new device asks for a driver. A module that fails is recorded, not fatal: a driver may refuse hardware it
/// cannot run (crc32c-intel without SSE4.2 answers ENODEV) and the machine still boots.
pub fn load_modules(list: &str, sys_bus: &Path) -> ModulesReport {
    use std::os::fd::AsFd;
    let entries = crate::modules::load::parse(list);
    let mut attempted = std::collections::BTreeSet::new();
    let mut report = ModulesReport::default();
    for _pass in 0..8 {
        let present = present_modaliases(sys_bus);
        let pick = crate::modules::load::select(&entries, &attempted, &present);
        if pick.is_empty() {
            break;
        }
        for i in pick {
            let e = &entries[i];
            attempted.insert(e.name.clone());
            match std::fs::File::open(&e.path).and_then(|f| sys::finit_module(f.as_fd())) {
                Ok(()) => report.loaded.push(e.name.clone()),
                Err(err) => {
                    warn!(module = %e.path, error = %bc_error_chain::InlineErrorChain::new(&err), "module not loaded");
                    report.failures.push(format!("{}: {err}", e.path));
                }
            }
        }
    }
    report.not_needed = entries
        .iter()
        .filter(|e| !attempted.contains(&e.name))
        .map(|e| e.name.clone())
        .collect();
    report
}

/// Wait (up to `max`) until disks stop appearing: every NVMe controller `live` and the list of block devices
/// unchanged for 500 ms (NVMe namespaces and SCSI disks are found asynchronously after their driver loads).
pub fn settle_devices(max: Duration) -> Vec<String> {
    let start = Instant::now();
    let block = || crate::diagnose::collect_disk_names(Path::new("/"));
    let nvme_live = || {
        std::fs::read_dir("/sys/class/nvme").map_or(true, |d| {
            d.flatten().all(|c| {
                std::fs::read_to_string(c.path().join("state")).is_ok_and(|s| s.trim() == "live")
            })
        })
    };
    let mut last = block();
    let mut stable_since = Instant::now();
    while start.elapsed() < max {
        std::thread::sleep(Duration::from_millis(50));
        let now = block();
        if now != last {
            last = now;
            stable_since = Instant::now();
        } else if nvme_live() && stable_since.elapsed() >= Duration::from_millis(500) {
            break;
        }
    }
    last
}

fn start_reaper() {
    let _ = std::thread::Builder::new().name("reaper".into()).spawn(|| {
        loop {
            if sys::wait_any_child().is_err() {
                // ECHILD: nothing to wait for yet.
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    });
}

fn init_logging(debug: bool) {
    let level = if debug { "debug" } else { "info" };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new(level))
        .try_init();
}

/// PID 1 entry point. Never returns.
pub fn run() -> ! {
    let phases = Phases::new();
    let mount_problems = mount_early();
    if std::fs::metadata("/dev/console").is_ok() {
        let _ = sys::redirect_stdio(Path::new("/dev/console"));
    }
    start_reaper();
    let cmdline_text = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let parsed = cmdline::parse(&cmdline_text);
    init_logging(parsed.as_ref().is_ok_and(|p| p.debug));
    for p in &mount_problems {
        warn!("{p}");
    }
    say(&format!(
        "bc-ramdisk {} starting as PID 1",
        env!("CARGO_PKG_VERSION")
    ));
    phases.mark("mounted");
    let params = match parsed {
        Ok(p) => p,
        Err(e) => fatal(&format!("kernel command line: {e}")),
    };
    // A panic must not end PID 1 (the kernel would panic): catch it, say what it was, and power off.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let list = std::fs::read_to_string(LOAD_ORDER).unwrap_or_default();
        report("modules", &load_modules(&list, Path::new("/sys/bus")));
        phases.mark("modules");
        let disks = settle_devices(Duration::from_secs(10));
        info!(?disks, "devices settled");
        phases.mark("devices");
        run_params(&params, &phases)
    }));
    match outcome {
        Ok(Ok(())) => {
            say("bc-done");
            phases.mark("done");
            halt()
        }
        Ok(Err(e)) => fatal(&e),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown payload".into());
            fatal(&format!("internal error (panic): {what}"))
        }
    }
}

/// Run what the parameters ask for. Returns only when the machine should power off (or on an error).
pub fn run_params(params: &RamdiskParams, phases: &Phases) -> Result<(), String> {
    match params.mode {
        Mode::Agent => {
            bring_up_network(params)?;
            phases.mark("dhcp");
            // Returns only when the node can no longer keep a session (refused, revoked, join failed).
            return crate::agent::run_pid1(params);
        }
        Mode::Rescue => {
            say("bc-rescue: bring-up done; idling (no shell in this initramfs)");
            idle()
        }
        Mode::Diagnose | Mode::Run => {}
    }
    let mut networked = false;
    for action in &params.actions {
        match action {
            Action::Diagnose => {
                let r = actions::diagnose();
                report("diagnose", &r);
                phases.mark("diagnose");
            }
            Action::Wipe => {
                let names = match &params.disks {
                    DiskSelection::All => {
                        let (wipe, skipped) = actions::all_disks(Path::new("/"));
                        if !skipped.is_empty() {
                            report("wipe-skipped", &skipped);
                        }
                        wipe
                    }
                    DiskSelection::Named(n) => n.clone(),
                };
                if names.is_empty() {
                    return Err("wipe: no disks found".into());
                }
                let views = actions::wipe_disks(&names);
                report("wipe", &views);
                phases.mark("wipe");
                let failed: Vec<&str> = views
                    .iter()
                    .filter(|v| !v.wiped)
                    .map(|v| v.device.as_str())
                    .collect();
                if !failed.is_empty() {
                    return Err(format!("wipe failed on {}", failed.join(", ")));
                }
            }
            Action::Stream => {
                if !networked {
                    bring_up_network(params)?;
                    networked = true;
                    phases.mark("dhcp");
                }
                let (Some(url), Some(digest), Some(target)) =
                    (&params.image, &params.image_digest, &params.target)
                else {
                    return Err(
                        "stream: bc.image, bc.image_sha256 and bc.target are required".into(),
                    );
                };
                let device = Path::new("/dev").join(target);
                let view = actions::stream(url, digest.sha512, &digest.hex, &device)
                    .map_err(|e| format!("stream to {}: {e}", device.display()))?;
                report("stream", &view);
                phases.mark("stream");
            }
            Action::Kexec => {
                let Some(target) = &params.target else {
                    return Err("kexec: bc.target is required".into());
                };
                deploy(params, target, phases)?;
            }
        }
    }
    Ok(())
}

fn bring_up_network(params: &RamdiskParams) -> Result<(), String> {
    let nic = crate::dhcp::net::choose_nic(
        params.nic.as_deref(),
        params.boot_mac,
        Duration::from_secs(10),
    )
    .map_err(|e| bc_error_chain::chain(&e))?;
    let xid: u32 = rand::random();
    let lease = crate::dhcp::net::acquire(&nic, xid, Duration::from_secs(60))
        .map_err(|e| bc_error_chain::chain(&e))?;
    // Host names in bc.image resolve through musl's resolver, which reads /etc/resolv.conf.
    if !lease.dns.is_empty() {
        let _ = std::fs::create_dir_all("/etc");
        if let Err(e) = std::fs::write("/etc/resolv.conf", crate::dhcp::resolv_conf(&lease)) {
            warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "writing /etc/resolv.conf");
        }
    }
    #[derive(Serialize)]
    struct Dhcp {
        nic: String,
        address: String,
        prefix_len: u8,
        router: Option<String>,
        server: String,
    }
    report(
        "dhcp",
        &Dhcp {
            nic: nic.name.clone(),
            address: lease.address.to_string(),
            prefix_len: lease.prefix_len,
            router: lease.router.map(|r| r.to_string()),
            server: lease.server.to_string(),
        },
    );
    keep_lease(nic, lease, xid.wrapping_add(1));
    Ok(())
}

/// Renews the boot NIC's lease on its own thread for as long as PID 1 runs: a wipe or an image stream can outlast
/// the lease, and the session keeps using the address. Each event is a console report.
fn keep_lease(nic: crate::dhcp::net::Interface, lease: crate::dhcp::Lease, xid: u32) {
    use crate::dhcp::net::LeaseEvent;
    let spawned = std::thread::Builder::new()
        .name("dhcp-lease".into())
        .spawn(move || {
            crate::dhcp::net::keep(&nic, lease, xid, &mut |event| {
                match event {
                    LeaseEvent::Renewed { address, lease_secs } => report(
                        "dhcp-renewed",
                        &serde_json::json!({"address": address.to_string(), "lease_secs": lease_secs}),
                    ),
                    LeaseEvent::Lost { address, why } => report(
                        "dhcp-lost",
                        &serde_json::json!({"address": address.to_string(), "why": why}),
                    ),
                    LeaseEvent::Reacquired { address, changed } => report(
                        "dhcp-reacquired",
                        &serde_json::json!({"address": address.to_string(), "changed": changed}),
                    ),
                    LeaseEvent::Trouble(why) => {
                        report("dhcp-trouble", &serde_json::json!({"why": why}))
                    }
                }
                true
            })
        });
    if let Err(e) = spawned {
        warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "the DHCP lease keeper did not start: the lease will not be renewed");
    }
}

/// Mount the installed root on `target`, write the NoCloud seed (with the single-use boot token) and kexec into
/// the installed kernel; reboot if kexec fails. Returns only on an error before the hand-over.
fn deploy(params: &RamdiskParams, target: &str, phases: &Phases) -> Result<(), String> {
    let view = actions::stage_installed(&actions::KexecSpec {
        target,
        cmdline: params.kexec_cmdline.as_deref(),
        join_token: params.boot_token.as_ref().map(|t| t.0.as_str()),
        ..Default::default()
    })?;
    report("deploy", &view);
    phases.mark("kexec-staged");
    Err(actions::hand_over(view.kexec_staged))
}

/// PID 1 of the lab OS's initramfs (`rdinit=/sbin/bc-lab-os`): mount, load modules, find the root with the
/// NoCloud seed, print a marker and the seed. It stands in for a real distribution in the QEMU tests, without
/// cloud-init or systemd: when the root holds the ramdisk's join token and the real `bcd` (`usr/local/bin/bcd`),
/// it does what the seed's user-data and `bcd.service` would (DHCP on the NIC, `bcd join --token-file` once and
/// the token removed, then `bcd run`, kept running); otherwise it powers off.
pub fn run_lab_os() -> ! {
    let _ = mount_early();
    if std::fs::metadata("/dev/console").is_ok() {
        let _ = sys::redirect_stdio(Path::new("/dev/console"));
    }
    // No reaper thread here: this PID 1 waits for its own children (`bcd join`, `bcd run`) and needs their exit
    // status; a reaper would take it first (ECHILD).
    init_logging(false);
    let list = std::fs::read_to_string(LOAD_ORDER).unwrap_or_default();
    let _ = load_modules(&list, Path::new("/sys/bus"));
    let _ = settle_devices(Duration::from_secs(10));
    say("BC-LAB-OS booted");
    let mnt = Path::new("/mnt/root");
    let disks = crate::diagnose::collect_disk_names(Path::new("/"));
    let mut found = false;
    for disk in disks {
        if actions::mount_root_with(&disk, mnt, &[crate::seed::SEED_DIR]).is_ok() {
            for name in ["meta-data", "user-data"] {
                let path = mnt.join(crate::seed::SEED_DIR).join(name);
                match std::fs::read_to_string(&path) {
                    Ok(text) => {
                        for line in text.lines() {
                            say(&format!("BC-LAB-OS-SEED {name}: {line}"));
                        }
                    }
                    Err(e) => say(&format!("BC-LAB-OS-SEED {name} unreadable: {e}")),
                }
            }
            found = true;
            break;
        }
    }
    if !found {
        say("BC-LAB-OS-SEED none");
        halt()
    }
    let bcd = mnt.join("usr/local/bin/bcd");
    let token = mnt.join(crate::seed::TOKEN_FILE);
    let state = mnt.join("var/lib/bcd");
    let joined = state.join("node.json").exists();
    if !bcd.exists() || !(joined || token.exists()) {
        say("BC-LAB-OS: no bcd or no join token on the root; powering off");
        let _ = sys::umount(mnt);
        halt()
    }
    // DHCP on the first NIC with a link: no bc.* parameters on the lab OS's command line.
    let network = cmdline::parse("bc.mode=rescue")
        .map_err(|e| e.to_string())
        .and_then(|params| bring_up_network(&params));
    if let Err(e) = network {
        say(&format!("BC-LAB-OS: no network: {e}"));
        halt()
    }
    let bcd_cmd = |args: &[&str]| {
        let mut c = std::process::Command::new(&bcd);
        c.arg("--config")
            .arg(mnt.join(crate::seed::CONFIG_FILE))
            .arg("--state-dir")
            .arg(&state)
            .args(args)
            .env("BCD_LOG", "info");
        c
    };
    if token.exists() {
        // The token is a secret: its digest (a prefix) says which one the ramdisk left, for the lab's tests.
        let digest = std::fs::read(&token)
            .map(|t| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&t)))
            .unwrap_or_default();
        say(&format!(
            "BC-LAB-OS: join token on the root (sha256 {})",
            digest.get(..16).unwrap_or("unreadable")
        ));
        let status = bcd_cmd(&["join", "--attempts", "30", "--token-file"])
            .arg(&token)
            .status();
        say(&format!("BC-LAB-OS: bcd join: {status:?}"));
        if status.is_ok_and(|s| s.success()) {
            let _ = std::fs::remove_file(&token);
        } else if !state.join("node.json").exists() {
            // No identity to run with: `bcd run` could only fail again and again.
            say("BC-LAB-OS: bcd join failed and this system has no node identity; powering off");
            let _ = sys::umount(mnt);
            halt()
        }
    }
    loop {
        let status = bcd_cmd(&["run"]).status();
        say(&format!(
            "BC-LAB-OS: bcd run ended: {status:?}; again in 5 s"
        ));
        std::thread::sleep(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modaliases_are_read_from_every_bus() {
        let t = tempfile::tempdir().expect("tempdir");
        for (bus, dev, alias) in [
            (
                "pci",
                "0000:00:03.0",
                "pci:v00001AF4d00001001sv00001AF4sd00000002bc01sc00i00",
            ),
            ("virtio", "virtio0", "virtio:d00000002v00001AF4"),
        ] {
            let d = t.path().join(bus).join("devices").join(dev);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("modalias"), format!("{alias}\n")).expect("write");
        }
        std::fs::create_dir_all(t.path().join("cpu/devices/cpu0")).expect("mkdir");
        let mut got = present_modaliases(t.path());
        got.sort();
        assert_eq!(
            got,
            [
                "pci:v00001AF4d00001001sv00001AF4sd00000002bc01sc00i00",
                "virtio:d00000002v00001AF4"
            ]
        );
        assert!(present_modaliases(&t.path().join("absent")).is_empty());
    }

    #[test]
    fn unloadable_modules_are_reported_not_fatal() {
        let t = tempfile::tempdir().expect("tempdir");
        let bogus = t.path().join("bogus.ko");
        std::fs::write(&bogus, b"not an ELF").expect("write");
        let list = format!(
            "{}\t\t\n/nonexistent/missing.ko\t\t\n/nonexistent/nic.ko\t\tpci:v000015B3d*\n",
            bogus.display()
        );
        let r = load_modules(&list, t.path());
        assert!(r.loaded.is_empty());
        assert_eq!(r.failures.len(), 2, "{:?}", r.failures);
        assert!(r.failures[1].contains("missing.ko"), "{:?}", r.failures);
        assert_eq!(r.not_needed, ["nic"], "no Mellanox device is present");
    }
}
