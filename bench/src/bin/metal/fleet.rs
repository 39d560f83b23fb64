//! Many machines in flight at once against sushy-tools' fake driver (no VMs), with simulated ramdisk agents: the
//! real control plane (`better-compute dev`), the real site agent (`bcd site run`: the BMC worker, the netboot
//! entries, the boot HTTP server) and sushy-tools' fake systems, whose power changes land 1 to 11 s after they are
//! asked for (the driver's own delay).
//!
//! A simulated machine watches its fake system. When the system powers on with its boot override on `Pxe`, the
//! machine "netboots": it fetches `/boot/<mac>.ipxe` from the site's HTTP server as iPXE would, reads the kernel
//! command line there (gateway URL, CA pin, JoinService key and the attempt's single-use boot token) and runs the
//! ramdisk's own agent (`bcd_ramdisk::agent::run`: bcd's join and session, results signed by the node key) with a
//! hook that answers `ramdisk.diagnose` and `ramdisk.wipe` at once from the machine's simulated hardware. A power-off
//! ends the agent, as it ends a ramdisk. A power-on without the override boots "the disk": nothing joins.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bc_bench::{Dev, cpu_ticks};
use bc_proto::v1;
use bc_testkit::sushy::{FakeBmc, FakeOptions, fake_emulator};
use bcd::session::{CommandHook, CommandOutput, ProgressReporter};
use serde_json::{Value, json};

const SITE: &str = "fleet";

/// What a fleet run measured.
pub struct Figures {
    pub machines: usize,
    /// From the first `provide` until the last machine is ready.
    pub wall_s: f64,
    /// Each machine's enroll → ready, from its timeline (its provide to the start of `ready`), sorted.
    pub ready_s: Vec<f64>,
    /// The control plane's CPU (dev and its PostgreSQL) over the wall time, per machine.
    pub control_cpu_s_per_machine: f64,
    /// The site agent's CPU over the wall time, per machine.
    pub site_cpu_s_per_machine: f64,
    pub power_cycles_max: u64,
    /// Seconds in each phase, per machine (from the timelines).
    pub phases: Vec<std::collections::BTreeMap<String, f64>>,
    /// Machines that took more than one power cycle, with their timelines' outcomes.
    pub rekicked: Vec<String>,
}

