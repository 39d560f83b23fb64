//! `better-compute`: the control plane binary. Everything lives in the library ([`bc_control::cli`]); this file
//! only stamps the version. The commit comes from `BC_COMMIT` at build time (scripts/package sets it), read here in
//! the binary crate alone, so a new commit relinks the binary and never rebuilds the library.

fn main() -> std::process::ExitCode {
    bc_control::cli::main(bc_proto::runtime::version(
        env!("CARGO_PKG_VERSION"),
        option_env!("BC_COMMIT"),
    ))
}
