//! Starting the VMM inside `bcd run`: reads `[vmm]` from bcd.toml, chooses the accelerator (a probe boot for
//! `auto`), and returns the supervisor as the session's [`InstanceHost`] and `instance.console` hook, with its task.
//! A bcd.toml without `[vmm]` starts nothing.

use crate::vmm::config::{self, VmmConfigError};
use crate::vmm::image::{ImageError, ImageStore};
use crate::vmm::qemu::Qemu;
use crate::vmm::supervisor::{ConsoleCommand, Supervisor};
use crate::vmm::vfio::Sysfs;
use crate::vmm::{InstanceHost, accel};
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] VmmConfigError),
    #[error("the VMM's image store")]
    Images(#[from] ImageError),
    #[error("creating the VMM's state directory {path}")]
    StateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The running VMM of `bcd run`.
pub struct Started {
    pub host: Arc<dyn InstanceHost>,
    pub hook: Arc<dyn crate::commands::CommandHook>,
    pub task: tokio::task::JoinHandle<()>,
}

/// The supervisor for bcd.toml's `[vmm]` table, running until `shutdown` (VMs keep running after it), or `None`
/// when the file has no such table.
pub async fn start(
    config_path: &Path,
    bcd_state_dir: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Option<Started>, StartError> {
    let Some(wire) = config::from_file(config_path)? else {
        return Ok(None);
    };
    let cfg = wire.validate(&config_path.display().to_string(), bcd_state_dir)?;
    std::fs::create_dir_all(&cfg.state_dir).map_err(|source| StartError::StateDir {
        path: cfg.state_dir.clone(),
        source,
    })?;
    let (accel, why) = accel::choose(&cfg.qemu, cfg.accel, &cfg.state_dir).await;
    tracing::info!(accel = accel.as_str(), reason = why, state_dir = %cfg.state_dir.display(), "VMM started");
    let images = ImageStore::new(&cfg.state_dir.join("images"), cfg.image_ca_file.as_deref())?;
    let pci = Arc::new(Sysfs::new(&cfg.sysfs_root));
    let (state_dir, stop_timeout, console_max) = (
        cfg.state_dir.clone(),
        cfg.stop_timeout,
        cfg.console_max_bytes,
    );
    let supervisor = Supervisor::new(
        Qemu::new(cfg, accel, pci),
        &state_dir,
        images,
        stop_timeout,
        console_max,
    )
    .map_err(|source| StartError::StateDir {
        path: state_dir.clone(),
        source,
    })?;
    let hook = Arc::new(ConsoleCommand {
        supervisor: supervisor.clone(),
    });
    let host: Arc<dyn InstanceHost> = Arc::new(supervisor.clone());
    let task = tokio::spawn(supervisor.run(shutdown));
    Ok(Some(Started { host, hook, task }))
}
