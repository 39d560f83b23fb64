//! The metal lab, for real: sushy-tools' libvirt driver as the BMC of QEMU (TCG) domains that libvirtd runs on a
//! boot segment served by the real `bcd site serve`, driven through our own Redfish client (`bcd_site::redfish`)
//! from the site namespace, where the site agent would run.
//!
//! (a) SeaBIOS domain: power is off (nothing sent); the one-time PXE override is accepted and read back as
//!     `Continuous` (sushy's libvirt driver ignores `Once`: reported as not applied, never as a success); power on →
//!     iPXE DHCP (dnsmasq) → proxy DHCP + script + kernel + initrd (bcd site) → the initramfs's marker on the serial
//!     console → it powers itself off, read back as `Off`; the override still reads Pxe/Continuous (the next reset
//!     would netboot again); restoring the disk (Hdd, Continuous) is read back, and the next power-on boots the disk
//!     (its boot sector's marker on the serial, no new script from bcd site); power off, read back, and libvirt agrees.
//! (c) A domain whose NIC is on the isolated bridge, PXE override set and powered on: its iPXE asks for DHCP and
//!     neither dnsmasq nor bcd site sees its MAC, although bcd site's table would answer it.
//! (b) OVMF (q35) domain: the same PXE boot through UEFI, to the marker and its own power-off.
//! (d) Basic auth (bcrypt cost 4): the wrong password is rejected, the right one works.
//! Per-step timings are printed. A second test kills a `metal-lab up` with SIGKILL and checks that `metal-lab
//! down` tears its lab down by the names and PIDs of its manifest.
//!
//! Skips (`SKIP: metal_lab: <why>`) without root, libvirt, QEMU, dnsmasq, OVMF, the iPXE loaders, the sushy venv
//! (`.venv-sushy-libvirt`, scripts/setup) or the PXE lab images (`images/build-pxe-lab`, run here when missing);
//! `BC_HWTESTS_REQUIRE_LAB=1` turns a skip into a failure. `bcd` is `BCD_BIN`, else built here.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bc_hwtests::lab::{
    self, BasicAuth, DISK_MARKER, Domain, DomainSpec, Firmware, LabOptions, MetalLab, Ns, Segment,
};
use bc_hwtests::proc::start_time;
use bc_hwtests::skip;
use bc_hwtests::watch::Watcher;
use bcd_site::redfish::models::ComputerSystem;
use bcd_site::redfish::{
    Bmc, BmcOptions, BootTarget, Credentials, PowerAction, PowerOutcome, RedfishError, RetryPolicy,
};

mod common;
use common::{bcd_binary, workspace};

const TEST: &str = "metal_lab";
const LOADERS: [&str; 3] = [
    "/usr/lib/ipxe/undionly.kpxe",
    "/usr/lib/ipxe/snponly.efi",
    "/usr/lib/ipxe/ipxe.efi",
];
const USER: &str = "lab-admin";
const PASSWORD: &str = "lab-secret";
/// The two tests run one at a time: a new lab reaps dead labs, which would race the reaper test's own `down`.
static ONE_LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// One PXE boot to the marker: ≈ 6–10 s on an idle machine (LAB-NOTES), several times that on a loaded one.
const BOOT_LIMIT: Duration = Duration::from_secs(150);

/// Steps and their timings: the time since the flow started, and how long the step itself took.
struct Steps {
    t0: Instant,
    rows: Vec<(String, Duration, Duration)>,
}

impl Steps {
    fn new() -> Steps {
        Steps {
            t0: Instant::now(),
            rows: Vec::new(),
        }
    }

    fn done(&mut self, label: impl Into<String>, started: Instant) {
        let label = label.into();
        let took = started.elapsed();
        println!(
            "  {:>6.1} s  {label} ({:.2} s)",
            self.t0.elapsed().as_secs_f64(),
            took.as_secs_f64()
        );
        self.rows.push((label, self.t0.elapsed(), took));
    }

