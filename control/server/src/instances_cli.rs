//! Operator and tenant commands of instances: `better-compute instances create|show|list|stop|start|reboot|delete|
//! set-pool`, thin typed calls of the instances module's API. `list` prints a table and `show` the instance's
//! fields (`-o json|yaml`: the API's answer); a verb prints what it did in a line (`-o json|yaml`: the answer).

use crate::client::ApiClient;
use crate::output::{self, Format, Table};
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

/// An answer of a verb: a line in a table format, the answer itself in JSON or YAML.
fn done<T: serde::Serialize>(
    out: Format,
    v: &T,
    line: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    match out {
        Format::Table | Format::Wide => {
            println!("{}", line());
            Ok(())
        }
        _ => output::print(out, v, Table::default),
    }
}

/// One instance's line of a verb's answer.
fn summary(verb: &str, i: &bc_core::api::instances::Instance) -> String {
    format!(
        "{verb} instance {}: {}{}",
        i.id,
        i.state.as_str(),
        i.node
            .as_ref()
            .map(|n| format!(" on {n}"))
            .unwrap_or_default()
    )
}

/// `instances show` in a table format: its fields as lines.
fn describe(i: &bc_core::api::instances::Instance) {
    let now = output::now_ms();
    let r = &i.request;
    println!(
        "instance {}  tenant {}  state {}",
        i.id,
        i.tenant,
        i.state.as_str()
    );
    println!(
        "pool {}  node {}  created {} ago",
        r.pool,
        i.node.as_ref().map_or("-".to_string(), |n| n.to_string()),
        output::age(Some(i.created_at_ms), now)
    );
    println!(
        "vcpus {}  memory {} MiB  disk {} GiB  gpus {}",
        r.vcpus, r.memory_mib, r.disk_gib, r.gpus
    );
    println!("image {} (sha256 {})", r.image.url, r.image.sha256);
    if let Some(o) = &i.observed {
        println!(
            "observed: {} (generation {}, cloud-init {}){}",
            o.state,
            o.generation,
            if o.cloud_init_done { "done" } else { "running" },
            o.reason
                .as_ref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
    }
    if let Some(e) = &i.error {
        println!("error: {e}");
    }
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

/// `instances list`: a table (ID, tenant, pool, state, node, size, AGE) or the answer.
fn print_list(out: Format, v: &bc_core::api::instances::InstanceList) -> anyhow::Result<()> {
    let now = output::now_ms();
    output::print(out, v, || {
        let mut t = Table::new(&[
            "ID", "TENANT", "POOL", "STATE", "NODE", "VCPUS", "MEMORY", "GPUS", "AGE",
        ])
        .wide(&["DISK", "OBSERVED", "ERROR"]);
        for i in &v.instances {
            let r = &i.request;
            t.row(vec![
                i.id.clone(),
                i.tenant.to_string(),
                r.pool.clone(),
                i.state.as_str().to_string(),
                i.node.as_ref().map(|n| n.to_string()).unwrap_or_default(),
                r.vcpus.to_string(),
                format!("{}Mi", r.memory_mib),
                r.gpus.to_string(),
                output::age(Some(i.created_at_ms), now),
                format!("{}Gi", r.disk_gib),
                i.observed
                    .as_ref()
                    .map(|o| o.state.clone())
                    .unwrap_or_default(),
                i.error.clone().unwrap_or_default(),
            ]);
        }
        t
    })
}

pub async fn instances(
    client: &ApiClient,
    out: Format,
    command: InstanceCommand,
) -> anyhow::Result<()> {
    let by_id = |id: String| InstanceById { id };
    match command {
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
            let v = client.method::<CreateInstanceMethod>(&request).await?;
            done(out, &v, || summary("created", &v.instance))
        }
        InstanceCommand::Show { id } => {
            let v = client.method::<ShowInstanceMethod>(&by_id(id)).await?;
            match out {
                Format::Table | Format::Wide => {
                    describe(&v.instance);
                    Ok(())
                }
                _ => output::print(out, &v, Table::default),
            }
        }
        InstanceCommand::List {
            tenant,
            deleted,
            limit,
        } => {
            let v = client
                .method::<ListInstancesMethod>(&ListInstances {
                    tenant,
                    deleted,
                    limit,
                })
                .await?;
            print_list(out, &v)
        }
        InstanceCommand::Stop { id } => {
            let v = client.method::<StopInstanceMethod>(&by_id(id)).await?;
            done(out, &v, || summary("stopping", &v.instance))
        }
        InstanceCommand::Start { id } => {
            let v = client.method::<StartInstanceMethod>(&by_id(id)).await?;
            done(out, &v, || summary("starting", &v.instance))
        }
        InstanceCommand::Reboot { id } => {
            let v = client.method::<RebootInstanceMethod>(&by_id(id)).await?;
            done(out, &v, || summary("rebooting", &v.instance))
        }
        InstanceCommand::Delete { id } => {
            let v = client.method::<DeleteInstanceMethod>(&by_id(id)).await?;
            done(out, &v, || summary("deleting", &v.instance))
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
            let v = client
                .method::<SetInstancePoolMethod>(&SetInstancePool {
                    pool,
                    class,
                    provider,
                })
                .await?;
            done(out, &v, || {
                format!("pool {} is {}", v.pool, v.class.as_str())
            })
        }
    }
}
