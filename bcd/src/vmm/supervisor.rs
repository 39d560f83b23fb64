//! The supervisor: the executor of [`plan::decide`]. Once a second (and whenever the desired list changes or a step
//! finishes) it observes every instance (its record, `Vmm::status`), asks the planner for the next step and runs
//! it as a task of its own, one step per instance at a time, so a slow image fetch never holds up another
//! instance's stop. It keeps the status table the session reports (inventory section `instances`) and
//! `<state_dir>/status.json` (written atomically when it changes), rotates the console logs and notices cloud-init's
//! final message.
//!
//! On start it reads the records of the instances on disk and takes them as the desired list until a desired state
//! arrives, so a restarted bcd re-adopts running VMs (same QEMU processes, found through their pidfiles and QMP
//! sockets) instead of stopping them. On shutdown it stops nothing: the VMs outlive bcd.

use crate::vmm::plan::{self, Failure, Observed, Record, StepKind};
use crate::vmm::{
    InstanceHost, InstanceSpec, InstanceStatus, LocalGpu, Power, VmStatus, Vmm, console,
    image::ImageStore, instance_dir,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// How often every instance is observed.
pub const TICK: Duration = Duration::from_secs(1);
/// A VM that exits this soon after starting, while it should run, counts as a failed start (no tight restart loop).
const EARLY_EXIT: Duration = Duration::from_secs(30);
pub const RECORD: &str = "instance.json";
pub const STATUS_FILE: &str = "status.json";

/// One desired instance with its GPUs resolved to PCI addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    spec: InstanceSpec,
    gpu_addrs: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default)]
struct Desired {
    instances: BTreeMap<String, Entry>,
}

/// The record on disk: the planner's [`Record`] plus the GPUs' PCI addresses (a GPU bound to vfio-pci is no longer
/// visible to NVML, so its address must be remembered).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct StoredRecord {
    #[serde(flatten)]
    record: Record,
    #[serde(default)]
    gpu_addrs: BTreeMap<String, String>,
}

struct Shared {
    state_dir: PathBuf,
    desired: watch::Sender<Desired>,
    records: Mutex<BTreeMap<String, StoredRecord>>,
    status: Mutex<BTreeMap<String, InstanceStatus>>,
    changes: watch::Sender<u64>,
}

/// The supervisor's handle: cheap to clone; the session holds one as its [`InstanceHost`].
pub struct Supervisor<V: Vmm> {
    vmm: Arc<V>,
    images: ImageStore,
    stop_timeout: Duration,
    console_max_bytes: u64,
    shared: Arc<Shared>,
}

impl<V: Vmm> Clone for Supervisor<V> {
    fn clone(&self) -> Self {
        Supervisor {
            vmm: self.vmm.clone(),
            images: self.images.clone(),
            stop_timeout: self.stop_timeout,
            console_max_bytes: self.console_max_bytes,
            shared: self.shared.clone(),
        }
    }
}

/// What a finished step reports back to the loop.
struct Done {
    id: String,
    step: StepKind,
    generation: u64,
    result: Result<(), String>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

impl<V: Vmm> Supervisor<V> {
    /// A supervisor over `vmm`, keeping images under `<state_dir>/images` and reading the records of the
    /// instances already on disk (they are the desired list until [`InstanceHost::apply`] is first called).
    pub fn new(
        vmm: V,
        state_dir: &Path,
        images: ImageStore,
        stop_timeout: Duration,
        console_max_bytes: u64,
    ) -> std::io::Result<Supervisor<V>> {
        std::fs::create_dir_all(state_dir.join("instances"))?;
        let records = load_records(state_dir);
        let adopted = Desired {
            instances: records
                .iter()
                .map(|(id, r)| {
                    (
                        id.clone(),
                        Entry {
                            spec: r.record.current.clone(),
                            gpu_addrs: r.gpu_addrs.clone(),
                        },
                    )
                })
                .collect(),
        };
        if !records.is_empty() {
            tracing::info!(
                instances = records.len(),
                "instances found on disk; adopting them"
            );
        }
        Ok(Supervisor {
            vmm: Arc::new(vmm),
            images,
            stop_timeout,
            console_max_bytes,
            shared: Arc::new(Shared {
                state_dir: state_dir.to_path_buf(),
                desired: watch::channel(adopted).0,
                records: Mutex::new(records),
                status: Mutex::new(BTreeMap::new()),
                changes: watch::channel(0).0,
            }),
        })
    }