    /// Prints what the watchers (all started at the same instant) saw, in the order it happened, relative to
    /// that start.
    fn seen(&mut self, domain: &str, watchers: &[&Watcher]) {
        let Some(t0) = watchers.first().map(|w| w.t0) else {
            return;
        };
        let mut all: Vec<&(String, Duration)> = watchers.iter().flat_map(|w| &w.seen).collect();
        all.sort_by_key(|(_, at)| *at);
        for (label, at) in all {
            println!(
                "  {:>6.1} s    {domain}: {label} at +{:.1} s",
                (t0 - self.t0 + *at).as_secs_f64(),
                at.as_secs_f64()
            );
            self.rows
                .push((format!("{domain}: {label}"), t0 - self.t0 + *at, *at));
        }
    }
}

fn opts() -> BmcOptions {
    BmcOptions {
        boot_readback: Duration::from_secs(1),
        power_apply_time: Some(Duration::from_secs(30)),
        poll_interval: Duration::from_millis(200),
        retry: RetryPolicy::new(3, Duration::from_millis(100), Duration::from_millis(500))
            .expect("a valid retry policy"),
        ..BmcOptions::default()
    }
}

fn creds(password: &str) -> Credentials {
    Credentials {
        username: USER.into(),
        password: password.into(),
    }
}

/// Where the flow looks for what happened outside the BMC.
struct Views<'a> {
    libvirt_uri: &'a str,
    dnsmasq_log: &'a Path,
    bcd_log: &'a Path,
}

impl Views<'_> {
    fn virsh(&self, args: &[&str]) -> Result<String> {
        bc_hwtests::run(
            Command::new("virsh")
                .args(["-q", "-c", self.libvirt_uri])
                .args(args),
        )
    }

    fn domstate(&self, d: &Domain) -> Result<String> {
        Ok(self.virsh(&["domstate", &d.name])?.trim().to_owned())
    }

    /// The boot order libvirt holds for the domain now (sushy rewrites it): `nic` or `disk` first.
    fn first_boot_device(&self, d: &Domain) -> Result<&'static str> {
        let xml = self.virsh(&["dumpxml", "--inactive", &d.name])?;
        let order_of = |tag: &str| -> Option<u32> {
            let start = xml.find(&format!("<{tag} "))?;
            let end = start + xml[start..].find(&format!("</{tag}>"))?;
            let block = &xml[start..end];
            let at = block.find("<boot order='")? + "<boot order='".len();
            block[at..].split('\'').next()?.parse().ok()
        };
        match (order_of("interface"), order_of("disk")) {
            (Some(n), Some(d)) if n < d => Ok("nic"),
            (Some(_), None) => Ok("nic"),
            (_, Some(_)) => Ok("disk"),
            (None, None) => bail!("{}: no boot order in the domain XML:\n{xml}", d.name),
        }
    }
}

async fn power_state(bmc: &Bmc, system: &str) -> Result<String> {
    let (sys, _) = bmc.get::<ComputerSystem>(system).await?;
    sys.power_state.context("no PowerState")
}

async fn read_boot(bmc: &Bmc, system: &str) -> Result<(String, String)> {
    let (sys, _) = bmc.get::<ComputerSystem>(system).await?;
    let boot = sys.boot.context("no Boot object")?;
    Ok((
        boot.boot_source_override_target.unwrap_or_default(),
        boot.boot_source_override_enabled.unwrap_or_default(),
    ))
}

