//! Thin binary shim for cynode-pm: the command line ([`cli`]) over the library.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
