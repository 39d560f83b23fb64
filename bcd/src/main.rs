//! `bcd`: the node daemon binary. Everything lives in the library: [`bcd::cli`] parses the arguments, builds the
//! runtime and runs the command.

fn main() {
    std::process::exit(bcd::cli::main());
}
