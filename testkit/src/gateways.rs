//! The two-gateway lab (issue 14, reused by issue 18): several `better-compute serve` processes on one PostgreSQL —
//! one process with the API (and controllers, scheduler) and N gateway processes — behind a real HAProxy in TCP
//! mode with TLS passthrough (mutual TLS still ends in the gateways). Nodes are told the balancer's URL, so they
//! spread over the gateways; the API process reaches each node's gateway through the tunnel relay (each gateway's
//! own address, published in the store).
//!
//! Every process this starts (the control plane's, HAProxy, and whatever the test adds with [`GatewayLab::spawn`])
//! is a child killed and reaped by its PID when the lab is dropped, even when the test fails. Std only: binaries
//! are given as paths ([`Binaries`]), so a test crate, a benchmark or issue 18's failover lab can all use it.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The binaries the lab runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub better_compute: PathBuf,
    pub bcd: PathBuf,
    pub haproxy: PathBuf,
}

impl Binaries {
    /// `better-compute` and `bcd` from the directory holding `one_of_them` (cargo puts a workspace's binaries side
    /// by side), and HAProxy from the PATH or /usr/sbin. Err names what is missing (HAProxy: Debian's `haproxy`,
    /// installed by scripts/setup).
    pub fn beside(one_of_them: &Path) -> Result<Binaries, String> {
        Binaries::beside_with(one_of_them, true)
    }

    /// [`Binaries::beside`]; HAProxy only when `haproxy` (else its path is empty).
    pub fn beside_with(one_of_them: &Path, haproxy_too: bool) -> Result<Binaries, String> {
        let dir = one_of_them
            .parent()
            .ok_or_else(|| format!("{} has no directory", one_of_them.display()))?;
        let find = |name: &str| -> Result<PathBuf, String> {
            let p = dir.join(name);
            match p.is_file() {
                true => Ok(p),
                false => Err(format!(
                    "{} is not built (cargo build -p {} --bin {name})",
                    p.display(),
                    if name == "bcd" { "bcd" } else { "bc-control" }
                )),
            }
        };
        Ok(Binaries {
            better_compute: find("better-compute")?,
            bcd: find("bcd")?,
            haproxy: match haproxy_too {
                true => haproxy().ok_or(NO_HAPROXY)?,
                false => PathBuf::new(),
            },
        })
    }
}

/// What [`Binaries::beside`] says without HAProxy (a test skips with it).
pub const NO_HAPROXY: &str =
    "haproxy is not installed (Debian's haproxy; scripts/setup installs it)";

/// HAProxy's binary, when installed.
pub fn haproxy() -> Option<PathBuf> {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    candidates
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
}

/// What the lab starts.
#[derive(Debug, Clone)]
pub struct LabSpec {
    /// The database every process shares (migrated, modules included: processes run `serve --no-migrate`).
    pub database_url: String,
    /// Where configurations, the shared state directory (the CA every process uses) and logs go.
    pub dir: PathBuf,
    pub trust_domain: String,
    /// Gateway processes behind the balancer.
    pub gateways: usize,
    /// Roles of the one non-gateway process (it serves the API).
    pub api_roles: String,
    /// Lines appended to every process's configuration (e.g. `shard_lease_ms = 2000`, a `[tunnels]` table last).
    pub extra_config: String,
    /// HAProxy's `maxconn` (global and frontend), per HAProxy process. HAProxy needs about twice as many descriptors
    /// (RLIMIT_NOFILE's hard limit) and refuses to start otherwise.
    pub max_connections: u32,
    /// HAProxy processes, each on every balancer port (SO_REUSEPORT, which HAProxy sets on Linux: the kernel spreads
    /// new connections over them) and each with its own `max_connections`. More than one where a process may not
    /// hold the descriptors all the connections need (two per connection).
    pub balancers: usize,
    /// Ports HAProxy listens on (at least 1; [`GatewayLab::balancer_urls`]). Loopback clients are limited to one
    /// connection per ephemeral port (about 28,000) per destination: 50,000 sessions need two ports or more.
    pub balancer_ports: usize,
    /// Whether HAProxy runs in front of the gateways. Without it (one gateway, the relay alone), nodes are given
    /// the first gateway's own URL.
    pub balancer: bool,
    /// Whether HAProxy sends the PROXY protocol v2 header (`send-proxy-v2`, from [`BALANCER_SOURCES`]) and the
    /// gateways trust it, so that they account each node by its own address rather than the balancer's.
    pub proxy_protocol: bool,
    /// How long one process may take to say it serves.
    pub start_deadline: Duration,
    /// Worker threads of each `serve` process the lab starts (`TOKIO_WORKER_THREADS`); None: the process's default,
    /// one per core. Several processes on a few cores share them with fewer each.
    pub worker_threads: Option<usize>,
    /// Threads of each HAProxy process (`nbthread`); None: HAProxy's default, one per core. Several HAProxy processes
    /// on a few cores share them with fewer each.
    pub balancer_threads: Option<usize>,
}