    pub fn vmm(&self) -> &V {
        &self.vmm
    }

    /// The current status table.
    pub fn statuses(&self) -> Vec<InstanceStatus> {
        lock(&self.shared.status).values().cloned().collect()
    }

    /// Runs until `shutdown` resolves. Steps in flight are abandoned at shutdown (each is idempotent and is
    /// planned again by the next bcd); VMs keep running.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut desired_rx = self.shared.desired.subscribe();
        let (done_tx, mut done_rx) = mpsc::channel::<Done>(64);
        let mut busy: BTreeSet<String> = BTreeSet::new();
        let mut failures: HashMap<String, Failure> = HashMap::new();
        let mut started: HashMap<String, Instant> = HashMap::new();
        let mut cloud_init: HashMap<String, (u64, bool)> = HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = desired_rx.changed() => {}
                Some(done) = done_rx.recv() => {
                    busy.remove(&done.id);
                    match done.result {
                        Ok(()) => {
                            if done.step == StepKind::Start {
                                started.insert(done.id.clone(), Instant::now());
                                cloud_init.remove(&done.id);
                            }
                            if done.step == StepKind::Delete {
                                // The status table drops the instance below, in this pass, when it finds nothing
                                // left of it; removing it here first hid that change from `publish`, so the
                                // session never reported the VM gone and the delete was never confirmed.
                                failures.remove(&done.id);
                                self.remove_unused_images();
                            } else {
                                failures.remove(&done.id);
                            }
                        }
                        Err(reason) => {
                            tracing::warn!(instance = done.id, step = ?done.step, %reason, "instance step failed");
                            let count = failures.get(&done.id).filter(|f| f.step == done.step).map_or(0, |f| f.count) + 1;
                            failures.insert(done.id.clone(), Failure {
                                step: done.step,
                                reason,
                                generation: done.generation,
                                count,
                                retry_at: Instant::now() + plan::backoff(count),
                            });
                        }
                    }
                }
                _ = tick.tick() => {}
            }
            while tasks.try_join_next().is_some() {}
            let desired = desired_rx.borrow_and_update().clone();
            let records = lock(&self.shared.records).clone();
            let mut ids: BTreeSet<String> = desired.instances.keys().cloned().collect();
            ids.extend(records.keys().cloned());
            ids.extend(dirs_on_disk(&self.shared.state_dir));
            ids.extend(lock(&self.shared.status).keys().cloned());
            let mut table = lock(&self.shared.status).clone();
            for id in &ids {
                if busy.contains(id) {
                    continue;
                }
                let entry = desired.instances.get(id);
                let vm = match self.vmm.status(id).await {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::warn!(instance = id, error = %crate::join::error_chain(&e), "observing the VM failed");
                        None
                    }
                };
                // A VM that should run but exited soon after it started: a failed start, backed off.
                if let (Some(e), Some(VmStatus::Stopped)) = (entry, &vm)
                    && e.spec.power == Power::Running
                    && let Some(at) = started.remove(id)
                    && at.elapsed() < EARLY_EXIT
                {
                    let count = failures.get(id).map_or(0, |f| f.count) + 1;
                    failures.insert(id.clone(), Failure {
                        step: StepKind::Start,
                        reason: format!(
                            "the VM exited {} s after it started: see its console log (instance.console)",
                            at.elapsed().as_secs()
                        ),
                        generation: e.spec.generation,
                        count,
                        retry_at: Instant::now() + plan::backoff(count),
                    });
                }
                let observed = Observed {
                    record: records.get(id).map(|r| r.record.clone()),
                    on_disk: instance_dir(&self.shared.state_dir, id).exists(),
                    vm: vm.clone(),
                    failure: failures.get(id).cloned(),
                };
                let decision = plan::decide(entry.map(|e| &e.spec), &observed, Instant::now());
                if entry.is_none() && decision.step.is_none() {
                    table.remove(id);
                    failures.remove(id);
                    continue;
                }
                let log = instance_dir(&self.shared.state_dir, id).join(console::FILE);
                let _ = console::rotate_if_over(&log, self.console_max_bytes);
                let pid = match &vm {
                    Some(VmStatus::Running { pid, .. }) => Some(*pid),
                    _ => None,
                };
                let done = pid.is_some() && {
                    let len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
                    let seen = cloud_init.entry(id.clone()).or_insert((u64::MAX, false));
                    if !seen.1 && seen.0 != len {
                        *seen = (len, console::cloud_init_done(&log));
                        if seen.1 {
                            tracing::info!(
                                instance = id,
                                "cloud-init reported done on the console"
                            );
                        }
                    }
                    seen.1
                };
                let generation = entry.map_or_else(
                    || records.get(id).map_or(0, |r| r.record.current.generation),
                    |e| e.spec.generation,
                );
                let passthrough = if pid.is_some() {
                    let mut v: Vec<String> = records
                        .get(id)
                        .map(|r| r.gpu_addrs.values().cloned().collect())
                        .unwrap_or_default();
                    v.sort();
                    v
                } else {
                    Vec::new()
                };
                table.insert(
                    id.clone(),
                    InstanceStatus {
                        id: id.clone(),
                        generation,
                        state: decision.state,
                        reason: decision.reason.clone(),
                        pid,
                        accel: pid.map(|_| self.vmm.accel()),
                        cloud_init_done: done,
                        passthrough,
                    },
                );
                if let Some(step) = decision.step {
                    busy.insert(id.clone());
                    let me = self.clone();
                    let tx = done_tx.clone();
                    let id = id.clone();
                    let entry = entry.cloned();
                    tasks.spawn(async move {
                        let generation = entry.as_ref().map_or(0, |e| e.spec.generation);
                        let result = me.step(step, &id, entry).await;
                        let _ = tx
                            .send(Done {
                                id,
                                step,
                                generation,
                                result,
                            })
                            .await;
                    });
                }
            }
            self.publish(table);
        }
        tasks.abort_all();
    }

    /// Runs one step; Err is the reason to report.
    async fn step(&self, step: StepKind, id: &str, entry: Option<Entry>) -> Result<(), String> {
        let chain = |e: &(dyn std::error::Error + 'static)| bc_error_chain::chain(e);
        match (step, entry) {
            (StepKind::Delete, _) => {
                self.vmm.delete(id).await.map_err(|e| chain(&e))?;
                lock(&self.shared.records).remove(id);
                tracing::info!(instance = id, "instance deleted: VM, disk and seed removed");
                Ok(())
            }
            (StepKind::Create, Some(e)) => {
                let image = self
                    .images
                    .ensure(&e.spec.image.url, &e.spec.image.sha256)
                    .await
                    .map_err(|err| chain(&err))?;
                if let Err(err) = self.vmm.create(&e.spec, &image).await {
                    // Nothing half-made stays behind (the record is written only once everything is there).
                    let _ = self.vmm.delete(id).await;
                    return Err(chain(&err));
                }
                let record = StoredRecord {
                    record: Record {
                        created: e.spec.clone(),
                        current: e.spec.clone(),
                        reboots_applied: e.spec.reboots,
                    },
                    gpu_addrs: e.gpu_addrs.clone(),
                };
                self.store_record(id, record)?;
                tracing::info!(
                    instance = id,
                    image = e.spec.image.sha256,
                    "instance created: disk overlay and seed made"
                );
                Ok(())
            }
            (StepKind::Start, Some(e)) => {
                let addrs: Vec<String> = e.gpu_addrs.values().cloned().collect();
                let pid = self
                    .vmm
                    .start(&e.spec, &addrs)
                    .await
                    .map_err(|err| chain(&err))?;
                self.update_record(id, |r| {
                    r.record.current = e.spec.clone();
                    r.record.reboots_applied = e.spec.reboots;
                    r.gpu_addrs = e.gpu_addrs.clone();
                })?;
                tracing::info!(instance = id, pid, "VM started");
                Ok(())
            }
            (StepKind::Stop, Some(e)) => {
                let outcome = self
                    .vmm
                    .stop(id, self.stop_timeout)
                    .await
                    .map_err(|err| chain(&err))?;
                self.update_record(id, |r| r.record.current = e.spec.clone())?;
                tracing::info!(instance = id, ?outcome, "VM stopped");
                Ok(())
            }
            (StepKind::Reboot, Some(e)) => {
                self.vmm.reboot(id).await.map_err(|err| chain(&err))?;
                self.update_record(id, |r| {
                    r.record.reboots_applied = e.spec.reboots;
                    r.record.current = e.spec.clone();
                })?;
                tracing::info!(instance = id, "VM reset");
                Ok(())
            }
            (step, None) => Err(format!("{step:?} without a desired instance")),
        }
    }

    fn store_record(&self, id: &str, record: StoredRecord) -> Result<(), String> {
        let path = instance_dir(&self.shared.state_dir, id).join(RECORD);
        let json = serde_json::to_vec_pretty(&record).map_err(|e| e.to_string())?;
        write_atomic(&path, &json).map_err(|e| format!("writing {}: {e}", path.display()))?;
        lock(&self.shared.records).insert(id.to_string(), record);
        Ok(())
    }

    fn update_record(&self, id: &str, f: impl FnOnce(&mut StoredRecord)) -> Result<(), String> {
        let Some(mut r) = lock(&self.shared.records).get(id).cloned() else {
            return Err(format!("instance {id} has no record"));
        };
        f(&mut r);
        self.store_record(id, r)
    }

    /// Deletes images no instance record refers to any more.
    fn remove_unused_images(&self) {
        let used: BTreeSet<String> = lock(&self.shared.records)
            .values()
            .map(|r| r.record.created.image.sha256.clone())
            .collect();
        let dir = self.shared.state_dir.join("images").join("sha256");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if crate::vmm::is_sha256_hex(&name) && !used.contains(&name) {
                self.images.remove(&name);
            }
        }
    }

    /// Replaces the status table; writes status.json and tells subscribers when it changed.
    fn publish(&self, table: BTreeMap<String, InstanceStatus>) {
        let changed = {
            let mut cur = lock(&self.shared.status);
            let changed = *cur != table;
            *cur = table.clone();
            changed
        };
        if !changed {
            return;
        }
        let doc = section_json(&table);
        let path = self.shared.state_dir.join(STATUS_FILE);
        if let Err(e) = write_atomic(&path, doc.to_string().as_bytes()) {
            tracing::warn!(path = %path.display(), error = %e, "writing the status file failed");
        }
        self.shared.changes.send_modify(|v| *v += 1);
    }
}