/// Runs `machines` simulated machines from enroll to ready; `bin` holds `better-compute` and `bcd`.
pub fn run(bin: &Path, machines: usize) -> anyhow::Result<Figures> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("control.toml");
    std::fs::write(
        &config,
        "[metal]\nnetboot_timeout_s = 120\nnetboot_attempts = 2\nready_idle_timeout_s = 0\n",
    )?;
    let dev = Dev::spawn_with(
        Command::new(bin.join("better-compute")),
        &dir.path().join("dev"),
        "127.0.0.1:0",
        &["--config".as_ref(), config.as_os_str()],
    )?;
    let cli = Cli {
        bin: bin.join("better-compute"),
        env: dev.env.clone(),
    };
    let mut children = Children(Vec::new());
    let http_port = bc_testkit::free_port()?;
    children
        .0
        .push(start_site(bin, dir.path(), &cli, http_port)?);
    let site_pid = children.0[0].id();
    let systems: Vec<FakeSystem> = (1..=machines).map(FakeSystem::new).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut events = HashMap::new();
    let mut inboxes = Vec::new();
    for s in &systems {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        events.insert(s.uuid.clone(), tx);
        inboxes.push(rx);
    }
    let notify = rt.block_on(notifications(events))?;
    let bmc = start_sushy(&systems, &notify)?;
    let sushy = bmc.url();
    cli.run_env(
        &["secrets", "put", "bmc/fleet", "--site", SITE],
        &[(
            "BC_SECRET_VALUE",
            r#"{"username":"fleet","password":"fleet"}"#,
        )],
    )?;
    for s in &systems {
        cli.run(&[
            "metal",
            "enroll",
            "--site",
            SITE,
            "--mac",
            &s.mac,
            "--bmc",
            &format!("{sushy}{}", s.path()),
            "--credentials",
            "bmc/fleet",
        ])?;
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sims: Vec<_> = systems
        .iter()
        .zip(inboxes)
        .map(|(s, inbox)| {
            rt.spawn(simulate(
                s.clone(),
                inbox,
                format!("http://127.0.0.1:{http_port}"),
                dir.path().join("agents"),
                stop_rx.clone(),
            ))
        })
        .collect();

    let dev_pid = dev.child.id();
    let (cpu0, site0) = (tree_ticks(dev_pid), cpu_ticks(site_pid));
    let t0 = Instant::now();
    for s in &systems {
        cli.run(&["metal", "provide", &s.mac])?;
    }
    let deadline = t0 + Duration::from_secs(600);
    let shows = loop {
        let list: Value = serde_json::from_str(&cli.run(&["metal", "list", "-o", "json"])?)?;
        let rows = list["machines"].as_array().cloned().unwrap_or_default();
        let phase = |m: &Value| {
            format!(
                "{} {}",
                m["state"]["state"].as_str().unwrap_or("?"),
                m["state"]["phase"].as_str().unwrap_or("?")
            )
        };
        let failed: Vec<String> = rows
            .iter()
            .filter(|m| m["state"]["state"] == "failed")
            .map(|m| format!("{}: {}", m["mac"], m["state"]["reason"]))
            .collect();
        if !failed.is_empty() {
            bail!("machines failed: {}", failed.join("; "));
        }
        if rows.len() == machines && rows.iter().all(|m| phase(m) == "active ready") {
            break rows;
        }
        if Instant::now() > deadline {
            let mut by: HashMap<String, usize> = HashMap::new();
            for m in &rows {
                *by.entry(phase(m)).or_default() += 1;
            }
            bail!("not all {machines} machines ready within 600 s: {by:?}");
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let (cpu1, site1) = (tree_ticks(dev_pid), cpu_ticks(site_pid));
    let _ = stop_tx.send(true);
    let mut power_cycles_max = 0;
    for s in sims {
        rt.block_on(s)??;
    }
    let (mut ready_s, mut phases, mut rekicked) = (Vec::new(), Vec::new(), Vec::new());
    for m in &shows {
        let mac = m["mac"].as_str().context("a machine's mac")?;
        let v: Value = serde_json::from_str(&cli.run(&["metal", "show", mac, "-o", "json"])?)?;
        ready_s.push(enroll_to_ready(&v).with_context(|| format!("{mac}'s timeline"))?);
        let cycles = v["power_cycles"].as_u64().unwrap_or(0);
        power_cycles_max = power_cycles_max.max(cycles);
        if cycles > 1 {
            let outcomes: Vec<String> = v["timeline"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| {
                    Some(format!(
                        "{} {}",
                        r["phase"].as_str()?,
                        r["outcome"].as_str()?
                    ))
                })
                .collect();
            rekicked.push(format!(
                "{mac}: {cycles} power cycles: {}",
                outcomes.join("; ")
            ));
        }
        phases.push(super::lab::phase_seconds(&v));
    }
    ready_s.sort_by(f64::total_cmp);
    drop(children);
    drop(bmc);
    dev.stop()?;
    let per = |ticks: u64| ticks as f64 / 100.0 / machines as f64;
    Ok(Figures {
        machines,
        wall_s,
        ready_s,
        control_cpu_s_per_machine: per(cpu1.saturating_sub(cpu0)),
        site_cpu_s_per_machine: per(site1.saturating_sub(site0)),
        power_cycles_max,
        phases,
        rekicked,
    })
}

/// Seconds from the provide (the end of the `enrolled` row: the machines were enrolled one after another before)
/// to the start of `ready`.
fn enroll_to_ready(v: &Value) -> anyhow::Result<f64> {
    let rows = v["timeline"].as_array().context("no timeline")?;
    let provided = rows
        .iter()
        .filter(|r| r["phase"] == "enrolled")
        .filter_map(|r| r["end"].as_i64())
        .min()
        .context("no closed enrolled row")?;
    let ready = rows
        .iter()
        .filter(|r| r["phase"] == "ready")
        .filter_map(|r| r["start"].as_i64())
        .max()
        .context("no ready row")?;
    Ok((ready - provided) as f64 / 1000.0)
}

/// The CPU ticks of `pid` and every process below it, with those of children they reaped.
fn tree_ticks(pid: u32) -> u64 {
    let mut parent: HashMap<u32, u32> = HashMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let ppid = std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()
            });
        if let Some(pp) = ppid {
            parent.insert(p, pp);
        }
    }
    let below = |mut p: u32| loop {
        if p == pid {
            return true;
        }
        match parent.get(&p) {
            Some(&pp) if pp != 0 && pp != p => p = pp,
            _ => return false,
        }
    };
    parent
        .keys()
        .filter(|&&p| below(p))
        .map(|&p| {
            let reaped = std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
                    Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
                })
                .unwrap_or(0);
            cpu_ticks(p) + reaped
        })
        .sum()
}

