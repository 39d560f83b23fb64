//! The metal flow end to end against real parts: a QEMU (TCG) domain that libvirtd runs on the lab's boot segment,
//! powered and pointed at PXE by sushy-tools' libvirt driver (HTTP Basic), dnsmasq as the segment's DHCP, the real
//! `better-compute dev` (real PostgreSQL, real mTLS) in the site namespace with its gateway on the segment, the real
//! `bcd site run` enrolled in it (proxy DHCP, TFTP, boot HTTP, the BMC worker, the site report), the real ramdisk
//! from images/ netbooted with the attempt's boot token, and the lab OS image (with the real `bcd`) streamed to the
//! domain's disk and kexec'd into. Driven only through `better-compute metal …` and read back with `metal show`.
//!
//! One lab, one VM for the happy path, in order, with each phase's time printed:
//! (a) enroll → provide → ready: inspection (Redfish), the ramdisk's signed diagnose and signed wipe evidence in
//!     `metal show`, the last DHCP the site saw from the machine;
//! (f) + (b) deploy: the control plane is stopped and started again while the ramdisk streams the image; the flow
//!     resumes from the stored record, the ramdisk ran the stream and the kexec once each (its own console says so),
//!     the installed system's bcd joins with the single-use token and reclaims the same node id: deployed, one power
//!     cycle from enroll;
//! (c) in parallel with (a): a domain whose NIC is on the isolated bridge is re-kicked k = 2 times and fails with
//!     "never joined: 2 PXE attempts, no DHCP seen from …" within its bounded deadlines (`[metal]` of dev's config);
//! (d) in parallel: a machine behind a BMC that accepts the boot override and does not apply it (a proxy in front of
//!     sushy that answers the PATCH with 204 and drops it) fails at once with what was read back;
//! (e) after (b): release netboots the ramdisk again (the same node, by reclaim), and an abort while it wipes fails
//!     the machine in wiping with the open wipe cancelled.
//!
//! Skips (`SKIP: metal_flow_lab: <why>`) without root, libvirt, QEMU, dnsmasq, the sushy venv, the iPXE loaders or
//! the images (`images/build-ramdisk`, `images/build-lab-os`); `BC_HWTESTS_REQUIRE_LAB=1` turns a skip into a failure.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bc_hwtests::lab::{
    self, BasicAuth, Domain, DomainSpec, Firmware, LabOptions, MetalLab, Ns, Segment,
};
use bc_hwtests::skip;
use serde_json::Value;

mod common;
use common::{bcd_binary, control_binary, workspace};

const TEST: &str = "metal_flow_lab";
const USER: &str = "lab-admin";
const PASSWORD: &str = "lab-secret";
const SITE: &str = "lab-rack";
const API: &str = "127.0.0.1:7080";
const GATEWAY_PORT: u16 = 7443;
const HTTP_PORT: u16 = 8080;
const LOADERS: [&str; 2] = ["/usr/lib/ipxe/undionly.kpxe", "/usr/lib/ipxe/ipxe.efi"];
/// Bounded failure cases: a PXE attempt waits this long for the join, k attempts.
const NETBOOT_TIMEOUT_S: u64 = 150;
const NETBOOT_ATTEMPTS: u32 = 2;

/// The lab's phases with their times, printed as they end.
struct Clock {
    t0: Instant,
    rows: Vec<(String, f64)>,
}

impl Clock {
    fn done(&mut self, what: &str, since: Instant) {
        let took = since.elapsed().as_secs_f64();
        println!(
            "  {:>6.1} s  {what} ({took:.1} s)",
            self.t0.elapsed().as_secs_f64()
        );
        self.rows.push((what.to_owned(), took));
    }
}

/// The control plane (`better-compute dev` in the site namespace) and how to reach it from there.
struct Plane {
    handle: usize,
    data: PathBuf,
    api_key: String,
    bin: PathBuf,
}

