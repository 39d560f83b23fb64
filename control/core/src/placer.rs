//! The placer's decision: which free GPUs a reservation gets. Pure and synchronous; the scheduler keeps a
//! [`Capacity`] in memory, asks [`Capacity::place`], books the answer in the database (`FOR UPDATE SKIP LOCKED` on
//! the devices), and on success [`Capacity::take`]s it. The database stays the arbiter: a stale capacity view
//! costs a retry, never a double booking.
//!
//! Policy: best fit (the node with the fewest free GPUs that still fits) keeps whole nodes free for large requests;
//! inside a node, the smallest NVLink clique that fits; `any` packs into already-used nodes first.

use crate::reservation::{ReservationRequest, Topology};
use std::collections::{BTreeMap, BTreeSet, HashMap};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeGpu {
    pub device_id: String,
    pub uuid: String,
    pub idx: i32,
    pub clique: Option<String>,
}

/// A node's free GPUs of one model.
type Slot = (String, String); // (node id, model)

#[derive(Debug, Default)]
pub struct Capacity {
    slots: HashMap<Slot, Vec<FreeGpu>>,
    /// Per model, (free count, node id) in ascending order: best fit is the first entry at or above the need.
    index: BTreeMap<String, BTreeSet<(usize, String)>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub model: String,
    /// (node id, GPUs on it), in node order.
    pub parts: Vec<(String, Vec<FreeGpu>)>,
}

impl Placement {
    pub fn gpu_count(&self) -> usize {
        self.parts.iter().map(|(_, g)| g.len()).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NoCapacity(pub String);

impl Capacity {
    /// Replaces what is known free on `node` for `model` (a reload from the database).
    pub fn set_node(&mut self, node: &str, model: &str, mut gpus: Vec<FreeGpu>) {
        let key = (node.to_string(), model.to_string());
        self.unindex(&key);
        gpus.sort_by_key(|g| g.idx);
        if !gpus.is_empty() {
            self.index
                .entry(model.to_string())
                .or_default()
                .insert((gpus.len(), node.to_string()));
            self.slots.insert(key, gpus);
        }
    }

    /// Forgets every model's free GPUs on `node`.
    pub fn remove_node(&mut self, node: &str) {
        let keys: Vec<Slot> = self
            .slots
            .keys()
            .filter(|(n, _)| n == node)
            .cloned()
            .collect();
        for k in keys {
            self.unindex(&k);
        }
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.index.clear();
    }

    fn unindex(&mut self, key: &Slot) {
        if let Some(old) = self.slots.remove(key)
            && let Some(set) = self.index.get_mut(&key.1)
        {
            set.remove(&(old.len(), key.0.clone()));
            if set.is_empty() {
                self.index.remove(&key.1);
            }
        }
    }

    pub fn free_gpus(&self) -> usize {
        self.slots.values().map(Vec::len).sum()
    }

    /// Removes a placement's GPUs (after the database booked them).
    pub fn take(&mut self, p: &Placement) {
        for (node, gpus) in &p.parts {
            let key = (node.clone(), p.model.clone());
            let Some(free) = self.slots.get(&key) else {
                continue;
            };
            let rest: Vec<FreeGpu> = free
                .iter()
                .filter(|g| !gpus.iter().any(|t| t.device_id == g.device_id))
                .cloned()
                .collect();
            self.set_node(node, &p.model, rest);
        }
    }

    /// Decides where `req` goes, or says why it cannot.
    pub fn place(&self, req: &ReservationRequest) -> Result<Placement, NoCapacity> {
        let need = req.gpus as usize;
        let models: Vec<&String> = match &req.model {
            Some(m) => self
                .index
                .get_key_value(m)
                .map(|(k, _)| k)
                .into_iter()
                .collect(),
            None => self.index.keys().collect(),
        };
        let found = match req.topology {
            Topology::Node => self.best_node(&models, need, false),
            Topology::Nvlink => self
                .best_node(&models, need, true)
                .or_else(|| self.cross_node_clique(&models, need)),
            Topology::Any => self
                .best_node(&models, need, false)
                .or_else(|| self.packed(&models, need)),
        };
        found.ok_or_else(|| NoCapacity(self.explain(req, &models)))
    }

    /// The best-fitting single node: the fewest free GPUs that still fit (ties by node id), across the models.
    fn best_node(&self, models: &[&String], need: usize, nvlink: bool) -> Option<Placement> {
        let mut best: Option<(usize, &str, &String, Vec<FreeGpu>)> = None;
        for model in models {
            let Some(set) = self.index.get(*model) else {
                continue;
            };
            for (free, node) in set.range((need, String::new())..) {
                if best.as_ref().is_some_and(|b| (b.0, b.1) <= (*free, node)) {
                    break;
                }
                let gpus = &self.slots[&(node.clone(), (*model).clone())];
                if let Some(chosen) = choose_in_node(gpus, need, nvlink) {
                    best = Some((*free, node, model, chosen));
                    break;
                }
            }
        }
        best.map(|(_, node, model, gpus)| Placement {
            model: model.clone(),
            parts: vec![(node.to_string(), gpus)],
        })
    }

    /// All GPUs in one clique spanning nodes (a multi-node NVLink fabric): the smallest clique that fits, filled
    /// from its nodes with the most free GPUs first so it touches as few nodes as possible.
    fn cross_node_clique(&self, models: &[&String], need: usize) -> Option<Placement> {
        for model in models {
            let mut cliques: BTreeMap<&str, Vec<(&str, Vec<&FreeGpu>)>> = BTreeMap::new();
            for ((node, m), gpus) in &self.slots {
                if m != *model {
                    continue;
                }
                let mut by_clique: BTreeMap<&str, Vec<&FreeGpu>> = BTreeMap::new();
                for g in gpus {
                    if let Some(c) = &g.clique {
                        by_clique.entry(c).or_default().push(g);
                    }
                }
                for (c, gs) in by_clique {
                    cliques.entry(c).or_default().push((node, gs));
                }
            }
            let best = cliques
                .into_iter()
                .map(|(c, nodes)| (nodes.iter().map(|(_, g)| g.len()).sum::<usize>(), c, nodes))
                .filter(|(total, _, _)| *total >= need)
                .min_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
            if let Some((_, _, mut nodes)) = best {
                nodes.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(b.0)));
                return Some(fill((*model).clone(), nodes, need));
            }
        }
        None
    }

