//! The metal lab: a boot segment in a network namespace, a real BMC (sushy-tools' libvirt driver over libvirtd
//! running QEMU domains under TCG), set up and torn down by name and PID, on every exit path.
//!
//! ```text
//!  netns bcdml<pid>x<n>s ("segment")                 netns bcdml<pid>x<n>b ("site")
//!  ┌──────────────────────────────────────────┐     ┌──────────────────────────────────────┐
//!  │ br0 10.78.0.1/24 fd78::1/64  ── vseg ────┼─────┼── vsite 10.78.0.2  (bcd site: proxy   │
//!  │   dnsmasq: DHCP pool + RA, no-ping        │     │   DHCP, TFTP, HTTP — started by tests)│
//!  │   vnetN ← domains on the boot segment     │     │ sushy-emulator 127.0.0.1:8000 (BMC)   │
//!  │ br1 (nothing else) ← isolated domains     │     │   └─ libvirt unix socket (lab folder) │
//!  │ libvirtd + virtlogd (private mount ns:    │     └──────────────────────────────────────┘
//!  │   /etc/libvirt, /run/libvirt, … = lab's)  │
//!  └──────────────────────────────────────────┘
//! ```
//! sushy sits with the site agent, so `bcd site` reaches the BMC on 127.0.0.1:8000 and the boot segment on
//! vsite, as a rack agent reaches a management network and a boot network. Test code that talks to the BMC (our
//! Redfish client) runs on a thread inside the site namespace: [`MetalLab::in_site`].
//!
//! Everything lives in `<tmp>/bcd-metal-lab/<pid>.<n>/`; its `manifest` lists the namespaces and processes as
//! they are made, so a lab whose test was killed is torn down by the next one, or by `scripts/lab down`
//! ([`manifest::reap`]). Dropping the lab (also while a test panics) destroys the domains, stops every daemon by
//! PID, deletes the namespaces by name and removes the folder (`BC_LAB_KEEP=1` keeps the folder and its logs).

pub mod libvirt;
pub mod manifest;
pub mod sushy;

use std::ffi::OsStr;
use std::fs;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub use libvirt::{DISK_MARKER, Domain, DomainSpec, Firmware, Segment};

use crate::netns::{Netns, ip};
use crate::proc::{Proc, have, run};

pub const SEGMENT_GATEWAY: &str = "10.78.0.1";
/// The site agent's address on the boot segment.
pub const SITE_IP: &str = "10.78.0.2";
pub const SITE_IFACE: &str = "vsite";

/// Basic-auth credentials for the BMC.
#[derive(Debug, Clone)]
pub struct BasicAuth {
    pub user: String,
    pub password: String,
}

#[derive(Debug, Clone, Default)]
pub struct LabOptions {
    /// When set, sushy requires HTTP Basic auth (bcrypt cost 4 htpasswd). The service root stays open.
    pub basic_auth: Option<BasicAuth>,
}

/// Where a process runs.
#[derive(Debug, Clone, Copy)]
pub enum Ns {
    Segment,
    Site,
}

pub struct MetalLab {
    pub dir: PathBuf,
    pub segment: Netns,
    pub site: Netns,
    /// `qemu:///system?socket=<lab>/libvirt/run/libvirt-sock`.
    pub libvirt_uri: String,
    /// The BMC's base URL, reachable from the site namespace.
    pub bmc_url: String,
    pub auth: Option<BasicAuth>,
    /// Setup steps and how long each took.
    pub timings: Vec<(String, Duration)>,
    manifest: manifest::Manifest,
    procs: Vec<Proc>,
    domains: Vec<Domain>,
    keep: bool,
}

static LABS: AtomicU32 = AtomicU32::new(0);