impl LabSpec {
    pub fn new(database_url: &str, dir: &Path) -> LabSpec {
        LabSpec {
            database_url: database_url.to_string(),
            dir: dir.to_path_buf(),
            trust_domain: "test.bc".into(),
            gateways: 2,
            api_roles: "api,controllers,scheduler".into(),
            extra_config: String::new(),
            max_connections: 4_000,
            balancers: 1,
            balancer_ports: 1,
            balancer: true,
            proxy_protocol: true,
            start_deadline: Duration::from_secs(60),
            worker_threads: None,
            balancer_threads: None,
        }
    }
}

/// Where the lab's HAProxy connects to the gateways from: 127.0.1.(16 k + i) for balancer process k and gateway i,
/// one address per pair (each has its own ~28,000 ephemeral ports), none of them 127.0.0.1, which the API
/// processes' relay and the tests use to reach a gateway directly, without a header.
pub const BALANCER_SOURCES: &str = "127.0.1.0/24";

fn balancer_source(k: usize, i: usize) -> Result<std::net::Ipv4Addr, String> {
    if k >= 16 || i >= 16 {
        return Err(format!(
            "the lab gives balancer processes and gateways an address each in {BALANCER_SOURCES}: at most 16 of \
             each ({} balancers, gateway {i})",
            k + 1
        ));
    }
    Ok(std::net::Ipv4Addr::new(127, 0, 1, (16 * k + i) as u8))
}

/// One gateway process of the lab.
#[derive(Debug, Clone)]
pub struct Gateway {
    /// Its configured id (`gw0`, `gw1`, ...), as session rows and audit rows name it.
    pub id: String,
    /// Where it listens (the balancer forwards here; the relay connects here).
    pub addr: SocketAddr,
    pub pid: u32,
    pub alive: bool,
}

