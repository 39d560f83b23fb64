//! bcd-ramdisk: diagnose, wipe, image stream and kexec for the PXE-booted static PID 1 (filled by the ramdisk issue).
