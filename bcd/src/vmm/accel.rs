//! Which accelerator VMs get. `/dev/kvm` existing proves little (on a nested host without VMX it opens and a guest
//! still never runs), so `auto` boots a probe under KVM first, with the CPU model VMs get there
//! ([`Accel::cpu`]): a 512-byte boot sector that writes `K` to the serial port and leaves through QEMU's
//! isa-debug-exit device. The model matters: on a nested AMD host (measured 2026-12-03) the probe ran under KVM with
//! QEMU's default CPU, while every VM, started with `-cpu host`, failed at once (`failed to set MSR 0x10a`). Only if that finishes within [`PROBE_DEADLINE`] is KVM
//! used; otherwise TCG, with the reason logged. The probe runs once per supervisor start (≈ 0.1 s with a working
//! KVM, the deadline without one).

use crate::vmm::Accel;
use crate::vmm::config::AccelChoice;
use std::path::Path;
use std::time::Duration;

/// How long the probe may take.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(3);
/// The exit status QEMU gives when the probe writes 0x31 to isa-debug-exit: (0x31 << 1) | 1.
const PROBE_EXIT: i32 = 99;

/// The probe boot sector: `mov dx,0x3f8; mov al,'K'; out dx,al; mov al,0x31; out 0xf4,al; hlt; jmp $-1`, then the
/// boot signature.
pub fn probe_sector() -> [u8; 512] {
    let code = [
        0xba, 0xf8, 0x03, 0xb0, b'K', 0xee, 0xb0, 0x31, 0xe6, 0xf4, 0xf4, 0xeb, 0xfd,
    ];
    let mut s = [0u8; 512];
    s[..code.len()].copy_from_slice(&code);
    s[510] = 0x55;
    s[511] = 0xaa;
    s
}

/// The accelerator for `choice`, and why (for the log). `work` is a directory for the probe's files.
pub async fn choose(qemu: &Path, choice: AccelChoice, work: &Path) -> (Accel, String) {
    match choice {
        AccelChoice::Tcg => (Accel::Tcg, "configured: accel = \"tcg\"".into()),
        AccelChoice::Kvm => (Accel::Kvm, "configured: accel = \"kvm\"".into()),
        AccelChoice::Auto => {
            if !Path::new("/dev/kvm").exists() {
                return (Accel::Tcg, "no /dev/kvm".into());
            }
            match probe(qemu, work).await {
                Ok(()) => (Accel::Kvm, "the KVM probe boot finished".into()),
                Err(why) => (Accel::Tcg, format!("KVM is not usable: {why}")),
            }
        }
    }
}

/// Boots the probe sector under KVM; Ok when it ran to its exit.
pub async fn probe(qemu: &Path, work: &Path) -> Result<(), String> {
    probe_under(qemu, work, Accel::Kvm).await
}

/// QEMU's command line for the probe under `accel`: the CPU model VMs get under it, the sector on an IDE disk, the
/// serial port into `serial`.
fn probe_args(accel: Accel, disk: &Path, serial: &Path) -> Vec<String> {
    let mut a: Vec<String> = [
        "-accel",
        accel.as_str(),
        "-machine",
        "pc",
        "-m",
        "16",
        "-nodefaults",
    ]
    .map(String::from)
    .to_vec();
    if let Some(cpu) = accel.cpu() {
        a.extend(["-cpu".to_string(), cpu.to_string()]);
    }
    a.extend(
        [
            "-display",
            "none",
            "-no-user-config",
            "-device",
            "isa-debug-exit,iobase=0xf4,iosize=0x01",
        ]
        .map(String::from),
    );
    a.extend([
        "-drive".to_string(),
        format!("file={},format=raw,if=ide", disk.display()),
        "-serial".to_string(),
        format!("file:{}", serial.display()),
    ]);
    a
}

