//! Thin binary shim for cynode-pm; the logic lives in the library (`cli`).

fn main() {
    std::process::exit(cynode_pm::cli::main());
}