/// Kills what it holds when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The operator CLI against dev.
struct Cli {
    bin: PathBuf,
    env: HashMap<String, String>,
}

impl Cli {
    fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        self.run_env(args, &[])
    }

    fn run_env(&self, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<String> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args).envs(&self.env);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output()?;
        if !out.status.success() {
            bail!(
                "better-compute {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }
}

fn wait_http(url: &str) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let up = std::net::TcpStream::connect(
            url.trim_start_matches("http://")
                .split('/')
                .next()
                .unwrap_or_default(),
        )
        .is_ok();
        if up {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("{url} did not answer within 60 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `bcd site enroll`, then `bcd site run` serving boot HTTP on 127.0.0.1:`http_port` (its proxy DHCP and TFTP on
/// loopback, where nothing asks them).
fn start_site(bin: &Path, dir: &Path, cli: &Cli, http_port: u16) -> anyhow::Result<Child> {
    let d = dir.join("site");
    let (tftp, artifacts, state) = (d.join("tftp"), d.join("artifacts"), d.join("state"));
    std::fs::create_dir_all(&tftp)?;
    std::fs::create_dir_all(artifacts.join("ramdisk"))?;
    // Simulated machines fetch only the script; the kernel and initramfs the script names must still exist.
    std::fs::write(artifacts.join("ramdisk/vmlinuz"), b"simulated kernel")?;
    std::fs::write(artifacts.join("ramdisk/initrd.img"), b"simulated initramfs")?;
    let get = |k: &str| cli.env.get(k).cloned().unwrap_or_default();
    let agent = d.join("bcd.toml");
    std::fs::write(
        &agent,
        format!(
            "gateway_url = \"{}\"\nca_pin = \"{}\"\njoin_public_key = \"{}\"\n",
            get("BC_GATEWAY_URL"),
            get("BC_CA_PIN"),
            get("BC_JOIN_KEY")
        ),
    )?;
    let token = cli.run(&["site-tokens", "create", "--site", SITE, "--uses", "1"])?;
    let out = Command::new(bin.join("bcd"))
        .args(["site", "enroll", "--agent-config"])
        .arg(&agent)
        .arg("--state-dir")
        .arg(&state)
        .env("BCD_SITE_TOKEN", token.trim())
        .output()?;
    if !out.status.success() {
        bail!(
            "bcd site enroll: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let config = d.join("site.toml");
    std::fs::write(
        &config,
        format!(
            "[boot]\ninterface = \"lo\"\nserver_ip = \"127.0.0.1\"\ntftp_root = \"{}\"\nartifacts = \"{}\"\n\
             http_port = {http_port}\nreport_interval_s = 0\n",
            tftp.display(),
            artifacts.display()
        ),
    )?;
    let child = Command::new(bin.join("bcd"))
        .args(["site", "run", "--agent-config"])
        .arg(&agent)
        .arg("--config")
        .arg(&config)
        .arg("--state-dir")
        .arg(&state)
        .env("BCD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("site.log"))?)
        .spawn()
        .context("bcd site run")?;
    wait_http(&format!("http://127.0.0.1:{http_port}/"))?;
    Ok(child)
}

/// sushy-tools' fake driver with `systems` powered off, telling `notify` of each change (bc_testkit::sushy: a free
/// port, a directory of its own, removed when it is dropped).
fn start_sushy(systems: &[FakeSystem], notify: &str) -> anyhow::Result<FakeBmc> {
    let emulator = fake_emulator().map_err(anyhow::Error::msg)?;
    let list: Vec<String> = systems
        .iter()
        .map(|s| {
            format!(
                "{{'uuid': '{}', 'name': '{}', 'power_state': 'Off', 'external_notifier': True, \
                 'nics': [{{'mac': '{}', 'ip': '10.79.0.{}'}}]}}",
                s.uuid, s.name, s.mac, s.n
            )
        })
        .collect();
    let opts = FakeOptions {
        basic_auth: None,
        config: format!(
            "EXTERNAL_NOTIFICATION_URL = '{notify}'\nSUSHY_EMULATOR_FAKE_SYSTEMS = [{}]\n",
            list.join(", ")
        ),
    };
    FakeBmc::start(&emulator, &opts).map_err(anyhow::Error::msg)
}

/// One of sushy's fake systems and the machine it stands for.
#[derive(Clone)]
struct FakeSystem {
    n: usize,
    uuid: String,
    name: String,
    mac: String,
}

impl FakeSystem {
    fn new(n: usize) -> FakeSystem {
        FakeSystem {
            n,
            uuid: format!("6b0f6a3e-1d7b-4c1f-9b7e-{n:012x}"),
            name: format!("fleet-{n:02}"),
            mac: format!("52:54:00:79:{:02x}:{:02x}", n >> 8, n & 0xff),
        }
    }

    fn path(&self) -> String {
        format!("/redfish/v1/Systems/{}", self.uuid)
    }

    /// The machine's own `/sys` and `/proc` under `dir` (what the join claims): its DMI identity (the system's
    /// UUID, a serial) and its boot NIC. Without it every simulated machine would claim this host's hardware, and
    /// the control plane rightly refuses a second node for it.
    fn hardware_root(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let root = dir.join(format!("{}-hardware", self.name));
        let dmi = root.join("sys/class/dmi/id");
        let nic = root.join("sys/class/net/eth0");
        std::fs::create_dir_all(&dmi)?;
        std::fs::create_dir_all(nic.join("device"))?;
        std::fs::create_dir_all(root.join("proc/sys/kernel"))?;
        for (file, value) in [
            ("product_uuid", self.uuid.clone()),
            ("product_serial", format!("SIM-{:04}", self.n)),
            ("board_serial", format!("SIM-BOARD-{:04}", self.n)),
            ("sys_vendor", "simulated".into()),
            ("product_name", "fleet".into()),
        ] {
            std::fs::write(dmi.join(file), format!("{value}\n"))?;
        }
        std::fs::write(nic.join("address"), format!("{}\n", self.mac))?;
        std::fs::write(
            root.join("proc/sys/kernel/hostname"),
            format!("{}\n", self.name),
        )?;
        Ok(root)
    }
}

/// A fake system's state as sushy's notifications carry it: (power state, boot device).
type Notice = (String, String);

/// Listens for sushy's external notifications (a PUT of the system's record after each change) and hands each to
/// its machine; returns the URL to give sushy.
async fn notifications(
    machines: HashMap<String, tokio::sync::mpsc::UnboundedSender<Notice>>,
) -> anyhow::Result<String> {
    let machines = Arc::new(machines);
    let app = axum::Router::new().fallback(axum::routing::put(
        move |axum::Json(v): axum::Json<Value>| {
            let machines = machines.clone();
            async move {
                let field = |k: &str, default: &str| v[k].as_str().unwrap_or(default).to_owned();
                if let Some(tx) = v["uuid"].as_str().and_then(|u| machines.get(u)) {
                    let _ = tx.send((field("power_state", "Off"), field("boot_device", "Hdd")));
                }
                ""
            }
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(url)
}

/// The machine behind `s`: boots the simulated ramdisk on each power-on with the PXE override, until `stop`.
async fn simulate(
    s: FakeSystem,
    mut inbox: tokio::sync::mpsc::UnboundedReceiver<Notice>,
    boot_http: String,
    agents: PathBuf,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut on = false;
    let mut boots = 0;
    let mut agent: Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )> = None;
    loop {
        let (power, boot) = tokio::select! {
            n = inbox.recv() => match n {
                Some(n) => n,
                None => break,
            },
            _ = stop.changed() => break,
        };
        let now_on = power == "On";
        if now_on && !on && boot == "Pxe" {
            boots += 1;
            let state = agents.join(format!("{}-{boots}", s.name));
            agent = netboot(&http, &s, &boot_http, &state, &agents).await?;
        }
        if !now_on && let Some((off, task)) = agent.take() {
            let _ = off.send(());
            let _ = task.await;
        }
        on = now_on;
    }
    if let Some((off, task)) = agent.take() {
        let _ = off.send(());
        let _ = task.await;
    }
    Ok(())
}

/// What iPXE does with the site's script for `s`, then the ramdisk's agent with the script's command line.
async fn netboot(
    http: &reqwest::Client,
    s: &FakeSystem,
    boot_http: &str,
    state_dir: &Path,
    hardware: &Path,
) -> anyhow::Result<
    Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )>,
> {
    let r = http
        .get(format!("{boot_http}/boot/{}.ipxe", s.mac))
        .send()
        .await?;
    if !r.status().is_success() {
        // No netboot entry: iPXE gives up and the firmware boots the disk.
        return Ok(None);
    }
    let script = r.text().await?;
    let cmdline = script
        .lines()
        .find_map(|l| l.strip_prefix("kernel "))
        .and_then(|l| l.split_once(' '))
        .map(|(_url, rest)| rest.to_owned())
        .with_context(|| format!("no kernel line in the script for {}:\n{script}", s.mac))?;
    let params = bcd_ramdisk::cmdline::parse(&cmdline)
        .with_context(|| format!("the command line the site gave {}", s.mac))?;
    let token = match &params.boot_token {
        Some(t) => t.0.clone(),
        None => bail!("no bc.boot_token for {}", s.mac),
    };
    std::fs::create_dir_all(state_dir)?;
    let mut config = bcd_ramdisk::agent::config_from_params(&params, state_dir)?;
    config.hardware_root = s.hardware_root(hardware)?;
    let hook = Arc::new(SimulatedRamdisk { mac: s.mac.clone() });
    let (off_tx, off_rx) = tokio::sync::oneshot::channel::<()>();
    let mac = s.mac.clone();
    let task = tokio::spawn(async move {
        let ran = bcd_ramdisk::agent::run(config, &token, hook, |_| {}, async move {
            let _ = off_rx.await;
        })
        .await;
        if let Err(e) = ran {
            eprintln!("simulated ramdisk {mac}: {:#}", anyhow::Error::from(e));
        }
    });
    Ok(Some((off_tx, task)))
}

/// The ramdisk's commands, answered at once from the simulated machine's hardware: 8 CPUs, 64 GiB, one NVMe disk,
/// the boot NIC, no problems; a wipe that erased that disk.
struct SimulatedRamdisk {
    mac: String,
}

impl CommandHook for SimulatedRamdisk {
    fn handles(&self, kind: &str) -> bool {
        bcd_ramdisk::commands::KINDS.contains(&kind)
    }

    fn run(&self, command: &v1::Command, _: &ProgressReporter) -> Result<CommandOutput, String> {
        let (payload_type, v) = match command.kind.as_str() {
            bcd_ramdisk::commands::DIAGNOSE_KIND => (
                bcd_ramdisk::agent::DIAGNOSE_PAYLOAD_TYPE,
                json!({
                    "system": {"vendor": "simulated", "product": "fleet"},
                    "cpu": {"logical_cpus": 8},
                    "memory": {"total_bytes": 64u64 << 30},
                    "pci": [],
                    "disks": [{"name": "nvme0n1", "size_bytes": 1u64 << 40}],
                    "nics": [{"name": "eth0", "mac": self.mac}],
                    "gpus": [],
                    "problems": [],
                }),
            ),
            bcd_ramdisk::commands::WIPE_KIND => (
                bcd_ramdisk::commands::WIPE_PAYLOAD_TYPE,
                json!({
                    "wiped": true,
                    "failed": [],
                    "devices": [{"device": "nvme0n1", "method": "simulated", "wiped": true}],
                    "skipped": [],
                }),
            ),
            other => return Err(format!("{other} is not simulated")),
        };
        Ok(CommandOutput {
            payload_type: payload_type.into(),
            payload: serde_json::to_vec(&v).map_err(|e| e.to_string())?,
        })
    }
}
