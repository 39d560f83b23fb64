//! The node's bookings as a Container Device Interface spec (the format podman, containerd, CRI-O and the NVIDIA
//! container toolkit read from `/etc/cdi`): kind `bettercompute.io/gpu`, one device per booked GPU (named by its
//! UUID) and one per reservation (named by the reservation id, all of its GPUs). A container started with
//! `--device bettercompute.io/gpu=<reservation>` gets exactly the booked GPUs. Written atomically; removed when
//! nothing is booked.

use serde::Deserialize;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

pub const KIND: &str = "bettercompute.io/gpu";
pub const FILE_NAME: &str = "bettercompute.io-gpu.json";
const CDI_VERSION: &str = "0.6.0";

/// One booking as the desired state carries it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Booking {
    pub reservation: String,
    pub gpus: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("desired state bookings are malformed: {0}")]
    Malformed(String),
    #[error("booking {reservation} names GPU {uuid}, which this node does not have")]
    UnknownGpu { reservation: String, uuid: String },
    #[error("reservation id {0:?} is not a valid CDI device name")]
    BadName(String),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What the node knows about one GPU: its UUID and, when the driver exposes it, its device minor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalGpu {
    pub uuid: String,
    pub minor: Option<u32>,
}

/// Reads `bookings` from a desired-state spec (absent means none).
pub fn bookings(spec: &Value) -> Result<Vec<Booking>, CdiError> {
    match spec.get("bookings") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(b) => {
            serde_json::from_value(b.clone()).map_err(|e| CdiError::Malformed(e.to_string()))
        }
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// Renders the spec (None when nothing is booked). Every booked GPU must be one of `local`.
pub fn render(bookings: &[Booking], local: &[LocalGpu]) -> Result<Option<Value>, CdiError> {
    if bookings.iter().all(|b| b.gpus.is_empty()) {
        return Ok(None);
    }
    let node_of = |uuid: &str| -> Value {
        let gpu = local.iter().find(|g| g.uuid == uuid);
        let mut edits = json!({ "env": [format!("NVIDIA_VISIBLE_DEVICES={uuid}")] });
        if let Some(minor) = gpu.and_then(|g| g.minor) {
            edits["deviceNodes"] = json!([{ "path": format!("/dev/nvidia{minor}") }]);
        }
        edits
    };
    let mut devices = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for b in bookings {
        if !valid_name(&b.reservation) {
            return Err(CdiError::BadName(b.reservation.clone()));
        }
        for uuid in &b.gpus {
            if !local.iter().any(|g| &g.uuid == uuid) {
                return Err(CdiError::UnknownGpu {
                    reservation: b.reservation.clone(),
                    uuid: uuid.clone(),
                });
            }
            if !valid_name(uuid) {
                return Err(CdiError::BadName(uuid.clone()));
            }
            if seen.insert(uuid.clone()) {
                devices.push(json!({ "name": uuid, "containerEdits": node_of(uuid) }));
            }
        }
        let nodes: Vec<Value> = b
            .gpus
            .iter()
            .filter_map(|u| local.iter().find(|g| &g.uuid == u).and_then(|g| g.minor))
            .map(|m| json!({ "path": format!("/dev/nvidia{m}") }))
            .collect();
        let mut edits = json!({ "env": [format!("NVIDIA_VISIBLE_DEVICES={}", b.gpus.join(","))] });
        if !nodes.is_empty() {
            edits["deviceNodes"] = Value::Array(nodes);
        }
        devices.push(json!({ "name": b.reservation, "containerEdits": edits }));
    }
    Ok(Some(json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "deviceNodes": [
                { "path": "/dev/nvidiactl" },
                { "path": "/dev/nvidia-uvm" },
                { "path": "/dev/nvidia-uvm-tools" },
            ]
        },
    })))
}

