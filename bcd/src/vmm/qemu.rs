//! The QEMU backend of [`Vmm`]. Each VM is its own daemonized QEMU process (`-daemonize`, a pidfile and a QMP
//! socket under the VMM's state directory, the serial console appended to a file), so it outlives bcd; every
//! operation reconnects to its QMP socket (the `qapi` crate's typed commands: `query-status`, `system_powerdown`,
//! `system_reset`, `quit`), which is all a restarted bcd needs to re-adopt it. A pidfile is believed only while
//! `/proc/<pid>/cmdline` still names that VM's QMP socket (a reused PID is not ours).
//!
//! Per instance, under `<state_dir>/instances/<id>/`: `disk.qcow2` (overlay on the verified image), `seed.img`
//! (NoCloud `cidata`), `console.log`(`.1`), `qemu.pid`, `vfio.json` (the GPU groups bound for it, given back when
//! the VM exits, by this process or a restarted one), `instance.json` (the supervisor's record). The QMP socket is
//! `<state_dir>/qmp/<hash>.sock` (short enough for a Unix socket address).
//!
//! QEMU runs with `-sandbox on,obsolete=deny,resourcecontrol=deny` (seccomp; `spawn=deny` and
//! `elevateprivileges=deny` are incompatible with `-daemonize` in QEMU 7.2) and `-no-user-config -nodefaults`.

