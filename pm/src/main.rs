//! Thin binary shim for cynode-pm: the command line ([`cli`]) over the library.

mod cli;

fn main() {
    // `cynode-pm run` starts itself as the keeper of its local worker.
    if let Some(code) = cynode_pm::local_worker::keeper::main_if_keeper() {
        std::process::exit(code);
    }
    std::process::exit(cli::main());
}
