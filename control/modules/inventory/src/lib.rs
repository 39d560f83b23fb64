//! bc-mod-inventory: the control plane's inventory module. It records the inventory sections nodes report
//! ([`Inventory`], the [`InventorySink`] the nodes module's session backend calls): each is checked (a known
//! section, at most 1 MiB, the SHA-256 it declares, JSON), stored under the node's current session epoch, and a
//! `gpus` section, read as bc-proto's typed [`GpusSection`], becomes the node's bookable devices through
//! [`bc_core::devices::plan_gpu_sync`] (a GPU another live node holds is a condition here, never a second device).

use bc_core::api::inventory::{
    InventoryRefusal, InventorySink, MAX_SECTION_BYTES, RecordFuture, Recorded, SECTIONS,
    SectionReport,
};
use bc_core::devices::ReportedGpu;
use bc_proto::payloads::{GPUS_SECTION, GpusSection};
use bc_store::Store;

/// The inventory module's state: the store it records into.
#[derive(Clone)]
pub struct Inventory {
    store: Store,
}

/// The GPUs of a `gpus` section that are devices (a GPU without a UUID is not one).
pub fn reported_gpus(section: &GpusSection) -> Vec<ReportedGpu> {
    section
        .gpus
        .iter()
        .filter(|g| !g.uuid.is_empty())
        .map(|g| ReportedGpu {
            uuid: g.uuid.clone(),
            index: i32::try_from(g.index).unwrap_or(i32::MAX),
            model: g.model.clone(),
            clique: g.clique.clone().filter(|c| !c.is_empty()),
        })
        .collect()
}

fn unavailable(what: &str, e: &(dyn std::error::Error + 'static)) -> InventoryRefusal {
    tracing::error!(error = %bc_error_chain::InlineErrorChain::new(e), "{what}");
    InventoryRefusal::Unavailable(format!(
        "{what} failed; the control plane logged the cause, retry later"
    ))
}

impl Inventory {
    pub fn new(store: Store) -> Inventory {
        Inventory { store }
    }

    /// Checks, stores and derives one section.
    pub async fn record_section(&self, s: SectionReport<'_>) -> Result<Recorded, InventoryRefusal> {
        let invalid = |why: String| Err(InventoryRefusal::Invalid(why));
        if !SECTIONS.contains(&s.name) {
            return invalid(format!(
                "unknown inventory section {:?}: the sections are {}",
                s.name,
                SECTIONS.join(", ")
            ));
        }
        if s.payload.len() > MAX_SECTION_BYTES {
            return invalid(format!("section {} exceeds 1 MiB", s.name));
        }
        if bc_proto::sha256(s.payload).as_slice() != s.hash {
            return invalid(format!("section {}: hash does not match payload", s.name));
        }
        let payload: serde_json::Value = match serde_json::from_slice(s.payload) {
            Ok(v) => v,
            Err(e) => return invalid(format!("section {}: payload is not JSON: {e}", s.name)),
        };
        // The typed section first: a `gpus` section that does not read as one is refused before anything is kept.
        let gpus = match s.name == GPUS_SECTION {
            false => None,
            true => match serde_json::from_value::<GpusSection>(payload.clone()) {
                Ok(g) => Some(reported_gpus(&g)),
                Err(e) => return invalid(format!("section gpus: {e}")),
            },
        };
        let stored = self
            .store
            .put_inventory(
                s.node.as_str(),
                s.epoch,
                s.name,
                &hex::encode(s.hash),
                &payload,
            )
            .await
            .map_err(|e| unavailable("storing the inventory section", &e))?;
        if !stored {
            return Ok(Recorded::Stale);
        }
        if let Some(gpus) = gpus {
            let sync = self
                .store
                .sync_reported_gpus(s.node.as_str(), &gpus)
                .await
                .map_err(|e| unavailable("deriving the node's devices", &e))?;
            if !sync.conflicted.is_empty() {
                tracing::warn!(
                    node_id = s.node.as_str(),
                    conflicts = sync.conflicted.len(),
                    "GPUs reported that other nodes hold: not bookable here"
                );
            }
        }
        Ok(Recorded::Stored)
    }
}

impl InventorySink for Inventory {
    fn record<'a>(&'a self, section: SectionReport<'a>) -> RecordFuture<'a> {
        Box::pin(self.record_section(section))
    }
}