/// Why the lab cannot run on this machine, if it cannot (the test prints it as its SKIP reason).
pub fn missing() -> Option<String> {
    let uid = run(Command::new("id").arg("-u")).unwrap_or_default();
    if uid.trim() != "0" {
        return Some("not root (network namespaces, bridges and libvirtd need root)".into());
    }
    for tool in [
        "ip",
        "unshare",
        "nsenter",
        "dnsmasq",
        "libvirtd",
        "virtlogd",
        "virsh",
        "qemu-system-x86_64",
    ] {
        if !have(tool) {
            return Some(format!(
                "{tool} not found (scripts/setup installs libvirt-daemon, libvirt-daemon-driver-qemu, \
                 libvirt-clients, qemu-system-x86, dnsmasq-base)"
            ));
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun missing (no tap devices)".into());
    }
    sushy::missing()
}

impl MetalLab {
    /// Sets the lab up: namespaces, bridges, dnsmasq, virtlogd + libvirtd, sushy; first tears down labs left by
    /// processes that are gone. Call [`missing`] first to skip where the lab cannot run.
    pub fn up(opts: LabOptions) -> Result<MetalLab> {
        let reaped = manifest::reap();
        if !reaped.labs.is_empty() {
            eprintln!(
                "metal lab: tore down {} stale lab(s): processes {:?}, namespaces {:?}",
                reaped.labs.len(),
                reaped.processes,
                reaped.namespaces
            );
        }
        let pid = std::process::id();
        let n = LABS.fetch_add(1, Ordering::Relaxed);
        let dir = manifest::labs_root().join(format!("{pid}.{n}"));
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        manifest::create_lab_dir(&dir)?;
        let manifest = manifest::Manifest::create(&dir)?;
        let seg_name = format!("bcdml{pid}x{n}s");
        let site_name = format!("bcdml{pid}x{n}b");
        manifest.netns(&seg_name)?;
        manifest.netns(&site_name)?;
        let t = Instant::now();
        let segment = Netns::create(seg_name)?;
        let site = match Netns::create(site_name) {
            Ok(s) => s,
            Err(e) => {
                manifest::tear_down(&dir, false);
                return Err(e);
            }
        };
        let sock_dir = dir.join("libvirt/run");
        let mut lab = MetalLab {
            libvirt_uri: format!(
                "qemu:///system?socket={}",
                sock_dir.join("libvirt-sock").display()
            ),
            bmc_url: format!("http://127.0.0.1:{}", sushy::PORT),
            auth: opts.basic_auth.clone(),
            timings: vec![("namespaces".into(), t.elapsed())],
            dir,
            segment,
            site,
            manifest,
            procs: Vec::new(),
            domains: Vec::new(),
            keep: std::env::var_os("BC_LAB_KEEP").is_some_and(|v| v == "1"),
        };
        // From here on a failure drops `lab`, which tears down what was made.
        lab.network()?;
        lab.dnsmasq()?;
        lab.libvirtd()?;
        lab.sushy(&opts)?;
        Ok(lab)
    }

    fn step(&mut self, name: &str, t: Instant) {
        self.timings.push((name.to_owned(), t.elapsed()));
    }

    fn network(&mut self) -> Result<()> {
        let t = Instant::now();
        let (s, b) = (self.segment.0.clone(), self.site.0.clone());
        let (s, b) = (s.as_str(), b.as_str());
        for br in ["br0", "br1"] {
            ip(&[
                "-n",
                s,
                "link",
                "add",
                br,
                "type",
                "bridge",
                "forward_delay",
                "0",
            ])?;
        }
        ip(&[
            "-n",
            s,
            "addr",
            "add",
            &format!("{SEGMENT_GATEWAY}/24"),
            "dev",
            "br0",
        ])?;
        ip(&["-n", s, "addr", "add", "fd78::1/64", "dev", "br0", "nodad"])?;
        ip(&[
            "-n", s, "link", "add", "vseg", "type", "veth", "peer", "name", SITE_IFACE, "netns", b,
        ])?;
        ip(&["-n", s, "link", "set", "vseg", "master", "br0", "up"])?;
        ip(&["-n", s, "link", "set", "br0", "up"])?;
        ip(&["-n", s, "link", "set", "br1", "up"])?;
        ip(&[
            "-n",
            b,
            "addr",
            "add",
            &format!("{SITE_IP}/24"),
            "dev",
            SITE_IFACE,
        ])?;
        ip(&["-n", b, "link", "set", SITE_IFACE, "up"])?;
        self.step("bridges and veth", t);
        Ok(())
    }

    /// `ip netns exec <ns> <program>`.
    pub fn command(&self, ns: Ns, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.ns_name(ns)]).arg(program);
        c
    }

    fn ns_name(&self, ns: Ns) -> &str {
        match ns {
            Ns::Segment => &self.segment.0,
            Ns::Site => &self.site.0,
        }
    }

    /// Starts a process that the lab stops at teardown (recorded in the manifest by PID); returns its handle.
    pub fn spawn(&mut self, name: &'static str, cmd: &mut Command) -> Result<usize> {
        let p = Proc::spawn(name, cmd)?;
        self.manifest.process(name, p.pid())?;
        self.procs.push(p);
        Ok(self.procs.len() - 1)
    }

    pub fn process(&mut self, handle: usize) -> &mut Proc {
        &mut self.procs[handle]
    }

    /// Fails, naming the process and its log, when one the lab started has exited.
    fn check_alive(&mut self, handle: usize, log: &Path) -> Result<()> {
        let p = &mut self.procs[handle];
        if let Some(status) = p.child.try_wait()? {
            bail!(
                "{} exited ({status}); {}:\n{}",
                p.name,
                log.display(),
                bc_testkit::log_tail(log, 30)
            );
        }
        Ok(())
    }

    fn dnsmasq(&mut self) -> Result<()> {
        let t = Instant::now();
        let d = self.dir.clone();
        let mut cmd = self.command(Ns::Segment, "dnsmasq");
        cmd.args(["--keep-in-foreground", "--conf-file=/dev/null"])
            .args([
                "--port=0",
                "--interface=br0",
                "--bind-interfaces",
                "--no-ping",
                "--log-dhcp",
            ])
            .args(["--dhcp-range=10.78.0.100,10.78.0.150,255.255.255.0,1h"])
            .args(["--enable-ra", "--dhcp-range=fd78::,ra-only"])
            .arg(format!("--dhcp-leasefile={}", d.join("leases").display()))
            .arg(format!("--pid-file={}", d.join("dnsmasq.pid").display()))
            .arg(format!("--log-facility={}", self.dnsmasq_log().display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let h = self.spawn("dnsmasq", &mut cmd)?;
        std::thread::sleep(Duration::from_millis(200));
        self.check_alive(h, &self.dnsmasq_log())?;
        self.step("dnsmasq", t);
        Ok(())
    }

    /// dnsmasq's log (`--log-dhcp`): every DISCOVER/OFFER/REQUEST/ACK on the boot segment.
    pub fn dnsmasq_log(&self) -> PathBuf {
        self.dir.join("dnsmasq.log")
    }

    fn libvirtd(&mut self) -> Result<()> {
        let t = Instant::now();
        let lv = self.dir.join("libvirt");
        for (name, target) in libvirt::BIND_DIRS {
            fs::create_dir_all(lv.join(name))?;
            // The mount point must exist on the host; these are the folders libvirt-daemon-system would make.
            fs::create_dir_all(target).with_context(|| format!("creating {target}"))?;
        }
        fs::write(lv.join("etc/qemu.conf"), libvirt::qemu_conf())?;
        let libvirtd_conf = self.dir.join("libvirtd.conf");
        let virtlogd_conf = self.dir.join("virtlogd.conf");
        fs::write(
            &libvirtd_conf,
            libvirt::libvirtd_conf(&lv.join("run"), &self.dir.join("libvirtd.log")),
        )?;
        fs::write(
            &virtlogd_conf,
            libvirt::virtlogd_conf(&self.dir.join("virtlogd.log")),
        )?;
        // A process that holds the private mount namespace (in the segment's network namespace); the daemons
        // enter both.
        let mounts: String = libvirt::BIND_DIRS
            .iter()
            .map(|(name, target)| format!("mount --bind {} {target} && ", lv.join(name).display()))
            .collect();
        let mut holder_cmd = self.command(Ns::Segment, "unshare");
        holder_cmd
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(format!("{mounts}echo mounted && exec sleep infinity"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let h = self.spawn("mount namespace holder", &mut holder_cmd)?;
        let holder = self.procs[h].pid();
        let mut line = String::new();
        if let Some(out) = self.procs[h].child.stdout.take() {
            BufReader::new(out).read_line(&mut line)?;
        }
        if line.trim() != "mounted" {
            let mut err = String::new();
            if let Some(e) = self.procs[h].child.stderr.take() {
                use std::io::Read as _;
                let _ = BufReader::new(e).read_to_string(&mut err);
            }
            bail!(
                "the private mount namespace for libvirtd failed: {}",
                err.trim()
            );
        }
        let enter = |program: &str| {
            let mut c = Command::new("nsenter");
            c.args(["-t", &holder.to_string(), "-m", "-n", program]);
            c
        };
        let mut virtlogd = enter("virtlogd");
        virtlogd
            .arg("-f")
            .arg(&virtlogd_conf)
            .stdout(Stdio::null())
            .stderr(fs::File::create(self.dir.join("virtlogd.stderr"))?);
        self.spawn("virtlogd", &mut virtlogd)?;
        let mut libvirtd = enter("libvirtd");
        libvirtd
            .arg("-f")
            .arg(&libvirtd_conf)
            .stdout(Stdio::null())
            .stderr(fs::File::create(self.dir.join("libvirtd.stderr"))?);
        let h = self.spawn("libvirtd", &mut libvirtd)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.check_alive(h, &self.dir.join("libvirtd.log"))?;
            if self.virsh(&["uri"]).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "libvirtd did not answer on {} within 30 s:\n{}",
                    self.libvirt_uri,
                    bc_testkit::log_tail(&self.dir.join("libvirtd.log"), 30)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.step("virtlogd + libvirtd answering", t);
        Ok(())
    }

    /// `virsh -c <lab URI> ARGS`.
    pub fn virsh(&self, args: &[&str]) -> Result<String> {
        run(Command::new("virsh")
            .args(["-q", "-c", &self.libvirt_uri])
            .args(args))
    }

    /// libvirt's own view of a domain's state (`running`, `shut off`, …).
    pub fn domstate(&self, domain: &str) -> Result<String> {
        Ok(self.virsh(&["domstate", domain])?.trim().to_owned())
    }

    fn sushy(&mut self, opts: &LabOptions) -> Result<()> {
        let t = Instant::now();
        let auth_file = match &opts.basic_auth {
            Some(a) => {
                let f = self.dir.join("htpasswd");
                fs::write(&f, sushy::htpasswd_line(&a.user, &a.password)?)?;
                Some(f)
            }
            None => None,
        };
        let state = self.dir.join("sushy-state");
        fs::create_dir_all(&state)?;
        let conf = self.dir.join("sushy.conf");
        fs::write(
            &conf,
            sushy::config(&self.libvirt_uri, &state, auth_file.as_deref()),
        )?;
        let log = self.sushy_log();
        let mut cmd = self.command(Ns::Site, sushy::emulator());
        cmd.arg("--config")
            .arg(&conf)
            .stdout(fs::File::create(&log)?)
            .stderr(fs::File::options().append(true).open(&log)?);
        let h = self.spawn("sushy-emulator (libvirt driver)", &mut cmd)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.check_alive(h, &log)?;
            if self.in_site(sushy::probe)?.is_some() {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "sushy-emulator did not answer within 60 s:\n{}",
                    bc_testkit::log_tail(&log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.step("sushy answering", t);
        Ok(())
    }

    pub fn sushy_log(&self) -> PathBuf {
        self.dir.join("sushy.log")
    }

    /// Runs `f` on a thread inside the site namespace (where the BMC's 127.0.0.1:8000 is).
    pub fn in_site<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        self.site.run(f)
    }

    /// Defines a domain (shut off; its disk is its only boot device). OVMF domains need package ovmf.
    pub fn define(&mut self, spec: &DomainSpec) -> Result<Domain> {
        if spec.firmware == Firmware::Ovmf {
            for f in [libvirt::OVMF_CODE, libvirt::OVMF_VARS] {
                if !Path::new(f).is_file() {
                    bail!("{f} missing (package ovmf)");
                }
            }
        }
        let t = Instant::now();
        let (domain, xml) = libvirt::prepare(spec, &self.dir)?;
        let file = self.dir.join(format!("{}.xml", spec.name));
        fs::write(&file, xml)?;
        self.virsh(&["define", &file.to_string_lossy()])?;
        self.domains.push(domain.clone());
        self.step(&format!("define {}", spec.name), t);
        Ok(domain)
    }

    pub fn domains(&self) -> &[Domain] {
        &self.domains
    }

    /// Prints the setup timings.
    pub fn print_timings(&self) {
        for (step, t) in &self.timings {
            println!("  {:>6.2} s  lab: {step}", t.as_secs_f64());
        }
    }

    /// Tails of the lab's logs, for a failure report.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for (name, path) in [
            ("sushy", self.sushy_log()),
            ("dnsmasq", self.dnsmasq_log()),
            ("libvirtd", self.dir.join("libvirtd.log")),
        ] {
            out.push_str(&format!(
                "--- {name} ({}):\n{}\n",
                path.display(),
                bc_testkit::log_tail(&path, 25)
            ));
        }
        for d in &self.domains {
            out.push_str(&format!(
                "--- serial of {} ({}):\n{}\n",
                d.name,
                d.serial.display(),
                bc_testkit::log_tail(&d.serial, 15)
            ));
        }
        out
    }
}

impl Drop for MetalLab {
    fn drop(&mut self) {
        for d in &self.domains {
            let _ = Command::new("virsh")
                .args(["-q", "-c", &self.libvirt_uri, "destroy", &d.name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        for p in self.procs.iter_mut().rev() {
            p.terminate(Duration::from_secs(3));
        }
        manifest::tear_down(&self.dir, self.keep);
        if self.keep {
            eprintln!("metal lab: kept {} (BC_LAB_KEEP=1)", self.dir.display());
        }
    }
}
