#![no_main]
//! `instances.create`'s body comes from any API caller. Parsing and validation never panic, and what the API
//! admits the node accepts: the desired-state entry the control plane builds from an admitted request
//! (`bc_core::api::instances::desired_entry`, the same function the placement uses) must parse under bcd's own
//! strict desired-state parser. A request the API admits and the node refuses would fail the node's whole desired
//! state, every other instance on it included.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(create) = serde_json::from_slice::<bc_core::api::instances::CreateInstance>(data) else {
        return;
    };
    let request = create.request();
    if request.validate().is_err() {
        return;
    }
    let _ = request.body_hash();
    // The ids the control plane gives (`inst-` and a UUIDv7 in hex) and GPU UUIDs as NVML reports them.
    let gpus: Vec<String> = (0..request.gpus)
        .map(|i| format!("GPU-{i:08x}-0000-0000-0000-000000000000"))
        .collect();
    let entry = bc_core::api::instances::desired_entry(
        "inst-0190a1b2c3d4e5f6a7b8c9d0e1f2a3b4",
        1,
        &request,
        serde_json::json!(gpus),
        "running",
        0,
    );
    let doc = serde_json::json!({ "instances": [entry] });
    if let Err(e) = bcd::vmm::spec::parse(&doc) {
        panic!("the API admitted {request:?}, but the node refuses it: {e}");
    }
});