/// Writes (or removes) the spec in `dir` atomically: temp file, fsync, rename.
pub fn apply(dir: &Path, spec: Option<&Value>) -> Result<(), CdiError> {
    let path = dir.join(FILE_NAME);
    let err = |source| CdiError::Write {
        path: path.clone(),
        source,
    };
    match spec {
        None => match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(err(e)),
        },
        Some(spec) => {
            use std::io::Write as _;
            std::fs::create_dir_all(dir).map_err(err)?;
            let tmp = dir.join(format!(".{FILE_NAME}.tmp"));
            let mut f = std::fs::File::create(&tmp).map_err(err)?;
            let mut text = serde_json::to_vec_pretty(spec).unwrap_or_default();
            text.push(b'\n');
            f.write_all(&text).map_err(err)?;
            f.sync_all().map_err(err)?;
            std::fs::rename(&tmp, &path).map_err(err)?;
            Ok(())
        }
    }
}

/// The device minor of the GPU at `pci_bus_id`, from the driver's procfs (`Device Minor:`), under `root`.
pub fn minor_from_procfs(root: &Path, pci_bus_id: &str) -> Option<u32> {
    if pci_bus_id.is_empty() {
        return None;
    }
    // The driver names the directory by the lowercase bus id with a 4-digit domain; NVML reports 8 digits.
    let id = pci_bus_id.to_ascii_lowercase();
    let (domain, rest) = id.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let p = root
        .join("proc/driver/nvidia/gpus")
        .join(format!("{domain:04x}:{rest}"))
        .join("information");
    if let Ok(text) = std::fs::read_to_string(&p) {
        return text
            .lines()
            .find_map(|l| l.strip_prefix("Device Minor:"))
            .and_then(|v| v.trim().parse().ok());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> Vec<LocalGpu> {
        (0..4)
            .map(|i| LocalGpu {
                uuid: format!("GPU-{i}"),
                minor: (i < 2).then_some(i),
            })
            .collect()
    }

    #[test]
    fn renders_exactly_the_booked_gpus() {
        let spec = json!({"bookings": [{"reservation": "rsv-a", "gpus": ["GPU-0", "GPU-3"]}]});
        let b = bookings(&spec).expect("bookings");
        let cdi = render(&b, &local()).expect("render").expect("some");
        // The file as the node writes it, byte for byte.
        let dir = tempfile::tempdir().expect("tempdir");
        apply(dir.path(), Some(&cdi)).expect("apply");
        let written = std::fs::read_to_string(dir.path().join(FILE_NAME)).expect("written");
        bc_testkit::assert_golden(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cdi_golden.json"),
            &written,
        );
    }

    #[test]
    fn nothing_booked_means_no_spec_and_unknown_gpus_are_refused() {
        assert_eq!(render(&[], &local()).expect("render"), None);
        assert_eq!(bookings(&json!({"version": 1})).expect("none"), vec![]);
        let b = vec![Booking {
            reservation: "rsv-a".into(),
            gpus: vec!["GPU-9".into()],
        }];
        assert!(matches!(
            render(&b, &local()),
            Err(CdiError::UnknownGpu { .. })
        ));
        let b = vec![Booking {
            reservation: "../x".into(),
            gpus: vec!["GPU-0".into()],
        }];
        assert!(matches!(render(&b, &local()), Err(CdiError::BadName(_))));
        assert!(bookings(&json!({"bookings": [{"gpus": 3}]})).is_err());
    }

    #[test]
    fn apply_writes_and_removes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = json!({"x": 1});
        apply(dir.path(), Some(&spec)).expect("write");
        assert!(dir.path().join(FILE_NAME).exists());
        apply(dir.path(), None).expect("remove");
        assert!(!dir.path().join(FILE_NAME).exists());
        apply(dir.path(), None).expect("remove twice is fine");
    }

    #[test]
    fn minor_from_driver_procfs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("proc/driver/nvidia/gpus/0000:18:00.0");
        std::fs::create_dir_all(&p).expect("mkdir");
        std::fs::write(p.join("information"), "Model: H100\nDevice Minor: 5\n").expect("write");
        assert_eq!(minor_from_procfs(dir.path(), "00000000:18:00.0"), Some(5));
        assert_eq!(minor_from_procfs(dir.path(), "0000:18:00.0"), Some(5));
        assert_eq!(minor_from_procfs(dir.path(), "0000:19:00.0"), None);
        assert_eq!(minor_from_procfs(dir.path(), ""), None);
    }
}
