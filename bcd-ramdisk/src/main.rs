//! `bcd-ramdisk`: PID 1 of the PXE initramfs, and operator subcommands. Everything lives in the library.

fn main() {
    std::process::exit(bcd_ramdisk::cli::main());
}
