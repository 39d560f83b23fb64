//! Command-line entry: PID 1 when the process is PID 1 (or `init`), otherwise the operator subcommands. `main.rs`
//! only calls [`main`].

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::actions;
use crate::init;

#[derive(Parser)]
#[command(
    name = "bcd-ramdisk",
    version,
    about = "Better Compute ramdisk: PID 1 of the PXE initramfs, and its tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run as PID 1 (what the initramfs does; parameters come from /proc/cmdline).
    Init,
    /// Print the hardware report (CPU, memory, PCI, GPUs, disks with NVMe identify and SMART, NICs) as JSON.
    Diagnose {
        /// Read /proc and /sys under this root (NVMe admin commands still go to /dev).
        #[arg(long, default_value = "/")]
        root: PathBuf,
    },
    /// Erase disks by probed capability and verify; prints per-device evidence. DESTROYS DATA.
    Wipe {
        /// Disk name or /dev path (repeatable).
        #[arg(long, required = true)]
        device: Vec<String>,
    },
    /// Download an image and write it to a device with inline digest check and read-back.
    Stream {
        #[arg(long)]
        url: reqwest::Url,
        /// Expected SHA-256 of the bytes as served.
        #[arg(long, conflicts_with = "sha512", required_unless_present = "sha512")]
        sha256: Option<String>,
        #[arg(long)]
        sha512: Option<String>,
        /// Block device (or, for tests, an existing file) to write.
        #[arg(long)]
        device: PathBuf,
    },
    /// Stage a kernel with kexec_file_load and jump into it (reboots on failure unless --no-reboot).
    Kexec {
        #[arg(long)]
        kernel: PathBuf,
        #[arg(long)]
        initrd: Option<PathBuf>,
        #[arg(long, default_value = "")]
        cmdline: String,
        /// Only stage the kernel (check that it would be accepted).
        #[arg(long)]
        load_only: bool,
    },
    /// DHCP on one interface (the ramdisk's own client): configure the lease and print it as JSON; with --keep,
    /// keep it (renew at T1, rebind at T2, start over when lost), printing each event as a JSON line.
    Dhcp {
        /// The interface (default: the first with a carrier).
        #[arg(long)]
        nic: Option<String>,
        /// Give up the first exchange after this many seconds.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Keep the lease after configuring it.
        #[arg(long)]
        keep: bool,
        /// With --keep: exit after this many renewals (tests).
        #[arg(long, requires = "keep")]
        renewals: Option<u32>,
    },
    /// Resolve the load order of kernel modules from their .modinfo (image builds use it).
    ModulesOrder {
        /// The lib/modules/<version> directory.
        #[arg(long)]
        dir: PathBuf,
        /// Modules wanted, comma-separated; absent ones are reported on stderr and skipped.
        #[arg(long, value_delimiter = ',')]
        want: Vec<String>,
        /// Print the initramfs load list instead (`PREFIX/<path>\t<deps>\t<device aliases>`), PREFIX being where
        /// the directory lands in the initramfs (`/lib/modules/<version>`).
        #[arg(long, value_name = "PREFIX")]
        load_list: Option<String>,
    },
}

/// Entry point. Returns the exit status (never, as PID 1).
pub fn main() -> i32 {
    let pid1 = std::process::id() == 1;
    let argv0 = std::env::args().next().unwrap_or_default();
    if argv0.rsplit('/').next() == Some("bc-lab-os") {
        init::run_lab_os();
    }
    if pid1 {
        init::run();
    }
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Init | Command::ModulesOrder { .. }) {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .try_init();
    }
    match run(cli.command) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bcd-ramdisk: {e}");
            1
        }
    }
}

fn print_json<T: serde::Serialize>(value: &T) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    println!("{text}");
    Ok(())
}

