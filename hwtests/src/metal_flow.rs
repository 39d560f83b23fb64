//! The metal flow's lab driver, shared by `tests/metal_flow_lab.rs` (every case once) and the `metal-bench` program
//! (`scripts/bench metal`: the happy path three times, for medians): the control plane (`better-compute dev` in the
//! site namespace) and its CLI, the site agent enrolled in it, the lab's machines, and the checks of `metal show`.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::lab::{self, Domain, DomainSpec, Firmware, MetalLab, Ns, Segment};

pub const USER: &str = "lab-admin";
pub const PASSWORD: &str = "lab-secret";
pub const SITE: &str = "lab-rack";
pub const API: &str = "127.0.0.1:7080";
pub const GATEWAY_PORT: u16 = 7443;
pub const HTTP_PORT: u16 = 8080;
pub const LOADERS: [&str; 2] = ["/usr/lib/ipxe/undionly.kpxe", "/usr/lib/ipxe/ipxe.efi"];

/// The lab's phases with their times, printed as they end.
pub struct Clock {
    pub t0: Instant,
    pub rows: Vec<(String, f64)>,
}

impl Clock {
    pub fn done(&mut self, what: &str, since: Instant) {
        let took = since.elapsed().as_secs_f64();
        println!(
            "  {:>6.1} s  {what} ({took:.1} s)",
            self.t0.elapsed().as_secs_f64()
        );
        self.rows.push((what.to_owned(), took));
    }
}

/// The control plane (`better-compute dev` in the site namespace) and how to reach it from there.
pub struct Plane {
    pub handle: usize,
    pub data: PathBuf,
    pub api_key: String,
    pub bin: PathBuf,
}

pub fn start_plane(lab: &mut MetalLab, bin: &Path, data: &Path, config: &Path) -> Result<Plane> {
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
                bc_testkit::log_tail(&log, 30)
            );
        }
        if Instant::now() > until {
            bail!(
                "better-compute dev not ready in 120 s:\n{}",
                bc_testkit::log_tail(&log, 30)
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
    pub fn cli(&self, lab: &MetalLab, args: &[&str]) -> Result<String> {
        self.cli_env(lab, args, &[])
    }

    pub fn cli_env(&self, lab: &MetalLab, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
        let mut cmd = lab.command(Ns::Site, &self.bin);
        cmd.args(args)
            .env("BC_API_URL", format!("http://{API}"))
            .env("BC_API_KEY", &self.api_key)
            .env("HOME", &self.data);
        for (k, v) in env {
            cmd.env(k, v);
        }
        crate::run(&mut cmd)
    }

    pub fn show(&self, lab: &MetalLab, mac: &str) -> Result<Value> {
        let out = self.cli(lab, &["metal", "show", mac, "-o", "json"])?;
        serde_json::from_str(&out).with_context(|| format!("metal show: {out}"))
    }

    /// Polls `metal show` until `done` holds (printing each change of state), or fails after `limit`.
    pub fn wait(
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

pub fn state_line(v: &Value) -> String {
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

pub fn phase_is(v: &Value, phase: &str) -> bool {
    v["state"]["state"] == "active" && v["state"]["phase"] == phase
}

pub fn failed(v: &Value) -> bool {
    v["state"]["state"] == "failed"
}

pub fn evidence<'a>(v: &'a Value, step: &str) -> Option<&'a Value> {
    v["evidence"].as_array()?.iter().find(|e| e["step"] == step)
}

/// Lines of the domain's serial console that contain every needle.
pub fn console_count(d: &Domain, needles: &[&str]) -> usize {
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
pub const QUIRK_PROXY: &str = r#"
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

pub struct Images {
    pub vmlinuz: PathBuf,
    pub initrd: PathBuf,
    pub lab_os: PathBuf,
}

pub fn images() -> std::result::Result<Images, String> {
    let out = std::env::var_os("BC_IMAGES_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/out"));
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

pub fn public_copy(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to.parent().context("a parent")?)?;
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(0o644))?;
    Ok(())
}

/// The site agent: enrolled with a site token, then `bcd site run` serving the boot segment from the site namespace.
pub fn start_site(
    lab: &mut MetalLab,
    plane: &Plane,
    bcd: &Path,
    images: &Images,
) -> Result<PathBuf> {
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
    crate::run(&mut enroll).context("bcd site enroll")?;
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

pub fn define(
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

pub fn enroll(lab: &MetalLab, plane: &Plane, d: &Domain, bmc: &str) -> Result<()> {
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

/// The most the lab's inspection of one machine may take (see [`check_ready`]).
pub const INSPECTION_BUDGET_S: f64 = 15.0;

/// The seconds a machine's timeline spent in `phase`, over every attempt that ended.
pub fn phase_seconds(v: &Value, phase: &str) -> f64 {
    v["timeline"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["phase"] == phase)
        .filter_map(|row| Some((row["end"].as_i64()? - row["start"].as_i64()?) as f64 / 1000.0))
        .sum()
}

pub fn check_ready(v: &Value, d: &Domain) -> Result<()> {
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
    // The inspection reads one system's inventory from sushy: 0.3 s here. It took about 35 s once, unnoticed while the
    // test passed: every read sushy answers 500 (its Storage) used the whole retry budget, and the three systems
    // behind the lab's BMC were each read whole.
    let inspecting = phase_seconds(v, "inspecting");
    if inspecting > INSPECTION_BUDGET_S {
        bail!(
            "(a) inspecting took {inspecting:.1} s (at most {INSPECTION_BUDGET_S} s; 0.3 s is usual): {}",
            v["timeline"]
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

pub fn check_deployed(v: &Value, d: &Domain, node: &str) -> Result<()> {
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

/// dev's `--config` for the lab: the `[metal]` deadlines, a PXE attempt waiting `netboot_timeout_s` for the join,
/// `netboot_attempts` of them.
pub fn metal_config(netboot_timeout_s: u64, netboot_attempts: u32) -> String {
    format!(
        "[metal]\nramdisk_cmdline = \"console=ttyS0 panic=-1\"\nbmc_timeout_s = 90\n\
         netboot_timeout_s = {netboot_timeout_s}\nnetboot_attempts = {netboot_attempts}\n\
         diagnose_timeout_s = 300\nwipe_timeout_s = 600\nstream_timeout_s = 600\n\
         kexec_join_timeout_s = 300\nready_idle_timeout_s = 0\ntick_ms = 1000\n"
    )
}

/// The site agent enrolled and running, the BMCs' secret (`bmc/lab`) put, and the lab OS image uploaded: its
/// `sha256:` reference.
pub fn site_and_image(
    lab: &mut MetalLab,
    plane: &Plane,
    bcd: &Path,
    images: &Images,
) -> Result<String> {
    start_site(lab, plane, bcd, images)?;
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
    Ok(image)
}

/// Deploys the lab OS image to a ready machine with a small cloud-config.
pub fn deploy(lab: &MetalLab, plane: &Plane, d: &Domain, image: &str) -> Result<()> {
    let user_data = lab.dir.join(format!("user-data-{}", d.name));
    fs::write(
        &user_data,
        format!("#cloud-config\nhostname: lab-{}\n", d.name),
    )?;
    plane.cli(
        lab,
        &[
            "metal",
            "deploy",
            &d.mac,
            "--image",
            image,
            "--user-data",
            &user_data.display().to_string(),
        ],
    )?;
    Ok(())
}