use crate::vmm::config::{DiskBus, Network, VmmConfig};
use crate::vmm::vfio::{self, PciSysfs};
use crate::vmm::{
    Accel, InstanceSpec, StopOutcome, VmStatus, Vmm, VmmError, console, instance_dir, qmp_socket,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long QEMU may take to daemonize (open its files, bind its socket).
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Any one QMP exchange (connect, negotiate, command).
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// After `quit`, how long before SIGKILL.
const QUIT_GRACE: Duration = Duration::from_secs(5);

pub const DISK: &str = "disk.qcow2";
pub const SEED: &str = "seed.img";
pub const PIDFILE: &str = "qemu.pid";
pub const VFIO_FILE: &str = "vfio.json";

pub struct Qemu {
    cfg: VmmConfig,
    accel: Accel,
    pci: Arc<dyn PciSysfs>,
}

fn io_err(id: &str, what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VmmError {
    let (id, path) = (id.to_string(), path.to_path_buf());
    move |source| VmmError::Io {
        id,
        what,
        path,
        source,
    }
}

impl Qemu {
    /// A backend for `cfg` with accelerator `accel` (see [`crate::vmm::accel::choose`]) and the PCI bus `pci`.
    pub fn new(cfg: VmmConfig, accel: Accel, pci: Arc<dyn PciSysfs>) -> Qemu {
        Qemu { cfg, accel, pci }
    }

    pub fn config(&self) -> &VmmConfig {
        &self.cfg
    }

    fn dir(&self, id: &str) -> PathBuf {
        instance_dir(&self.cfg.state_dir, id)
    }

    fn socket(&self, id: &str) -> PathBuf {
        qmp_socket(&self.cfg.state_dir, id)
    }

    /// QEMU's command line for `spec` with `passthrough` devices (pure but for the paths it names).
    pub fn args(&self, spec: &InstanceSpec, passthrough: &[String]) -> Vec<String> {
        let dir = self.dir(&spec.id);
        let p = |name: &str| dir.join(name).display().to_string();
        let mut a: Vec<String> = Vec::new();
        let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
        push(&["-name", &format!("guest={},debug-threads=on", spec.id)]);
        push(&[
            "-machine",
            "q35,graphics=off",
            "-accel",
            self.accel.as_str(),
        ]);
        if let Some(cpu) = self.accel.cpu() {
            push(&["-cpu", cpu]);
        }
        push(&[
            "-smp",
            &spec.vcpus.to_string(),
            "-m",
            &format!("{}M", spec.memory_mib),
        ]);
        push(&["-nodefaults", "-no-user-config", "-display", "none"]);
        push(&["-sandbox", "on,obsolete=deny,resourcecontrol=deny"]);
        push(&["-daemonize", "-pidfile", &p(PIDFILE)]);
        push(&[
            "-qmp",
            &format!(
                "unix:{},server=on,wait=off",
                self.socket(&spec.id).display()
            ),
        ]);
        push(&[
            "-chardev",
            &format!("file,id=console,path={},append=on", p(console::FILE)),
            "-serial",
            "chardev:console",
        ]);
        push(&[
            "-drive",
            &format!(
                "file={},if=none,id=disk0,format=qcow2,discard=unmap",
                p(DISK)
            ),
            "-drive",
            &format!("file={},if=none,id=seed0,format=raw,readonly=on", p(SEED)),
        ]);
        match self.cfg.disk_bus {
            DiskBus::Nvme => push(&[
                "-device",
                "nvme,serial=bc-disk0,drive=disk0,bootindex=0",
                "-device",
                "nvme,serial=bc-seed0,drive=seed0",
            ]),
            DiskBus::Virtio => push(&[
                "-device",
                "virtio-blk-pci,drive=disk0,bootindex=0",
                "-device",
                "virtio-blk-pci,drive=seed0",
            ]),
        }
        match &self.cfg.network {
            Network::User => push(&["-netdev", "user,id=net0"]),
            Network::Bridge(_) => push(&[
                "-netdev",
                &format!(
                    "tap,id=net0,ifname={},script=no,downscript=no",
                    crate::vmm::tap_name(&spec.id)
                ),
            ]),
        }
        push(&[
            "-device",
            &format!(
                // romfile= empty: no iPXE option ROM (instances boot from their disk; its banner costs ≈ 2 s).
                "virtio-net-pci,netdev=net0,mac={},romfile=",
                crate::vmm::mac_address(&spec.id)
            ),
        ]);
        for addr in passthrough {
            push(&["-device", &format!("vfio-pci,host={addr}")]);
        }
        a
    }

    /// The PID of this instance's QEMU if it runs: the pidfile, checked against the process's command line.
    pub fn live_pid(&self, id: &str) -> Option<u32> {
        let text = std::fs::read_to_string(self.dir(id).join(PIDFILE)).ok()?;
        let pid: u32 = text.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let socket = self.socket(id).display().to_string();
        let ours = cmdline
            .split(|b| *b == 0)
            .any(|arg| String::from_utf8_lossy(arg).contains(&socket));
        ours.then_some(pid)
    }

    /// Runs one QMP command on a fresh connection (every exchange bounded by [`QMP_TIMEOUT`]).
    async fn qmp<C>(&self, id: &str, what: &'static str, command: C) -> Result<C::Ok, VmmError>
    where
        C: qapi::qmp::QmpCommand + Send + 'static,
        C::Ok: Send,
    {
        let err = |message: String| VmmError::Qmp {
            id: id.to_string(),
            what,
            message,
        };
        let socket = self.socket(id);
        let exchange = async {
            let stream = qapi::futures::QmpStreamTokio::open_uds(&socket)
                .await
                .map_err(|e| err(format!("connecting to {}: {e}", socket.display())))?;
            let stream = stream
                .negotiate()
                .await
                .map_err(|e| err(format!("negotiating: {e}")))?;
            let (service, events) = stream.spawn_tokio();
            let result = service.execute(command).await;
            drop(service);
            let _ = events.await;
            result.map_err(|e| err(e.to_string()))
        };
        tokio::time::timeout(QMP_TIMEOUT, exchange)
            .await
            .map_err(|_| err(format!("no answer within {} s", QMP_TIMEOUT.as_secs())))?
    }

    /// Waits until the process is gone or `deadline` passes; true when gone.
    async fn wait_gone(&self, id: &str, deadline: Duration) -> bool {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            if self.live_pid(id).is_none() {
                return true;
            }
            if tokio::time::Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// What a VM leaves behind once its process is gone: the GPU groups go back to their drivers, the tap is
    /// deleted, pidfile and socket removed. Idempotent; run whenever a VM is seen stopped.
    fn after_exit(&self, id: &str) {
        let dir = self.dir(id);
        let vfio_path = dir.join(VFIO_FILE);
        if let Ok(text) = std::fs::read_to_string(&vfio_path) {
            match serde_json::from_str::<vfio::Binding>(&text) {
                Ok(binding) => {
                    let left = vfio::release(self.pci.as_ref(), &binding);
                    if left.is_empty() {
                        let _ = std::fs::remove_file(&vfio_path);
                        tracing::info!(instance = id, devices = ?binding.passthrough(), "GPU groups given back to their drivers");
                    }
                }
                Err(e) => {
                    tracing::error!(instance = id, path = %vfio_path.display(), error = %e, "unreadable VFIO record; devices may still be bound to vfio-pci");
                }
            }
        }
        if let Network::Bridge(_) = &self.cfg.network {
            let tap = crate::vmm::tap_name(id);
            if Path::new("/sys/class/net").join(&tap).exists() {
                let _ = ip(&["link", "del", &tap]);
            }
        }
        let _ = std::fs::remove_file(dir.join(PIDFILE));
        let _ = std::fs::remove_file(self.socket(id));
    }

    fn kill(&self, id: &str) {
        if let Some(pid) = self.live_pid(id)
            && let Some(pid) = i32::try_from(pid)
                .ok()
                .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }

    /// Creates the tap for a bridged VM and enslaves it (a leftover of a crashed run is reused).
    fn setup_tap(&self, id: &str) -> Result<(), VmmError> {
        let Network::Bridge(bridge) = &self.cfg.network else {
            return Ok(());
        };
        let tap = crate::vmm::tap_name(id);
        let net = |message: String| VmmError::Network {
            id: id.to_string(),
            message,
        };
        if !Path::new("/sys/class/net").join(bridge).exists() {
            return Err(net(format!(
                "bridge {bridge} does not exist: the node's network setup must create it ([vmm.network] bridge)"
            )));
        }
        if !Path::new("/sys/class/net").join(&tap).exists() {
            ip(&["tuntap", "add", "dev", &tap, "mode", "tap"]).map_err(net)?;
        }
        ip(&["link", "set", &tap, "master", bridge]).map_err(net)?;
        ip(&["link", "set", &tap, "up"]).map_err(net)?;
        Ok(())
    }
}

/// Runs `ip` with `args`; the error is its stderr.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Vmm for Qemu {
    fn accel(&self) -> Accel {
        self.accel
    }

    async fn create(&self, spec: &InstanceSpec, image: &Path) -> Result<(), VmmError> {
        let id = &spec.id;
        let dir = self.dir(id);
        std::fs::create_dir_all(&dir).map_err(io_err(id, "creating", &dir))?;
        let disk = dir.join(DISK);
        if !disk.exists() {
            let bytes = spec.disk_gib << 30;
            crate::vmm::image::make_overlay(&self.cfg.qemu_img, image, &disk, bytes)
                .await
                .map_err(|message| VmmError::Disk {
                    id: id.clone(),
                    message,
                })?;
        }
        let seed_path = dir.join(SEED);
        if !seed_path.exists() {
            let seed = crate::vmm::seed::render(spec);
            let path = seed_path.clone();
            tokio::task::spawn_blocking(move || crate::vmm::seed::build(&seed, &path))
                .await
                .map_err(|e| VmmError::Launch {
                    id: id.clone(),
                    message: format!("seed task: {e}"),
                })?
                .map_err(|source| VmmError::Seed {
                    id: id.clone(),
                    source,
                })?;
        }
        Ok(())
    }

    async fn start(&self, spec: &InstanceSpec, passthrough: &[String]) -> Result<u32, VmmError> {
        let id = &spec.id;
        if let Some(pid) = self.live_pid(id) {
            return Ok(pid);
        }
        self.after_exit(id);
        let dir = self.dir(id);
        let socket = self.socket(id);
        if let Some(parent) = socket.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(id, "creating", parent))?;
        }
        let log = dir.join(console::FILE);
        let _ = console::rotate_if_over(&log, self.cfg.console_max_bytes);
        console::mark_start(&log).map_err(io_err(id, "writing", &log))?;
        let devices = if passthrough.is_empty() {
            Vec::new()
        } else {
            let binding =
                vfio::bind(self.pci.as_ref(), passthrough).map_err(|source| VmmError::Vfio {
                    id: id.clone(),
                    source,
                })?;
            let path = dir.join(VFIO_FILE);
            let json = serde_json::to_vec(&binding).unwrap_or_default();
            if let Err(e) = std::fs::write(&path, json) {
                vfio::release(self.pci.as_ref(), &binding);
                return Err(io_err(id, "writing", &path)(e));
            }
            binding.passthrough()
        };
        let launched = async {
            self.setup_tap(id)?;
            let mut cmd = tokio::process::Command::new(&self.cfg.qemu);
            cmd.args(self.args(spec, &devices))
                .current_dir(&dir)
                .stdin(std::process::Stdio::null())
                .kill_on_drop(true);
            let out = tokio::time::timeout(LAUNCH_TIMEOUT, cmd.output())
                .await
                .map_err(|_| VmmError::Launch {
                    id: id.clone(),
                    message: format!(
                        "QEMU did not daemonize within {} s",
                        LAUNCH_TIMEOUT.as_secs()
                    ),
                })?
                .map_err(|e| VmmError::Launch {
                    id: id.clone(),
                    message: format!("running {}: {e}", self.cfg.qemu.display()),
                })?;
            if !out.status.success() {
                let stderr = String::from_utf8_lossy(&out.stderr);
                let tail: String = stderr
                    .trim()
                    .chars()
                    .rev()
                    .take(2000)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                return Err(VmmError::Launch {
                    id: id.clone(),
                    message: format!("{} ({})", tail, out.status),
                });
            }
            let pid = self.live_pid(id).ok_or_else(|| VmmError::Launch {
                id: id.clone(),
                message: "QEMU daemonized but its pidfile names no running QEMU".into(),
            })?;
            self.qmp(id, "query-status", qapi::qmp::query_status {})
                .await?;
            Ok(pid)
        };
        match launched.await {
            Ok(pid) => Ok(pid),
            Err(e) => {
                self.kill(id);
                self.after_exit(id);
                Err(e)
            }
        }
    }

    async fn stop(&self, id: &str, deadline: Duration) -> Result<StopOutcome, VmmError> {
        if self.live_pid(id).is_none() {
            self.after_exit(id);
            return Ok(StopOutcome::NotRunning);
        }
        let asked = self
            .qmp(id, "system_powerdown", qapi::qmp::system_powerdown {})
            .await;
        if let Err(e) = &asked {
            tracing::warn!(instance = id, error = %e, "graceful stop not asked; forcing");
        }
        if asked.is_ok() && self.wait_gone(id, deadline).await {
            self.after_exit(id);
            return Ok(StopOutcome::Graceful);
        }
        tracing::info!(
            instance = id,
            deadline_s = deadline.as_secs(),
            "the guest did not power off in time: quitting QEMU"
        );
        let _ = self.qmp(id, "quit", qapi::qmp::quit {}).await;
        if !self.wait_gone(id, QUIT_GRACE).await {
            self.kill(id);
            self.wait_gone(id, QUIT_GRACE).await;
        }
        if self.live_pid(id).is_some() {
            return Err(VmmError::Launch {
                id: id.to_string(),
                message: "QEMU survived quit and SIGKILL".into(),
            });
        }
        self.after_exit(id);
        Ok(StopOutcome::Forced)
    }

    async fn reboot(&self, id: &str) -> Result<(), VmmError> {
        let log = self.dir(id).join(console::FILE);
        let _ = console::mark_start(&log);
        self.qmp(id, "system_reset", qapi::qmp::system_reset {})
            .await
            .map(|_| ())
    }

    async fn delete(&self, id: &str) -> Result<(), VmmError> {
        if self.live_pid(id).is_some() {
            let _ = self.qmp(id, "quit", qapi::qmp::quit {}).await;
            if !self.wait_gone(id, QUIT_GRACE).await {
                self.kill(id);
                self.wait_gone(id, QUIT_GRACE).await;
            }
        }
        self.after_exit(id);
        let dir = self.dir(id);
        if self.dir(id).join(VFIO_FILE).exists() {
            return Err(VmmError::Held {
                id: id.to_string(),
                message: format!(
                    "its GPU groups did not go back to their drivers (see {}); the disk is kept until they do",
                    dir.join(VFIO_FILE).display()
                ),
            });
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(id, "removing", &dir)(e)),
        }
    }

    async fn status(&self, id: &str) -> Result<VmStatus, VmmError> {
        let Some(pid) = self.live_pid(id) else {
            self.after_exit(id);
            return Ok(VmStatus::Stopped);
        };
        let run_state = match self
            .qmp(id, "query-status", qapi::qmp::query_status {})
            .await
        {
            Ok(s) => Some(
                serde_json::to_value(s.status)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_else(|| "unknown".into()),
            ),
            Err(e) => {
                tracing::debug!(instance = id, error = %e, "QMP query-status failed");
                None
            }
        };
        Ok(VmStatus::Running { pid, run_state })
    }

    fn console(&self, id: &str, max_bytes: usize) -> Result<Vec<u8>, VmmError> {
        let path = self.dir(id).join(console::FILE);
        console::tail(&path, max_bytes).map_err(io_err(id, "reading", &path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::config::{NetworkWire, VmmWire};

    fn backend(network: NetworkWire, disk_bus: &str) -> Qemu {
        let cfg = VmmWire {
            disk_bus: Some(disk_bus.into()),
            network,
            ..Default::default()
        }
        .validate("test", Path::new("/var/lib/bcd"))
        .expect("config");
        Qemu::new(cfg, Accel::Tcg, Arc::new(vfio::FakeKernel::new(&[])))
    }

    fn golden(name: &str, args: &[String]) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/vmm/golden")
            .join(name);
        bc_testkit::assert_golden(path, &(args.join("\n") + "\n"));
    }

    #[test]
    fn command_lines_match_the_golden_files() {
        let spec = crate::vmm::seed::tests::spec();
        let user = backend(
            NetworkWire {
                mode: Some("user".into()),
                bridge: None,
            },
            "nvme",
        );
        golden("qemu-user-nvme.args", &user.args(&spec, &[]));
        let bridged = backend(
            NetworkWire {
                mode: Some("bridge".into()),
                bridge: Some("br-vps".into()),
            },
            "virtio",
        );
        golden(
            "qemu-bridge-virtio-vfio.args",
            &bridged.args(&spec, &["0000:18:00.0".into(), "0000:18:00.1".into()]),
        );
    }
}
