//! The placer's view of free capacity: every free GPU, and the same GPUs by pool, kept in step, so a request
//! that names a pool is placed among that pool's nodes and one that does not among all.

use bc_core::placer::{Capacity, FreeGpu, NoCapacity, Placement};
use bc_core::reservation::ReservationRequest;
use bc_store::reservations::FreeDevice;
use std::collections::{BTreeMap, HashMap};

#[derive(Default)]
pub struct View {
    all: Capacity,
    by_pool: HashMap<String, Capacity>,
    pool_of: HashMap<String, String>,
}

impl View {
    pub fn clear(&mut self) {
        *self = View::default();
    }

    /// Adds free devices (after [`View::remove_node`] for nodes read again).
    pub fn fill(&mut self, devices: Vec<FreeDevice>) {
        let mut by_slot: BTreeMap<(String, String, String), Vec<FreeGpu>> = BTreeMap::new();
        for d in devices {
            by_slot
                .entry((d.node_id, d.model, d.pool))
                .or_default()
                .push(FreeGpu {
                    device_id: d.device_id,
                    uuid: d.uuid,
                    idx: d.idx,
                    clique: d.clique,
                });
        }
        for ((node, model, pool), gpus) in by_slot {
            self.by_pool
                .entry(pool.clone())
                .or_default()
                .set_node(&node, &model, gpus.clone());
            self.all.set_node(&node, &model, gpus);
            self.pool_of.insert(node, pool);
        }
    }

    pub fn remove_node(&mut self, node: &str) {
        self.all.remove_node(node);
        if let Some(pool) = self.pool_of.remove(node)
            && let Some(c) = self.by_pool.get_mut(&pool)
        {
            c.remove_node(node);
        }
    }

    /// Where `req` goes: among its pool's nodes when it names one, else among all.
    pub fn place(&self, req: &ReservationRequest) -> Result<Placement, NoCapacity> {
        match &req.pool {
            None => self.all.place(req),
            Some(pool) => match self.by_pool.get(pool.as_str()) {
                Some(c) => c.place(req),
                None => Err(NoCapacity(format!(
                    "pool {pool} has no free GPUs on an adopted node"
                ))),
            },
        }
    }

    /// Removes a placement's GPUs from every view.
    pub fn take(&mut self, p: &Placement) {
        self.all.take(p);
        let mut pools: Vec<&String> = p
            .parts
            .iter()
            .filter_map(|(node, _)| self.pool_of.get(node))
            .collect();
        pools.sort();
        pools.dedup();
        let pools: Vec<String> = pools.into_iter().cloned().collect();
        for pool in pools {
            if let Some(c) = self.by_pool.get_mut(&pool) {
                c.take(p);
            }
        }
    }
}
