//! libvirt for the lab: the daemons' configuration (everything under the lab's folder) and the domains' XML.
//!
//! libvirtd runs privileged but inside a private mount namespace in which `/etc/libvirt`, `/run/libvirt`,
//! `/var/lib/libvirt`, `/var/cache/libvirt` and `/var/log/libvirt` are the lab's own folders: its qemu.conf, its
//! sockets, its domain definitions and capability cache live there and go with the lab. qemu.conf runs guests as
//! root with no security driver and no cgroups (so no `machine` cgroups are left behind, and libvirt's KVM check
//! agrees with its probe: as `libvirt-qemu` without access to `/dev/kvm` it re-probes QEMU on every call, ≈ 5 s each).

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
pub const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// The system folders libvirtd uses, each replaced by `<lab>/libvirt/<name>` in its mount namespace.
pub const BIND_DIRS: [(&str, &str); 5] = [
    ("etc", "/etc/libvirt"),
    ("run", "/run/libvirt"),
    ("lib", "/var/lib/libvirt"),
    ("cache", "/var/cache/libvirt"),
    ("log", "/var/log/libvirt"),
];

/// What the boot sector of every lab disk prints on the serial console (see [`boot_sector`]).
pub const DISK_MARKER: &str = "BCDLAB-DISK booted from the disk";

pub fn qemu_conf() -> &'static str {
    "user = \"root\"\ngroup = \"root\"\ndynamic_ownership = 0\nsecurity_driver = \"none\"\n\
     cgroup_controllers = [ ]\nstdio_handler = \"logd\"\n"
}

pub fn libvirtd_conf(sock_dir: &Path, log: &Path) -> String {
    format!(
        "unix_sock_dir = \"{}\"\nauth_unix_rw = \"none\"\nauth_unix_ro = \"none\"\n\
         unix_sock_rw_perms = \"0700\"\nunix_sock_ro_perms = \"0700\"\nunix_sock_admin_perms = \"0700\"\n\
         log_outputs = \"3:file:{}\"\n",
        sock_dir.display(),
        log.display()
    )
}

pub fn virtlogd_conf(log: &Path) -> String {
    format!("log_outputs = \"3:file:{}\"\n", log.display())
}

/// The firmware a domain boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Firmware {
    /// i440fx with SeaBIOS, its text on the serial port; QEMU's iPXE ROM on the NIC.
    SeaBios,
    /// q35 with OVMF (4M pflash, a private copy of the variable store); QEMU's iPXE EFI ROM on the NIC.
    Ovmf,
}

/// Which bridge the domain's NIC is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// `br0`: dnsmasq's DHCP and `bcd site`'s proxy DHCP, TFTP and HTTP.
    Boot,
    /// `br1`: a bridge with nothing else on it. A machine whose NIC is not on the boot segment never PXE boots.
    Isolated,
}

impl Segment {
    pub fn bridge(self) -> &'static str {
        match self {
            Segment::Boot => "br0",
            Segment::Isolated => "br1",
        }
    }
}

/// A domain to define.
#[derive(Debug, Clone)]
pub struct DomainSpec {
    pub name: String,
    /// Fixed (sushy caches domain handles by UUID: a domain re-created with another UUID confuses it).
    pub uuid: String,
    pub mac: String,
    pub firmware: Firmware,
    pub segment: Segment,
    pub memory_mib: u32,
    pub disk_mib: u64,
}

impl DomainSpec {
    /// Domain number `n` of the lab: UUID `6b0f6a3e-1d7b-4c1f-9b7e-0000000000<n>`, MAC `52:54:00:78:01:<n>`, 1 GiB
    /// of memory (sushy reports whole GiB: 512 MiB reads as 0), a 64 MiB disk, NIC on the boot segment.
    pub fn new(name: &str, n: u8, firmware: Firmware) -> DomainSpec {
        DomainSpec {
            name: name.to_owned(),
            uuid: format!("6b0f6a3e-1d7b-4c1f-9b7e-0000000000{n:02x}"),
            mac: format!("52:54:00:78:01:{n:02x}"),
            firmware,
            segment: Segment::Boot,
            memory_mib: 1024,
            disk_mib: 64,
        }
    }

    pub fn on(mut self, segment: Segment) -> DomainSpec {
        self.segment = segment;
        self
    }
}

/// A defined domain and where to look at it.
#[derive(Debug, Clone)]
pub struct Domain {
    pub name: String,
    pub uuid: String,
    pub mac: String,
    pub firmware: Firmware,
    pub segment: Segment,
    /// The serial console (firmware text, iPXE, the kernel), written by QEMU.
    pub serial: PathBuf,
    /// A raw disk image whose boot sector prints [`DISK_MARKER`].
    pub disk: PathBuf,
}

impl Domain {
    /// The system's path on sushy-tools' Redfish service.
    pub fn redfish_path(&self) -> String {
        format!("/redfish/v1/Systems/{}", self.uuid)
    }
}