fn dhcp(nic: Option<&str>, timeout: u64, keep: bool, renewals: Option<u32>) -> Result<(), String> {
    use crate::dhcp::net::{self, LeaseEvent};
    let nic = net::choose_nic(nic, None, std::time::Duration::from_secs(10))
        .map_err(|e| bc_error_chain::chain(&e))?;
    let xid = rand::random();
    let lease = net::acquire(&nic, xid, std::time::Duration::from_secs(timeout))
        .map_err(|e| bc_error_chain::chain(&e))?;
    print_json(&serde_json::json!({
        "event": "bound",
        "nic": nic.name,
        "address": lease.address.to_string(),
        "prefix_len": lease.prefix_len,
        "server": lease.server.to_string(),
        "lease_secs": lease.lease_secs,
    }))?;
    if !keep {
        return Ok(());
    }
    let mut renewed = 0u32;
    let mut lost = None;
    net::keep(&nic, lease, xid.wrapping_add(1), &mut |event| {
        let line = match &event {
            LeaseEvent::Renewed {
                address,
                lease_secs,
            } => {
                renewed += 1;
                serde_json::json!({"event": "renewed", "address": address.to_string(), "lease_secs": lease_secs})
            }
            LeaseEvent::Lost { address, why } => {
                lost = Some(why.clone());
                serde_json::json!({"event": "lost", "address": address.to_string(), "why": why})
            }
            LeaseEvent::Reacquired { address, changed } => {
                serde_json::json!({"event": "reacquired", "address": address.to_string(), "changed": changed})
            }
            LeaseEvent::Trouble(why) => serde_json::json!({"event": "trouble", "why": why}),
        };
        println!("{line}");
        renewals.is_none_or(|n| renewed < n)
    });
    match (renewals, lost) {
        (Some(n), _) if renewed >= n => Ok(()),
        (_, Some(why)) => Err(format!("lease lost: {why}")),
        _ => Err("the lease does not expire: nothing to keep".into()),
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Init => init::run(),
        Command::Diagnose { root } => {
            print_json(&crate::diagnose::collect(&root, &crate::diagnose::RealNvme))
        }
        Command::Wipe { device } => {
            let views = actions::wipe_disks(&device);
            print_json(&views)?;
            let failed: Vec<&str> = views
                .iter()
                .filter(|v| !v.wiped)
                .map(|v| v.device.as_str())
                .collect();
            if failed.is_empty() {
                Ok(())
            } else {
                Err(format!("NOT wiped: {}", failed.join(", ")))
            }
        }
        Command::Stream {
            url,
            sha256,
            sha512,
            device,
        } => {
            let (sha512_flag, hex) = match (sha256, sha512) {
                (Some(h), None) => (false, h),
                (None, Some(h)) => (true, h),
                _ => return Err("give exactly one of --sha256 and --sha512".into()),
            };
            let view = actions::stream(&url, sha512_flag, &hex, &device)?;
            print_json(&view)
        }
        Command::Kexec {
            kernel,
            initrd,
            cmdline,
            load_only,
        } => {
            crate::kexec::load(&kernel, initrd.as_deref(), &cmdline)
                .map_err(|e| bc_error_chain::chain(&e))?;
            if load_only {
                println!("kexec: {} staged", kernel.display());
                return Ok(());
            }
            let e = crate::kexec::exec();
            eprintln!(
                "bcd-ramdisk: {}; rebooting instead",
                bc_error_chain::chain(&e)
            );
            Err(crate::os::sys::restart().to_string())
        }
        Command::Dhcp {
            nic,
            timeout,
            keep,
            renewals,
        } => dhcp(nic.as_deref(), timeout, keep, renewals),
        Command::ModulesOrder {
            dir,
            want,
            load_list,
        } => {
            let wanted: Vec<&str> = want.iter().map(String::as_str).collect();
            let order =
                crate::modules::order_tree(&dir, &wanted).map_err(|e| bc_error_chain::chain(&e))?;
            for name in &order.absent {
                eprintln!(
                    "modules-order: {name} is not in {} (skipped)",
                    dir.display()
                );
            }
            for (file, info) in order.files.iter().zip(&order.infos) {
                let rel = file.strip_prefix(&dir).unwrap_or(file);
                match &load_list {
                    Some(prefix) => {
                        let path = format!("{}/{}", prefix.trim_end_matches('/'), rel.display());
                        println!("{}", crate::modules::load::render_line(&path, info));
                    }
                    None => println!("{}", rel.display()),
                }
            }
            Ok(())
        }
    }
}
