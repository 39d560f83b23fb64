//! `bcd`: the node daemon binary. Everything lives in the library: [`bcd::cli`] parses the arguments, builds the
//! runtime and runs the command. This file only stamps the version: the commit comes from `BC_COMMIT` at build time
//! (scripts/package sets it), read here in the binary crate alone, so a new commit never rebuilds the library.

fn main() {
    std::process::exit(bcd::cli::main(bc_proto::runtime::version(
        env!("CARGO_PKG_VERSION"),
        option_env!("BC_COMMIT"),
    )));
}
