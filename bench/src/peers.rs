//! The peers and the network of `scripts/bench tunnel`: OpenSSH's `sshd` on a generated host key with key
//! authentication, all in the bench's own folder (Debian's openssh-server), the `ssh -N -L` forward through it,
//! and a network namespace joined to this one by a link that delays and rate-limits both ways (netem on a veth
//! pair, or the [`crate::delay`] line where the kernel lacks netem). Every process is a child killed by its PID;
//! the namespace and the link are deleted by name (they carry the bench's PID) when dropped.

use crate::delay::{DelayLine, Shape, open_tun};
use anyhow::{Context as _, bail};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed (SIGKILL, by its PID) and reaped when dropped.
pub struct Kill(pub Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Waits until `addr` accepts a TCP connection (from the namespace `netns` when given).
pub fn wait_listening(addr: SocketAddr, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on {addr} after {} s", within.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// sshd on `listen`, its keys and configuration in `dir`; `prefix` runs it (e.g. `ip netns exec <ns>`).
pub struct Sshd {
    _child: Kill,
    pub listen: SocketAddr,
    /// The client's private key.
    pub identity: PathBuf,
}

impl Sshd {
    pub fn start(dir: &Path, listen: SocketAddr, prefix: &[&str]) -> anyhow::Result<Sshd> {
        let sshd = ["/usr/sbin/sshd", "/usr/bin/sshd"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .context(
                "sshd is not installed (Debian's openssh-server; scripts/setup installs it)",
            )?;
        std::fs::create_dir_all(dir)?;
        let (host, user) = (dir.join("host_ed25519"), dir.join("user_ed25519"));
        for key in [&host, &user] {
            if !key.exists() {
                run(Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                    .arg(key))?;
            }
        }
        let authorized = dir.join("authorized_keys");
        std::fs::copy(user.with_extension("pub"), &authorized)?;
        // Debian's sshd needs its privilege separation directory, even for one connection on loopback.
        std::fs::create_dir_all("/run/sshd")?;
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "ListenAddress {listen}\nHostKey {}\nAuthorizedKeysFile {}\nPidFile {}\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n\
                 AllowTcpForwarding yes\nLogLevel ERROR\n",
                host.display(),
                authorized.display(),
                dir.join("sshd.pid").display()
            ),
        )?;
        let (program, args) = match prefix.split_first() {
            Some((p, rest)) => (PathBuf::from(p), rest.to_vec()),
            None => (sshd.clone(), Vec::new()),
        };
        let mut cmd = Command::new(program);
        cmd.args(args);
        if !prefix.is_empty() {
            cmd.arg(&sshd);
        }
        let child = cmd
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("sshd.log"))?)
            .spawn()
            .context("starting sshd")?;
        let child = Kill(child);
        wait_listening(listen, Duration::from_secs(10))?;
        Ok(Sshd {
            _child: child,
            listen,
            identity: user,
        })
    }

    /// `ssh -N -L <local>:<target>` through this sshd, as root; returns once `local` accepts.
    pub fn forward(&self, local: SocketAddr, target: SocketAddr) -> anyhow::Result<Kill> {
        let child = Command::new("ssh")
            .args([
                "-N",
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
            ])
            .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"])
            .args(["-o", "ExitOnForwardFailure=yes", "-i"])
            .arg(&self.identity)
            .args(["-p", &self.listen.port().to_string()])
            .arg("-L")
            .arg(format!("{local}:{target}"))
            .arg(format!("root@{}", self.listen.ip()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting ssh -L")?;
        let child = Kill(child);
        wait_listening(local, Duration::from_secs(15))?;
        Ok(child)
    }
}

/// A network namespace `bctun<pid>` joined to this one by a link whose two ends are `bt<pid>a` (here, `.1`) and
/// `bt<pid>b` (there, `.2`), on a /30 of 10.0.0.0/8 chosen by the PID (two benches side by side do not collide),
/// each direction delayed by half the RTT and limited to the rate. The link is a veth pair shaped by netem where
/// the kernel has `sch_netem`; where it does not (this project's VMs: a Firecracker kernel without modules), two
/// TUN devices joined by this process's [`DelayLine`], which applies the same model.
pub struct Wan {
    pub name: String,
    veth: Option<String>,
    pub here: std::net::Ipv4Addr,
    pub there: std::net::Ipv4Addr,
    /// How the link is shaped, for the bench's output.
    pub shaper: String,
    /// The user-space line, when netem is missing; its counters say what it carried.
    pub line: Option<DelayLine>,
}

/// The TUN devices' MTU when the delay line shapes the link (BC_WAN_MTU overrides it): jumbo frames keep the line's
/// two system calls per packet to about 14,000 packets a second at 1 Gbit/s.
const LINE_MTU: u32 = 9000;

/// The namespace's TCP send buffers: min, default, max.
pub const WAN_WMEM: &str = "net.ipv4.tcp_wmem=4096 16384 33554432";

impl Wan {
    pub fn create(rtt: Duration, rate_bps: u64) -> anyhow::Result<Wan> {
        let pid = std::process::id();
        let (b, c) = (200 + (pid % 50) as u8, ((pid / 50) % 256) as u8);
        let mut wan = Wan {
            name: format!("bctun{pid}"),
            veth: None,
            here: std::net::Ipv4Addr::new(10, b, c, 1),
            there: std::net::Ipv4Addr::new(10, b, c, 2),
            shaper: String::new(),
            line: None,
        };
        let (near, far) = (format!("bt{pid}a"), format!("bt{pid}b"));
        let delay = format!("{}us", rtt.as_micros() / 2);
        run(Command::new("ip").args(["netns", "add", &wan.name]))?;
        let ns = |args: &[&str]| -> anyhow::Result<()> {
            run(Command::new("ip")
                .args(["netns", "exec", &wan.name])
                .args(args))
        };
        ns(&["ip", "link", "set", "lo", "up"])?;
        // The far end sends every transfer. Linux's default send buffer (at most 4 MiB) would hold every sender
        // there, the peers and the tunnel alike, to about 420 Mbit/s at 50 ms; 32 MiB covers the link's 6.25 MB
        // bandwidth-delay product, so raw TCP can fill it and the windows under test decide.
        ns(&["sysctl", "-qw", WAN_WMEM])?;
        run(Command::new("ip").args([
            "link", "add", &near, "type", "veth", "peer", "name", &far, "netns", &wan.name,
        ]))?;
        wan.veth = Some(near.clone());
        // A queue that holds a bandwidth-delay product at line rate (1 Gbit/s × 25 ms ≈ 2,100 full frames).
        let rate = format!("{rate_bps}bit");
        let netem = [
            "root", "netem", "delay", &delay, "rate", &rate, "limit", "100000",
        ];
        match run(Command::new("tc")
            .args(["qdisc", "add", "dev", &near])
            .args(netem))
        {
            Ok(()) => {
                ns(&[&["tc", "qdisc", "add", "dev", &far][..], &netem[..]].concat())?;
                wan.shaper = format!("netem delay {delay} rate {rate} on both veth ends");
                let (here, there) = (format!("{}/30", wan.here), format!("{}/30", wan.there));
                run(Command::new("ip").args(["addr", "add", &here, "dev", &near]))?;
                run(Command::new("ip").args(["link", "set", &near, "up"]))?;
                ns(&["ip", "addr", "add", &there, "dev", &far])?;
                ns(&["ip", "link", "set", &far, "up"])?;
                return Ok(wan);
            }
            Err(e) if format!("{e:#}").contains("qdisc kind is unknown") => {}
            Err(e) => return Err(e),
        }
        run(Command::new("ip").args(["link", "del", &near]))?;
        wan.veth = None;
        let mtu = crate::knob("BC_WAN_MTU", LINE_MTU, 1280)?.to_string();
        let (a, b) = (open_tun(&near)?, open_tun(&far)?);
        run(Command::new("ip").args(["link", "set", &far, "netns", &wan.name]))?;
        let (here, there) = (wan.here.to_string(), wan.there.to_string());
        run(Command::new("ip").args(["addr", "add", &here, "peer", &there, "dev", &near]))?;
        run(Command::new("ip").args(["link", "set", &near, "mtu", &mtu, "up"]))?;
        ns(&["ip", "addr", "add", &there, "peer", &here, "dev", &far])?;
        ns(&["ip", "link", "set", &far, "mtu", &mtu, "up"])?;
        let shape = Shape {
            delay: rtt / 2,
            rate_bps,
            limit: 100_000,
        };
        wan.line = Some(DelayLine::start(a, b, shape)?);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        wan.shaper = format!(
            "this kernel ({}) has no sch_netem: a user-space delay line between two TUN devices (MTU {mtu}), \
             delay {delay} and {rate} each way",
            kernel.trim()
        );
        Ok(wan)
    }

    /// `ip netns exec <name>`: the prefix that runs a command there.
    pub fn prefix(&self) -> Vec<String> {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            self.name.clone(),
        ]
    }
}

impl Drop for Wan {
    fn drop(&mut self) {
        // The line's devices go with its descriptors.
        self.line = None;
        if let Some(veth) = &self.veth {
            let _ = Command::new("ip")
                .args(["link", "del", veth])
                .stderr(Stdio::null())
                .status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}