/// Boots the probe sector under `accel` with the CPU model VMs get under it (KVM; TCG in the test that proves the
/// sector itself works).
async fn probe_under(qemu: &Path, work: &Path, accel: Accel) -> Result<(), String> {
    let dir = tempfile::Builder::new()
        .prefix(".kvm-probe-")
        .tempdir_in(work)
        .map_err(|e| format!("creating the probe directory: {e}"))?;
    let disk = dir.path().join("probe.img");
    let serial = dir.path().join("serial.out");
    std::fs::write(&disk, probe_sector()).map_err(|e| format!("writing the probe: {e}"))?;
    let mut cmd = tokio::process::Command::new(qemu);
    cmd.args(probe_args(accel, &disk, &serial))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .map_err(|e| format!("running {}: {e}", qemu.display()))?;
    let out = match tokio::time::timeout(PROBE_DEADLINE, child.wait_with_output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => return Err(format!("waiting for the probe: {e}")),
        Err(_) => {
            return Err(format!(
                "the probe boot did not finish within {} s",
                PROBE_DEADLINE.as_secs()
            ));
        }
    };
    let printed = std::fs::read(&serial).unwrap_or_default();
    if out.status.code() == Some(PROBE_EXIT) && printed.contains(&b'K') {
        Ok(())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        Err(format!(
            "the probe exited with {} ({})",
            out.status,
            stderr.lines().last().unwrap_or("no message").trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `-cpu` a VM gets after the probe chose its accelerator is the one the probe ran: a probe with QEMU's
    /// default model passed on a nested AMD host where every `-cpu host` VM failed to start.
    #[test]
    fn the_probe_runs_the_cpu_model_vms_get() {
        let cpu = |args: &[String]| -> Vec<String> {
            args.windows(2)
                .filter(|w| w[0] == "-cpu")
                .map(|w| w[1].clone())
                .collect()
        };
        let spec = crate::vmm::seed::tests::spec();
        for accel in [Accel::Kvm, Accel::Tcg] {
            let cfg = crate::vmm::config::VmmWire {
                network: crate::vmm::config::NetworkWire {
                    mode: Some("user".into()),
                    bridge: None,
                },
                ..Default::default()
            }
            .validate("test", Path::new("/var/lib/bcd"))
            .expect("config");
            let vm = crate::vmm::qemu::Qemu::new(
                cfg,
                accel,
                std::sync::Arc::new(crate::vmm::vfio::FakeKernel::new(&[])),
            )
            .args(&spec, &[]);
            let probe = probe_args(accel, Path::new("/p.img"), Path::new("/s.out"));
            assert_eq!(cpu(&probe), cpu(&vm), "{accel:?}");
        }
        assert_eq!(
            cpu(&probe_args(Accel::Kvm, Path::new("/p"), Path::new("/s"))),
            ["host"]
        );
    }

    /// The probe sector runs to its exit where a CPU runs it at all (TCG): a KVM probe that fails is KVM's failure.
    #[tokio::test]
    async fn the_probe_sector_prints_and_exits_under_tcg() {
        let qemu = Path::new("qemu-system-x86_64");
        if std::process::Command::new(qemu)
            .arg("--version")
            .output()
            .is_err()
        {
            bc_testkit::skip!("qemu-system-x86_64 is not installed (scripts/setup)");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        probe_under(qemu, dir.path(), Accel::Tcg)
            .await
            .expect("the probe boots under TCG");
        // Without a usable KVM (this lab: /dev/kvm opens, nothing runs) auto falls back to TCG with the reason.
        let (accel, why) = choose(qemu, AccelChoice::Auto, dir.path()).await;
        if accel == Accel::Tcg {
            assert!(
                why.contains("KVM is not usable") || why.contains("no /dev/kvm"),
                "{why}"
            );
        }
        assert_eq!(
            choose(qemu, AccelChoice::Tcg, dir.path()).await.0,
            Accel::Tcg
        );
    }
}