/// A child process, killed (SIGKILL, by its PID) and reaped when dropped.
pub struct Proc {
    pub name: String,
    child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited (reaping it if so).
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, as a service manager stops it, and waits up to `limit` for it to exit: how it exited and how long
    /// it took. Past `limit` it is killed (SIGKILL) and Err says so.
    pub fn terminate(&mut self, limit: Duration) -> Result<(ExitStatus, Duration), String> {
        match crate::terminate(&mut self.child, limit) {
            Ok(crate::Stopped::Exited(status, took)) => Ok((status, took)),
            Ok(crate::Stopped::Killed) => Err(format!(
                "{} did not exit within {:.1} s of SIGTERM; killed",
                self.name,
                limit.as_secs_f64()
            )),
            Err(e) => Err(format!("stopping {} (pid {}): {e}", self.name, self.pid())),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The running lab.
pub struct GatewayLab {
    /// `http://` URL of the API process.
    pub api_url: String,
    /// `https://127.0.0.1:<port>`: the gateway URL nodes are given (the balancer's; without one, the first
    /// gateway's).
    pub balancer_url: String,
    /// Every port of the balancer ([`LabSpec::balancer_ports`]), `balancer_url` first.
    pub balancer_urls: Vec<String>,
    pub gateways: Vec<Gateway>,
    pub ca_pin: String,
    pub join_public_key: String,
    /// The state directory every control-plane process shares (the CA).
    pub state_dir: PathBuf,
    /// The API process's PID.
    pub api_pid: u32,
    /// Every HAProxy process's PID ([`LabSpec::balancers`]).
    pub haproxy_pids: Vec<u32>,
    /// Gateway processes by index in `gateways`, then the API process, HAProxy, and what the test added.
    procs: Vec<Option<Proc>>,
    dir: PathBuf,
    spec: LabSpec,
}

/// A `serve` process started, or why not.
type Started = Result<(Proc, Serving), String>;

/// What a `serve` process printed once it listened.
struct Serving {
    api: Option<SocketAddr>,
    gateway: Option<SocketAddr>,
    ca_pin: String,
    join_key: String,
}

fn parse_serving(line: &str) -> Option<Serving> {
    let rest = line.strip_prefix("serving: ")?;
    let mut s = Serving {
        api: None,
        gateway: None,
        ca_pin: String::new(),
        join_key: String::new(),
    };
    for kv in rest.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        match k {
            "api" => s.api = v.parse().ok(),
            "gateway" => s.gateway = v.parse().ok(),
            "ca_pin" => s.ca_pin = v.to_string(),
            "join_key" => s.join_key = v.to_string(),
            _ => {}
        }
    }
    Some(s)
}

/// [`crate::free_port`], its error as this module's strings.
pub(crate) fn free_port() -> Result<u16, String> {
    crate::free_port().map_err(|e| format!("finding a free loopback port: {e}"))
}

impl GatewayLab {
    /// Starts the API process, then the gateways (they share its state directory and so its CA), then HAProxy in
    /// front of the gateways; returns once every process serves and the balancer accepts connections.
    pub fn start(bins: &Binaries, spec: &LabSpec) -> Result<GatewayLab, String> {
        let state_dir = spec.dir.join("state");
        std::fs::create_dir_all(&state_dir).map_err(|e| format!("{}: {e}", state_dir.display()))?;
        let lb_ports = (0..spec.balancer_ports.max(1))
            .map(|_| free_port())
            .collect::<Result<Vec<u16>, String>>()?;
        let balancer_urls: Vec<String> = lb_ports
            .iter()
            .map(|p| format!("https://127.0.0.1:{p}"))
            .collect();
        let mut lab = GatewayLab {
            api_url: String::new(),
            balancer_url: balancer_urls[0].clone(),
            balancer_urls,
            gateways: Vec::new(),
            ca_pin: String::new(),
            join_public_key: String::new(),
            state_dir: state_dir.clone(),
            api_pid: 0,
            haproxy_pids: Vec::new(),
            procs: Vec::new(),
            dir: spec.dir.clone(),
            spec: spec.clone(),
        };
        let (api_proc, api) = lab.serve(bins, "api", &lab.config("api", &spec.api_roles, None))?;
        lab.api_url = format!(
            "http://{}",
            api.api.ok_or("the API process printed no API address")?
        );
        lab.api_pid = api_proc.pid();
        lab.ca_pin = api.ca_pin;
        lab.join_public_key = api.join_key;
        let mut gateway_procs = Vec::new();
        for i in 0..spec.gateways {
            let id = format!("gw{i}");
            let (p, s) = lab.serve(bins, &id, &lab.config(&id, "gateway", Some((&id, None))))?;
            lab.gateways.push(Gateway {
                id,
                addr: s
                    .gateway
                    .ok_or("a gateway process printed no gateway address")?,
                pid: p.pid(),
                alive: true,
            });
            gateway_procs.push(Some(p));
        }
        lab.procs = gateway_procs;
        lab.procs.push(Some(api_proc));
        if !spec.balancer {
            let first = lab
                .gateways
                .first()
                .ok_or("a lab without a balancer needs a gateway")?;
            lab.balancer_url = format!("https://127.0.0.1:{}", first.addr.port());
            return Ok(lab);
        }
        for k in 0..spec.balancers.max(1) {
            let haproxy = lab.haproxy(bins, &lb_ports, k)?;
            lab.haproxy_pids.push(haproxy.pid());
            lab.procs.push(Some(haproxy));
        }
        Ok(lab)
    }

    /// The configuration of one process: `gateway` names a gateway process's id and, for a restart, its address.
    fn config(
        &self,
        name: &str,
        roles: &str,
        gateway: Option<(&str, Option<SocketAddr>)>,
    ) -> String {
        let spec = &self.spec;
        let (mut id, listen) = match gateway {
            Some((g, at)) => (
                format!("gateway_id = {g:?}\n"),
                at.map_or("127.0.0.1:0".to_string(), |a| a.to_string()),
            ),
            None => (String::new(), "127.0.0.1:0".to_string()),
        };
        if gateway.is_some() && spec.balancer && spec.proxy_protocol {
            id.push_str(&format!(
                "gateway_proxy_protocol_from = [{BALANCER_SOURCES:?}]\n"
            ));
        }
        format!(
            "state_dir = {:?}\ndatabase_url = {:?}\ntrust_domain = {:?}\nroles = {roles:?}\n\
             api_listen = \"127.0.0.1:0\"\ngateway_listen = {listen:?}\n\
             gateway_hosts = [\"localhost\", \"127.0.0.1\"]\ngateway_url = {:?}\n{id}\
             # {name}\n{}\n",
            self.state_dir,
            spec.database_url,
            spec.trust_domain,
            self.balancer_url,
            spec.extra_config
        )
    }

    /// Runs one `better-compute serve` with `config`; waits for its `serving:` line.
    fn serve(&self, bins: &Binaries, name: &str, config: &str) -> Result<(Proc, Serving), String> {
        let spec = &self.spec;
        let path = self.dir.join(format!("{name}.toml"));
        std::fs::write(&path, config).map_err(|e| format!("{}: {e}", path.display()))?;
        let log = self.log(name)?;
        let mut cmd = Command::new(&bins.better_compute);
        cmd.args(["serve", "--no-migrate", "--config"])
            .arg(&path)
            .env(
                "BC_LOG",
                std::env::var("BC_LAB_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(Stdio::piped())
            .stderr(log);
        if let Some(n) = spec.worker_threads {
            cmd.env("TOKIO_WORKER_THREADS", n.max(1).to_string());
        }
        let mut proc = spawn(name, &mut cmd)?;
        let stdout = proc.child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = mpsc::channel();
        // Reads the serving line, then keeps draining stdout so the process never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent && let Some(s) = parse_serving(&line) {
                    let _ = tx.send(s);
                    sent = true;
                }
            }
        });
        match rx.recv_timeout(spec.start_deadline) {
            Ok(s) => Ok((proc, s)),
            Err(_) => {
                let exited = proc.exited();
                Err(format!(
                    "{name} did not say it serves within {} s (exited: {exited}); the end of its log:\n{}",
                    spec.start_deadline.as_secs(),
                    crate::log_tail(&self.dir.join(format!("{name}.log")), 20)
                ))
            }
        }
    }

