use super::*;
use crate::reservation::Topology;
use proptest::prelude::*;
use std::collections::HashSet;

const H100: &str = "NVIDIA H100 80GB HBM3";
const A10: &str = "NVIDIA A10";

fn gpus(node: &str, n: i32, clique: impl Fn(i32) -> Option<String>) -> Vec<FreeGpu> {
    (0..n)
        .map(|i| FreeGpu {
            device_id: format!("{node}/gpu/{i}"),
            uuid: format!("GPU-{node}-{i}"),
            idx: i,
            clique: clique(i),
        })
        .collect()
}

fn req(n: u32, topology: Topology, model: Option<&str>) -> ReservationRequest {
    ReservationRequest {
        tenant: "t".into(),
        gpus: n,
        model: model.map(str::to_string),
        topology,
        duration_s: 60,
        pool: None,
    }
}

#[test]
fn best_fit_keeps_whole_nodes_free() {
    let mut c = Capacity::default();
    c.set_node("a", H100, gpus("a", 8, |_| None));
    c.set_node("b", H100, gpus("b", 3, |_| None));
    c.set_node("c", H100, gpus("c", 2, |_| None));
    let p = c.place(&req(2, Topology::Node, None)).expect("fits");
    assert_eq!(p.parts[0].0, "c");
    let p = c.place(&req(3, Topology::Node, None)).expect("fits");
    assert_eq!(p.parts[0].0, "b");
    let p = c.place(&req(8, Topology::Node, None)).expect("fits");
    assert_eq!(p.parts[0].0, "a");
    let e = c.place(&req(9, Topology::Node, None)).expect_err("too big");
    assert!(e.0.contains("largest free block 8"), "{e}");
    assert!(e.0.contains("13 free"), "{e}");
}

#[test]
fn model_filter_and_take() {
    let mut c = Capacity::default();
    c.set_node("a", A10, gpus("a", 4, |_| None));
    c.set_node("b", H100, gpus("b", 8, |_| None));
    let p = c.place(&req(4, Topology::Node, Some(H100))).expect("fits");
    assert_eq!(p.parts[0].0, "b");
    c.take(&p);
    assert_eq!(c.free_gpus(), 8);
    let p2 = c.place(&req(4, Topology::Node, Some(H100))).expect("fits");
    let first: HashSet<_> = p.parts[0].1.iter().map(|g| &g.uuid).collect();
    assert!(p2.parts[0].1.iter().all(|g| !first.contains(&g.uuid)));
    c.take(&p2);
    assert!(c.place(&req(1, Topology::Node, Some(H100))).is_err());
    assert!(c.place(&req(1, Topology::Node, Some("B200"))).is_err());
    assert!(c.place(&req(1, Topology::Node, None)).is_ok());
}

#[test]
fn nvlink_prefers_one_clique_and_can_span_nodes() {
    let mut c = Capacity::default();
    // Node a: two cliques of 4. Node b: no NVLink.
    c.set_node(
        "a",
        H100,
        gpus("a", 8, |i| Some(if i < 4 { "x" } else { "y" }.into())),
    );
    c.set_node("b", H100, gpus("b", 8, |_| None));
    let p = c.place(&req(4, Topology::Nvlink, None)).expect("fits");
    assert_eq!(p.parts.len(), 1);
    assert_eq!(p.parts[0].0, "a");
    let cl: HashSet<_> = p.parts[0].1.iter().map(|g| g.clique.clone()).collect();
    assert_eq!(cl.len(), 1);
    // 6 in one clique: impossible within a (cliques of 4), node b has no NVLink.
    assert!(c.place(&req(6, Topology::Nvlink, None)).is_err());
    // Topology node takes 6 from b (8 free, no clique) or a; both fit, best fit by id is a.
    assert!(c.place(&req(6, Topology::Node, None)).is_ok());

    // A multi-node fabric clique "f" across nodes m1, m2 (4 each).
    let mut c = Capacity::default();
    c.set_node("m1", H100, gpus("m1", 4, |_| Some("f".into())));
    c.set_node("m2", H100, gpus("m2", 4, |_| Some("f".into())));
    let p = c
        .place(&req(6, Topology::Nvlink, None))
        .expect("fabric fits");
    assert_eq!(p.gpu_count(), 6);
    assert_eq!(p.parts.len(), 2);
}

#[test]
fn any_packs_partial_nodes_first() {
    let mut c = Capacity::default();
    c.set_node("a", H100, gpus("a", 8, |_| None));
    c.set_node("b", H100, gpus("b", 3, |_| None));
    c.set_node("c", H100, gpus("c", 3, |_| None));
    let p = c
        .place(&req(5, Topology::Any, None))
        .expect("fits on a alone");
    assert_eq!(p.parts.len(), 1, "a single node that fits wins");
    let p = c.place(&req(10, Topology::Any, None)).expect("spans");
    assert_eq!(p.gpu_count(), 10);
    let nodes: Vec<_> = p.parts.iter().map(|(n, g)| (n.as_str(), g.len())).collect();
    assert_eq!(nodes, vec![("a", 4), ("b", 3), ("c", 3)]);
    assert!(c.place(&req(15, Topology::Any, None)).is_err());
}

proptest! {
    /// Whatever the sequence of requests, no GPU is handed out twice and every placement matches its request.
    #[test]
    fn never_double_books(
        nodes in proptest::collection::vec((1i32..=8, 0u8..3), 1..12),
        asks in proptest::collection::vec((1u32..=10, 0u8..3), 1..40),
    ) {
        let mut c = Capacity::default();
        for (i, (n, cl)) in nodes.iter().enumerate() {
            let node = format!("n{i}");
            let cl = *cl;
            c.set_node(&node, H100, gpus(&node, *n, |g| match cl { 0 => None, 1 => Some(format!("c{i}")), _ => Some(format!("c{}", g % 2)) }));
        }
        let total = c.free_gpus();
        let mut seen = HashSet::new();
        for (n, t) in asks {
            let topology = [Topology::Node, Topology::Nvlink, Topology::Any][t as usize];
            if let Ok(p) = c.place(&req(n, topology, None)) {
                prop_assert_eq!(p.gpu_count(), n as usize);
                if topology == Topology::Node { prop_assert_eq!(p.parts.len(), 1); }
                if topology == Topology::Nvlink {
                    let cl: HashSet<_> = p.parts.iter().flat_map(|(_, g)| g.iter().map(|g| g.clique.clone())).collect();
                    prop_assert_eq!(cl.len(), 1);
                    prop_assert!(!cl.contains(&None));
                }
                for (_, g) in &p.parts {
                    for g in g {
                        prop_assert!(seen.insert(g.device_id.clone()), "{} twice", g.device_id);
                    }
                }
                c.take(&p);
                prop_assert_eq!(c.free_gpus() + seen.len(), total);
            }
        }
    }
}
