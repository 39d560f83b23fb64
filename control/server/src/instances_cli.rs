//! Operator and tenant commands of instances: `better-compute instances create|show|list|stop|start|reboot|delete|
//! set-pool`, thin typed calls of the instances module's API; each prints the answer as JSON.

use crate::client::ApiClient;
use anyhow::Context as _;
use bc_core::api::instances::{
    CreateInstance, InstanceById, InstanceImage, ListInstances, PoolClass, SetInstancePool,
};
use bc_mod_instances::methods::{
    CreateInstanceMethod, DeleteInstanceMethod, ListInstancesMethod, RebootInstanceMethod,
    SetInstancePoolMethod, ShowInstanceMethod, StartInstanceMethod, StopInstanceMethod,
};
use clap::Subcommand;
use std::path::PathBuf;

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

#[derive(Subcommand)]
pub enum InstanceCommand {
    /// Create an instance (a VM) on a vps-host pool: admitted under the idempotency key, placed on a node with
    /// enough free vCPUs, memory, disk and GPUs, then run by that node's bcd.
    Create {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        pool: String,
        #[arg(long, default_value_t = 1)]
        vcpus: u32,
        #[arg(long, default_value_t = 1024)]
        memory_mib: u32,
        #[arg(long, default_value_t = 10)]
        disk_gib: u32,
        /// GPUs passed through to the VM (whole devices, with VFIO).
        #[arg(long, default_value_t = 0)]
        gpus: u32,
        /// http(s) URL of the disk image (raw or qcow2).
        #[arg(long)]
        image_url: String,
        /// SHA-256 of the image file as served (64 lowercase hex).
        #[arg(long)]
        image_sha256: String,
        /// A cloud-init user-data file (default `#cloud-config {}`).
        #[arg(long)]
        user_data: Option<PathBuf>,
        /// An OpenSSH public key line for the image's default user (repeatable).
        #[arg(long = "ssh-key")]
        ssh_keys: Vec<String>,
        #[arg(long)]
        hostname: Option<String>,
        /// Retrying with the same key and body returns the same instance.
        #[arg(long)]
        idempotency_key: Option<String>,
    },
    /// Show one instance, with what its node last reported (state, cloud-init done).
    Show { id: String },
    /// List instances (the caller's tenant, or every tenant for a root caller), newest first.
    List {
        #[arg(long)]
        tenant: Option<String>,
        /// Include deleted instances.
        #[arg(long)]
        deleted: bool,
        #[arg(long)]
        limit: Option<i64>,
    },
    /// Stop the VM (ACPI power button, forced at the node's stop deadline); its disk is kept.
    Stop { id: String },
    /// Start a stopped VM.
    Start { id: String },
    /// Reset the running VM once.
    Reboot { id: String },
    /// Delete the instance: its node kills the VM and removes its disk; its vCPUs, memory, disk and GPUs go back
    /// to the pool.
    Delete { id: String },
    /// Make a pool a hosted pool (`vps-host`: its nodes run bcd with [vmm]) or a `provider` pool.
    SetPool {
        pool: String,
        class: String,
        /// A provider pool's configuration, a JSON file: kind, endpoint, region, credentials {site, name},
        /// instance_types, images (docs/instances.md).
        #[arg(long)]
        provider: Option<PathBuf>,
    },
}

pub async fn instances(client: &ApiClient, command: InstanceCommand) -> anyhow::Result<()> {
    let by_id = |id: String| InstanceById { id };
    let out = match command {
        InstanceCommand::Create {
            tenant,
            pool,
            vcpus,
            memory_mib,
            disk_gib,
            gpus,
            image_url,
            image_sha256,
            user_data,
            ssh_keys,
            hostname,
            idempotency_key,
        } => {
            let user_data = user_data
                .map(|p| {
                    std::fs::read_to_string(&p)
                        .with_context(|| format!("reading --user-data {}", p.display()))
                })
                .transpose()?;
            let request = CreateInstance {
                tenant,
                pool,
                vcpus,
                memory_mib,
                disk_gib,
                gpus,
                image: InstanceImage {
                    url: image_url,
                    sha256: image_sha256,
                },
                user_data,
                ssh_keys,
                hostname,
                idempotency_key,
            };
            request
                .request()
                .validate()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            json(&client.method::<CreateInstanceMethod>(&request).await?)
        }
        InstanceCommand::Show { id } => {
            json(&client.method::<ShowInstanceMethod>(&by_id(id)).await?)
        }
        InstanceCommand::List {
            tenant,
            deleted,
            limit,
        } => json(
            &client
                .method::<ListInstancesMethod>(&ListInstances {
                    tenant,
                    deleted,
                    limit,
                })
                .await?,
        ),
        InstanceCommand::Stop { id } => {
            json(&client.method::<StopInstanceMethod>(&by_id(id)).await?)
        }
        InstanceCommand::Start { id } => {
            json(&client.method::<StartInstanceMethod>(&by_id(id)).await?)
        }
        InstanceCommand::Reboot { id } => {
            json(&client.method::<RebootInstanceMethod>(&by_id(id)).await?)
        }
        InstanceCommand::Delete { id } => {
            json(&client.method::<DeleteInstanceMethod>(&by_id(id)).await?)
        }
        InstanceCommand::SetPool {
            pool,
            class,
            provider,
        } => {
            let class = PoolClass::parse(&class)
                .with_context(|| format!("class {class:?}: use \"vps-host\" or \"provider\""))?;
            let provider = match provider {
                None => None,
                Some(path) => {
                    let text = std::fs::read_to_string(&path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    Some(serde_json::from_str(&text).with_context(|| {
                        format!("{}: a provider pool's configuration", path.display())
                    })?)
                }
            };
            json(
                &client
                    .method::<SetInstancePoolMethod>(&SetInstancePool {
                        pool,
                        class,
                        provider,
                    })
                    .await?,
            )
        }
    };
    println!("{out}");
    Ok(())
}