fn start_plane(lab: &mut MetalLab, bin: &Path, data: &Path, config: &Path) -> Result<Plane> {
    let env = data.join("dev.env");
    let _ = fs::remove_file(&env);
    let log = lab.dir.join("control.log");
    let mut cmd = lab.command(Ns::Site, bin);
    cmd.arg("dev")
        .arg("--data-dir")
        .arg(data)
        .args(["--api-listen", API])
        .args([
            "--gateway-listen",
            &format!("{}:{GATEWAY_PORT}", lab::SITE_IP),
        ])
        .args(["--gateway-host", lab::SITE_IP])
        .arg("--config")
        .arg(config)
        .env("BC_LOG", "info")
        .stdout(Stdio::null())
        .stderr(fs::File::options().create(true).append(true).open(&log)?);
    let handle = lab.spawn("better-compute dev", &mut cmd)?;
    let until = Instant::now() + Duration::from_secs(120);
    while !env.exists() {
        if let Some(status) = lab.process(handle).child.try_wait()? {
            bail!(
                "better-compute dev exited ({status}):\n{}",
                bc_hwtests::watch::tail(&log, 30)
            );
        }
        if Instant::now() > until {
            bail!(
                "better-compute dev not ready in 120 s:\n{}",
                bc_hwtests::watch::tail(&log, 30)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = fs::read_to_string(&env)?;
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::to_owned)
            .with_context(|| format!("{k} not in {}", env.display()))
    };
    Ok(Plane {
        handle,
        data: data.to_owned(),
        api_key: get("BC_API_KEY")?,
        bin: bin.to_owned(),
    })
}

impl Plane {
    /// `better-compute ARGS` in the site namespace; its stdout.
    fn cli(&self, lab: &MetalLab, args: &[&str]) -> Result<String> {
        self.cli_env(lab, args, &[])
    }

    fn cli_env(&self, lab: &MetalLab, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
        let mut cmd = lab.command(Ns::Site, &self.bin);
        cmd.args(args)
            .env("BC_API_URL", format!("http://{API}"))
            .env("BC_API_KEY", &self.api_key)
            .env("HOME", &self.data);
        for (k, v) in env {
            cmd.env(k, v);
        }
        bc_hwtests::run(&mut cmd)
    }

    fn show(&self, lab: &MetalLab, mac: &str) -> Result<Value> {
        let out = self.cli(lab, &["metal", "show", mac, "-o", "json"])?;
        serde_json::from_str(&out).with_context(|| format!("metal show: {out}"))
    }

    /// Polls `metal show` until `done` holds (printing each change of state), or fails after `limit`.
    fn wait(
        &self,
        lab: &MetalLab,
        mac: &str,
        limit: Duration,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let t = Instant::now();
        let mut last = String::new();
        loop {
            let v = self.show(lab, mac)?;
            let state = state_line(&v);
            if state != last {
                println!(
                    "           {mac} +{:.1} s: {state}",
                    t.elapsed().as_secs_f64()
                );
                last = state;
            }
            if done(&v) {
                return Ok(v);
            }
            if t.elapsed() > limit {
                bail!(
                    "{mac}: no {what} within {limit:?}; last:\n{}",
                    serde_json::to_string_pretty(&v)?
                );
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

fn state_line(v: &Value) -> String {
    let s = &v["state"];
    let mut line = format!(
        "{} {}",
        s["state"].as_str().unwrap_or("?"),
        s["phase"].as_str().unwrap_or("?")
    );
    if let Some(r) = s["reason"].as_str() {
        line.push_str(&format!(": {r}"));
    }
    if let Some(w) = v["waiting_for"].as_str() {
        line.push_str(&format!(" (waiting for {w}, attempt {})", v["attempt"]));
    }
    line
}

fn phase_is(v: &Value, phase: &str) -> bool {
    v["state"]["state"] == "active" && v["state"]["phase"] == phase
}

fn failed(v: &Value) -> bool {
    v["state"]["state"] == "failed"
}

fn evidence<'a>(v: &'a Value, step: &str) -> Option<&'a Value> {
    v["evidence"].as_array()?.iter().find(|e| e["step"] == step)
}

/// Lines of the domain's serial console that contain every needle.
fn console_count(d: &Domain, needles: &[&str]) -> usize {
    fs::read(&d.serial)
        .map(|b| {
            String::from_utf8_lossy(&b)
                .lines()
                .filter(|l| needles.iter().all(|n| l.contains(n)))
                .count()
        })
        .unwrap_or(0)
}

/// A BMC that accepts the one-time boot override and does not apply it: a proxy in front of sushy that answers a
/// PATCH of a system with 204 and forwards everything else (the quirk fixture of case (d)).
const QUIRK_PROXY: &str = r#"
import http.server, sys, urllib.request
UP = "http://127.0.0.1:8000"
class H(http.server.BaseHTTPRequestHandler):
    def fwd(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        if self.command == "PATCH" and "/Systems/" in self.path:
            self.send_response(204); self.end_headers(); return
        req = urllib.request.Request(UP + self.path, data=body, method=self.command)
        for k in ("Authorization", "Content-Type", "Accept", "If-Match"):
            if self.headers.get(k): req.add_header(k, self.headers[k])
        try:
            r = urllib.request.urlopen(req, timeout=30); code, data, hdrs = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            code, data, hdrs = e.code, e.read(), e.headers
        self.send_response(code)
        for k in ("Content-Type", "ETag", "WWW-Authenticate"):
            if hdrs.get(k): self.send_header(k, hdrs[k])
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    do_GET = do_POST = do_PATCH = do_DELETE = fwd
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

struct Images {
    vmlinuz: PathBuf,
    initrd: PathBuf,
    lab_os: PathBuf,
}

fn images() -> std::result::Result<Images, String> {
    let out = std::env::var_os("BC_IMAGES_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("images/out"));
    let i = Images {
        vmlinuz: out.join("vmlinuz"),
        initrd: out.join("ramdisk.cpio.zst"),
        lab_os: out.join("lab-os.img.zst"),
    };
    for f in [&i.vmlinuz, &i.initrd, &i.lab_os] {
        if !f.is_file() {
            return Err(format!(
                "{} missing (images/build-ramdisk and images/build-lab-os build it)",
                f.display()
            ));
        }
    }
    Ok(i)
}

fn public_copy(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to.parent().context("a parent")?)?;
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(0o644))?;
    Ok(())
}

/// The site agent: enrolled with a site token, then `bcd site run` serving the boot segment from the site namespace.
fn start_site(lab: &mut MetalLab, plane: &Plane, bcd: &Path, images: &Images) -> Result<PathBuf> {
    let d = lab.dir.join("site");
    let (tftp, artifacts, state) = (d.join("tftp"), d.join("artifacts"), d.join("state"));
    for l in LOADERS {
        let l = Path::new(l);
        public_copy(l, &tftp.join(l.file_name().context("loader")?))?;
    }
    public_copy(&images.vmlinuz, &artifacts.join("ramdisk/vmlinuz"))?;
    public_copy(&images.initrd, &artifacts.join("ramdisk/initrd.img"))?;
    let env = fs::read_to_string(plane.data.join("dev.env"))?;
    let get = |k: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_owned()
    };
    let agent = d.join("bcd.toml");
    fs::write(
        &agent,
        format!(
            "gateway_url = \"{}\"\nca_pin = \"{}\"\njoin_public_key = \"{}\"\n",
            get("BC_GATEWAY_URL"),
            get("BC_CA_PIN"),
            get("BC_JOIN_KEY")
        ),
    )?;
    let token = plane.cli(
        lab,
        &["site-tokens", "create", "--site", SITE, "--uses", "1"],
    )?;
    let token = token.trim().to_owned();
    let mut enroll = lab.command(Ns::Site, bcd);
    enroll
        .args(["site", "enroll", "--agent-config"])
        .arg(&agent)
        .arg("--state-dir")
        .arg(&state)
        .env("BCD_SITE_TOKEN", &token);
    bc_hwtests::run(&mut enroll).context("bcd site enroll")?;
    let config = d.join("site.toml");
    fs::write(
        &config,
        format!(
            "[boot]\ninterface = \"{}\"\nserver_ip = \"{}\"\ntftp_root = \"{}\"\nartifacts = \"{}\"\n\
             http_port = {HTTP_PORT}\nreport_interval_s = 0\n",
            lab::SITE_IFACE,
            lab::SITE_IP,
            tftp.display(),
            artifacts.display()
        ),
    )?;
    let log = lab.dir.join("site.log");
    let mut run = lab.command(Ns::Site, bcd);
    run.args(["site", "run", "--agent-config"])
        .arg(&agent)
        .arg("--config")
        .arg(&config)
        .arg("--state-dir")
        .arg(&state)
        .env("BCD_LOG", "info,bcd_site=debug,bcd::site::report=debug")
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log)?);
    lab.spawn("bcd site run", &mut run)?;
    Ok(log)
}

