//! `/init` of the PXE lab's initramfs (built by `images/build-pxe-lab`, not part of the workspace): prints the
//! marker the kernel command line handed it (`BCDLAB_MARKER=<text>` reaches PID 1 as an environment variable),
//! then powers the machine off so `qemu -no-reboot` exits.

use std::io::Write as _;

extern "C" {
    fn sync();
    fn reboot(cmd: i32) -> i32;
}

/// `RB_POWER_OFF` from <sys/reboot.h>.
const RB_POWER_OFF: i32 = 0x4321_fedc_u32 as i32;

fn main() {
    let marker = std::env::var("BCDLAB_MARKER").unwrap_or_else(|_| "unset".to_owned());
    let mut out = std::io::stdout();
    let _ = writeln!(out, "BCDLAB-INIT marker={marker}");
    let _ = out.flush();
    // SAFETY: plain syscalls without pointers; as PID 1 there is nothing left to tear down.
    unsafe {
        sync();
        reboot(RB_POWER_OFF);
    }
    // PID 1 must never exit (the kernel would panic); wait for the power-off to land.
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}