/// Writes the domain's disk and returns its XML. The disk is the only boot device (`<boot order='1'/>`): a
/// power-on without a boot override boots the disk, as a machine with an installed system would.
pub fn prepare(spec: &DomainSpec, dir: &Path) -> Result<(Domain, String)> {
    let disk = dir.join(format!("{}.img", spec.name));
    let serial = dir.join(format!("{}.serial", spec.name));
    let f = fs::File::create(&disk).with_context(|| format!("creating {}", disk.display()))?;
    f.set_len(spec.disk_mib << 20)?;
    drop(f);
    write_at_start(&disk, &boot_sector())?;
    let mut os = String::new();
    match spec.firmware {
        Firmware::SeaBios => {
            os.push_str("    <type arch='x86_64' machine='pc'>hvm</type>\n");
            os.push_str("    <bios useserial='yes' rebootTimeout='2000'/>\n");
        }
        Firmware::Ovmf => {
            os.push_str("    <type arch='x86_64' machine='q35'>hvm</type>\n");
            let _ = writeln!(
                os,
                "    <loader readonly='yes' type='pflash'>{OVMF_CODE}</loader>"
            );
            let _ = writeln!(
                os,
                "    <nvram template='{OVMF_VARS}'>{}</nvram>",
                dir.join(format!("{}_VARS.fd", spec.name)).display()
            );
        }
    }
    let xml = format!(
        "<domain type='qemu'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <memory unit='MiB'>{mem}</memory>
  <vcpu>1</vcpu>
  <os>
{os}  </os>
  <features><acpi/><apic/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
      <boot order='1'/>
    </disk>
    <interface type='bridge'>
      <mac address='{mac}'/>
      <source bridge='{bridge}'/>
      <model type='virtio'/>
    </interface>
    <serial type='file'>
      <source path='{serial}' append='on'/>
      <target port='0'/>
    </serial>
    <memballoon model='none'/>
  </devices>
</domain>
",
        name = spec.name,
        uuid = spec.uuid,
        mem = spec.memory_mib,
        disk = disk.display(),
        mac = spec.mac,
        bridge = spec.segment.bridge(),
        serial = serial.display(),
    );
    Ok((
        Domain {
            name: spec.name.clone(),
            uuid: spec.uuid.clone(),
            mac: spec.mac.clone(),
            firmware: spec.firmware,
            segment: spec.segment,
            serial,
            disk,
        },
        xml,
    ))
}

fn write_at_start(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::{Seek as _, SeekFrom, Write as _};
    let mut f = fs::OpenOptions::new().write(true).open(path)?;
    f.seek(SeekFrom::Start(0))?;
    f.write_all(bytes)?;
    Ok(())
}

/// A 512-byte MBR boot sector that writes [`DISK_MARKER`] to COM1 (port 0x3f8) and halts: the proof, on the
/// serial console, that the firmware booted the disk and not the network.
pub fn boot_sector() -> [u8; 512] {
    // 16-bit real mode, loaded at 0000:7c00.
    let code: [u8; 23] = [
        0x31, 0xC0, // xor ax, ax
        0x8E, 0xD8, // mov ds, ax
        0xFC, // cld
        0xBE, 0x17, 0x7C, // mov si, 0x7c17 (the message, right after the code)
        0xBA, 0xF8, 0x03, // mov dx, 0x3f8
        0xAC, // next: lodsb
        0x84, 0xC0, // test al, al
        0x74, 0x03, // jz done
        0xEE, // out dx, al
        0xEB, 0xF8, // jmp next
        0xFA, // done: cli
        0xF4, // hlt
        0xEB, 0xFC, // jmp done
    ];
    let mut sector = [0u8; 512];
    sector[..code.len()].copy_from_slice(&code);
    let msg = format!("\r\n{DISK_MARKER}\r\n");
    sector[code.len()..code.len() + msg.len()].copy_from_slice(msg.as_bytes());
    sector[510] = 0x55;
    sector[511] = 0xAA;
    sector
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_sector_is_bootable_and_points_at_its_message() {
        let s = boot_sector();
        assert_eq!(&s[510..], &[0x55, 0xAA]);
        // mov si, imm16 must name 0x7c00 + the offset of the message.
        let si = u16::from_le_bytes([s[6], s[7]]) as usize;
        let at = si - 0x7c00;
        assert!(s[at..].starts_with(format!("\r\n{DISK_MARKER}").as_bytes()));
        assert!(at + DISK_MARKER.len() + 4 < 510);
        assert_eq!(s[at + DISK_MARKER.len() + 4], 0, "NUL-terminated");
        // The two short jumps land on lodsb (offset 11) and cli (offset 19).
        assert_eq!(19 + (s[18] as i8 as isize), 11);
        assert_eq!(23 + (s[22] as i8 as isize), 19);
        assert_eq!(16 + s[15] as usize, 19);
    }

    #[test]
    fn domain_xml_names_the_bridge_firmware_and_fixed_uuid() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("bcd-lab-xml-{}", std::process::id()));
        fs::create_dir_all(&dir)?;
        let spec = DomainSpec::new("uefi", 2, Firmware::Ovmf).on(Segment::Isolated);
        let (d, xml) = prepare(&spec, &dir)?;
        assert!(xml.contains("<uuid>6b0f6a3e-1d7b-4c1f-9b7e-000000000002</uuid>"));
        assert!(xml.contains("<source bridge='br1'/>"));
        assert!(xml.contains("machine='q35'") && xml.contains(OVMF_CODE));
        assert!(xml.contains("<mac address='52:54:00:78:01:02'/>"));
        assert_eq!(fs::metadata(&d.disk)?.len(), 64 << 20);
        assert_eq!(
            d.redfish_path(),
            "/redfish/v1/Systems/6b0f6a3e-1d7b-4c1f-9b7e-000000000002"
        );
        fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
