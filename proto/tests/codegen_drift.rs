//! The generated gRPC code is checked in so builds need neither protoc nor a build script. This test regenerates it
//! with protox + tonic-prost-build and fails when the checked-in copy has drifted from the .proto files.
//! Regenerate with `BC_REGEN_PROTO=1 cargo test -p bc-proto --test codegen_drift`.

use std::path::Path;

#[test]
fn generated_code_matches_proto_files() -> anyhow_free::Result {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir()?;
    let fds = protox::compile(
        [root.join("proto/bettercompute/v1/node.proto")],
        [root.join("proto")],
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .generate_default_stubs(true)
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_fds(fds)?;
    let fresh = std::fs::read_to_string(out.path().join("bettercompute.v1.rs"))?;
    let checked_in_path = root.join("src/gen/bettercompute.v1.rs");
    if std::env::var_os("BC_REGEN_PROTO").is_some() {
        std::fs::write(&checked_in_path, &fresh)?;
        return Ok(());
    }
    let checked_in = std::fs::read_to_string(&checked_in_path)?;
    assert!(
        fresh == checked_in,
        "src/gen/bettercompute.v1.rs is stale: run BC_REGEN_PROTO=1 cargo test -p bc-proto --test codegen_drift"
    );
    Ok(())
}

mod anyhow_free {
    pub type Result = std::result::Result<(), Box<dyn std::error::Error>>;
}
