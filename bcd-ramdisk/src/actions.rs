//! The ramdisk's actions as the PID 1 flow and the operator subcommands both run them: diagnose, wipe, stream,
//! and deploy (NoCloud seed + kexec). Each returns a serializable result; the callers print it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use tracing::info;

use crate::diagnose::{self, DiagnoseReport, RealNvme};
use crate::os::DirectDevice;
use crate::stream::http::{FetchPolicy, client, stream_url};
use crate::stream::{DigestAlgo, DigestOver, ExpectedDigest, Progress, StreamSpec};
use crate::wipe::{self, WipeEvidence, WipeOutcome};

pub fn diagnose() -> DiagnoseReport {
    diagnose::collect(Path::new("/"), &RealNvme)
}

// === wipe ===

#[derive(Clone, Debug, Serialize)]
pub struct WipeAttemptView {
    pub method: String,
    pub result: String,
    pub elapsed_ms: u64,
}

/// The evidence of one device, as reported.
#[derive(Clone, Debug, Serialize)]
pub struct WipeView {
    pub device: String,
    pub wiped: bool,
    pub method: Option<String>,
    pub failure: Option<String>,
    pub attempts: Vec<WipeAttemptView>,
    pub skipped: Vec<String>,
    pub sample_seed: u64,
    pub samples_verified: usize,
    pub metadata_verified: bool,
    pub elapsed_ms: u64,
}

impl From<&WipeEvidence> for WipeView {
    fn from(ev: &WipeEvidence) -> Self {
        let (method, failure) = match &ev.outcome {
            WipeOutcome::Wiped { method } => (Some(format!("{method:?}")), None),
            WipeOutcome::Failed { reason } => (None, Some(reason.clone())),
        };
        Self {
            device: ev.device.clone(),
            wiped: ev.is_wiped(),
            method,
            failure,
            attempts: ev
                .attempts
                .iter()
                .map(|a| WipeAttemptView {
                    method: format!("{:?}", a.method),
                    result: format!("{:?}", a.result),
                    elapsed_ms: a.elapsed.as_millis() as u64,
                })
                .collect(),
            skipped: ev
                .skipped
                .iter()
                .map(|s| format!("{:?}: {}", s.method, s.reason))
                .collect(),
            sample_seed: ev.sample_seed,
            samples_verified: ev.samples.iter().filter(|s| s.ok).count(),
            metadata_verified: ev.metadata_verified,
            elapsed_ms: ev.elapsed.as_millis() as u64,
        }
    }
}

/// What `bc.disks=all` means under `root` (`/`): every whole physical disk except read-only and removable media
/// (CD-ROMs, BMC virtual media, USB sticks), which are returned apart with the reason.
pub fn all_disks(root: &Path) -> (Vec<String>, Vec<String>) {
    let mut wipe = Vec::new();
    let mut skipped = Vec::new();
    for name in diagnose::collect_disk_names(root) {
        let flag = |f: &str| {
            std::fs::read_to_string(root.join("sys/class/block").join(&name).join(f))
                .is_ok_and(|v| v.trim() == "1")
        };
        if flag("ro") {
            skipped.push(format!("{name}: read-only"));
        } else if flag("removable") {
            skipped.push(format!(
                "{name}: removable media (name it in bc.disks to wipe it)"
            ));
        } else {
            wipe.push(name);
        }
    }
    (wipe, skipped)
}

/// Wipe each named disk (`vda`, `nvme0n1`); a disk that cannot even be probed or opened is a failed entry.
pub fn wipe_disks(names: &[String]) -> Vec<WipeView> {
    names.iter().map(|n| wipe_one(n)).collect()
}

fn failed(device: &str, why: String) -> WipeView {
    WipeView {
        device: device.to_string(),
        wiped: false,
        method: None,
        failure: Some(why),
        attempts: Vec::new(),
        skipped: Vec::new(),
        sample_seed: 0,
        samples_verified: 0,
        metadata_verified: false,
        elapsed_ms: 0,
    }
}