fn define(
    lab: &mut MetalLab,
    name: &str,
    n: u8,
    segment: Segment,
    disk_mib: u64,
) -> Result<Domain> {
    let mut spec = DomainSpec::new(name, n, Firmware::SeaBios).on(segment);
    spec.disk_mib = disk_mib;
    lab.define(&spec)
}

fn enroll(lab: &MetalLab, plane: &Plane, d: &Domain, bmc: &str) -> Result<()> {
    let address = format!("{bmc}{}", d.redfish_path());
    plane.cli(
        lab,
        &[
            "metal",
            "enroll",
            "--site",
            SITE,
            "--mac",
            &d.mac,
            "--bmc",
            &address,
            "--credentials",
            "bmc/lab",
        ],
    )?;
    Ok(())
}

#[test]
fn a_machine_goes_from_pxe_to_ready_and_deployed_through_the_real_parts() -> Result<()> {
    if let Some(why) = lab::missing() {
        return skip(TEST, why);
    }
    for l in LOADERS {
        if !Path::new(l).is_file() {
            return skip(TEST, format!("{l} missing (package ipxe)"));
        }
    }
    let images = match images() {
        Ok(i) => i,
        Err(why) => return skip(TEST, why),
    };
    let started = Instant::now();
    let bcd = bcd_binary()?;
    let control = control_binary()?;
    let mut clock = Clock {
        t0: Instant::now(),
        rows: Vec::new(),
    };
    println!(
        "{TEST}: binaries ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let t = Instant::now();
    let mut lab = MetalLab::up(LabOptions {
        basic_auth: Some(BasicAuth {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
    })?;
    let m1 = define(&mut lab, "m1", 0x21, Segment::Boot, 256)?;
    let m2 = define(&mut lab, "m2", 0x22, Segment::Isolated, 64)?;
    let m3 = define(&mut lab, "m3", 0x23, Segment::Boot, 64)?;
    clock.done(
        "lab up: namespaces, dnsmasq, libvirtd, sushy, 3 domains defined",
        t,
    );
    let result = flow(
        &mut lab,
        &mut clock,
        &control,
        &bcd,
        &images,
        [&m1, &m2, &m3],
    );
    if let Err(e) = result {
        let mut logs = lab.logs();
        for f in ["control.log", "site.log"] {
            logs.push_str(&format!(
                "--- {f}:\n{}\n",
                bc_hwtests::watch::tail(&lab.dir.join(f), 40)
            ));
        }
        logs.push_str(&format!(
            "--- m1 serial:\n{}\n",
            bc_hwtests::watch::tail(&m1.serial, 60)
        ));
        return Err(e.context(logs));
    }
    println!("{TEST}: phases");
    for (what, s) in &clock.rows {
        println!("  {s:>7.1} s  {what}");
    }
    println!("{TEST}: total {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn flow(
    lab: &mut MetalLab,
    clock: &mut Clock,
    control: &Path,
    bcd: &Path,
    images: &Images,
    [m1, m2, m3]: [&Domain; 3],
) -> Result<()> {
    let t = Instant::now();
    let metal = lab.dir.join("control.toml");
    fs::write(
        &metal,
        format!(
            "[metal]\nramdisk_cmdline = \"console=ttyS0 panic=-1\"\nbmc_timeout_s = 90\n\
             netboot_timeout_s = {NETBOOT_TIMEOUT_S}\nnetboot_attempts = {NETBOOT_ATTEMPTS}\n\
             diagnose_timeout_s = 300\nwipe_timeout_s = 600\nstream_timeout_s = 600\n\
             kexec_join_timeout_s = 300\nready_idle_timeout_s = 0\ntick_ms = 1000\n"
        ),
    )?;
    let data = lab.dir.join("control");
    let mut plane = start_plane(lab, control, &data, &metal)?;
    clock.done(
        "better-compute dev up in the site namespace (PostgreSQL, migrations, CA)",
        t,
    );
    let t = Instant::now();
    let _site_log = start_site(lab, &plane, bcd, images)?;
    plane.cli_env(
        lab,
        &["secrets", "put", "bmc/lab", "--site", SITE],
        &[(
            "BC_SECRET_VALUE",
            &format!("{{\"username\":\"{USER}\",\"password\":\"{PASSWORD}\"}}"),
        )],
    )?;
    let image = plane
        .cli(
            lab,
            &["artifacts", "put", &images.lab_os.display().to_string()],
        )?
        .trim()
        .to_owned();
    if !image.starts_with("sha256:") {
        bail!("artifacts put printed {image:?}, not a sha256: reference");
    }
    let quirk = lab.dir.join("quirk-bmc.py");
    fs::write(&quirk, QUIRK_PROXY)?;
    let mut q = lab.command(Ns::Site, "python3");
    q.arg(&quirk)
        .arg("8001")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    lab.spawn("quirk BMC proxy", &mut q)?;
    enroll(lab, &plane, m1, &lab.bmc_url.clone())?;
    enroll(lab, &plane, m2, &lab.bmc_url.clone())?;
    enroll(lab, &plane, m3, "http://127.0.0.1:8001")?;
    clock.done(
        "site enrolled and running; BMC secret, lab OS image uploaded; 3 machines enrolled",
        t,
    );

    // (a), (c), (d) at once.
    let t = Instant::now();
    for d in [m1, m2, m3] {
        plane.cli(lab, &["metal", "provide", &d.mac])?;
    }
    let v3 = plane.wait(
        lab,
        &m3.mac,
        Duration::from_secs(240),
        "failure (d)",
        failed,
    )?;
    let reason = v3["state"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if !(v3["state"]["phase"] == "booting-ramdisk" && reason.contains("one-time PXE boot")) {
        bail!("(d) failed otherwise than on the override: {reason}");
    }
    println!("  (d) {}: {reason}", m3.mac);
    clock.done(
        "(d) override accepted and not applied: failed with what was read back",
        t,
    );
    let v1 = plane.wait(lab, &m1.mac, Duration::from_secs(600), "ready (a)", |v| {
        phase_is(v, "ready") || failed(v)
    })?;
    if !phase_is(&v1, "ready") {
        bail!("(a) {} did not reach ready: {}", m1.mac, state_line(&v1));
    }
    clock.done("(a) enroll → ready (inspect, PXE, join, diagnose, wipe)", t);
    check_ready(&v1, m1)?;

    // (b) + (f): deploy; restart the control plane while the ramdisk streams.
    let t = Instant::now();
    let node = v1["node_id"].as_str().context("node id")?.to_owned();
    let user_data = lab.dir.join("user-data");
    fs::write(&user_data, "#cloud-config\nhostname: lab-m1\n")?;
    plane.cli(
        lab,
        &[
            "metal",
            "deploy",
            &m1.mac,
            "--image",
            &image,
            "--user-data",
            &user_data.display().to_string(),
        ],
    )?;
    plane.wait(
        lab,
        &m1.mac,
        Duration::from_secs(300),
        "the stream sent",
        |v| {
            v["steps"].as_array().is_some_and(|s| {
                s.iter().any(|x| {
                    x["step"] == "stream" && (x["state"] == "sent" || x["state"] == "done")
                })
            }) || failed(v)
        },
    )?;
    let r = Instant::now();
    lab.process(plane.handle).terminate(Duration::from_secs(30));
    println!("  (f) control plane stopped while the ramdisk streams");
    plane = start_plane(lab, control, &data, &metal)?;
    clock.done("(f) control plane restarted mid-deploy", r);
    let v = plane.wait(
        lab,
        &m1.mac,
        Duration::from_secs(900),
        "deployed (b)",
        |v| phase_is(v, "deployed") || failed(v),
    )?;
    if !phase_is(&v, "deployed") {
        bail!("(b) {} did not reach deployed: {}", m1.mac, state_line(&v));
    }
    clock.done(
        "(b) ready → deployed (stream, kexec, the installed system's bcd joined)",
        t,
    );
    check_deployed(&v, m1, &node)?;

    // (c): bounded, running since the provide.
    let t = Instant::now();
    let v2 = plane.wait(
        lab,
        &m2.mac,
        Duration::from_secs(NETBOOT_ATTEMPTS as u64 * (NETBOOT_TIMEOUT_S + 120)),
        "failure (c)",
        failed,
    )?;
    let reason = v2["state"]["reason"].as_str().unwrap_or_default();
    let want = format!(
        "never joined: {NETBOOT_ATTEMPTS} PXE attempts, no DHCP seen from {}",
        m2.mac
    );
    if reason != want || v2["power_cycles"] != NETBOOT_ATTEMPTS {
        bail!(
            "(c) {}: {reason:?} after {} power cycles; expected {want:?}",
            m2.mac,
            v2["power_cycles"]
        );
    }
    println!("  (c) {}: {reason}", m2.mac);
    clock.done(
        "(c) never PXE boots: k re-kicks, then failed (waited here after (b))",
        t,
    );

    // (e): release → the ramdisk again → abort while it wipes.
    let t = Instant::now();
    plane.cli(lab, &["metal", "release", &m1.mac])?;
    let v = plane.wait(lab, &m1.mac, Duration::from_secs(600), "wiping (e)", |v| {
        phase_is(v, "wiping") || phase_is(v, "ready") || failed(v)
    })?;
    if !phase_is(&v, "wiping") {
        bail!("(e) {} never observed wiping: {}", m1.mac, state_line(&v));
    }
    if v["node_id"].as_str() != Some(node.as_str()) {
        bail!(
            "(e) the released machine's ramdisk joined as {} not {node}",
            v["node_id"]
        );
    }
    let aborted = plane.cli(lab, &["metal", "abort", &m1.mac]);
    let v = plane.show(lab, &m1.mac)?;
    match aborted {
        Ok(_) if v["state"]["reason"] == "aborted by the operator during wiping" => {
            println!("  (e) {}: {}", m1.mac, state_line(&v));
        }
        other => bail!("(e) abort during wiping: {other:?}; now {}", state_line(&v)),
    }
    clock.done(
        "(e) release → the ramdisk rejoined as the same node → abort while wiping",
        t,
    );
    Ok(())
}

fn check_ready(v: &Value, d: &Domain) -> Result<()> {
    let inspected = v["inspection"]["macs"]
        .as_array()
        .is_some_and(|m| m.iter().any(|x| x == d.mac.as_str()));
    if !inspected {
        bail!(
            "(a) the inspection lacks the domain's MAC: {}",
            v["inspection"]
        );
    }
    if v["diagnosis"]["cpus"].as_u64().unwrap_or(0) == 0 {
        bail!("(a) no diagnosis: {}", v["diagnosis"]);
    }
    let node = v["node_id"].as_str().unwrap_or_default();
    for step in ["diagnose", "wipe"] {
        let e = evidence(v, step)
            .with_context(|| format!("(a) no {step} evidence: {}", v["evidence"]))?;
        if !e["signer"]
            .as_str()
            .is_some_and(|s| s.ends_with(&format!("/node/{node}")))
            || e["node_id"] != node
        {
            bail!("(a) the {step} evidence is not signed by the ramdisk's node {node}: {e}");
        }
    }
    if evidence(v, "wipe").is_some_and(|e| e["result"]["wiped"] != true) {
        bail!(
            "(a) the wipe evidence does not say wiped: {}",
            v["evidence"]
        );
    }
    // `-o json` prints the API's `last_dhcp_ms` instant as `last_dhcp`, RFC 3339 (docs/cli.md).
    if !v["last_dhcp"].as_str().is_some_and(|t| t.starts_with("20")) {
        bail!("(a) the site reported no DHCP from {}", d.mac);
    }
    println!(
        "  (a) node {node}, inspection {}, diagnosis {}, last DHCP at {}, {} power cycle(s)",
        v["inspection"], v["diagnosis"], v["last_dhcp"], v["power_cycles"]
    );
    Ok(())
}

fn check_deployed(v: &Value, d: &Domain, node: &str) -> Result<()> {
    if v["node_id"].as_str() != Some(node) {
        bail!(
            "(b) deployed as node {} but the ramdisk was {node}",
            v["node_id"]
        );
    }
    if v["power_cycles"].as_u64().unwrap_or(99) > 2 {
        bail!(
            "(b) {} power cycles from enroll to deployed",
            v["power_cycles"]
        );
    }
    for (kind, n) in [("ramdisk.stream", 1), ("ramdisk.kexec", 1)] {
        let ran = console_count(d, &["bc-report command", &format!("\"kind\":\"{kind}\"")]);
        if ran != n {
            bail!("(f) the ramdisk ran {kind} {ran} times (its console), not {n}");
        }
    }
    if console_count(d, &["BC-LAB-OS booted"]) != 1 {
        bail!("(b) the lab OS did not boot once after the kexec");
    }
    if console_count(d, &["BC-LAB-OS: bcd join: Ok(", "(0)"]) != 1 {
        bail!("(b) the lab OS's `bcd join` with the seed's token did not exit 0 (its console)");
    }
    println!(
        "  (b) deployed as node {node} after {} power cycle(s); stream and kexec ran once each on the machine",
        v["power_cycles"]
    );
    Ok(())
}