/// The inventory section's document: `{"instances": [status, …]}` in id order.
fn section_json(table: &BTreeMap<String, InstanceStatus>) -> serde_json::Value {
    serde_json::json!({ "instances": table.values().collect::<Vec<_>>() })
}

/// The ids of instance directories on disk.
fn dirs_on_disk(state_dir: &Path) -> Vec<String> {
    std::fs::read_dir(state_dir.join("instances"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|id| crate::vmm::spec::valid_id(id))
                .collect()
        })
        .unwrap_or_default()
}

fn load_records(state_dir: &Path) -> BTreeMap<String, StoredRecord> {
    let mut out = BTreeMap::new();
    for id in dirs_on_disk(state_dir) {
        let path = instance_dir(state_dir, &id).join(RECORD);
        match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<StoredRecord>(&bytes) {
                Ok(r) if r.record.created.id == id => {
                    out.insert(id, r);
                }
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "record names another instance; ignored")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable instance record; the instance is treated as half-made")
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "reading an instance record failed")
            }
        }
    }
    out
}

impl<V: Vmm> InstanceHost for Supervisor<V> {
    fn apply(
        &self,
        generation: u64,
        instances: Vec<InstanceSpec>,
        gpus: &[LocalGpu],
    ) -> Result<(), String> {
        let records = lock(&self.shared.records).clone();
        let mut out = BTreeMap::new();
        for spec in instances {
            let mut addrs = BTreeMap::new();
            for uuid in &spec.gpus {
                let addr = gpus
                    .iter()
                    .find(|g| &g.uuid == uuid)
                    .map(|g| g.pci_bus_id.clone())
                    .or_else(|| {
                        records
                            .get(&spec.id)
                            .and_then(|r| r.gpu_addrs.get(uuid).cloned())
                    })
                    .ok_or_else(|| {
                        format!(
                            "instance {}: GPU {uuid} is not on this node (or its backend does not list it)",
                            spec.id
                        )
                    })?;
                let addr = crate::vmm::vfio::normalize_addr(&addr)
                    .map_err(|e| format!("instance {}: GPU {uuid}: {e}", spec.id))?;
                addrs.insert(uuid.clone(), addr);
            }
            out.insert(
                spec.id.clone(),
                Entry {
                    spec,
                    gpu_addrs: addrs,
                },
            );
        }
        tracing::info!(generation, instances = out.len(), "desired instances");
        self.shared.desired.send_replace(Desired { instances: out });
        Ok(())
    }