fn wipe_one(name: &str) -> WipeView {
    let name = name.trim_start_matches("/dev/");
    let caps = match wipe::probe_device(name) {
        Ok(c) => c,
        Err(e) => return failed(name, format!("probing: {}", bc_error_chain::chain(&e))),
    };
    let plan = wipe::plan(&caps);
    let mut dev = match DirectDevice::open(&Path::new("/dev").join(name)) {
        Ok(d) => d,
        Err(e) => return failed(name, bc_error_chain::chain(&e)),
    };
    let seed = rand::random::<u64>();
    let ev = wipe::execute(&mut dev, &plan, seed);
    WipeView::from(&ev)
}

// === stream ===

#[derive(Clone, Debug, Serialize)]
pub struct StreamView {
    pub url: String,
    pub device: String,
    pub compression: String,
    pub image_bytes: u64,
    pub source_bytes: u64,
    pub algo: String,
    pub digest: String,
    pub read_back_verified: bool,
    pub resumes: u32,
    pub elapsed_ms: u64,
}

/// How a stream reports progress: every `interval`, to the console log and to `on_progress` (agent mode hands it
/// to the session).
pub struct StreamOptions {
    pub progress_interval: Duration,
    pub on_progress: Box<dyn FnMut(&Progress) + Send>,
    /// The CAs an `https` image server must chain to (the control plane's trust bundle from join in agent mode,
    /// plus any the command names). Empty: `https` is refused, never fetched unverified.
    pub trust: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// The command's deadline: the download stops there and what was written is zeroed ([`FetchPolicy::deadline`]).
    pub deadline: Option<std::time::Instant>,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            progress_interval: Duration::from_secs(1),
            on_progress: Box::new(|_| {}),
            trust: Vec::new(),
            deadline: None,
        }
    }
}

/// Download `url` onto `/dev/<device>` (or a path), verifying `digest` over the bytes as served.
pub fn stream(
    url: &reqwest::Url,
    sha512: bool,
    hex_digest: &str,
    device: &Path,
) -> Result<StreamView, String> {
    stream_with(url, sha512, hex_digest, device, StreamOptions::default())
}

/// [`stream`] with a progress interval and an extra progress receiver.
pub fn stream_with(
    url: &reqwest::Url,
    sha512: bool,
    hex_digest: &str,
    device: &Path,
    options: StreamOptions,
) -> Result<StreamView, String> {
    let algo = if sha512 {
        DigestAlgo::Sha512
    } else {
        DigestAlgo::Sha256
    };
    let digest = ExpectedDigest::from_hex(algo, DigestOver::Compressed, hex_digest)
        .map_err(|e| e.to_string())?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in &options.trust {
        roots
            .add(ca.clone())
            .map_err(|e| format!("a trusted CA certificate is unusable: {e}"))?;
    }
    if url.scheme() == "https" && roots.is_empty() {
        return Err(
            "https image URLs need trusted CAs: in agent mode the control plane's (from join) and any `ca_pem` the \
             command carries; bc.action=stream on the kernel command line fetches http only"
                .into(),
        );
    }
    let sink = DirectDevice::open(device).map_err(|e| bc_error_chain::chain(&e))?;
    let policy = FetchPolicy {
        deadline: options.deadline,
        ..FetchPolicy::default()
    };
    let http = client(roots, &policy).map_err(|e| bc_error_chain::chain(&e))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let mut spec = StreamSpec::new(digest);
    spec.progress_interval = options.progress_interval;
    let mut on_progress = options.on_progress;
    let progress = Box::new(move |p: &Progress| {
        info!(written = p.written, source = p.source_read, total = ?p.source_total, rate_bps = p.rate_bps as u64, eta = ?p.eta, "streaming");
        on_progress(p);
    });
    let started = std::time::Instant::now();
    let (_sink, report) = rt
        .block_on(stream_url(
            &http,
            url.clone(),
            sink,
            spec,
            &policy,
            progress,
        ))
        .map_err(|e| bc_error_chain::chain(&e))?;
    Ok(StreamView {
        url: url.to_string(),
        device: device.display().to_string(),
        compression: format!("{:?}", report.stream.compression),
        image_bytes: report.stream.image_bytes,
        source_bytes: report.stream.source_bytes,
        algo: report.stream.algo.name().to_string(),
        digest: hex::encode(&report.stream.digest),
        read_back_verified: report.stream.read_back_verified,
        resumes: report.resumes,
        elapsed_ms: started.elapsed().as_millis() as u64,
    })
}

