//! The generated gRPC code is checked in so builds need neither protoc nor a build script. This test regenerates it
//! with protox + tonic-prost-build and fails when the checked-in copy has drifted from the .proto files.
//! Regenerate with `BC_UPDATE_GOLDEN=1 cargo test -p bc-proto --test codegen_drift` (the checked-in copy is a golden
//! file: bc_testkit::assert_golden).

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
        // A tunnel's bytes: decoded as a slice of the received buffer, not copied into a Vec at every hop.
        .bytes(".bettercompute.v1.TunnelFrame.data")
        // prost's codec with small first buffers: an idle Session costs the gateway less (see codec.rs).
        .codec_path("crate::codec::LeanCodec")
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_fds(fds)?;
    let fresh = std::fs::read_to_string(out.path().join("bettercompute.v1.rs"))?;
    bc_testkit::assert_golden(root.join("src/gen/bettercompute.v1.rs"), &fresh);
    Ok(())
}

mod anyhow_free {
    pub type Result = std::result::Result<(), Box<dyn std::error::Error>>;
}