    fn section(&self) -> serde_json::Value {
        section_json(&lock(&self.shared.status))
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }
}

// === the console command ===

/// `instance.console {"id": "<instance>", "max_bytes": 16384}` → the console's tail (signed by the session like
/// every command result). At most 64 KiB per call.
pub struct ConsoleCommand<V: Vmm> {
    pub supervisor: Supervisor<V>,
}

/// The payload type of `instance.console` results.
pub const CONSOLE_PAYLOAD_TYPE: &str = "application/vnd.bettercompute.instance-console+json";

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleArgs {
    id: String,
    #[serde(default)]
    max_bytes: Option<usize>,
}

impl<V: Vmm> crate::commands::CommandHook for ConsoleCommand<V> {
    fn handles(&self, kind: &str) -> bool {
        kind == crate::vmm::CONSOLE_COMMAND
    }

    fn run(
        &self,
        command: &bc_proto::v1::Command,
        _progress: &crate::commands::ProgressReporter,
    ) -> Result<crate::commands::CommandOutput, String> {
        let args: ConsoleArgs = serde_json::from_slice(&command.args)
            .map_err(|e| format!("instance.console arguments: {e}"))?;
        if !crate::vmm::spec::valid_id(&args.id) {
            return Err("instance.console arguments: id: not an instance id".into());
        }
        let max = args.max_bytes.unwrap_or(16 * 1024).min(64 * 1024);
        let bytes = self
            .supervisor
            .vmm()
            .console(&args.id, max)
            .map_err(|e| crate::join::error_chain(&e))?;
        let payload = serde_json::json!({
            "id": args.id,
            "bytes": bytes.len(),
            "console": String::from_utf8_lossy(&bytes),
        });
        Ok(crate::commands::CommandOutput {
            payload_type: CONSOLE_PAYLOAD_TYPE.into(),
            payload: payload.to_string().into_bytes(),
        })
    }
}
