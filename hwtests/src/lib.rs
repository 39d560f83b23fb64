//! bc-hwtests: tests that need real or emulated hardware (QEMU lab, Redfish emulator, NVML). Each skips with a printed reason when its hardware is absent.
