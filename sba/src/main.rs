//! Thin binary shim for cynode-sba; the logic lives in the library (`cli`, `runner`).

fn main() {
    std::process::exit(cynode_sba::cli::main());
}
