#![no_main]
//! The `instances` list of a node's desired state comes from the control plane as JSON: parsing never panics, and
//! whatever it accepts renders a NoCloud meta-data whose lines are exactly bcd's own (no value breaks out of its
//! quoted scalar).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(list) = bcd::vmm::spec::parse(&doc) else {
        return;
    };
    for spec in &list {
        let seed = bcd::vmm::seed::render(spec);
        let keys = spec.meta.ssh_keys.len();
        let want = 2 + if keys > 0 { 1 + keys } else { 0 };
        assert_eq!(seed.meta_data.lines().count(), want, "{:?}", seed.meta_data);
        for other in &list {
            let _ = spec.immutable_change(other);
        }
    }
});