    /// HAProxy in TCP mode (TLS passthrough) on `ports`, least connections first (sessions are long-lived: new ones
    /// go where fewest are held) over the gateways; with [`LabSpec::proxy_protocol`], each connection to a gateway
    /// from [`balancer_source`] with a PROXY protocol v2 header naming the node. Health checks at HAProxy's default
    /// timings (every 2 s, down after 3 failures), every 500 ms once one failed or while a gateway is down (an
    /// earlier setting, every 500 ms and down after 2, marked all three gateways of a 50,000-session storm down
    /// while they were busy). `k`: which of [`LabSpec::balancers`] this is (`haproxy-<k>.log` past the first); it
    /// serves once `k + 1` sockets listen on every port.
    fn haproxy(&self, bins: &Binaries, ports: &[u16], k: usize) -> Result<Proc, String> {
        let spec = &self.spec;
        // No `on-marked-down shutdown-sessions`: a killed gateway's connections end with it (its kernel closes them,
        // HAProxy passes that on), and a hung one's end by the nodes' HTTP/2 keep-alive. What the option did end were
        // a busy gateway's healthy sessions: in a 50,000-session storm a gateway's accept queue was full, HAProxy's
        // check timed out ("Layer4 timeout, check duration 2010 ms"), and ~2,000 sessions per HAProxy process were
        // cut and joined the storm (`scripts/bench sessions` over 3 gateways, 2026-12-04).
        let mut servers = String::new();
        for (i, g) in self.gateways.iter().enumerate() {
            let proxy = if spec.proxy_protocol {
                format!(" source {} send-proxy-v2", balancer_source(k, i)?)
            } else {
                String::new()
            };
            servers.push_str(&format!(
                "    server {} {}{proxy} check inter 2s fastinter 500ms downinter 500ms fall 3 rise 2\n",
                g.id, g.addr
            ));
        }
        let binds: String = ports
            .iter()
            .map(|p| format!("    bind 127.0.0.1:{p}\n"))
            .collect();
        let threads = spec
            .balancer_threads
            .map_or(String::new(), |n| format!("    nbthread {n}\n"));
        let cfg = format!(
            "global\n    maxconn {max}\n{threads}    log stdout format raw local0\n\ndefaults\n    mode tcp\n    log global\n    \
             option tcplog\n    option redispatch\n    timeout connect 5s\n    \
             timeout client 2h\n    timeout server 2h\n\nfrontend gateways\n{binds}    maxconn {max}\n    \
             default_backend gateways\n\nbackend gateways\n    balance leastconn\n{servers}",
            max = spec.max_connections
        );
        let path = self.dir.join("haproxy.cfg");
        std::fs::write(&path, cfg).map_err(|e| format!("{}: {e}", path.display()))?;
        let check = Command::new(&bins.haproxy)
            .args(["-c", "-q", "-f"])
            .arg(&path)
            .output()
            .map_err(|e| format!("running haproxy -c: {e}"))?;
        if !check.status.success() {
            return Err(format!(
                "haproxy refused {}: {}",
                path.display(),
                String::from_utf8_lossy(&check.stderr)
            ));
        }
        let name = match k {
            0 => "haproxy".to_string(),
            k => format!("haproxy-{k}"),
        };
        let log = self.log(&name)?;
        // Its log: one line per connection when it ends, with HAProxy's termination state (`option tcplog`: who
        // closed it and in which phase, e.g. `SD`, the server's side broke during the data phase).
        let stdout = log.try_clone().map_err(|e| format!("{name}.log: {e}"))?;
        let mut cmd = Command::new(&bins.haproxy);
        cmd.args(["-db", "-f"])
            .arg(&path)
            .stdout(stdout)
            .stderr(log);
        let mut proc = spawn(&name, &mut cmd)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        for &port in ports {
            while listeners(port) <= k || std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
            {
                if proc.exited() || Instant::now() > deadline {
                    let log = std::fs::read_to_string(self.dir.join(format!("{name}.log")))
                        .unwrap_or_default();
                    return Err(format!(
                        "haproxy does not accept on 127.0.0.1:{port}; its log:\n{}",
                        log.trim()
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(proc)
    }

    fn log(&self, name: &str) -> Result<std::fs::File, String> {
        let path = self.dir.join(format!("{name}.log"));
        std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Kills gateway `i` with SIGKILL (a crash: no goodbye to its nodes or to the database).
    pub fn kill_gateway(&mut self, i: usize) {
        if let Some(Some(p)) = self.procs.get_mut(i) {
            p.kill();
        }
        if let Some(g) = self.gateways.get_mut(i) {
            g.alive = false;
        }
    }

    /// Stops gateway `i` as a service manager does (SIGTERM: it closes its sessions, then its calls in flight) and
    /// waits up to `limit` for it to exit: how it exited and how long it took. Past `limit` it is killed and Err
    /// says so. [`GatewayLab::restart_gateway`] starts it again.
    pub fn stop_gateway(
        &mut self,
        i: usize,
        limit: Duration,
    ) -> Result<(ExitStatus, Duration), String> {
        let stopped = match self.procs.get_mut(i) {
            Some(Some(p)) => p.terminate(limit),
            _ => Err(format!("gateway {i} is not running")),
        };
        if let Some(g) = self.gateways.get_mut(i) {
            g.alive = false;
        }
        stopped
    }

    /// Starts gateway `i` again (after [`GatewayLab::kill_gateway`] or [`GatewayLab::stop_gateway`]) on the
    /// address it had, so the balancer's configuration still names it; returns once it serves.
    pub fn restart_gateway(&mut self, bins: &Binaries, i: usize) -> Result<(), String> {
        self.restart_gateways(bins, &[i])
    }

    /// Starts gateways `which` again at once (after [`GatewayLab::kill_gateway`]), each on the address it had, as
    /// machines restarted independently would; returns once every one serves.
    pub fn restart_gateways(&mut self, bins: &Binaries, which: &[usize]) -> Result<(), String> {
        let mut todo = Vec::new();
        for &i in which {
            let g = self
                .gateways
                .get(i)
                .cloned()
                .ok_or_else(|| format!("no gateway {i}"))?;
            if g.alive {
                return Err(format!("gateway {} is running: kill it first", g.id));
            }
            let config = self.config(&g.id, "gateway", Some((&g.id, Some(g.addr))));
            // Each start its own log: `gw0-restarted.log`, then `gw0-restarted-2.log`, …
            let mut name = format!("{}-restarted", g.id);
            for k in 2.. {
                if !self.dir.join(format!("{name}.log")).exists() {
                    break;
                }
                name = format!("{}-restarted-{k}", g.id);
            }
            todo.push((i, name, config));
        }
        let lab = &*self;
        let started: Vec<(usize, Started)> = std::thread::scope(|s| {
            let handles: Vec<_> = todo
                .iter()
                .map(|(i, name, config)| (*i, s.spawn(move || lab.serve(bins, name, config))))
                .collect();
            handles
                .into_iter()
                .map(|(i, h)| {
                    (
                        i,
                        h.join()
                            .unwrap_or_else(|_| Err("a restart thread panicked".into())),
                    )
                })
                .collect()
        });
        let mut failed = Vec::new();
        for (i, r) in started {
            match r {
                Ok((p, _)) => {
                    self.gateways[i].pid = p.pid();
                    self.gateways[i].alive = true;
                    self.procs[i] = Some(p);
                }
                Err(e) => failed.push(e),
            }
        }
        match failed.is_empty() {
            true => Ok(()),
            false => Err(failed.join("\n")),
        }
    }

    /// Starts a process the lab owns (a `bcd run`, a load tool): killed by its PID with the lab. Returns its PID.
    pub fn spawn(&mut self, name: &str, cmd: &mut Command) -> Result<u32, String> {
        let p = spawn(name, cmd)?;
        let pid = p.pid();
        self.procs.push(Some(p));
        Ok(pid)
    }

    /// Kills (SIGKILL) and reaps the lab's process `pid`.
    pub fn kill(&mut self, pid: u32) {
        for slot in &mut self.procs {
            if slot.as_ref().is_some_and(|p| p.pid() == pid)
                && let Some(mut p) = slot.take()
            {
                p.kill();
            }
        }
    }

    /// Whether the lab's process `pid` still runs.
    pub fn running(&mut self, pid: u32) -> bool {
        self.procs
            .iter_mut()
            .flatten()
            .find(|p| p.pid() == pid)
            .is_some_and(|p| !p.exited())
    }

    /// Where the lab writes logs (`<name>.log` per process).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Sockets listening on 127.0.0.1:`port` (`/proc/net/tcp`, state 0A), of any process.
fn listeners(port: u16) -> usize {
    let local = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let mut f = l.split_whitespace().skip(1);
            f.next() == Some(local.as_str()) && f.nth(1) == Some("0A")
        })
        .count()
}

fn spawn(name: &str, cmd: &mut Command) -> Result<Proc, String> {
    let child = cmd
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {name} ({:?}): {e}", cmd.get_program()))?;
    Ok(Proc {
        name: name.to_string(),
        child,
    })
}

/// A loopback port where nothing listens, and where no test of this machine will start to listen while it runs: one
/// below the kernel's ephemeral range (`ip_local_port_range`), from which every `bind(…:0)` takes its port. A port
/// bound and released from that range ([`crate::free_port`]) is soon handed to another test's listener: a tunnel test's
/// "refused dial" once reached another test's echo server that way (scripts/test, 2026-12-03).
pub fn dead_port() -> Result<u16, String> {
    let range =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let low: u16 = range
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32768);
    // Start somewhere that depends on the process, so tests rarely probe the same ports; any of them would do.
    let span = low.saturating_sub(10_000).max(1);
    let start = 10_000 + (std::process::id() % u32::from(span)) as u16;
    (0..span)
        .map(|i| 10_000 + (start - 10_000 + i) % span)
        .find(|&port| TcpListener::bind(("127.0.0.1", port)).is_ok())
        .ok_or_else(|| format!("no free loopback port in 10000..{low}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serving_line_is_read_and_anything_else_is_not() {
        let s =
            parse_serving("serving: api=127.0.0.1:7080 gateway=- ca_pin=sha256:ab join_key=bcjk_x");
        let s = s.expect("a serving line");
        assert_eq!(s.api, Some(SocketAddr::from(([127, 0, 0, 1], 7080))));
        assert_eq!(s.gateway, None);
        assert_eq!(
            (s.ca_pin.as_str(), s.join_key.as_str()),
            ("sha256:ab", "bcjk_x")
        );
        assert!(parse_serving("starting").is_none());
    }

    #[test]
    fn listeners_counts_the_sockets_listening_on_a_loopback_port() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        assert_eq!(listeners(port), 1);
        // A connected socket on the port is not a listener.
        let _c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        assert_eq!(listeners(port), 1);
        drop(l);
        assert_eq!(listeners(port), 0);
    }
}