    /// Anywhere, one model: nodes with the fewest free GPUs first, so whole nodes stay whole.
    fn packed(&self, models: &[&String], need: usize) -> Option<Placement> {
        for model in models {
            let Some(set) = self.index.get(*model) else {
                continue;
            };
            if set.iter().map(|(f, _)| f).sum::<usize>() < need {
                continue;
            }
            let nodes = set
                .iter()
                .map(|(_, node)| {
                    let gpus = &self.slots[&(node.clone(), (*model).clone())];
                    (node.as_str(), gpus.iter().collect::<Vec<_>>())
                })
                .collect();
            return Some(fill((*model).clone(), nodes, need));
        }
        None
    }

    fn explain(&self, req: &ReservationRequest, models: &[&String]) -> String {
        let what = req.model.as_deref().unwrap_or("GPUs");
        let mut total = 0;
        let mut largest = 0;
        for model in models {
            if let Some(set) = self.index.get(*model) {
                total += set.iter().map(|(f, _)| f).sum::<usize>();
                largest = largest.max(set.iter().next_back().map_or(0, |(f, _)| *f));
            }
        }
        match req.topology {
            Topology::Node => format!(
                "no capacity: no node has {} free {what} (largest free block {largest}, {total} free in all)",
                req.gpus
            ),
            Topology::Nvlink => format!(
                "no capacity: no NVLink clique has {} free {what} ({total} free in all)",
                req.gpus
            ),
            Topology::Any => format!(
                "no capacity: {} {what} requested, {total} free of one model",
                req.gpus
            ),
        }
    }
}

/// The GPUs to take inside one node: the smallest clique group that fits (lowest indices), else (unless NVLink is
/// required) the lowest indices.
fn choose_in_node(gpus: &[FreeGpu], need: usize, nvlink: bool) -> Option<Vec<FreeGpu>> {
    if gpus.len() < need {
        return None;
    }
    let mut by_clique: BTreeMap<&str, Vec<&FreeGpu>> = BTreeMap::new();
    for g in gpus {
        if let Some(c) = &g.clique {
            by_clique.entry(c).or_default().push(g);
        }
    }
    let group = by_clique
        .values()
        .filter(|g| g.len() >= need)
        .min_by_key(|g| g.len());
    match group {
        Some(g) => Some(g.iter().take(need).map(|g| (*g).clone()).collect()),
        None if nvlink => None,
        None => Some(gpus.iter().take(need).cloned().collect()),
    }
}

fn fill(model: String, nodes: Vec<(&str, Vec<&FreeGpu>)>, need: usize) -> Placement {
    let mut left = need;
    let mut parts = Vec::new();
    for (node, gpus) in nodes {
        if left == 0 {
            break;
        }
        let take: Vec<FreeGpu> = gpus.iter().take(left).map(|g| (*g).clone()).collect();
        left -= take.len();
        parts.push((node.to_string(), take));
    }
    parts.sort_by(|a, b| a.0.cmp(&b.0));
    Placement { model, parts }
}

#[cfg(test)]
#[path = "placer_tests.rs"]
mod tests;