// === installed root ===

/// Partitions of `/dev/<disk>` after asking the kernel to re-read its table, in order.
pub fn partitions(disk: &str) -> Result<Vec<String>, String> {
    use std::os::fd::AsFd;
    let dev = Path::new("/dev").join(disk);
    let f = std::fs::File::open(&dev).map_err(|e| format!("opening {}: {e}", dev.display()))?;
    if let Err(e) = crate::os::sys::reread_partitions(f.as_fd()) {
        tracing::warn!(disk, error = %bc_error_chain::InlineErrorChain::new(&e), "BLKRRPART failed; using the partitions the kernel knows");
    }
    drop(f);
    // Partition nodes appear in devtmpfs asynchronously.
    let sys = Path::new("/sys/class/block").join(disk);
    for _ in 0..50 {
        let mut parts: Vec<String> = std::fs::read_dir(&sys)
            .map_err(|e| format!("reading {}: {e}", sys.display()))?
            .flatten()
            .filter(|e| e.path().join("partition").exists())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        parts.sort_by_key(|p| (p.len(), p.clone()));
        if !parts.is_empty() && parts.iter().all(|p| Path::new("/dev").join(p).exists()) {
            return Ok(parts);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("{disk} has no partitions"))
}

/// Mount each partition of `disk` read-write at `mountpoint` in turn until one holds `marker` (a relative path such
/// as `boot/vmlinuz`); returns the partition, left mounted.
pub fn mount_root_with(disk: &str, mountpoint: &Path, marker: &[&str]) -> Result<String, String> {
    std::fs::create_dir_all(mountpoint)
        .map_err(|e| format!("creating {}: {e}", mountpoint.display()))?;
    let mut tried = Vec::new();
    for part in partitions(disk)? {
        let dev = format!("/dev/{part}");
        match crate::os::sys::mount(&dev, mountpoint, "ext4", 0, None) {
            Ok(()) => {
                if marker.iter().any(|m| {
                    crate::kexec::resolve_in_root(mountpoint, m).is_some()
                        || mountpoint.join(m).exists()
                }) {
                    return Ok(part);
                }
                let _ = crate::os::sys::umount(mountpoint);
                tried.push(format!("{part}: no {}", marker.join(" or ")));
            }
            Err(e) => tried.push(format!("{part}: mount ext4: {e}")),
        }
    }
    Err(format!(
        "no installed root on {disk} ({})",
        tried.join("; ")
    ))
}

/// Where the installed root is mounted during deploy.
pub fn root_mountpoint() -> PathBuf {
    PathBuf::from("/mnt/root")
}

// === kexec into the installed system ===

/// What to boot from the installed root on a disk, and the join token to leave there in a NoCloud seed.
#[derive(Clone, Debug, Default)]
pub struct KexecSpec<'a> {
    /// The disk holding the installed root (`vda`).
    pub target: &'a str,
    /// The kernel and initrd inside the root (`boot/vmlinuz`); the installed system's defaults when `None`.
    pub kernel: Option<&'a str>,
    pub initrd: Option<&'a str>,
    /// The kernel command line; the root's `etc/kernel/cmdline` when `None`.
    pub cmdline: Option<&'a str>,
    /// The single-use join token the installed system joins with; no seed is written without one.
    pub join_token: Option<&'a str>,
    /// The control plane to join (written as the installed system's `/etc/bcd/bcd.toml`).
    pub control: Option<crate::seed::ControlPlane>,
    /// The operator's cloud-init user-data and meta-data (empty: none).
    pub user_data: &'a str,
    pub meta_data: &'a str,
}

/// What staging did, as reported.
#[derive(Clone, Debug, Serialize)]
pub struct StagedView {
    pub partition: String,
    pub seed: Option<String>,
    pub kernel: String,
    pub initrd: Option<String>,
    pub cmdline: String,
    pub kexec_staged: bool,
    pub error: Option<String>,
}