/// Sets the one-time PXE override, which sushy's libvirt driver stores as Continuous: the client reports it as
/// not applied, with what it read back, and libvirt's boot order now starts with the NIC.
async fn set_pxe(bmc: &Bmc, system: &str, d: &Domain, v: &Views<'_>) -> Result<()> {
    match bmc.boot_once(system, BootTarget::Pxe).await {
        Err(RedfishError::BootOverrideNotApplied { observed, .. }) => {
            if (observed.target.as_str(), observed.enabled.as_str()) != ("Pxe", "Continuous") {
                bail!("{}: the override read back as {observed}", d.name);
            }
        }
        Ok(b) => bail!(
            "{}: sushy's libvirt driver read back {b}: Once honoured? (LAB-NOTES says it is stored as Continuous)",
            d.name
        ),
        Err(e) => return Err(e).context(format!("{}: boot_once", d.name)),
    }
    let first = v.first_boot_device(d)?;
    if first != "nic" {
        bail!(
            "{}: after the PXE override libvirt boots the {first} first",
            d.name
        );
    }
    Ok(())
}

/// Powers the domain on and waits for the PXE lab's marker on its serial console and its own power-off (the
/// initramfs powers off), read back through the BMC. Returns what was seen when.
async fn pxe_boot(
    bmc: &Bmc,
    system: &str,
    d: &Domain,
    v: &Views<'_>,
    steps: &mut Steps,
) -> Result<()> {
    let t = Instant::now();
    let mut console = Watcher::new(d.serial.clone(), t);
    let mut dhcp = Watcher::new(v.dnsmasq_log.to_owned(), t);
    let mut site = Watcher::new(v.bcd_log.to_owned(), t);
    let on = bmc.power(system, PowerAction::On).await?;
    if !matches!(&on, PowerOutcome::Applied { power_state, .. } if power_state == "On") {
        bail!("{}: power on: {on}", d.name);
    }
    steps.done(format!("{}: Reset On, PowerState read back On", d.name), t);
    let marker = format!("BCDLAB-INIT marker={}", d.name);
    let mac = format!("mac={}", d.mac);
    let ack = "DHCPACK(br0)";
    let mut off_at = None;
    while t.elapsed() < BOOT_LIMIT {
        console.poll(&[
            ("firmware text on the serial console", &["BIOS"]),
            ("iPXE configuring the NIC", &["Configuring (net0"]),
            ("the initramfs's marker", &[marker.as_str()]),
        ]);
        dhcp.poll(&[("dnsmasq acked an address", &[ack, d.mac.as_str()])]);
        site.poll(&[
            (
                "bcd site served the iPXE script",
                &["served iPXE script", &mac],
            ),
            (
                "bcd site served the kernel",
                &["target=/artifacts/lab/vmlinuz", "status=200"],
            ),
            (
                "bcd site served the initrd",
                &["target=/artifacts/lab/initramfs.cpio", "status=200"],
            ),
        ]);
        if console.has("the initramfs's marker") && power_state(bmc, system).await? == "Off" {
            off_at = Some(t.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    steps.seen(&d.name, &[&console, &dhcp, &site]);
    let Some(off_at) = off_at else {
        bail!(
            "{}: no marker {marker:?} and power-off within {BOOT_LIMIT:?}; seen {:?} {:?} {:?}",
            d.name,
            console.seen,
            dhcp.seen,
            site.seen
        );
    };
    for needed in [
        "bcd site served the iPXE script",
        "bcd site served the kernel",
        "bcd site served the initrd",
    ] {
        if !site.has(needed) {
            bail!(
                "{}: booted, but {needed:?} is not in bcd site's log",
                d.name
            );
        }
    }
    if !dhcp.has("dnsmasq acked an address") {
        bail!("{}: booted, but dnsmasq never acked {}", d.name, d.mac);
    }
    println!(
        "  {:>6.1} s    {}: powered itself off, PowerState read back Off at +{:.1} s",
        (t - steps.t0 + off_at).as_secs_f64(),
        d.name,
        off_at.as_secs_f64()
    );
    let state = v.domstate(d)?;
    if state != "shut off" {
        bail!("{}: the BMC reads Off but libvirt says {state:?}", d.name);
    }
    Ok(())
}

async fn flow(
    url: &str,
    bios: &Domain,
    uefi: &Domain,
    isolated: &Domain,
    v: &Views<'_>,
) -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut steps = Steps::new();

    // (d) Basic auth: the service root is open, the systems are not.
    let t = Instant::now();
    let wrong = match Bmc::connect(url, creds("not-the-password"), opts()).await {
        Ok(bmc) => bmc.system_path(Some(&bios.uuid)).await.err(),
        Err(e) => Some(e),
    };
    match &wrong {
        Some(RedfishError::AuthRejected { status: 401, .. }) => {}
        other => bail!("a wrong BMC password must be rejected with 401, got {other:?}"),
    }
    let bmc = Bmc::connect(url, creds(PASSWORD), opts()).await?;
    if bmc.auth_kind() != "basic" {
        bail!(
            "sushy has no SessionService: expected Basic, got {}",
            bmc.auth_kind()
        );
    }
    let listed = bmc.systems().await?;
    let mut uuids: Vec<String> = listed
        .members
        .iter()
        .filter_map(|m| m.odata_id.rsplit('/').next().map(str::to_owned))
        .collect();
    uuids.sort();
    let mut want = vec![bios.uuid.clone(), uefi.uuid.clone(), isolated.uuid.clone()];
    want.sort();
    if uuids != want {
        bail!("sushy lists systems {uuids:?}, the lab defined {want:?}");
    }
    steps.done(
        "BMC: wrong password rejected (401), Basic login, 3 systems listed by UUID",
        t,
    );

    let t = Instant::now();
    let inv = bmc.inventory().await?;
    let sys = inv
        .systems
        .iter()
        .find(|s| s.system.uuid.as_deref() == Some(bios.uuid.as_str()))
        .context("the inventory lacks the bios system")?;
    let macs: Vec<String> = sys.macs().map(str::to_ascii_lowercase).collect();
    if !macs.contains(&bios.mac) {
        bail!(
            "the inventory's MACs {macs:?} lack the domain's {}",
            bios.mac
        );
    }
    println!(
        "           inventory of bios: {} CPU(s), {} MiB, MACs {macs:?}, vendor line {:?}",
        sys.cpu_count(),
        sys.memory_mib(),
        bmc.vendor_line()
    );
    steps.done("BMC: inventory read (the domain's MAC is there)", t);

    // (a) SeaBIOS.
    let system = bmc.system_path(Some(&bios.uuid)).await?;
    let t = Instant::now();
    let off = bmc.power(&system, PowerAction::Off).await?;
    if off != PowerOutcome::AlreadyInState("Off".into()) {
        bail!("a defined domain starts off; power off said {off}");
    }
    steps.done("bios: power off while off: nothing sent", t);
    let t = Instant::now();
    set_pxe(&bmc, &system, bios, v).await?;
    steps.done(
        "bios: one-time PXE override accepted, read back Pxe/Continuous (not applied as Once); libvirt boots the NIC first",
        t,
    );
    pxe_boot(&bmc, &system, bios, v, &mut steps).await?;
    let t = Instant::now();
    let boot = read_boot(&bmc, &system).await?;
    if boot != ("Pxe".into(), "Continuous".into()) {
        bail!(
            "after the netboot the override reads {boot:?}; expected it to persist as Pxe/Continuous"
        );
    }
    let restored = bmc.restore_disk_boot(&system).await?;
    let first = v.first_boot_device(bios)?;
    if first != "disk" {
        bail!("after restoring the disk boot libvirt boots the {first} first");
    }
    steps.done(
        format!(
            "bios: the override persisted (Pxe/Continuous); disk boot restored, read back Target={}, Enabled={}; \
             libvirt boots the disk first",
            restored.target, restored.enabled
        ),
        t,
    );
    let t = Instant::now();
    let mut console = Watcher::new(bios.serial.clone(), t);
    let mut site = Watcher::new(v.bcd_log.to_owned(), t);
    let on = bmc.power(&system, PowerAction::On).await?;
    if !matches!(on, PowerOutcome::Applied { .. }) {
        bail!("bios: power on from disk: {on}");
    }
    while t.elapsed() < Duration::from_secs(60) && !console.has("disk") {
        console.poll(&[
            (
                "SeaBIOS booting from the hard disk",
                &["Booting from Hard Disk"],
            ),
            ("disk", &[DISK_MARKER]),
        ]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    site.poll(&[(
        "script",
        &["served iPXE script", &format!("mac={}", bios.mac)],
    )]);
    steps.seen("bios", &[&console]);
    if !console.has("disk") {
        bail!(
            "bios: after restoring the disk boot, no {DISK_MARKER:?} on the serial console within 60 s:\n{}",
            bc_testkit::log_tail(&bios.serial, 15)
        );
    }
    if site.has("script") || console.text().contains("iPXE initialising") {
        bail!("bios: netbooted again after the disk boot was restored");
    }
    steps.done(
        "bios: Reset On boots the disk (its boot sector's marker), no netboot",
        t,
    );
    let t = Instant::now();
    let off = bmc.power(&system, PowerAction::Off).await?;
    if !matches!(&off, PowerOutcome::Applied { power_state, .. } if power_state == "Off") {
        bail!("bios: power off: {off}");
    }
    let state = v.domstate(bios)?;
    if state != "shut off" {
        bail!("bios: the BMC reads Off, libvirt says {state:?}");
    }
    steps.done(
        "bios: ForceOff, PowerState read back Off, libvirt: shut off",
        t,
    );

    // (c) The isolated domain: its iPXE asks for DHCP where nothing answers. Powered off once it has asked and
    // had a few seconds for any answer, so that the OVMF boot after it has both CPUs.
    let isys = bmc.system_path(Some(&isolated.uuid)).await?;
    let t = Instant::now();
    set_pxe(&bmc, &isys, isolated, v).await?;
    let mut iconsole = Watcher::new(isolated.serial.clone(), t);
    let mut idhcp = Watcher::new(v.dnsmasq_log.to_owned(), t);
    let mut isite = Watcher::new(v.bcd_log.to_owned(), t);
    bmc.power(&isys, PowerAction::On).await?;
    steps.done("isolated: PXE override set (Continuous), Reset On", t);
    let asked = "iPXE asked for DHCP";
    while t.elapsed() < Duration::from_secs(90) && !iconsole.has(asked) {
        iconsole.poll(&[(asked, &["Configuring (net0", isolated.mac.as_str()])]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if !iconsole.has(asked) {
        bail!(
            "isolated: its iPXE never tried DHCP:\n{}",
            bc_testkit::log_tail(&isolated.serial, 15)
        );
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    idhcp.poll(&[("seen", &[isolated.mac.as_str()])]);
    isite.poll(&[("seen", &[isolated.mac.as_str()])]);
    steps.seen("isolated", &[&iconsole]);
    if idhcp.has("seen") || isite.has("seen") {
        bail!("isolated: its MAC reached the boot segment (dnsmasq or bcd site saw it)");
    }
    let t = Instant::now();
    bmc.power(&isys, PowerAction::Off).await?;
    bmc.restore_disk_boot(&isys).await?;
    steps.done(
        "isolated: 4 s after its DHCP request neither dnsmasq nor bcd site had seen its MAC; ForceOff, disk restored",
        t,
    );

    // (b) OVMF.
    let usys = bmc.system_path(Some(&uefi.uuid)).await?;
    let t = Instant::now();
    set_pxe(&bmc, &usys, uefi, v).await?;
    steps.done("uefi: PXE override set (Continuous)", t);
    pxe_boot(&bmc, &usys, uefi, v, &mut steps).await?;
    bmc.restore_disk_boot(&usys).await?;
    bmc.close().await?;
    println!("metal_lab: BMC requests {}", bmc.requests());
    Ok(())
}

#[test]
fn bmc_powers_and_pxe_boots_libvirt_domains() -> Result<()> {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    if let Some(why) = lab::missing() {
        return skip(TEST, why);
    }
    for file in LOADERS
        .iter()
        .chain(&[lab::libvirt::OVMF_CODE, lab::libvirt::OVMF_VARS])
    {
        if !Path::new(file).is_file() {
            return skip(TEST, format!("{file} missing (packages ipxe, ovmf)"));
        }
    }
    let images = workspace().join("images/out/pxe-lab");
    if !images.join("vmlinuz").is_file() || !images.join("initramfs.cpio").is_file() {
        let out = Command::new(workspace().join("images/build-pxe-lab")).output()?;
        if !out.status.success() {
            return skip(
                TEST,
                format!(
                    "PXE lab kernel/initramfs unavailable: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            );
        }
    }
    let bcd = bcd_binary()?;

    let mut lab = MetalLab::up(LabOptions {
        basic_auth: Some(BasicAuth {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
    })?;
    let bios = lab.define(&DomainSpec::new("bios", 1, Firmware::SeaBios))?;
    let uefi = lab.define(&DomainSpec::new("uefi", 2, Firmware::Ovmf))?;
    let isolated =
        lab.define(&DomainSpec::new("isolated", 3, Firmware::SeaBios).on(Segment::Isolated))?;
    println!("metal_lab: setup");
    lab.print_timings();

    // bcd site serve in the site namespace; its table has all three MACs (the isolated one too: only the
    // segment keeps it from netbooting).
    let t = Instant::now();
    let d = lab.dir.clone();
    let tftp = d.join("tftp");
    let artifacts = d.join("artifacts/lab");
    fs::create_dir_all(&tftp)?;
    fs::create_dir_all(&artifacts)?;
    let public = |from: &Path, to: &Path| -> Result<()> {
        fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
        fs::set_permissions(to, fs::Permissions::from_mode(0o644))?;
        Ok(())
    };
    for l in LOADERS {
        let l = Path::new(l);
        public(l, &tftp.join(l.file_name().context("loader name")?))?;
    }
    public(&images.join("vmlinuz"), &artifacts.join("vmlinuz"))?;
    public(
        &images.join("initramfs.cpio"),
        &artifacts.join("initramfs.cpio"),
    )?;
    let mut site_toml = format!(
        "[boot]\ninterface = \"{}\"\nserver_ip = \"{}\"\ntftp_root = \"{}\"\nartifacts = \"{}\"\n\
         report_interval_s = 0\n\n",
        lab::SITE_IFACE,
        lab::SITE_IP,
        tftp.display(),
        d.join("artifacts").display()
    );
    for dom in [&bios, &uefi, &isolated] {
        site_toml.push_str(&format!(
            "[[machine]]\nmac = \"{}\"\nkernel = \"lab/vmlinuz\"\ninitrd = \"lab/initramfs.cpio\"\n\
             cmdline = \"console=ttyS0 quiet panic=-1 BCDLAB_MARKER={}\"\n\n",
            dom.mac, dom.name
        ));
    }
    fs::write(d.join("site.toml"), site_toml)?;
    let bcd_log = d.join("bcd.log");
    let mut cmd = lab.command(Ns::Site, &bcd);
    cmd.args(["site", "serve", "--config"])
        .arg(d.join("site.toml"))
        .env("BCD_LOG", "info,bcd_site=debug")
        .stdout(Stdio::null())
        .stderr(fs::File::create(&bcd_log)?);
    let h = lab.spawn("bcd site serve", &mut cmd)?;
    let mut ready = Watcher::new(bcd_log.clone(), Instant::now());
    while !ready.has("serving") {
        ready.poll(&[("serving", &["bcd site serving"])]);
        if let Some(status) = lab.process(h).child.try_wait()? {
            bail!(
                "bcd site serve exited ({status}): {}",
                fs::read_to_string(&bcd_log)?
            );
        }
        if ready.t0.elapsed() > Duration::from_secs(20) {
            bail!(
                "bcd site serve did not start: {}",
                fs::read_to_string(&bcd_log)?
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "  {:>6.2} s  bcd site serving in the site namespace",
        t.elapsed().as_secs_f64()
    );

    let views = Views {
        libvirt_uri: &lab.libvirt_uri,
        dnsmasq_log: &lab.dnsmasq_log(),
        bcd_log: &bcd_log,
    };
    let url = lab.bmc_url.clone();
    println!(
        "metal_lab: the flow (times from its start; our Redfish client in the site namespace)"
    );
    let result = lab.in_site(|| -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(flow(&url, &bios, &uefi, &isolated, &views))
    })?;
    if let Err(e) = result {
        let log = bc_testkit::log_tail(&bcd_log, 30);
        return Err(e.context(format!("{}--- bcd site:\n{log}", lab.logs())));
    }
    println!("metal_lab: total {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// A lab whose process is killed (SIGKILL: no destructor runs) is torn down by `metal-lab down`, by the names and
/// PIDs in its manifest, and nothing of it is left running.
#[test]
fn a_killed_lab_is_reaped_by_name_and_pid() -> Result<()> {
    const TEST: &str = "metal_lab reaper";
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(why) = lab::missing() {
        return skip(TEST, why);
    }
    let bin = env!("CARGO_BIN_EXE_metal-lab");
    let mut up = Command::new(bin)
        .args(["up", "--domain", "r1:bios"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let pid = up.id();
    let dir = lab::manifest::labs_root().join(format!("{pid}.0"));
    let mut out = std::io::BufReader::new(up.stdout.take().context("stdout")?);
    let mut printed = String::new();
    loop {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut out, &mut line)? == 0 {
            bail!("metal-lab up ended before it was up:\n{printed}");
        }
        printed.push_str(&line);
        if line.starts_with("metal-lab: up") {
            break;
        }
    }
    let manifest = fs::read_to_string(dir.join("manifest"))?;
    let procs: Vec<(u32, u64)> = manifest
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                ["proc", _, pid, start] => Some((pid.parse().ok()?, start.parse().ok()?)),
                _ => None,
            }
        })
        .collect();
    let namespaces: Vec<String> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("netns ").map(str::to_owned))
        .collect();
    if procs.len() < 5 || namespaces.len() != 2 {
        bail!("manifest lists too little:\n{manifest}");
    }
    // Start the domain so that a QEMU process (libvirt's child, not ours) must be reaped too.
    let uri = format!(
        "qemu:///system?socket={}",
        dir.join("libvirt/run/libvirt-sock").display()
    );
    bc_hwtests::run(Command::new("virsh").args(["-q", "-c", &uri, "start", "r1"]))?;
    let qemu_pid: u32 = fs::read_to_string(dir.join("libvirt/run/qemu/r1.pid"))?
        .trim()
        .parse()?;
    let qemu_start = start_time(qemu_pid).context("qemu not running")?;

    up.kill()?; // SIGKILL: no Drop runs.
    up.wait()?;
    let t = Instant::now();
    let down = bc_hwtests::run(Command::new(bin).arg("down"))?;
    println!("{}", down.trim());
    println!(
        "metal_lab reaper: torn down in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    for (pid, start) in procs.iter().chain([&(qemu_pid, qemu_start)]) {
        if start_time(*pid) == Some(*start) {
            bail!("pid {pid} still runs after metal-lab down:\n{manifest}");
        }
    }
    for n in &namespaces {
        if Path::new("/run/netns").join(n).exists() {
            bail!("namespace {n} left after metal-lab down");
        }
    }
    if dir.exists() {
        bail!("{} left after metal-lab down", dir.display());
    }
    if !down.contains(&namespaces[0]) {
        bail!("metal-lab down did not report the namespaces it deleted: {down}");
    }
    Ok(())
}