/// Mount the installed root on `spec.target`, write the NoCloud seed (with the single-use join token), stage its
/// kernel with `kexec_file_load` while the root is mounted, then unmount. `Err` when there is nothing to stage (no
/// root, no kernel, a bad seed); the view says whether the kernel accepted the staged image.
pub fn stage_installed(spec: &KexecSpec<'_>) -> Result<StagedView, String> {
    let mnt = root_mountpoint();
    let part = mount_root_with(spec.target, &mnt, &["boot/vmlinuz", "vmlinuz"])?;
    info!(partition = %part, "installed root mounted");
    let staged = stage_mounted(spec, &mnt, part);
    crate::os::sys::sync();
    if let Err(e) = crate::os::sys::umount(&mnt) {
        tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "unmounting the installed root");
    }
    staged
}

fn stage_mounted(
    spec: &KexecSpec<'_>,
    mnt: &Path,
    partition: String,
) -> Result<StagedView, String> {
    let mac = crate::dhcp::net::interfaces(Path::new("/sys/class/net"))
        .first()
        .map(|i| hex::encode(i.mac))
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
    let seed = match spec.join_token {
        Some(token) => {
            let seed = crate::seed::render(&crate::seed::SeedInput {
                instance_id: format!("bc-{mac}-{:08x}", rand::random::<u32>()),
                hostname: format!("bc-{mac}"),
                join_token: token.to_string(),
                control: spec.control.clone(),
                user_data: spec.user_data.to_owned(),
                meta_data: spec.meta_data.to_owned(),
            })
            .map_err(|e| bc_error_chain::chain(&e))?;
            let dir = crate::seed::write(mnt, &seed).map_err(|e| bc_error_chain::chain(&e))?;
            Some(dir.display().to_string())
        }
        None => {
            tracing::warn!(
                "no join token: no NoCloud seed written; the installed system will not join by itself"
            );
            None
        }
    };
    let mut boot = crate::kexec::installed_boot(mnt, spec.cmdline)?;
    let inside = |what: &str, rel: &str| {
        crate::kexec::resolve_in_root(mnt, rel).ok_or_else(|| {
            format!(
                "{what} {rel:?} is not a file in the installed root on {}",
                spec.target
            )
        })
    };
    if let Some(k) = spec.kernel {
        boot.kernel = inside("kernel", k)?;
    }
    if let Some(i) = spec.initrd {
        boot.initrd = Some(inside("initrd", i)?);
    }
    // The kernel reads the files during the call: stage while the root is mounted.
    let staged = crate::kexec::load(&boot.kernel, boot.initrd.as_deref(), &boot.cmdline);
    Ok(StagedView {
        partition,
        seed,
        kernel: boot.kernel.display().to_string(),
        initrd: boot.initrd.as_ref().map(|i| i.display().to_string()),
        cmdline: boot.cmdline.clone(),
        kexec_staged: staged.is_ok(),
        error: staged.as_ref().err().map(|e| bc_error_chain::chain(e)),
    })
}

/// Jump into the staged kernel (when `staged`); when that fails, or nothing was staged, reboot into the installed
/// system the firmware way. Returns only when even the reboot failed, with why.
pub fn hand_over(staged: bool) -> String {
    if staged {
        crate::init::say("bc-kexec: jumping into the installed kernel");
        let e = crate::kexec::exec();
        crate::init::say(&format!(
            "bc-kexec failed: {}; rebooting instead",
            bc_error_chain::chain(&e)
        ));
    } else {
        crate::init::say("bc-kexec: staging failed; rebooting into the installed system instead");
    }
    let e = crate::os::sys::restart();
    format!("reboot after kexec failure also failed: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_disks_leaves_out_read_only_and_removable_media() {
        let t = tempfile::tempdir().expect("tempdir");
        for (name, ro, removable) in [
            ("nvme0n1", "0", "0"),
            ("sda", "0", "1"),
            ("sr0", "1", "1"),
            ("vda", "0", "0"),
        ] {
            let d = t.path().join("sys/class/block").join(name);
            std::fs::create_dir_all(d.join("device")).expect("mkdir");
            std::fs::write(d.join("ro"), ro).expect("write");
            std::fs::write(d.join("removable"), removable).expect("write");
        }
        let (wipe, skipped) = all_disks(t.path());
        assert_eq!(wipe, ["nvme0n1", "vda"]);
        assert_eq!(skipped.len(), 2);
        assert!(skipped[0].starts_with("sda: removable"), "{skipped:?}");
        assert!(skipped[1].starts_with("sr0: read-only"), "{skipped:?}");
    }
}
